"""precision="bf16": validation, predict and export compute one function; the loss sees the batch
as given and float32 outputs; an NNX BatchNorm keeps the model in bfloat16, as Linen's does; a model
that computes in float32 anyway, or partly because a float32 value promotes it, is warned of; other
trainers' spellings of precision are answered with flaxlight's."""

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quiet
from flax import nnx

import flaxlight
from flaxlight.config import ConfigError, load_config
from flaxlight.optim import as_optimizer_config
from flaxlight.step import computing_state
from flaxlight.zoo import ClassificationTrainer, RegressionTrainer
from flaxlight.zoo.models import MLPRegressor

BF16 = {"optimizer": "adam", "lr": 2e-2, "schedule": "constant", "precision": "bf16"}


def _sine(n: int = 400):
    """Targets near 300, where bfloat16's steps are 2 apart: its rounding shows."""
    x = np.random.default_rng(0).uniform(-2, 2, (n, 1)).astype(np.float32)
    return x, (300 + 10 * np.sin(3 * x)).astype(np.float32)


def _on_bf16_grid(values: np.ndarray) -> bool:
    return np.array_equal(values, np.asarray(jnp.asarray(values).astype(jnp.bfloat16).astype(jnp.float32)))


def test_a_bf16_runs_validation_predict_and_export_compute_the_same_outputs(tmp_path):
    """predict() and export computed the last layer without rounding it to bfloat16 (XLA's excess
    precision skipped it before their cast to float32), validation rounded: every served output
    was about 0.72 below the one validation measured, and the served error twice the reported."""
    x, y = _sine()
    trainer = RegressionTrainer(model_class=MLPRegressor, model_hparams={"hidden_dims": [64], "output_dim": 1},
                                optimizer_hparams=BF16, exmp_input=x[:1], seed=0, **quiet(tmp_path))
    trainer.train_model((x[:300], y[:300]), (x[300:], y[300:]), num_epochs=10, batch_size=50)
    reported = trainer.eval_model((x[300:], y[300:]), batch_size=100)["loss"]
    predicted = trainer.predict(x[300:], batch_size=100)
    served = np.asarray(flaxlight.load_exported(trainer.export(tmp_path / "export", which="current"))(x[300:]))
    assert predicted.dtype == np.float32 and _on_bf16_grid(predicted)  # the bfloat16 model's outputs
    np.testing.assert_array_equal(served, predicted)
    np.testing.assert_allclose(np.mean((predicted - y[300:].astype(np.float64)) ** 2), reported, rtol=1e-5)


def test_a_bf16_loss_gets_the_targets_as_given_and_float32_outputs(tmp_path):
    """The whole batch was cast to bfloat16, targets included, and the loss computed in bfloat16:
    val/loss was the error against rounded targets (1.32 where the model's error was 0.99)."""
    seen = {}

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            hidden = nn.Dense(32)(x)
            seen["hidden"] = str(hidden.dtype)
            return nn.Dense(1)(nn.silu(hidden)) + 300.0  # a Python float: still bfloat16

    class Regressor(flaxlight.TrainerModule):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y = batch
            pred, updates = state.apply_model(params, x, train=train, rng=rng)
            seen.update(x=str(x.dtype), y=str(y.dtype), outputs=str(pred.dtype),
                        params=str(jax.tree.leaves(params)[0].dtype))
            return jnp.mean((pred - y) ** 2), ({}, updates)

    x, y = _sine()
    trainer = Regressor(model_class=Model, model_hparams={}, optimizer_hparams=BF16, exmp_input=x[:1],
                        **quiet(tmp_path))
    trainer.train_model((x[:300], y[:300]), (x[300:], y[300:]), num_epochs=10, batch_size=50)
    assert seen == {"hidden": "bfloat16", "x": "float32", "y": "float32", "outputs": "float32", "params": "bfloat16"}
    reported = trainer.eval_model((x[300:], y[300:]), batch_size=100)["loss"]
    predicted = trainer.predict(x[300:], batch_size=100).astype(np.float64)
    rounded_targets = np.asarray(jnp.asarray(y[300:]).astype(jnp.bfloat16), np.float64)
    np.testing.assert_allclose(reported, np.mean((predicted - y[300:]) ** 2), rtol=1e-5)  # the real error
    assert abs(reported - np.mean((predicted - rounded_targets) ** 2)) > 1e-3 * reported  # not the rounded ones


def test_a_bf16_classifiers_loss_is_the_float32_cross_entropy_of_its_logits(tmp_path):
    """The zoo's cross-entropy ran on bfloat16 logits: 0.34570 reported for 0.34539."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 8)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int32) + (x[:, 3] > 1).astype(np.int32)
    trainer = ClassificationTrainer(model_class=flaxlight.zoo.models.MLPClassifier,
                                    model_hparams={"hidden_dims": [32], "num_classes": 3},
                                    optimizer_hparams={**BF16, "lr": 1e-2}, exmp_input=x[:1], **quiet(tmp_path))
    trainer.train_model((x[:300], y[:300]), (x[300:], y[300:]), num_epochs=3, batch_size=50)
    reported = trainer.eval_model((x[300:], y[300:]), batch_size=100)["loss"]
    logits = trainer.predict(x[300:], batch_size=100).astype(np.float64)
    log_softmax = logits - logits.max(1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
    np.testing.assert_allclose(reported, -log_softmax[np.arange(100), y[300:]].mean(), rtol=2e-6)


class _Images(nn.Module):
    """uint8 images normalised inside the model, as the Flax MNIST example does (or not)."""
    to_float32: bool = True

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        x = x.astype(jnp.float32) / 255 if self.to_float32 else x / 255.0
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


@pytest.mark.parametrize("to_float32, precision, warned", [(True, "bf16", True), (False, "bf16", False),
                                                            (True, "fp32", False)])
def test_bf16_warns_once_when_the_model_computes_in_float32_anyway(tmp_path, caplog, to_float32, precision,
                                                                   warned):
    """x.astype(jnp.float32) / 255 in the model made every Dense compute in float32 under bf16,
    silently: the run paid bfloat16's rounding without its savings."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (96, 4, 4), dtype=np.uint8), rng.integers(0, 3, 96).astype(np.int32)
    trainer = ClassificationTrainer(model_class=_Images, model_hparams={"to_float32": to_float32},
                                    optimizer_hparams={**BF16, "precision": precision}, exmp_input=x[:1],
                                    **quiet(tmp_path))
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer.train_model((x[:64], y[:64]), (x[64:], y[64:]), num_epochs=2, batch_size=16)
    said = [r.getMessage() for r in caplog.records if "precision='bf16', but" in r.getMessage()]
    assert len(said) == int(warned)
    if warned:
        assert "every matrix multiplication and convolution of the train step runs in float32" in said[0]
        assert "`x.astype(jnp.float32) / 255`" in said[0] and "`x / 255.0`" in said[0]


class _NNXNormed(nnx.Module):
    """Linear -> nnx.BatchNorm -> relu -> Linear, as the user's trial built it."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.dense, self.norm = nnx.Linear(8, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.norm(self.dense(x))))


class _LinenNormed(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3)(nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x))))


def _classes(n: int = 192):
    x = np.random.default_rng(0).normal(size=(n, 8)).astype(np.float32)
    return x, ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)


@pytest.mark.parametrize("model", [_NNXNormed, _LinenNormed])
def test_a_bf16_model_with_batchnorm_computes_in_bfloat16_after_it(tmp_path, caplog, model):
    """nnx.BatchNorm promoted the activations to its float32 statistics: every layer after it ran
    in float32 under bf16, unsaid, outputs were off the bfloat16 grid and export differed from predict()."""
    x, y = _classes()
    trainer = ClassificationTrainer(model_class=model, model_hparams={}, optimizer_hparams=BF16, exmp_input=x[:1],
                                    **quiet(tmp_path))
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer.train_model((x[:128], y[:128]), None, num_epochs=1, batch_size=32)
    assert not [r for r in caplog.records if "precision='bf16', but" in r.getMessage()]
    state, params = computing_state(trainer.state, "bf16")
    for train in (True, False):
        jaxpr = jax.make_jaxpr(lambda p: state.apply_model(p, x[:4], train=train, rng=jax.random.key(0))[0])(params)
        assert {str(v.aval.dtype) for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"
                for v in e.invars} == {"bfloat16"}, (train, jaxpr)
    stats = jax.tree.leaves(trainer.state.batch_stats)  # kept and updated in float32
    assert {leaf.dtype for leaf in stats} == {np.dtype(np.float32)}
    assert not all(_on_bf16_grid(np.asarray(leaf)) for leaf in stats)
    predicted = trainer.predict(x[128:], batch_size=32)
    served = np.asarray(flaxlight.load_exported(trainer.export(tmp_path / "export", which="current"))(x[128:]))
    assert _on_bf16_grid(predicted)
    np.testing.assert_array_equal(served, predicted)


def _promoting(kind: str):
    class Model(nn.Module):  # kind: what comes between the two layers
        @nn.compact
        def __call__(self, x, train: bool = False):
            hidden = nn.relu(nn.Dense(16)(x))
            if kind == "table":  # a float32 table promotes the activations, and the head runs in float32
                hidden = hidden + jnp.asarray(np.linspace(0, 1, 16, dtype=np.float32))
            if kind == "float32 head":  # on purpose
                return nn.Dense(3)(hidden.astype(jnp.float32))
            if kind == "float32 layer":  # on purpose
                return nn.Dense(3, dtype=jnp.float32)(hidden)
            return nn.Dense(3)(hidden)

    return Model


@pytest.mark.parametrize("kind, warned", [("table", True), ("float32 head", False), ("float32 layer", False)])
def test_bf16_warns_once_when_a_float32_value_promotes_part_of_the_model(tmp_path, caplog, kind, warned):
    """The check warned only when every matrix multiplication was float32: a float32 table sending
    the layers after it back to float32 went unsaid. A float32 head asked for is no promotion."""
    x, y = _classes()
    trainer = ClassificationTrainer(model_class=_promoting(kind), model_hparams={}, optimizer_hparams=BF16,
                                    exmp_input=x[:1], **quiet(tmp_path))
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer.train_model((x, y), None, num_epochs=2, batch_size=64)
    said = [r.getMessage() for r in caplog.records if "precision='bf16', but" in r.getMessage()]
    assert len(said) == int(warned), said
    if warned:
        assert "1 of the model's 2 matrix multiplications and convolutions run in float32" in said[0]
        assert re.search(r"meets the bfloat16 activations at \S*test_mixed_precision.py:\d+ ", said[0])  # + table
        assert "`value.astype(x.dtype)`" in said[0] and "if float32 there is on purpose, ignore this" in said[0]


@pytest.mark.parametrize("value, says", [
    ("bf16-mixed", "flaxlight spells it 'bf16' (the model computes in bfloat16"),
    ("mixed_bfloat16", "flaxlight spells it 'bf16'"),
    ("bf16-true", "flaxlight offers bfloat16 as mixed precision only: 'bf16'"),
    (16, "float16 (fp16, Lightning's 16 / '16-mixed', Keras' 'mixed_float16') is not offered: use 'bf16'"),
    ("16-mixed", "float16 (fp16, Lightning's 16 / '16-mixed', Keras' 'mixed_float16') is not offered"),
    ("fp16", "is not offered: use 'bf16'"),
    ("mixed_float16", "is not offered: use 'bf16'"),
    (32, "flaxlight spells it 'fp32'"),
])
def test_other_trainers_precision_spellings_are_answered_with_flaxlights(value, says):
    """'bf16-mixed' and 'mixed_bfloat16' got no hint, 16 a 'Did you mean bf16?' as if a typo."""
    with pytest.raises(ValueError) as caught:
        as_optimizer_config({"precision": value})
    assert says in str(caught.value) and "Did you mean" not in str(caught.value)
    if value == "bf16-mixed":  # the CLI's optimizer.precision=bf16-mixed says the same
        with pytest.raises(ConfigError, match="optimizer: Unknown precision 'bf16-mixed' .* flaxlight spells it 'bf16'"):
            load_config({"trainer": {"name": "regression"}, "model": {"name": "mlp_regressor"},
                         "data": {"name": "sine"}, "optimizer": {"precision": "bf16-mixed"}})


def test_a_floating_input_given_by_keyword_computes_in_bf16_too(tmp_path):
    """apply_model(params, x, mask=m): only positional inputs were cast, and the float32 mask sent the
    rest of the model back to float32 (review)."""
    seen = {}

    class Masked(nn.Module):
        @nn.compact
        def __call__(self, x, mask=None, train: bool = False):
            hidden = nn.Dense(8)(x) * mask
            seen["hidden"] = str(hidden.dtype)
            return nn.Dense(1)(hidden)

    class Trainer(flaxlight.TrainerModule):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, m, y = batch
            pred, updates = state.apply_model(params, x, train=train, rng=rng, mask=m)
            return jnp.mean((pred - y) ** 2), ({}, updates)

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    m, y = np.ones((64, 1), np.float32), x[:, :1] * 2
    trainer = Trainer(model_class=Masked, model_hparams={}, exmp_input=(x[:1], m[:1]), optimizer_hparams=BF16,
                      **quiet(tmp_path))
    trainer.train_model((x, m, y), None, num_epochs=1, batch_size=32)
    assert seen["hidden"] == "bfloat16"
