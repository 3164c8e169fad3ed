"""The ResNet of digits_cnn.py written in flax.nnx, trained by the very same trainer and loss.

Only the model differs from examples/digits_cnn.py (same layers, initialisers, flags, data,
augmentation, optimizer and loss function; see docs/models.md for the two side by side):

- NNX modules create their parameters in ``__init__``, so input sizes are arguments
  (``in_channels``) and the trainer builds the model as ``ResNet(**model_hparams, rngs=nnx.Rngs(seed))``;
- ``__call__`` takes no ``train`` argument: the trainer switches the module with ``model.train()``
  / ``model.eval()``, which sets Dropout's ``deterministic`` and BatchNorm's
  ``use_running_average``; the dropout key is fresh every step (from the train state's RNG);
- ``trainer.bind_model()`` returns a live NNX module (eval mode) carrying the trained weights.

Target: the Linen model's test accuracy, within 1%.

Run: python examples/digits_cnn_nnx.py [--epochs 60] [--log-dir DIR]
"""

from __future__ import annotations

from typing import Sequence

from flax import nnx

from digits_cnn import build_parser, conv_kernel_init, run


class ResidualBlock(nnx.Module):
    """conv3x3 -> BN -> relu -> conv3x3 -> BN, plus the input (a 1x1 conv + BN when the shape changes)."""

    def __init__(self, in_features: int, features: int, strides: int = 1, bn_momentum: float = 0.9, *,
                 rngs: nnx.Rngs):
        conv = dict(use_bias=False, kernel_init=conv_kernel_init, rngs=rngs)
        self.conv1 = nnx.Conv(in_features, features, (3, 3), strides=strides, **conv)
        self.bn1 = nnx.BatchNorm(features, momentum=bn_momentum, rngs=rngs)
        self.conv2 = nnx.Conv(features, features, (3, 3), **conv)
        self.bn2 = nnx.BatchNorm(features, momentum=bn_momentum, rngs=rngs)
        reshape = strides != 1 or in_features != features  # (assign an attribute once: None is static in NNX)
        self.shortcut = nnx.Sequential(nnx.Conv(in_features, features, (1, 1), strides=strides, **conv),
                                       nnx.BatchNorm(features, momentum=bn_momentum, rngs=rngs)) if reshape else None

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return nnx.relu((x if self.shortcut is None else self.shortcut(x)) + y)


class ResNet(nnx.Module):
    """Stem conv, then ``blocks_per_stage`` residual blocks per stage (the first block of every
    stage but the first halves the resolution), global average pooling, dropout, logits."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, stage_features: Sequence[int] = (32, 64),
                 blocks_per_stage: int = 2, dropout_prob: float = 0.2, bn_momentum: float = 0.9, *,
                 rngs: nnx.Rngs):
        self.stem = nnx.Conv(in_channels, stage_features[0], (3, 3), use_bias=False, kernel_init=conv_kernel_init,
                             rngs=rngs)
        self.stem_bn = nnx.BatchNorm(stage_features[0], momentum=bn_momentum, rngs=rngs)
        self.blocks = nnx.List()
        features_in = stage_features[0]
        for stage, features in enumerate(stage_features):
            for block in range(blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                self.blocks.append(ResidualBlock(features_in, features, strides, bn_momentum, rngs=rngs))
                features_in = features
        self.dropout = nnx.Dropout(dropout_prob, rngs=rngs)
        self.head = nnx.Linear(features_in, num_classes, rngs=rngs)

    def __call__(self, x):  # no `train` argument: model.train() / model.eval() switch the mode
        x = nnx.relu(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        x = self.dropout(x.mean(axis=(1, 2)))
        return self.head(x)


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser(__doc__.splitlines()[0]).parse_args(argv)
    hparams = {"in_channels": 1, "num_classes": 10, "stage_features": [args.width, 2 * args.width],
               "blocks_per_stage": args.blocks, "dropout_prob": args.dropout}
    return run(args, ResNet, hparams)


if __name__ == "__main__":
    main()
