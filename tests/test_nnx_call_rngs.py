"""NNX modules written as the NNX tutorial writes them: ``nnx.Dropout(rate)`` without rngs at
construction, the keys given at call time through a ``rngs`` argument of ``__call__``."""

import jax
import numpy as np
import optax
import pytest
from conftest import linear_data, quiet
from flax import nnx

import flaxlight
from flaxlight.models import make_adapter


class TutorialStyle(nnx.Module):
    """As in the flax NNX MNIST tutorial: Dropout built without rngs, keys passed at call time."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(4, 32, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.5)
        self.linear2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.linear2(self.dropout(nnx.relu(self.linear1(x)), rngs=rngs))


class Regressor(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        return optax.l2_loss(pred, y).mean(), ({}, updates)


class OwnRngs(Regressor):
    """A loss that builds the module's rngs itself, as the tutorial's train step does."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        rngs = nnx.Rngs(dropout=jax.random.fold_in(rng, 7)) if train else None
        pred, updates = state.apply_model(params, x, train=train, rng=rng, rngs=rngs)
        return optax.l2_loss(pred, y).mean(), ({}, updates)


def _fit(tmp_path, trainer_class=Regressor, seed=0):
    trainer = trainer_class(model_class=TutorialStyle, model_hparams={}, exmp_input=linear_data(1)[0], seed=seed,
                            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))
    train = flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32)
    best = trainer.train_model(train, val, num_epochs=3)
    return trainer, best


@pytest.mark.parametrize("trainer_class", [Regressor, OwnRngs])
def test_a_tutorial_style_nnx_module_trains_with_call_time_dropout_keys(tmp_path, trainer_class):
    trainer, best = _fit(tmp_path / "a", trainer_class)
    again, best_again = _fit(tmp_path / "b", trainer_class)
    assert best["val/loss"] == best_again["val/loss"]  # the keys come from the seed: reproducible
    jax.tree.map(np.testing.assert_array_equal, trainer.state.params, again.state.params)
    x = linear_data(8, 2)[0]
    model = trainer.bind_model()
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(model(x)))  # evaluation: no dropout


def test_dropout_is_active_in_training(tmp_path):
    trainer, _ = _fit(tmp_path)
    x = linear_data(16, 3)[0]
    params = trainer.state.params
    first, _ = trainer.state.apply_model(params, x, train=True, rng=jax.random.PRNGKey(1))
    second, _ = trainer.state.apply_model(params, x, train=True, rng=jax.random.PRNGKey(2))
    assert not np.allclose(np.asarray(first), np.asarray(second))  # other keys, other masks


def test_a_failing_nnx_tabulate_says_its_own_error_once_and_leaves_the_model_trainable(tmp_path, capsys,
                                                                                       monkeypatch, regression_loaders):
    from conftest import RegressTrainer, TinyNNX

    def broken_tabulate(*args, **kwargs):
        raise RuntimeError("tabulate cannot trace this model")

    monkeypatch.setattr(nnx, "tabulate", broken_tabulate)
    trainer = RegressTrainer(model_class=TinyNNX, model_hparams={"din": 4, "hidden_dims": [8]},
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=linear_data(1)[0],
                             **quiet(tmp_path, enable_model_summary=True))
    out = capsys.readouterr().out
    assert out.count("tabulate cannot trace this model") == 1 and "TinyNNX (NNX): no table (RuntimeError" in out
    train, val, _ = regression_loaders
    metrics = trainer.train_model(train, val, num_epochs=2)  # the model the trainer holds is intact
    assert np.isfinite(metrics["val/loss"])


def test_the_model_summary_of_a_tutorial_style_module_and_of_a_broken_one(tmp_path, capsys):
    """The default summary (nnx.tabulate) failed on a module taking call-time rngs, left flax's
    classes patched, and the first train step died with "no attribute '_nnx_tabulate_id'"; a
    module that does not fit the data broke every later NNX model in the process the same way."""
    train = flaxlight.ArrayLoader(*linear_data(64, 0), batch_size=32)
    trainer = Regressor(model_class=TutorialStyle, model_hparams={}, exmp_input=linear_data(1)[0],
                        optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                        **quiet(tmp_path / "a", enable_model_summary=True))
    assert "TutorialStyle Summary" in capsys.readouterr().out
    assert np.isfinite(trainer.train_model(train, None, num_epochs=1)["train/loss"])

    class TooNarrow(TutorialStyle):
        def __init__(self, *, rngs: nnx.Rngs):
            super().__init__(rngs=rngs)
            self.linear1 = nnx.Linear(3, 32, rngs=rngs)  # the data has 4 features

    adapter = make_adapter(TooNarrow, {}, seed=0)  # the summary alone: the trainer refuses the model before it
    assert adapter.tabulate([linear_data(1)[0]]).startswith("TooNarrow (NNX): no table (TypeError: dot_general")
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):  # its own error, not flax's patch
        Regressor(model_class=TooNarrow, model_hparams={}, exmp_input=linear_data(1)[0],
                  optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path / "b", enable_model_summary=True))
    trainer, _ = _fit(tmp_path / "c")  # and the next model in this process trains
    assert np.isfinite(float(trainer.state.step))


class RngsRequired(TutorialStyle):
    def __call__(self, x, rngs: nnx.Rngs):  # no default, as some NNX tutorials write it
        return super().__call__(x, rngs=rngs)


def test_the_model_summary_of_a_module_whose_call_requires_rngs(tmp_path, capsys):
    """Training, predict and bind_model worked, but the table was "no table (TypeError: ... missing 1
    required positional argument: 'rngs')": the summary passes rngs=None, as the eval step does."""
    trainer = Regressor(model_class=RngsRequired, model_hparams={}, exmp_input=linear_data(1)[0],
                        optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                        **quiet(tmp_path, enable_model_summary=True))
    out = capsys.readouterr().out
    assert "RngsRequired Summary" in out and "no table" not in out
