"""A model drawing from a random stream other than ``dropout`` (a VAE's ``noise``): the trainer
supplies only ``dropout``; a loss that forgets to pass the other gets Flax's error with a note
saying so and how to pass it, and the documented way works for Linen and NNX."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import linear_data, quiet
from flax import nnx

import flaxlight


class LinenNoisy(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(8)(x)
        if train:
            h = h + 0.1 * jax.random.normal(self.make_rng("noise"), h.shape)
        return nn.Dense(1)(h)


class NNXNoisy(nnx.Module):
    """Takes its keys at call time, as the NNX tutorial writes it, and reads ``rngs.noise()``."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        h = self.hidden(x)
        if rngs is not None:
            h = h + 0.1 * jax.random.normal(rngs.noise(), h.shape)
        return self.head(h)


class Forgets(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)  # no 'noise' stream
        return jnp.mean((pred - y) ** 2), ({}, updates)


class PassesNoise(flaxlight.TrainerModule):
    """The documented way: split the step's key and pass the stream."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        noise_rng, rng = jax.random.split(rng)
        if self.model_adapter.kind == "linen":
            streams = {"rngs": {"noise": noise_rng}}
        else:
            streams = {"rngs": nnx.Rngs(dropout=rng, noise=noise_rng)} if train else {}
        pred, updates = state.apply_model(params, x, train=train, rng=rng, **streams)
        return jnp.mean((pred - y) ** 2), ({}, updates)


def _trainer(cls, model_class, tmp_path):
    return cls(model_class=model_class, model_hparams={}, exmp_input=linear_data(1)[0],
               optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))


def _loaders():
    return (flaxlight.ArrayLoader(*linear_data(64, 0), batch_size=16, shuffle=True, seed=0),
            flaxlight.ArrayLoader(*linear_data(32, 1), batch_size=16))


@pytest.mark.parametrize("model_class, flax_says, given, fix", [
    (LinenNoisy, 'needs PRNG for "noise"', "the streams ['dropout']", "rngs={'noise': noise_rng}"),
    (NNXNoisy, "No RngStream named 'noise'", "nnx.Rngs(dropout=<the step's key>)",
     "rngs=nnx.Rngs(dropout=rng, noise=noise_rng)"),
], ids=["linen", "nnx"])
def test_a_forgotten_stream_says_the_trainer_supplies_only_dropout_and_how_to_pass_it(
        tmp_path, model_class, flax_says, given, fix):
    """The report's VAE: Flax's bare "None needs PRNG for "noise"" / "No RngStream named 'noise'
    found in Rngs." (the latter from the Rngs flaxlight builds), with no word of the trainer."""
    trainer = _trainer(Forgets, model_class, tmp_path)
    with pytest.raises(Exception, match=flax_says) as caught:
        trainer.train_model(*_loaders(), num_epochs=1)
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "random stream 'noise'" in note and given in note
    assert "supplies only the 'dropout' stream" in note and "jax.random.split(rng)" in note
    assert fix in note and "docs/models.md" in note


@pytest.mark.parametrize("model_class", [LinenNoisy, NNXNoisy], ids=["linen", "nnx"])
def test_a_stream_passed_as_documented_trains(tmp_path, model_class):
    trainer = _trainer(PassesNoise, model_class, tmp_path)
    metrics = trainer.train_model(*_loaders(), num_epochs=2)
    assert np.isfinite(metrics["val/loss"])


class DropsOutInEval(nn.Module):
    """Dropout left on in eval mode (no deterministic flag follows train)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1)(nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x)))


class NoRng(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train)  # rng= forgotten
        return jnp.mean((pred - y) ** 2), ({}, updates)


def test_a_missing_dropout_stream_gets_advice_for_dropout_not_for_another_stream(tmp_path):
    """The note told a model missing 'dropout' itself to pass rngs={'dropout': ...} as 'any other'
    stream (a review): in training the loss forgot rng=; in eval mode dropout should be off."""
    from conftest import TinyMLP

    trainer = NoRng(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "dropout_prob": 0.5},
                    exmp_input=linear_data(1)[0], optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                    **quiet(tmp_path / "train"))
    with pytest.raises(Exception, match='needs PRNG for "dropout"') as caught:
        trainer.train_model(*_loaders(), num_epochs=1)
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "no 'dropout' stream" in note and "did not pass rng=rng" in note and "any other" not in note

    trainer = _trainer(Forgets, DropsOutInEval, tmp_path / "eval")
    with pytest.raises(Exception, match='needs PRNG for "dropout"') as caught:
        trainer.predict(linear_data(8, 0)[0], batch_size=8)
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "eval mode" in note and "deterministic=not train" in note and "any other" not in note
