"""Small models, data and trainers shared by the tests (each test builds its own objects)."""

from __future__ import annotations

import os
import signal
import tempfile
from typing import Sequence

os.environ.setdefault("CI", "true")  # plain progress output in test logs
# One persistent compilation cache for the test session's trainers (not the user's ~/.cache).
os.environ.setdefault("FLAXLIGHT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "flaxlight-tests-jax-cache"))

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flaxlight

def pytest_configure(config):
    # Tests compare with references computed another way (unjitted, other batch sizes) at float32
    # tolerances; a GPU's default matmul precision (TF32) makes such pairs differ by ~1e-3. In a
    # hook, not at import: the subprocess scripts that import this module set up JAX themselves.
    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")


class TinyMLP(nn.Module):
    """Dense layers with optional BatchNorm and dropout; `train` switches both."""

    hidden_dims: Sequence[int] = (16,)
    output_dim: int = 1
    batch_norm: bool = False
    dropout_prob: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        for dim in self.hidden_dims:
            x = nn.Dense(dim)(x)
            if self.batch_norm:
                x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
            if self.dropout_prob:
                x = nn.Dropout(self.dropout_prob, deterministic=not train)(x)
        return nn.Dense(self.output_dim)(x)


class TinyNNX(nnx.Module):
    """An NNX MLP: Linear+ReLU layers with optional BatchNorm and dropout (switched by train()/eval())."""

    def __init__(self, din: int = 4, hidden_dims: Sequence[int] = (16,), output_dim: int = 1,
                 batch_norm: bool = False, dropout_prob: float = 0.0, *, rngs: nnx.Rngs):
        self.layers = nnx.List()
        for dim in hidden_dims:
            self.layers.append(nnx.Linear(din, dim, rngs=rngs))
            if batch_norm:
                self.layers.append(nnx.BatchNorm(dim, rngs=rngs))
            if dropout_prob:
                self.layers.append(nnx.Dropout(dropout_prob, rngs=rngs))
            din = dim
        self.head = nnx.Linear(din, output_dim, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers:
            x = layer(x)
            if isinstance(layer, nnx.Linear):
                x = nnx.relu(x)
        return self.head(x)


class RegressTrainer(flaxlight.TrainerModule):
    """Mean squared error; BatchNorm updates are returned when the model has them."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        return jnp.mean((pred - y) ** 2), ({}, updates)


class ClassifyTrainer(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, ({"acc": (logits.argmax(-1) == y).mean()}, updates)


def linear_data(num: int, seed: int = 0, dim: int = 4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, dim)).astype(np.float32)
    w = np.arange(1, dim + 1, dtype=np.float32).reshape(dim, 1) / dim
    return x, (x @ w).astype(np.float32)


class AtStep(flaxlight.Callback):
    """Does ``act(trainer)`` once step ``step`` is done: a stop, a SIGTERM, a crash mid-epoch."""

    every_n_steps = 1

    def __init__(self, step: int):
        self.step = step

    def on_step(self, trainer, step):
        if step == self.step:
            self.act(trainer)

    def act(self, trainer):
        raise NotImplementedError


class StopAt(AtStep):
    def act(self, trainer):
        trainer.stop(f"stopped at step {self.step}")


class SigtermAt(AtStep):
    """Sends SIGTERM to this process (the trainer saves a checkpoint and exits)."""

    def act(self, trainer):
        os.kill(os.getpid(), signal.SIGTERM)


class FailAt(AtStep):
    """Raises, as a data error in the middle of an epoch would."""

    def act(self, trainer):
        raise RuntimeError(f"data error at step {self.step}")


class CrashAfterEpoch(flaxlight.Callback):
    """Raises at the end of an epoch, after its checkpoint is on disk: a crash right after a save."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, trainer, epoch):
        if epoch == self.epoch:
            trainer.checkpointer.wait()
            raise RuntimeError("crash after the save")


def quiet(tmp_path, **kwargs):
    """Trainer keyword arguments for tests: no bars, no model table, files under tmp_path."""
    kwargs.setdefault("logger_params", {"log_dir": str(tmp_path / "run")})
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    return kwargs


@pytest.fixture
def regression_loaders():
    train = flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32)
    test = flaxlight.ArrayLoader(*linear_data(70, 2), batch_size=32)
    return train, val, test
