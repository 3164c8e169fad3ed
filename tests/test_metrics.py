import jax
import jax.numpy as jnp
import pytest

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
