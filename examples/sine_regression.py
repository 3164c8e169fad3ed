"""The seed's example 1: regress y = sin(3x) with an MLP, x ~ U(-2, 2).

Run: python examples/sine_regression.py [--epochs 50] [--log-dir DIR]
Prints the test MSE (the seed reports 5.88e-4; the target is <= 1e-3).
The same run from a config: flaxlight fit --config examples/configs/sine_regression.yaml
"""

from __future__ import annotations

import argparse
from typing import Sequence

import flaxlight
from flaxlight.zoo import MLPRegressor, RegressionTrainer, sine_data


class MLPRegressTrainer(RegressionTrainer):
    """The seed's pattern: the model's hyperparameters are constructor arguments (the MSE loss
    comes from flaxlight.zoo's RegressionTrainer)."""

    def __init__(self, hidden_dims: Sequence[int], output_dim: int, **kwargs):
        super().__init__(model_class=MLPRegressor,
                         model_hparams={"hidden_dims": hidden_dims, "output_dim": output_dim}, **kwargs)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    train = flaxlight.ArrayLoader(*sine_data(1000, 0), batch_size=64, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(*sine_data(200, 1), batch_size=64)
    test = flaxlight.ArrayLoader(*sine_data(500, 2), batch_size=64)
    logger_params = {"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": "checkpoints"}
    trainer = MLPRegressTrainer(
        hidden_dims=[128, 128], output_dim=1,
        optimizer_hparams={"optimizer": "adamw", "lr": 4e-3, "b2": 0.99, "weight_decay": 1e-4},
        exmp_input=next(iter(train))[0][:1],
        check_val_every_n_epoch=min(5, args.epochs),
        logger_params=logger_params,
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False,
    )
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=args.epochs)
    print(f"test MSE: {metrics['test/loss']:.3e}  (val MSE {metrics['val/loss']:.3e})")
    print(f"logs and checkpoint: {trainer.log_dir}")
    return metrics


if __name__ == "__main__":
    main()
