"""The seed's example 2 on scikit-learn's digits (8x8 images shipped with scikit-learn).

An MLP with BatchNorm and dropout, trained with AdamW + weight decay; the best model on the
validation set is restored and tested. Target: test accuracy >= 0.95.

Run: python examples/digits_mlp.py [--epochs 40] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import flaxlight


class MLPClassifier(nn.Module):
    hidden_dims: Sequence[int]
    num_classes: int
    dropout_prob: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        for dim in self.hidden_dims:
            x = nn.Dense(dim)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.swish(x)
            x = nn.Dropout(self.dropout_prob, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


class MLPClassTrainer(flaxlight.TrainerModule):
    """Cross-entropy and accuracy; BatchNorm statistics are returned as updates."""

    def loss_fn(self, params, batch, *, train, rng, state):
        images, labels = batch
        logits, updates = state.apply_model(params, images, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        acc = (logits.argmax(-1) == labels).mean()
        return loss, ({"acc": acc}, updates)


def load_splits(seed: int = 0):
    """Digits scaled to [0, 1], split 1197 / 300 / 300 (train / val / test) with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1197], y[:1197]), (x[1197:1497], y[1197:1497]), (x[1497:], y[1497:])


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    train_data, val_data, test_data = load_splits()
    train = flaxlight.ArrayLoader(*train_data, batch_size=64, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(*val_data, batch_size=128)
    test = flaxlight.ArrayLoader(*test_data, batch_size=128)
    logger_params = {"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": "checkpoints"}
    trainer = MLPClassTrainer(
        model_class=MLPClassifier,
        model_hparams={"hidden_dims": [256, 256], "num_classes": 10, "dropout_prob": 0.2},
        optimizer_hparams={"optimizer": "adamw", "lr": 2e-3, "weight_decay": 1e-2, "warmup": 20},
        exmp_input=train_data[0][:1],
        logger_params=logger_params,
        enable_progress_bar=not args.no_progress_bar,
        monitor="val/acc", mode="max",
    )
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=args.epochs)
    print(f"test accuracy: {metrics['test/acc']:.4f}  (best val accuracy {metrics['val/acc']:.4f})")
    print(f"logs: {trainer.log_dir}\ncheckpoint: {trainer.checkpointer.directory}")
    return metrics


if __name__ == "__main__":
    main()
