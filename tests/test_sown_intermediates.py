"""Sown intermediates reach the loss: ``state.apply_model(..., mutable=["intermediates"])``.

Linen (``self.sow("intermediates", ...)``) and NNX (``self.sow(nnx.Intermediate, ...)``) alike:
returned in training and in eval, usable in the loss (an activation penalty changes what is
learned), never kept in the state or the checkpoints. A ``mutable=`` the trainer cannot honour is
a clear error; without ``mutable`` nothing is collected (the default path is unchanged).
"""

from __future__ import annotations

import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flaxlight


class SowLinen(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(self.hidden)(x)
        self.sow("intermediates", "hidden", h)
        return nn.Dense(2)(nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)))


class SowNNX(nnx.Module):
    def __init__(self, din: int = 4, hidden: int = 16, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(din, hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, x):
        h = self.dense(x)
        self.sow(nnx.Intermediate, "hidden", h)
        return self.head(nnx.relu(self.norm(h)))


MODELS = {"linen": (SowLinen, {}), "nnx": (SowNNX, {"din": 4})}


class Penalized(flaxlight.TrainerModule):
    """Cross-entropy plus ``penalty * mean(hidden ** 2)`` on the sown activations (before the BatchNorm,
    which keeps the classifier's input scale: the penalty shrinks the first layer freely)."""

    penalty = 0.0

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng, mutable=["batch_stats", "intermediates"])
        activation = jnp.mean(updates["intermediates"]["hidden"][0] ** 2)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + self.penalty * activation
        return loss, ({"acc": (logits.argmax(-1) == y).mean(), "activation": activation}, updates)


class StrongPenalty(Penalized):
    penalty = 5.0


def data(num: int = 160):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num, 4)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32)


def make(cls, kind, tmp_path, name):
    model_class, model_hparams = MODELS[kind]
    return cls(model_class=model_class, model_hparams=model_hparams, exmp_input=data()[0][:1],
               optimizer_hparams={"optimizer": "sgd", "lr": 0.1, "gradient_clip": None, "schedule": "constant"}, enable_progress_bar=False,
               enable_model_summary=False, logger_params={"log_dir": str(tmp_path / name)})


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_apply_model_returns_the_sown_values_in_training_and_in_eval(tmp_path, kind):
    trainer = make(Penalized, kind, tmp_path, "run")
    state, x = trainer.state, jnp.asarray(data()[0][:5])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # NNX: collected by nnx.capture, not the deprecated way
        for train in (True, False):
            logits, updates = state.apply_model(state.params, x, train=train, rng=jax.random.PRNGKey(0),
                                                mutable=["intermediates"])
            assert logits.shape == (5, 2)
            assert set(updates) == ({"batch_stats", "intermediates"} if train else {"intermediates"})
            (hidden,) = updates["intermediates"]["hidden"]
            dense = state.params["Dense_0" if kind == "linen" else "dense"]
            np.testing.assert_allclose(hidden, x @ dense["kernel"] + dense["bias"], rtol=1e-5, atol=1e-6)
    # the same list in a string, or with batch_stats named as Flax users write it
    _, updates = state.apply_model(state.params, x, train=False, mutable="intermediates")
    assert set(updates) == {"intermediates"}
    _, updates = state.apply_model(state.params, x, train=True, rng=jax.random.PRNGKey(0),
                                   mutable=["batch_stats", "intermediates"])
    assert set(updates) == {"batch_stats", "intermediates"}


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_without_mutable_nothing_is_collected(tmp_path, kind):
    trainer = make(Penalized, kind, tmp_path, "run")
    state, x = trainer.state, jnp.asarray(data()[0][:5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # flax 0.12: sow outside nnx.capture
        _, updates = state.apply_model(state.params, x, train=True, rng=jax.random.PRNGKey(0))
        assert set(updates) == {"batch_stats"}
        for mutable in (None, False, [], ["batch_stats"]):
            _, updates = state.apply_model(state.params, x, train=False, mutable=mutable)
            assert updates == {}


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_an_activation_penalty_on_sown_values_trains_and_nothing_sown_is_kept(tmp_path, kind):
    x, y = data()
    train = flaxlight.ArrayLoader(x[:128], y[:128], batch_size=32, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(x[128:], y[128:], batch_size=32)
    results, trainers = {}, {}
    for cls in (Penalized, StrongPenalty):
        trainer = make(cls, kind, tmp_path, cls.__name__)
        results[cls.__name__] = trainer.train_model(train, val, num_epochs=4)
        trainers[cls.__name__] = trainer
    # the penalty reached the gradients: the hidden activations are much smaller with it
    assert results["StrongPenalty"]["val/activation"] < 0.3 * results["Penalized"]["val/activation"]
    assert min(r["val/acc"] for r in results.values()) > 0.75  # both learn the task
    # the state holds the BatchNorm statistics only, as a model without sow would
    for trainer in trainers.values():
        names = {str(getattr(p, "key", p)) for path, _ in jax.tree_util.tree_flatten_with_path(
            trainer.state.batch_stats)[0] for p in path}
        assert "hidden" not in names and "intermediates" not in names and {"mean", "var"} <= names
    # nor do the checkpoints: nothing named after the sown value in any checkpoint file, and loading works
    log_dir = trainers["StrongPenalty"].log_dir
    assert os.listdir(os.path.join(log_dir, "checkpoints"))
    for root, _, files in os.walk(os.path.join(log_dir, "checkpoints")):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                content = f.read()
            assert b"intermediates" not in content and b'"hidden"' not in content, os.path.join(root, name)
    loaded = StrongPenalty.load_from_checkpoint(log_dir, exmp_input=x[:1])
    assert jax.tree.structure(loaded.state.batch_stats) == jax.tree.structure(trainers["StrongPenalty"].state.batch_stats)


@pytest.mark.parametrize("mutable, message", [
    (["params"], r"apply_model\(mutable=\['params'\]\): the trainer cannot make 'params' mutable: the params are "
                 r"changed by the optimizer.*mutable=\['intermediates'\]\), then updates\['intermediates'\]"),
    (["intermediates", "cache"], r"cannot make 'cache' mutable: the train state holds only 'params' and "
                                 r"'batch_stats'.*state\.apply_fn\(state\.variables\(params\), x, mutable=\[\.\.\.\]\)"),
    (True, r"apply_model\(mutable=True\): give a list of collection names; the one apply_model returns on request "
           r"is 'intermediates'"),
])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_mutable_the_trainer_cannot_honour_is_a_clear_error(tmp_path, kind, mutable, message):
    trainer = make(Penalized, kind, tmp_path, "run")
    state, x = trainer.state, jnp.asarray(data()[0][:5])
    for train in (True, False):
        with pytest.raises(ValueError, match=message):
            state.apply_model(state.params, x, train=train, rng=jax.random.PRNGKey(0), mutable=mutable)
