"""Smoke test for the lowest dependency versions the package declares (run by .ci/run in its own
venv, see tests/lowest-requirements.txt): a fit, a resume, a tune trial. Exits non-zero on failure.

    python tests/smoke_lowest.py <work dir>
"""

import os
import sys

import flax.linen as nn
import jax
import numpy as np
import optax

import flaxlight
from flaxlight.tune import Float, tune


class MLP(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1)(nn.relu(nn.Dense(self.hidden)(x)))


class Regressor(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        out, updates = state.apply_model(params, x, train=train, rng=rng)
        return optax.l2_loss(out, y).mean(), ({}, updates)


class CrashAfterEpoch(flaxlight.Callback):
    def on_epoch_end(self, trainer, epoch):
        if epoch == 2:
            trainer.checkpointer.wait()
            raise RuntimeError("crash after the save")


def trainer(log_dir, **kwargs):
    return Regressor(model_class=MLP, model_hparams={"hidden": 16}, optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                     exmp_input=np.zeros((1, 4), np.float32), logger_params={"log_dir": log_dir},
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def main(work: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = x @ np.arange(1, 5, dtype=np.float32)[:, None] / 4
    data = dict(train_loader=(x[:192], y[:192]), val_loader=(x[192:], y[192:]), batch_size=32)

    straight = trainer(os.path.join(work, "fit"))
    result = straight.train_model(**data, num_epochs=4)
    assert result.history[-1]["val/loss"] < result.history[0]["val/loss"], result.history
    print("fit: ok", {k: round(v, 4) for k, v in result.items() if isinstance(v, float)})

    try:
        trainer(os.path.join(work, "cut"), callbacks=[CrashAfterEpoch()]).train_model(**data, num_epochs=4)
    except RuntimeError:
        pass
    resumed = trainer(os.path.join(work, "cut"))
    resumed.train_model(**data, num_epochs=4, resume=True)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, straight.state.params)
    print("resume: ok (bitwise-equal params)")

    study = tune(Regressor, {"optimizer_hparams.lr": Float(1e-3, 1e-1, log=True)},
                 hparams=dict(model_class=MLP, model_hparams={"hidden": 8}, optimizer_hparams={"optimizer": "adam"},
                              exmp_input=x[:1]),
                 train_loader=flaxlight.ArrayLoader(x[:192], y[:192], batch_size=32, shuffle=True),
                 val_loader=flaxlight.ArrayLoader(x[192:], y[192:], batch_size=32),
                 num_epochs=2, metric="val/loss", n_trials=1, study_name="smoke", base_dir=os.path.join(work, "studies"))
    assert len(study.trials) == 1 and np.isfinite(study.best_value)
    print("tune: ok", round(study.best_value, 4))


if __name__ == "__main__":
    main(sys.argv[1])
