"""The seed's example 2 on scikit-learn's digits (8x8 images shipped with scikit-learn).

An MLP with BatchNorm and dropout, trained with AdamW + weight decay; the best model on the
validation set is restored and tested. Target: test accuracy >= 0.95.

Run: python examples/digits_mlp.py [--epochs 40] [--log-dir DIR | --base-log-dir DIR]
The same run from a config: flaxlight fit --config examples/configs/digits_mlp.yaml
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import jax

import flaxlight
from flaxlight.zoo import ClassificationTrainer as MLPClassTrainer
from flaxlight.zoo import MLPClassifier, digits_splits


def load_splits(seed: int = 0):
    """Digits scaled to [0, 1], split 1197 / 300 / 300 (train / val / test) with a fixed seed."""
    return digits_splits(seed)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--log-dir", default=None, help="the run's folder (a folder holding a run is refused)")
    parser.add_argument("--base-log-dir", default="checkpoints",
                        help="without --log-dir: each run gets <base>/MLPClassifier/version_N (default %(default)s)")
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    train_data, val_data, test_data = load_splits()
    train = flaxlight.ArrayLoader(*train_data, batch_size=64, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(*val_data, batch_size=128)
    test = flaxlight.ArrayLoader(*test_data, batch_size=128)
    logger_params = {"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": args.base_log_dir}
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

    # The best model's class probabilities on the test images, and the same model as an artifact
    # that plain JAX serves (jax.export.deserialize(...).call(x)), without flaxlight.
    probabilities = jax.nn.softmax(trainer.predict(test_data[0], batch_size=256, which="best"))
    print(f"predicted classes of the first test images: {probabilities[:8].argmax(-1).tolist()}")
    exported = trainer.export(os.path.join(trainer.log_dir, "export"), which="best")
    print(f"exported model: {exported}")
    return metrics


if __name__ == "__main__":
    main()
