import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet
from flax import struct

from flaxlight.metric_objects import Max
from flaxlight.metrics import accumulate, batch_size, init_accumulator, read_means


def test_weighted_mean_counts_a_partial_last_batch_by_its_size():
    acc = init_accumulator({"loss": jnp.float32(0), "acc": jnp.float32(0)})
    step = jax.jit(lambda acc, m, batch: accumulate(acc, m, batch_size(batch)))
    acc = step(acc, {"loss": 1.0, "acc": 1.0}, jnp.zeros((32, 2)))
    acc = step(acc, {"loss": 4.0, "acc": 0.0}, jnp.zeros((8, 2)))
    means = read_means(acc, prefix="val/")
    assert means["val/loss"] == pytest.approx((32 * 1 + 8 * 4) / 40)
    assert means["val/acc"] == pytest.approx(32 / 40)


def test_non_scalar_metric_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"'per_class'.*\(10,\).*mean"):
        init_accumulator({"per_class": jax.ShapeDtypeStruct((10,), jnp.float32)})


class _DictBatches(RegressTrainer):
    """Dict batches: ``x``, ``y`` per example and, sorting first, a scalar ``a_scale`` or a
    ``(10,)`` ``a_weights`` (all ones: the loss is the plain mean squared error)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        pred, updates = state.apply_model(params, batch["x"], train=train, rng=rng)
        factor = batch["a_scale"] if "a_scale" in batch else batch["a_weights"][0]
        return jnp.mean((pred - batch["y"]) ** 2) * factor, ({}, updates)


@pytest.mark.parametrize("leaf", [np.float32(1.0), np.ones(10, np.float32)], ids=["scalar", "(10,)"])
def test_leaves_that_are_not_per_example_do_not_weight_the_metrics(tmp_path, leaf):
    """docs/data.md: on one device a scalar or a (10,) leaf next to the examples is accepted. The
    batch size was the first leaf's: a scalar sorting first failed ("Cannot tell the batch size"),
    a (10,) leaf sorting first weighted the 64-row and the 16-row batch as 10 examples each."""
    x, y = linear_data(80)
    trainer = _DictBatches(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                           exmp_input=x[:1], **quiet(tmp_path))
    name = "a_scale" if np.ndim(leaf) == 0 else "a_weights"
    batches = [{name: leaf, "x": x[i:i + n], "y": y[i:i + n]} for i, n in ((0, 64), (64, 16))]
    trainer.train_model(batches, batches, num_epochs=1)
    true_mean = float(np.mean((np.asarray(trainer.bind_model()(x)) - y) ** 2))
    assert trainer.eval_model(batches)["loss"] == pytest.approx(true_mean, rel=1e-5)
    assert trainer.history[-1]["val/loss"] == pytest.approx(true_mean, rel=1e-5)


def test_a_batch_whose_leaves_have_no_majority_leading_dimension_is_named():
    assert batch_size((np.zeros((8, 4)), np.zeros((8, 1)), np.ones(10))) == 8
    with pytest.raises(ValueError, match=r"Cannot tell the batch size: the batch's arrays disagree on their leading "
                                         r"dimension and no one dimension is shared by most of them \(\['cw'\] \(10,\), "
                                         r"\['x'\] \(8, 4\)\)\. .*keep constants such as class weights in the model"):
        batch_size({"cw": np.ones(10), "x": np.zeros((8, 4)), "scale": np.float32(2.0)})


# ---------------------------------------------------------------- what a step's metrics may be
@struct.dataclass
class R2:
    """Coefficient of determination over the epoch of one output column: ``compute()`` has shape (1,)."""

    n: jax.Array
    total: jax.Array
    squares: jax.Array
    errors: jax.Array

    @classmethod
    def of(cls, pred, target):  # (B, 1) each
        return cls(jnp.float32(target.shape[0]), target.sum(0), (target ** 2).sum(0), ((pred - target) ** 2).sum(0))

    def merge(self, other):
        return R2(self.n + other.n, self.total + other.total, self.squares + other.squares, self.errors + other.errors)

    def compute(self):
        return 1 - self.errors / (self.squares - self.total ** 2 / self.n)


class R2Trainer(RegressTrainer):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        return jnp.mean((pred - y) ** 2), ({"r2": R2.of(pred, y)}, updates)


def test_a_one_element_object_result_is_a_number_logged_and_monitored(tmp_path):
    """An R² over a (B, 1) head is an array of shape (1,): monitoring it crashed at the first
    validation ("only 0-dimensional arrays can be converted"), and without a monitor it was left
    out of metrics.csv and TensorBoard."""
    (x, y), val = linear_data(128, 0), linear_data(50, 1)
    trainer = R2Trainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                        exmp_input=x[:1], **quiet(tmp_path, monitor="val/r2", mode="max"))
    result = trainer.train_model((x, y), val, num_epochs=2, batch_size=32)
    pred = np.asarray(trainer.predict(val[0], batch_size=32), np.float64)
    expected = 1 - ((pred - val[1]) ** 2).sum() / ((val[1] - val[1].mean()) ** 2).sum()
    assert type(trainer.history[-1]["val/r2"]) is float
    assert trainer.history[-1]["val/r2"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert type(result["val/r2"]) is float and trainer.checkpoint_callback.best_model_score == result["val/r2"]
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(row["val/r2"]) for row in rows if row.get("val/r2")] == pytest.approx(
        [row["val/r2"] for row in trainer.history], rel=1e-6)
    assert sum(1 for row in rows if row.get("train/r2")) == 2


class HeadsTrainer(RegressTrainer):
    """Per-head metrics as a nested dict (an object among them), or a value of ``self.extra``."""

    extra: dict = {}

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        errors = (pred - y) ** 2
        heads = {"reg": {"mse": errors.mean(), "abs": {"max": Max.of(jnp.abs(pred - y))}}}
        return errors.mean(), ({**heads, **self.extra}, updates)


def _heads(tmp_path, **kwargs):
    x, _ = linear_data(8)
    return HeadsTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                        exmp_input=x[:1], **quiet(tmp_path, **kwargs))


def test_nested_metric_dicts_are_logged_under_slash_names(tmp_path):
    """A multi-task loss's {"reg": {"mse": ...}} failed inside JAX (float() argument must be ... not 'dict')."""
    (x, y), val = linear_data(96, 0), linear_data(40, 1)
    trainer = _heads(tmp_path, monitor="val/reg/mse")
    trainer.train_model((x, y), val, num_epochs=1, batch_size=32)
    pred = np.asarray(trainer.predict(val[0], batch_size=32))
    last = trainer.history[-1]
    assert last["val/reg/mse"] == pytest.approx(float(((pred - val[1]) ** 2).mean()), rel=1e-5)
    assert last["val/reg/abs/max"] == pytest.approx(float(np.abs(pred - val[1]).max()), rel=1e-5)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        header = next(csv.reader(f))
    assert {"train/reg/mse", "train/reg/abs/max", "val/reg/mse", "val/reg/abs/max"} <= set(header)


@pytest.mark.parametrize("extra, expected", [
    ({"per_head": [1.0, 2.0]}, r"Metric 'per_head' \(metrics\['per_head'\]\) is a list; step metrics must be scalars, "
                               r"metric objects \(merge/compute\) or dicts of them: return one scalar per name, e\.g\. "
                               r"\{'per_head/0': \.\.\., 'per_head/1': \.\.\.\}"),
    ({"heads": {"acc": (1.0, 2.0)}}, r"Metric 'heads/acc' \(metrics\['heads'\]\['acc'\]\) is a tuple"),
    ({"aux_loss": None}, r"Metric 'aux_loss' \(metrics\['aux_loss'\]\) is None; .*leave the key out when it has no "
                         r"value"),
])
def test_a_list_tuple_or_none_metric_is_refused_before_training_naming_it(tmp_path, extra, expected):
    trainer = _heads(tmp_path)
    trainer.extra = extra
    with pytest.raises(TypeError, match=expected):
        trainer.train_model(linear_data(64), None, num_epochs=1, batch_size=32)
    assert trainer.global_step == 0


def test_two_spellings_of_one_metric_name_are_refused():
    from flaxlight.metrics import flat_metrics

    with pytest.raises(ValueError, match=r"Metrics metrics\['reg/mse'\] and metrics\['reg'\]\['mse'\] both name "
                                         r"'reg/mse' .*rename one of them"):
        flat_metrics({"reg/mse": 1.0, "reg": {"mse": 2.0}})
