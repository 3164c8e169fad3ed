"""A small ResNet (residual blocks, BatchNorm, dropout) in flax.linen on scikit-learn's 8x8 digits.

Two stages of residual blocks (8x8 then 4x4 feature maps), global average pooling, dropout and a
linear classifier. The training batches are augmented on the device, inside the jitted step:
every image is shifted by up to ``--max-shift`` pixels (a fresh random shift per step, drawn from
the step's RNG key, so a resumed run sees the same shifts). The best model on the validation set
is restored and tested. Target: test accuracy >= 0.98.

The same model written in flax.nnx, trained by the same trainer: examples/digits_cnn_nnx.py.

Run: python examples/digits_cnn.py [--epochs 60] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flaxlight
from flaxlight.zoo import digits_splits


# ---------------------------------------------------------------------------- the model (Linen)
def conv_kernel_init(key, shape, dtype=jnp.float32):
    """Flax's default (``lecun_normal``) for a conv kernel ``(kh, kw, in, out)``, drawn as a 2-D
    ``(kh * kw * in, out)`` matrix and reshaped: the same distribution (the same fan-in), but it
    compiles in a fraction of the time. Drawing a 4-D random array directly cost about 2 s of XLA
    compilation per kernel on the 2-core CPU these examples were tuned on (jax 0.10, partitionable
    threefry; 1-D or 2-D draws: 0.3-0.5 s), which dominated the example's start-up.
    """
    flat = nn.initializers.lecun_normal()(key, (math.prod(shape[:-1]), shape[-1]), dtype)
    return flat.reshape(shape)


class ResidualBlock(nn.Module):
    """conv3x3 -> BN -> relu -> conv3x3 -> BN, plus the input (a 1x1 conv + BN when the shape changes)."""

    features: int
    strides: int = 1
    bn_momentum: float = 0.9

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False, kernel_init=conv_kernel_init)(x)
        y = nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum)(y)
        y = nn.relu(y)
        y = nn.Conv(self.features, (3, 3), use_bias=False, kernel_init=conv_kernel_init)(y)
        y = nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), strides=self.strides, use_bias=False, kernel_init=conv_kernel_init)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum)(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Stem conv, then ``blocks_per_stage`` residual blocks per stage (the first block of every
    stage but the first halves the resolution), global average pooling, dropout, logits."""

    num_classes: int = 10
    stage_features: Sequence[int] = (32, 64)
    blocks_per_stage: int = 2
    dropout_prob: float = 0.2
    bn_momentum: float = 0.9  # running statistics' decay (flax's default 0.99 suits longer runs)

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.stage_features[0], (3, 3), use_bias=False, kernel_init=conv_kernel_init)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum)(x))
        for stage, features in enumerate(self.stage_features):
            for block in range(self.blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                x = ResidualBlock(features, strides, self.bn_momentum)(x, train=train)
        x = x.mean(axis=(1, 2))
        x = nn.Dropout(self.dropout_prob, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


# ---------------------------------------------------------------------------- data and loss
def random_shift(images, rng, max_shift: int):
    """Shift every image of ``(N, H, W, C)`` by its own random offset in [-max_shift, max_shift]
    pixels (zero fill); runs on the device, inside the jitted step."""
    if max_shift <= 0:
        return images
    n, h, w, c = images.shape
    pad = ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0))
    padded = jnp.pad(images, pad)
    offsets = jax.random.randint(rng, (n, 2), 0, 2 * max_shift + 1)
    crop = lambda image, offset: jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (h, w, c))
    return jax.vmap(crop)(padded, offsets)


class DigitsCNNTrainer(flaxlight.TrainerModule):
    """Cross-entropy and accuracy; training batches are randomly shifted by up to ``max_shift`` px.

    The loss is the same for a Linen and an NNX model: ``state.apply_model`` hides the difference
    (train/eval mode, the dropout key, BatchNorm statistics returned in ``updates``).
    """

    def __init__(self, max_shift: int = 1, **kwargs: Any):
        self.max_shift = int(max_shift)  # read when the step is traced, so set before the trainer jits
        super().__init__(**kwargs)
        self.config["max_shift"] = self.max_shift  # saved in hparams.yaml; load_from_checkpoint passes it back

    def loss_fn(self, params, batch, *, train, rng, state):
        images, labels = batch
        if train:
            shift_rng, rng = jax.random.split(rng)
            images = random_shift(images, shift_rng, self.max_shift)
        logits, updates = state.apply_model(params, images, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        acc = (logits.argmax(-1) == labels).mean()
        return loss, ({"acc": acc}, updates)


def load_splits(seed: int = 0):
    """Digits in [0, 1] as ``(N, 8, 8, 1)`` images, split 1197 / 300 / 300 (train / val / test)."""
    return tuple((x[..., None], y) for x, y in digits_splits(seed))


# ---------------------------------------------------------------------------- the script
def build_parser(description: str, default_epochs: int = 60) -> argparse.ArgumentParser:
    """The flags of this example and of digits_cnn_nnx.py (the same run, another model kind)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=default_epochs)
    parser.add_argument("--log-dir", default=None, help="default: checkpoints/<Model>/version_N")
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument("--no-summary", action="store_true", help="do not print the model table")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine)")
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=32, help="channels of the first stage (doubled in the second)")
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--max-shift", type=int, default=1, help="random shift augmentation in pixels (0: off)")
    parser.add_argument("--train-fraction", type=float, default=1.0,
                        help="use only this fraction of the training images (fast tests)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation, data order and augmentation")
    return parser


def run(args: argparse.Namespace, model_class: type, model_hparams: Mapping[str, Any]) -> dict:
    """Train ``model_class`` (Linen or NNX) on the digits with ``args``; return the best metrics."""
    train_data, val_data, test_data = load_splits()
    if args.train_fraction < 1.0:
        keep = max(args.batch_size, int(len(train_data[0]) * args.train_fraction))
        train_data = (train_data[0][:keep], train_data[1][:keep])
    train = flaxlight.ArrayLoader(*train_data, batch_size=args.batch_size, shuffle=True, seed=args.seed, drop_last=True)
    val = flaxlight.ArrayLoader(*val_data, batch_size=300)
    test = flaxlight.ArrayLoader(*test_data, batch_size=300)
    logger_params = {"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": "checkpoints"}
    trainer = DigitsCNNTrainer(
        max_shift=args.max_shift,
        model_class=model_class,
        model_hparams=dict(model_hparams),
        optimizer_hparams={"optimizer": "adamw", "lr": args.lr, "weight_decay": args.weight_decay,
                           "warmup_steps": min(2, args.epochs // 10) * len(train)},
        exmp_input=train_data[0][:1],
        seed=args.seed,
        logger_params=logger_params,
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=not args.no_summary,
        monitor="val/acc", mode="max",
    )
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=args.epochs)
    metrics["num_params"] = int(sum(np.size(p) for p in jax.tree.leaves(trainer.state.params)))
    print(f"{model_class.__name__} ({trainer.model_adapter.kind}, {metrics['num_params']} parameters): "
          f"test accuracy {metrics['test/acc']:.4f}  (best val accuracy {metrics['val/acc']:.4f})")
    print(f"logs and checkpoint: {trainer.log_dir}")
    return metrics


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser(__doc__.splitlines()[0]).parse_args(argv)
    hparams = {"num_classes": 10, "stage_features": [args.width, 2 * args.width],
               "blocks_per_stage": args.blocks, "dropout_prob": args.dropout}
    return run(args, ResNet, hparams)


if __name__ == "__main__":
    main()
