"""The model of Flax's NNX MNIST tutorial, as the tutorial writes it, trained by flaxlight.

The ``CNN`` below keeps the tutorial's layers and call signature unchanged: two 3x3 convolutions
with batch norm and 2x2 average pooling, ``nnx.Dropout`` layers built without rngs and given
them at call time (``__call__(self, x, rngs=None)``), a 3136 -> 256 -> 10 head, and the
tutorial's optimizer (``optax.adamw(0.005, 0.9)``) and metric names (``loss``, ``accuracy``).
What flaxlight adds: the trainer passes ``rngs=nnx.Rngs(dropout=<the step's key>)`` in training
and ``rngs=None`` in evaluation (a fresh, reproducible key every step), switches the module
between ``train()`` and ``eval()``, and picks the best model by ``val/accuracy``.

The tutorial trains on MNIST (28x28); nothing is downloaded here, so scikit-learn's 8x8 digits
are magnified 3x and padded to 28x28, which the tutorial's model takes as it is.

Run: python examples/nnx_mnist_tutorial.py [--epochs 10] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Sequence

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flaxlight
from digits_cnn import load_splits


class CNN(nnx.Module):
    """A simple CNN model (the NNX MNIST tutorial's, unchanged)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


class TutorialTrainer(flaxlight.TrainerModule):
    """The tutorial's loss and metrics: cross-entropy on integer labels, ``loss`` and ``accuracy``."""

    def loss_fn(self, params, batch, *, train, rng, state):
        images, labels = batch
        logits, updates = state.apply_model(params, images, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, ({"accuracy": jnp.mean(logits.argmax(-1) == labels)}, updates)


def as_28x28(images: np.ndarray) -> np.ndarray:
    """8x8 digits (N, 8, 8, 1) magnified 3x (24x24) and padded by 2 pixels to MNIST's 28x28."""
    big = images.repeat(3, axis=1).repeat(3, axis=2)
    return np.pad(big, ((0, 0), (2, 2), (2, 2), (0, 0))).astype(np.float32)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)  # the tutorial's
    parser.add_argument("--log-dir", default=None, help="default: checkpoints/CNN/version_N")
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument("--no-summary", action="store_true")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_val, y_val), (x_test, y_test) = load_splits()
    train = flaxlight.ArrayLoader(as_28x28(x_train), y_train, batch_size=args.batch_size, shuffle=True, seed=0,
                                  drop_last=True)
    val = flaxlight.ArrayLoader(as_28x28(x_val), y_val, batch_size=300)
    test = flaxlight.ArrayLoader(as_28x28(x_test), y_test, batch_size=300)
    trainer = TutorialTrainer(
        model_class=CNN, model_hparams={}, optimizer_hparams=optax.adamw(0.005, 0.9),  # the tutorial's optimizer
        exmp_input=as_28x28(x_train[:1]), seed=0, monitor="val/accuracy", mode="max",
        logger_params={"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": "checkpoints"},
        enable_progress_bar=not args.no_progress_bar, enable_model_summary=not args.no_summary)
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=args.epochs)
    print(f"test accuracy {metrics['test/accuracy']:.4f} (best val accuracy {metrics['val/accuracy']:.4f}); "
          f"logs and checkpoints: {trainer.log_dir}")
    return metrics


if __name__ == "__main__":
    main()
