import jax
import jax.numpy as jnp
import optax
import pytest

from flaxlight import TrainState


def _state(tx):
    return TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx, rng=jax.random.PRNGKey(0))


def test_create_uses_arrays_for_step_and_epoch():
    state = _state(optax.sgd(0.1))
    assert state.step.dtype == jnp.int32 and state.epoch.dtype == jnp.int32
    assert state.batch_stats is None and state.metrics is None


def test_apply_gradients_passes_the_loss_to_optimizers_that_take_it():
    seen = []

    def update(updates, state, params=None, *, value=None, **extra):
        seen.append(value)
        return updates, state

    tx = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    state = _state(tx).apply_gradients(grads={"w": jnp.ones(3)}, value=jnp.float32(2.5))
    assert float(seen[0]) == 2.5
    assert int(state.step) == 1


def test_apply_gradients_works_with_plain_transformations_and_replaces_fields():
    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s))
    state = _state(tx).apply_gradients(grads={"w": jnp.ones(3)}, value=1.0, batch_stats={"m": jnp.zeros(2)})
    assert jnp.allclose(state.params["w"], 2.0)  # plain update adds the gradient as is
    assert state.batch_stats["m"].shape == (2,)


def test_apply_gradients_in_jit_with_reduce_on_plateau():
    tx = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, accumulation_size=1))
    state = _state(tx)
    step = jax.jit(lambda s: s.apply_gradients(grads={"w": jnp.ones(3)}, value=jnp.float32(1.0)))
    for _ in range(5):
        state = step(state)
    assert float(state.opt_state[1].scale) < 1.0  # the constant loss was seen: the LR was reduced


def test_inference_state_without_optimizer_explains_itself():
    with pytest.raises(ValueError, match="init_optimizer"):
        _state(None).apply_gradients(grads={"w": jnp.ones(3)})
