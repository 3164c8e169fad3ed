import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TinyMLP

from flaxlight import TrainState, TrainStep, make_eval_step, make_train_step


def _mse(params, batch, *, train, rng, state):
    x, y = batch
    pred, updates = state.apply_model(params, x, train=train, rng=rng)
    return jnp.mean((pred - y) ** 2), ({"mae": jnp.mean(jnp.abs(pred - y))}, updates)


def _state(model, x, lr=0.1):
    variables = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x, train=True)
    return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.sgd(lr),
                             batch_stats=variables.get("batch_stats"), rng=jax.random.PRNGKey(2))


def _batch(n=8):
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    return x, x.sum(1, keepdims=True)


def test_backward_is_one_value_and_grad_of_the_loss():
    x, y = _batch()
    state = _state(TinyMLP(), x)
    step = TrainStep(_mse, state=state)
    rng = jax.random.fold_in(state.rng, state.step)
    (loss, aux), grads = step.backward((x, y))
    expected_loss, expected_grads = jax.value_and_grad(
        lambda p: _mse(p, (x, y), train=True, rng=rng, state=state)[0])(state.params)
    assert float(loss) == pytest.approx(float(expected_loss))
    assert "mae" in aux[0]
    jax.tree.map(np.testing.assert_allclose, grads, expected_grads)


def test_stateful_train_step_lowers_the_loss_and_counts_steps():
    x, y = _batch()
    step = TrainStep(_mse, state=_state(TinyMLP(), x, lr=0.05))
    first = float(step.train_step((x, y))["loss"])
    for _ in range(30):
        last = float(step.train_step((x, y))["loss"])
    assert last < first / 2
    assert int(step.state.step) == 31


def test_function_form_threads_batch_stats_and_splits_the_rng():
    x, y = _batch()
    state = _state(TinyMLP(batch_norm=True, dropout_prob=0.5), x)
    train_step = jax.jit(make_train_step(_mse))
    eval_step = jax.jit(make_eval_step(_mse))
    new_state, metrics = train_step(state, (x, y))
    assert set(metrics) == {"loss", "mae"}
    mean_before = state.batch_stats["BatchNorm_0"]["mean"]
    assert not np.allclose(new_state.batch_stats["BatchNorm_0"]["mean"], mean_before)  # updated in training
    from flaxlight.state import step_key

    assert not np.array_equal(step_key(new_state), step_key(state))  # a fresh dropout key every step
    # eval mode is deterministic and leaves the statistics alone
    np.testing.assert_array_equal(eval_step(new_state, (x, y))["loss"], eval_step(new_state, (x, y))["loss"])


def test_subclass_overrides_loss_fn_and_bad_aux_is_explained():
    class Step(TrainStep):
        def loss_fn(self, params, batch, *, train, rng, state):
            return _mse(params, batch, train=train, rng=rng, state=state)[0], {}

    x, y = _batch()
    state, metrics = Step().step(_state(TinyMLP(), x), (x, y))
    assert set(metrics) == {"loss"}

    bad = TrainStep(lambda params, batch, **kw: (jnp.float32(0.0) + 0 * jax.tree.leaves(params)[0].sum(), 3))
    with pytest.raises(TypeError, match=r"\(loss, metrics\)"):
        bad.step(_state(TinyMLP(), x), (x, y))
    with pytest.raises(TypeError, match="loss function"):
        TrainStep()


def test_common_loss_fn_return_mistakes_are_named():
    """Each failed deep inside the step: 'too many values to unpack', a TrainState keyword error."""
    x, y = _batch()
    state = _state(TinyMLP(), x)

    def flat(params, batch, **kw):
        loss, (metrics, updates) = _mse(params, batch, **kw)
        return loss, metrics, updates

    def swapped(params, batch, **kw):
        loss, (metrics, updates) = _mse(params, batch, **kw)
        return loss, (updates, metrics)

    def per_example(params, batch, **kw):
        pred, _ = kw["state"].apply_model(params, batch[0], train=True, rng=kw["rng"])
        return (pred - batch[1]) ** 2

    with pytest.raises(TypeError, match=r"returned a tuple of 3 items.*not `return loss, metrics, updates`"):
        TrainStep(flat).step(state, (x, y))
    with pytest.raises(TypeError, match=r"updates with keys \['mae'\].*Did you swap metrics and updates"):
        TrainStep(swapped).step(state, (x, y))
    with pytest.raises(TypeError, match=r"with a scalar loss; got .* of shape \(8, 1\) \(a loss per example"):
        TrainStep(per_example).step(state, (x, y))
    with pytest.raises(TypeError, match=r"returned a loss of shape \(8, 1\).*take its mean"):  # it was jax's own error
        TrainStep(lambda params, batch, **kw: (per_example(params, batch, **kw), {})).step(state, (x, y))
    lightning = TrainStep(lambda params, batch, **kw: {"loss": _mse(params, batch, **kw)[0], "mae": 0.0})
    with pytest.raises(TypeError, match=r"returned a dict with 'loss' \(Lightning's training_step habit\).*"
                                        r"`return loss, \(metrics, updates\)`, with the dict's other entries \('mae'\)"):
        lightning.step(state, (x, y))
    bare = TrainStep(lambda params, batch, **kw: _mse(params, batch, **kw)[0])  # a bare loss, as Lightning takes
    _, metrics = bare.step(state, (x, y))
    assert set(metrics) == {"loss"} and set(bare.eval_step(state, (x, y))) == {"loss"}


def test_a_batchnorm_loss_that_returns_no_updates_is_warned_about(caplog):
    """Its running statistics stayed at mean 0 / var 1 silently, and evaluation used them."""
    import logging

    x, y = _batch()
    state = _state(TinyMLP(batch_norm=True), x)
    without = TrainStep(lambda params, batch, **kw: (_mse(params, batch, **kw)[0], {}))
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        without.step(state, (x, y))
        TrainStep(_mse).step(state, (x, y))  # returns the updates: no warning
        TrainStep(lambda params, batch, **kw: (_mse(params, batch, **kw)[0], {})).step(_state(TinyMLP(), x), (x, y))
        buffer_only = _state(TinyMLP(), x).replace(batch_stats={"table": {"scale": jnp.ones(3)}})  # NNX: a buffer
        TrainStep(lambda params, batch, **kw: (_mse(params, batch, **kw)[0], {})).step(buffer_only, (x, y))
        without.step(state, (x, y))  # the same step object again (debug=True runs it every step): said once
    warned = [r.getMessage() for r in caplog.records if "batch_stats" in r.getMessage()]
    assert len(warned) == 1 and "returned no updated 'batch_stats'" in warned[0]


def test_step_owner_finds_a_trainstep_through_a_wrapper_and_ignores_unbound_cells():
    from flaxlight.step import TrainStep, step_owner

    step = TrainStep(lambda params, batch, **kwargs: (0.0, {}))

    def wrap(inner):
        def with_a_metric(state, batch):
            return inner(state, batch), later

        return with_a_metric

    wrapped = wrap(step.step)
    assert step_owner(wrapped) is step  # `later` is an empty cell when asked: no error
    later = None  # noqa: F841 - bound after the question, as a user's code may


def test_a_stateful_train_step_on_a_trainers_state_leaves_the_trainer_working(tmp_path):
    """It donated trainer.state: the trainer's next predict failed with "Array has been deleted"."""
    from conftest import ClassifyTrainer, quiet

    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    trainer = ClassifyTrainer(model_class=TinyMLP, model_hparams={"output_dim": 2, "batch_norm": True},
                              optimizer_hparams={"optimizer": "sgd", "lr": 0.1}, exmp_input=x[:1], **quiet(tmp_path))
    trainer.train_model((x, y), num_epochs=1, batch_size=32)
    before, evaluated = trainer.predict(x, batch_size=32), trainer.eval_model((x, y), batch_size=32)
    step = TrainStep(trainer.loss_fn, state=trainer.state)
    step.train_step((x[:32], y[:32]))
    step.train_step((x[32:], y[32:]))  # the step's own state from here on
    assert int(step.state.step) == 4 and int(trainer.state.step) == 2
    np.testing.assert_array_equal(trainer.predict(x, batch_size=32), before)  # the trainer's state is intact
    assert trainer.eval_model((x, y), batch_size=32) == evaluated
    assert not np.allclose(step.state.apply_model(step.state.params, x, train=False)[0], before)
