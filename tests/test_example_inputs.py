"""What a user sees when ``exmp_input`` and the model or the data disagree: a wrong NNX input size,
``x[0]`` for ``x[:1]`` (as exmp_input, or as predict's data), a layer init never reached."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RegressTrainer, TinyNNX, linear_data, quiet
from flax import nnx

import flaxlight

ADAM = {"optimizer": "adam", "lr": 1e-2}


class Reshaping(nn.Module):
    """A Linen model with an input size fixed in its hparams (it flattens to ``din`` features)."""

    din: int = 4

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1)(x.reshape(-1, self.din))


def _nothing_written(folder) -> bool:
    """No file in the run folder (its empty folder is given back once the trainer is gone)."""
    return not os.path.exists(folder) or not [path for path in folder.rglob("*") if path.is_file()]


def _flaxlight_note(error: BaseException) -> str:
    return next(note for note in getattr(error, "__notes__", []) if note.startswith("flaxlight:"))


@pytest.mark.parametrize("summary", [False, True])
def test_an_nnx_model_with_the_wrong_input_size_fails_when_built_naming_its_hparams(tmp_path, summary):
    x, _ = linear_data(8)  # 4 features
    with pytest.raises(TypeError) as info:
        RegressTrainer(model_class=TinyNNX, model_hparams={"din": 3, "hidden_dims": [8]}, optimizer_hparams=ADAM,
                       exmp_input=x[:1], **quiet(tmp_path, enable_model_summary=summary))
    assert "dot_general requires contracting dimensions" in str(info.value)  # JAX's own error, with flaxlight's note
    note = _flaxlight_note(info.value)
    assert note.startswith("flaxlight: TinyNNX(din=3, hidden_dims=[8]) cannot be called on exmp_input (an array of "
                           "shape (1, 4))")
    assert "An NNX model takes its input sizes from model_hparams" in note and "x[:1], not x[0]" in note
    assert _nothing_written(tmp_path / "run")


@pytest.mark.parametrize("summary", [False, True])
def test_a_linen_model_that_cannot_take_exmp_input_fails_the_same_way(tmp_path, summary):
    x, _ = linear_data(8)
    with pytest.raises((TypeError, ValueError)) as info:  # jitted init: TypeError; the summary's call: ValueError
        RegressTrainer(model_class=Reshaping, model_hparams={"din": 3}, optimizer_hparams=ADAM, exmp_input=x[:1],
                       **quiet(tmp_path, enable_model_summary=summary))
    assert "cannot reshape" in str(info.value)
    note = _flaxlight_note(info.value)
    assert note.startswith("flaxlight: Reshaping(din=3) cannot be called on exmp_input (an array of shape (1, 4))")
    called = "model.tabulate" if summary else "model.init"  # the summary, when on, is the first call
    assert f"{called}(rngs, *exmp_input, train=True)" in note and "x[:1], not x[0]" in note
    assert _nothing_written(tmp_path / "run")


def test_a_fitting_nnx_model_still_builds_and_trains(tmp_path, regression_loaders):
    x, _ = linear_data(8)
    trainer = RegressTrainer(model_class=TinyNNX, model_hparams={"din": 4, "hidden_dims": [8]},
                             optimizer_hparams=ADAM, exmp_input=x[:1], **quiet(tmp_path))
    train, val, _ = regression_loaders
    assert np.isfinite(trainer.train_model(train, val, num_epochs=1)["val/loss"])


class PerSequence(nn.Module):
    """Takes one (T, F) sequence or a batch of them, as flax's nn.RNN does: x[0] traces too."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return jnp.cumsum(nn.Dense(2)(x), axis=-2)


def test_exmp_input_without_its_batch_axis_is_named_so(tmp_path):
    x = np.ones((16, 5, 3), np.float32)
    y = np.ones((16, 5, 2), np.float32)
    trainer = RegressTrainer(model_class=TinyNNX, model_hparams={"din": 3, "hidden_dims": [4], "output_dim": 2},
                             optimizer_hparams=ADAM, exmp_input=x[0], **quiet(tmp_path))
    with pytest.raises(ValueError) as info:
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=8), None, num_epochs=1)
    message = str(info.value)
    assert "initialised with exmp_input of shape (5, 3): exmp_input lacks the batch axis" in message
    assert "x[:1] (shape (1, 5, 3)), not x[0] (shape (5, 3))" in message
    assert "exmp_input[0]" not in message


def test_predict_refuses_one_example_without_its_batch_axis(tmp_path):
    x = np.random.default_rng(0).normal(size=(6, 5, 3)).astype(np.float32)
    trainer = RegressTrainer(model_class=PerSequence, model_hparams={}, optimizer_hparams=ADAM, exmp_input=x[:1],
                             **quiet(tmp_path))
    with pytest.raises(ValueError, match=r"predict's data has shape \(5, 3\): exmp_input's shape \(1, 5, 3\) without "
                                         r"its batch axis.*x\[:1\] or x\[None\]"):
        trainer.predict(x[0], batch_size=2)  # the model traces on it: it used to come back cut into rows
    right = trainer.predict(x[:1], batch_size=2)
    assert right.shape == (1, 5, 2)
    with pytest.warns(UserWarning, match="one dimension fewer than exmp_input"):  # another length: warned of
        trainer.predict(np.ones((7, 3), np.float32), batch_size=4)


class ProjectedOnlyOnRequest(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False, project: bool = False):
        h = nn.Dense(8)(x)
        return nn.Dense(2, name="proj")(h) if project else h


class ProjectingTrainer(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        z, updates = state.apply_model(params, batch[0], train=train, rng=rng, project=True)
        return (z ** 2).mean(), ({}, updates)


def test_a_layer_init_never_reached_gets_a_note_naming_the_branch(tmp_path):
    x, y = linear_data(32)
    trainer = ProjectingTrainer(model_class=ProjectedOnlyOnRequest, model_hparams={}, optimizer_hparams=ADAM,
                                exmp_input=x[:1], **quiet(tmp_path))
    with pytest.raises(Exception, match='Could not find parameter named "kernel" in scope "/proj"') as info:
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=16), None, num_epochs=1)
    note = _flaxlight_note(info.value)
    assert "model.init(rngs, *exmp_input, train=True)" in note and "This call passes project=True" in note
    assert "`if project or self.is_initializing():`" in note and "run_model_init" in note


# ---------------------------------------------------------------------- models the check must not refuse
class MaskedNNX(nnx.Module):
    """Needs a keyword exmp_input cannot carry; the loss passes it."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x, *, mask):
        return self.lin(x * mask)


class NoisyNNX(nnx.Module):
    """Draws from call-time rngs in eval mode too (a VAE's sampling); the loss always passes them."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.enc, self.dec = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        h = self.enc(x)
        return self.dec(h + 0.1 * jax.random.normal(rngs.noise(), h.shape))


class CalledWithExtras(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        extra = {"mask": jnp.ones_like(x)} if self.model_class is MaskedNNX else {"rngs": nnx.Rngs(noise=rng)}
        pred, updates = state.apply_model(params, x, train=train, rng=rng, **extra)
        return jnp.mean((pred - y) ** 2), ({}, updates)


@pytest.mark.parametrize("model_class", [MaskedNNX, NoisyNNX])
def test_nnx_models_the_loss_calls_with_more_than_exmp_input_still_build(tmp_path, regression_loaders, model_class):
    """The construction-time call refused them (a required keyword; rngs None in eval mode)."""
    trainer = CalledWithExtras(model_class=model_class, model_hparams={}, optimizer_hparams=ADAM,
                               exmp_input=linear_data(1)[0], **quiet(tmp_path, enable_model_summary=True))
    train, val, _ = regression_loaders
    assert np.isfinite(trainer.train_model(train, val, num_epochs=1)["val/loss"])


def test_overrides_in_the_uva_guides_order_see_the_run_folder(tmp_path):
    """init_model ran before the run's folder was set up: an override writing there failed."""
    class WritesAtInit(RegressTrainer):
        def init_model(self, exmp_input):
            super().init_model(exmp_input)
            with open(os.path.join(self.log_dir, "init.txt"), "w") as f:
                f.write("built")

    trainer = WritesAtInit(model_class=TinyNNX, model_hparams={"din": 4, "hidden_dims": [8]}, optimizer_hparams=ADAM,
                           exmp_input=linear_data(1)[0], **quiet(tmp_path))
    assert (tmp_path / "run" / "init.txt").read_text() == "built" and trainer.logger is not None


def test_predict_of_one_value_for_a_one_feature_model_is_not_refused(tmp_path):
    """(1,) for exmp_input (1, 1) is as well a batch of one value: it was refused as x[0]."""
    trainer = RegressTrainer(model_class=Reshaping, model_hparams={"din": 1}, optimizer_hparams=ADAM,
                             exmp_input=np.zeros((1, 1), np.float32), **quiet(tmp_path))
    np.testing.assert_allclose(trainer.predict(np.array([0.5], np.float32), batch_size=8).ravel(),
                               trainer.predict(np.array([[0.5]], np.float32), batch_size=8).ravel())
