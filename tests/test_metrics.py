import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

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
