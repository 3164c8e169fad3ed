"""The optimizer interface (issue 4): config -> optax, weight decay applied exactly once, masks,
schedules, errors, and the loss reaching optimizers that need it (also through a TrainerModule run).

Every numeric claim is checked against the hand-written optax (or loss) equivalent.
"""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import flaxlight
from flaxlight import optim
from flaxlight.optim import (
    OptimizerConfig,
    as_optimizer_config,
    current_learning_rate,
    ema_params,
    make_l2_regularizer,
    make_optimizer,
    make_optimizer_plan,
    make_schedule,
    make_weight_decay_mask,
)
from flaxlight.state import TrainState
from flaxlight.step import TrainStep

RTOL, ATOL = 1e-6, 1e-7


# --------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _fresh_log_once():
    """The 'said once' notes are once per process; each test starts from a clean slate."""
    optim._logged.clear()
    yield
    optim._logged.clear()


def _params(seed=0):
    """A Flax-shaped parameter tree with a kernel, biases and norm scales."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {
        "Dense_0": {"kernel": jax.random.normal(k[0], (3, 4)), "bias": jax.random.normal(k[1], (4,))},
        "LayerNorm_0": {"scale": 1.0 + 0.1 * jax.random.normal(k[2], (4,)), "bias": jnp.full((4,), 0.3)},
        "Dense_1": {"kernel": jax.random.normal(k[3], (4, 1)), "bias": jnp.ones((1,))},
    }


def _grads(params, seed=1):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(params)))
    leaves = [jax.random.normal(key, leaf.shape) for key, leaf in zip(keys, jax.tree.leaves(params))]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _run_updates(tx, params, steps=3, zero_grads=False):
    """Apply ``steps`` updates with fixed pseudo-random (or zero) gradients; return the params."""
    state = tx.init(params)
    update = jax.jit(tx.update) if steps > 3 else tx.update  # jit only pays off over several steps
    for i in range(steps):
        grads = jax.tree.map(jnp.zeros_like, params) if zero_grads else _grads(params, seed=i + 1)
        updates, state = update(grads, state, params, value=jnp.float32(1.0))
        params = optax.apply_updates(params, updates)
    return params, state


def _assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def _decayed(params):
    """The default mask by hand: kernels decay, biases and norm scales do not."""
    return {name: {leaf: leaf == "kernel" for leaf in layer} for name, layer in params.items()}


def _linear_loss(params, batch, *, train, rng, state):
    x, y = batch
    pred = x @ params["kernel"] + params["bias"]
    return jnp.mean((pred - y) ** 2), {}


def _linear_problem(n=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    return x, y


def _linear_state(tx, seed=0):
    params = {"kernel": 0.1 * jax.random.normal(jax.random.PRNGKey(seed), (3, 1)), "bias": jnp.zeros((1,))}
    return TrainState.create(apply_fn=None, params=params, tx=tx, rng=jax.random.PRNGKey(1))


# --------------------------------------------------------------------------- seed keys, typed config, ready tx
def test_seed_keys_build_the_hand_written_chain():
    """The seed's dict (digits example) == clip(1.0) + optax.adamw(warmup-cosine, wd, default mask)."""
    params, total = _params(), 50
    hp = {"optimizer": "adamw", "lr": 2e-3, "weight_decay": 1e-2, "warmup": 20}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 20, total, end_value=2e-5)
    hand = optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=1e-2, mask=_decayed(params)))
    ours, _ = _run_updates(make_optimizer(hp, total), params, steps=3)
    expected, _ = _run_updates(hand, params, steps=3)
    _assert_trees_close(ours, expected)
    # The sine example's pass-through key reaches optax.adamw (b2), as in the seed.
    make_optimizer({"optimizer": "adamw", "lr": 4e-3, "b2": 0.99}, total_steps=100)


def test_typed_config_equals_dict_and_round_trips_as_data():
    params = _params()
    config = OptimizerConfig(optimizer="sgd", lr=0.05, schedule="linear", warmup_steps=2, weight_decay=0.01,
                             optimizer_kwargs={"momentum": 0.9})
    as_dict = {"optimizer": "sgd", "lr": 0.05, "schedule": "linear", "warmup": 2, "weight_decay": 0.01,
               "momentum": 0.9}
    a, _ = _run_updates(make_optimizer(config, 10), params)
    b, _ = _run_updates(make_optimizer(as_dict, 10), params)
    _assert_trees_close(a, b, rtol=0, atol=0)
    # Saved as plain YAML (hparams.yaml) and loaded back as a dict: the same config.
    text = yaml.safe_dump(dict(config))
    assert OptimizerConfig.from_dict(yaml.safe_load(text)) == config
    assert as_optimizer_config(as_dict) == config
    # Defaults are declared once, on the fields.
    assert OptimizerConfig() == OptimizerConfig.from_dict({})
    assert OptimizerConfig().optimizer == "adamw" and OptimizerConfig().gradient_clip == 1.0


def test_ready_transformation_used_unchanged_and_factory_gets_total_steps():
    tx = optax.sgd(0.1)
    assert make_optimizer(tx, total_steps=10) is tx
    seen = []

    def factory(total_steps):
        seen.append(total_steps)
        return optax.adam(1e-3)

    plan = make_optimizer_plan(factory, total_steps=123)
    assert seen == [123] and plan.config is None and plan.regularizer is None


# --------------------------------------------------------------------------- weight decay, exactly once
@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "lion", "nadamw", "rmsprop"])
def test_decoupled_decay_is_applied_exactly_once(name):
    """With zero gradients the whole update is the decay: -lr * wd * param on kernels, 0 elsewhere."""
    params, lr, wd = _params(), 0.1, 0.05
    hp = {"optimizer": name, "lr": lr, "schedule": "constant", "weight_decay": wd}
    new, _ = _run_updates(make_optimizer(hp, 10), params, steps=1, zero_grads=True)
    expected = jax.tree.map(lambda p, m: p - lr * wd * p if m else p, params, _decayed(params))
    _assert_trees_close(new, expected)


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "novograd"])  # optax optimizers that decay
def test_l2_mode_keeps_decay_out_of_the_optimizer(name):
    """weight_decay_mode='l2': the optax chain holds no decay at all (zero grads -> no change)..."""
    params = _params()
    plan = make_optimizer_plan({"optimizer": name, "lr": 0.1, "schedule": "constant", "weight_decay": 0.05,
                                "weight_decay_mode": "l2"}, 10)
    new, _ = _run_updates(plan.tx, params, steps=2, zero_grads=True)
    _assert_trees_close(new, params, rtol=0, atol=0)
    # ...and the penalty the step must add is 0.5 * wd * |masked params|^2.
    expected = 0.5 * 0.05 * sum(float(jnp.sum(p ** 2)) for p in (params["Dense_0"]["kernel"],
                                                                 params["Dense_1"]["kernel"]))
    np.testing.assert_allclose(float(plan.regularizer(params)), expected, rtol=1e-6)


def test_adam_plus_decoupled_decay_is_adamw_and_says_so_once(caplog):
    params = _params()
    hp = {"optimizer": "adam", "lr": 1e-2, "weight_decay": 0.1, "gradient_clip": None}
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        tx = make_optimizer(hp, 20)
        make_optimizer(hp, 20)
    notes = [r for r in caplog.records if r.name == "flaxlight" and "AdamW" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    schedule = make_schedule(1e-2, 0, 20)
    hand = optax.adamw(schedule, weight_decay=0.1, mask=_decayed(params))
    _assert_trees_close(_run_updates(tx, params, steps=5)[0], _run_updates(hand, params, steps=5)[0])


def test_sgd_decoupled_uses_add_decayed_weights_and_momentum_gives_sgdw():
    params, lr, wd = _params(), 0.1, 0.01
    base = {"optimizer": "sgd", "lr": lr, "schedule": "constant", "weight_decay": wd, "gradient_clip": None}
    mask = _decayed(params)
    hand = optax.chain(optax.add_decayed_weights(wd, mask), optax.sgd(lr))
    _assert_trees_close(_run_updates(make_optimizer(base, 10), params)[0], _run_updates(hand, params)[0])
    # With momentum the decay does not go through the momentum buffer (SGDW), by hand:
    ours, _ = _run_updates(make_optimizer({**base, "momentum": 0.9}, 10), params)
    p, trace = params, jax.tree.map(jnp.zeros_like, params)
    for i in range(3):
        g = _grads(params, seed=i + 1)
        trace = jax.tree.map(lambda t, gi: 0.9 * t + gi, trace, g)
        p = jax.tree.map(lambda pi, t, m: pi - lr * t - (lr * wd * pi if m else 0.0), p, trace, mask)
    _assert_trees_close(ours, p)


def test_adamw_without_weight_decay_uses_the_documented_default_and_logs_it(caplog):
    params = _params()
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        plan = make_optimizer_plan({"optimizer": "adamw", "lr": 0.1, "schedule": "constant"}, 10)
        make_optimizer_plan({"optimizer": "adamw", "lr": 0.1, "schedule": "constant"}, 10)
    warnings = [r for r in caplog.records if "default weight_decay=0.0001" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert plan.weight_decay == pytest.approx(1e-4)
    new, _ = _run_updates(plan.tx, params, steps=1, zero_grads=True)
    _assert_trees_close(new, jax.tree.map(lambda p, m: p - 0.1 * 1e-4 * p if m else p, params, _decayed(params)))
    # Explicit 0 turns it off, silently; 'l2' never falls back to optax's decoupled default.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        off = make_optimizer_plan({"optimizer": "adamw", "lr": 0.1, "weight_decay": 0}, 10)
        l2 = make_optimizer_plan({"optimizer": "adamw", "lr": 0.1, "weight_decay_mode": "l2"}, 10)
    assert not caplog.records
    assert off.weight_decay == 0 and l2.weight_decay == 0 and l2.regularizer is None
    _assert_trees_close(_run_updates(off.tx, params, 1, zero_grads=True)[0], params, rtol=0, atol=0)


def test_l2_mode_in_the_train_step_matches_loss_plus_penalty_by_hand():
    """TrainStep adds 0.5*wd*|w|^2 (bias excluded) once; 'loss' is the data loss, 'penalty' the term."""
    x, y = _linear_problem()
    wd, lr = 0.1, 0.05
    plan = make_optimizer_plan({"optimizer": "adam", "lr": lr, "schedule": "constant", "gradient_clip": None,
                                "weight_decay": wd, "weight_decay_mode": "l2"}, 10)
    step = jax.jit(TrainStep(_linear_loss, regularizer=plan.regularizer).step)
    state = _linear_state(plan.tx)

    def hand_loss(p):
        return _linear_loss(p, (x, y), train=True, rng=None, state=None)[0] + 0.5 * wd * jnp.sum(p["kernel"] ** 2)

    hand_tx, params = optax.adam(lr), state.params
    hand_state = hand_tx.init(params)
    for _ in range(4):
        data_loss = _linear_loss(state.params, (x, y), train=True, rng=None, state=None)[0]
        penalty = 0.5 * wd * jnp.sum(state.params["kernel"] ** 2)  # the bias is not decayed
        state, metrics = step(state, (x, y))
        updates, hand_state = hand_tx.update(jax.grad(hand_loss)(params), hand_state, params)
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(metrics["loss"], data_loss, rtol=1e-6)
        np.testing.assert_allclose(metrics["penalty"], penalty, rtol=1e-6)
    _assert_trees_close(state.params, params)


def test_l2_and_decoupled_agree_for_plain_sgd_so_neither_doubles():
    """For SGD without momentum L2 and decoupled decay are the same maths: any double decay would differ."""
    x, y = _linear_problem()
    runs = {}
    for mode in ("l2", "decoupled"):
        plan = make_optimizer_plan({"optimizer": "sgd", "lr": 0.1, "schedule": "constant", "gradient_clip": None,
                                    "weight_decay": 0.2, "weight_decay_mode": mode, "weight_decay_exclude": ()}, 10)
        step = jax.jit(TrainStep(_linear_loss, regularizer=plan.regularizer).step)
        state = _linear_state(plan.tx)
        for _ in range(5):
            state, _ = step(state, (x, y))
        runs[mode] = state.params
    _assert_trees_close(runs["l2"], runs["decoupled"], rtol=1e-5, atol=1e-6)


def test_default_mask_excludes_biases_and_norm_scales():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dense(4)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.LayerNorm()(x)
            return nn.Dense(2, use_bias=False)(x)

    variables = Net().init(jax.random.PRNGKey(0), jnp.ones((2, 3)), train=True)
    params = variables["params"]
    mask = make_weight_decay_mask()(params)
    assert mask == {
        "Dense_0": {"kernel": True, "bias": False},
        "BatchNorm_0": {"scale": False, "bias": False},
        "LayerNorm_0": {"scale": False, "bias": False},
        "Dense_1": {"kernel": True},
    }
    # The optimizer decays exactly the masked leaves (zero grads: the update is the decay).
    new, _ = _run_updates(make_optimizer({"optimizer": "adamw", "lr": 0.5, "schedule": "constant",
                                          "weight_decay": 0.1}, 5), params, steps=1, zero_grads=True)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new, params)
    assert changed == {k: {n: bool(v) and bool(jnp.any(params[k][n] != 0)) for n, v in layer.items()}
                       for k, layer in mask.items()}
    # Configurable: exclude nothing, or pass a mask function.
    assert all(jax.tree.leaves(make_weight_decay_mask(())(params)))
    only_first = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "Dense_0", p)  # noqa: E731
    new, _ = _run_updates(make_optimizer({"optimizer": "sgd", "lr": 0.5, "schedule": "constant", "weight_decay": 0.1,
                                          "weight_decay_mask": only_first}, 5), params, steps=1, zero_grads=True)
    np.testing.assert_allclose(new["Dense_0"]["bias"], params["Dense_0"]["bias"] * (1 - 0.05), rtol=1e-6)
    np.testing.assert_array_equal(new["Dense_1"]["kernel"], params["Dense_1"]["kernel"])
    # The same mask feeds the L2 penalty.
    reg = make_l2_regularizer(2.0)
    assert float(reg({"kernel": jnp.ones(2), "bias": jnp.ones(3)})) == pytest.approx(5.0)
    reg = make_l2_regularizer(2.0, make_weight_decay_mask())
    assert float(reg({"kernel": jnp.ones(2), "bias": jnp.ones(3)})) == pytest.approx(2.0)


# --------------------------------------------------------------------------- schedules
@pytest.mark.parametrize(
    "schedule, extra, expected",
    [
        ("constant", {}, {0: 1.0, 50: 1.0, 99: 1.0}),
        ("constant", {"warmup_steps": 10}, {0: 0.0, 5: 0.5, 10: 1.0, 99: 1.0}),
        ("warmup_cosine", {"warmup_steps": 10}, {0: 0.0, 5: 0.5, 10: 1.0, 55: 0.505, 100: 0.01}),
        ("warmup_cosine", {}, {0: 1.0, 50: 0.505, 100: 0.01}),
        ("linear", {"end_lr_factor": 0.0}, {0: 1.0, 25: 0.75, 100: 0.0}),
        ("linear", {"warmup_steps": 20}, {10: 0.5, 20: 1.0, 60: 0.505, 100: 0.01}),
        ("exponential", {}, {0: 1.0, 50: 0.1, 100: 0.01}),
        ("piecewise", {"boundaries_and_scales": {30: 0.1, 60: 0.5}}, {29: 1.0, 30: 0.1, 60: 0.05}),
        ("one_cycle", {"warmup_steps": 25}, {0: 1 / 25, 25: 1.0, 100: 1 / 25 / 1e4}),
    ],
)
def test_schedules_give_the_expected_learning_rates(schedule, extra, expected):
    plan = make_optimizer_plan({"optimizer": "sgd", "lr": 1.0, "schedule": schedule, **extra}, total_steps=100)
    for step, value in expected.items():
        np.testing.assert_allclose(float(plan.schedule(step)), value, rtol=1e-4, atol=1e-7, err_msg=f"step {step}")


def test_current_learning_rate_is_readable_from_the_state_and_counts_updates():
    params = {"w": jnp.ones(2)}
    plan = make_optimizer_plan({"optimizer": "sgd", "lr": 1.0, "schedule": "linear", "end_lr_factor": 0.0,
                                "accumulate_grad_batches": 2}, total_steps=20)  # 10 updates
    state = plan.tx.init(params)
    np.testing.assert_allclose(current_learning_rate(state), 1.0)
    for _ in range(4):  # 4 batches = 2 optimizer updates
        _, state = plan.tx.update({"w": jnp.ones(2)}, state, params, value=jnp.float32(1.0))
    np.testing.assert_allclose(current_learning_rate(state), 0.8, rtol=1e-6)
    # Works from a TrainState, inside jit, e.g. to log it from a loss function.
    ts = TrainState.create(apply_fn=None, params=params, tx=plan.tx)
    assert float(jax.jit(current_learning_rate)(ts)) == pytest.approx(1.0)
    assert current_learning_rate(optax.sgd(0.1).init(params)) is None
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3).init(params)
    assert float(current_learning_rate(injected)) == pytest.approx(0.3)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "hparams, total, fragments",
    [
        ({"optimizer": "adamm"}, 10, ["Unknown optimizer 'adamm'", "Did you mean 'adam'", "sgd"]),
        ({"optimizer": "sgd", "momentun": 0.9}, 10, ["'momentun'", "Did you mean 'momentum'", "nesterov"]),
        ({"weight_decy": 0.1}, 10, ["'weight_decy'", "Did you mean 'weight_decay'"]),
        ({"learning_rate": 0.1}, 10, ["'learning_rate'", "'lr'"]),
        ({"lr": 0.0}, 10, ["'lr'", "> 0"]),
        ({"lr": -1e-3}, 10, ["'lr'", "> 0"]),
        ({"schedule": "cosine"}, 10, ["Unknown schedule 'cosine'", "warmup_cosine", "one_cycle"]),
        ({"warmup": 50}, 10, ["warmup_steps", "longer than the run", "10 optimizer updates"]),
        ({"weight_decay": -0.1}, 10, ["'weight_decay'", ">= 0"]),
        ({"weight_decay_mode": "decopled"}, 10, ["'decopled'", "Did you mean 'decoupled'", "l2"]),
        ({"weight_decay_mode": "L2"}, 10, ["Did you mean 'l2'"]),
        ({"accumulate_grad_batches": 0}, 10, ["'accumulate_grad_batches'", ">= 1"]),
        ({"precision": "fp16"}, 10, ["precision", "bf16"]),
        ({"reduce_on_plateau": {"patients": 3}}, 10, ["'patients'", "Did you mean 'patience'"]),
        ({"optimizer": "polyak_sgd", "schedule": "warmup_cosine"}, 10, ["polyak_sgd", "schedule='constant'"]),
        ({"schedule": "piecewise"}, 10, ["boundaries_and_scales"]),
        ({"ema_decay": 1.5}, 10, ["'ema_decay'", "(0, 1)"]),
        ({"warmup": 1, "warmup_steps": 2}, 10, ["'warmup'", "'warmup_steps'"]),
        ({"optimizer": "adamw", "mask": None}, 10, ["'mask'", "'weight_decay_mask'"]),
    ],
)
def test_bad_input_fails_with_a_helpful_message(hparams, total, fragments):
    with pytest.raises(ValueError) as info:
        make_optimizer(hparams, total_steps=total)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_typed_config_is_validated_too():
    with pytest.raises(ValueError, match="Did you mean 'momentum'"):
        OptimizerConfig(optimizer="sgd", optimizer_kwargs={"momentun": 0.9})
    with pytest.raises(ValueError, match="Unknown weight_decay_mode"):
        OptimizerConfig(weight_decay_mode="both")
    with pytest.raises(TypeError, match="optimizer_hparams must be"):
        make_optimizer(42, total_steps=10)


# --------------------------------------------------------------------------- the loss reaches the optimizer
def _plateau_problem(n=8):
    """x = 0 and zero-mean targets: the gradient is exactly 0, so the loss is flat at 1.0."""
    x = np.zeros((n, 3), np.float32)
    y = np.tile(np.array([[1.0], [-1.0]], np.float32), (n // 2, 1))
    return x, y


def test_reduce_on_plateau_lowers_the_lr_only_after_a_plateau():
    tx = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=2, factor=0.5))
    step = jax.jit(TrainStep(_linear_loss).step)
    flat = _linear_state(tx).replace(params={"kernel": jnp.zeros((3, 1)), "bias": jnp.zeros((1,))})
    for _ in range(6):
        flat, metrics = step(flat, _plateau_problem())
    assert float(metrics["loss"]) == 1.0
    hand = optax.contrib.reduce_on_plateau(patience=2, factor=0.5)
    hand_state = hand.init(flat.params)
    for _ in range(6):
        _, hand_state = hand.update(flat.params, hand_state, value=jnp.float32(1.0))
    plateau = flat.opt_state[1]
    assert float(plateau.scale) == float(hand_state.scale) < 1.0
    # A steadily improving loss keeps the scale at 1.
    improving = _linear_state(tx)
    for _ in range(6):
        improving, _ = step(improving, _linear_problem(n=8))  # same shapes: no second compile
    assert float(improving.opt_state[1].scale) == 1.0


def test_polyak_sgd_receives_the_loss():
    x, y = _linear_problem()
    plan = make_optimizer_plan({"optimizer": "polyak_sgd", "lr": 2.0, "schedule": "constant",
                                "gradient_clip": None}, 10)
    state = _linear_state(plan.tx)
    loss, grads = jax.value_and_grad(lambda p: _linear_loss(p, (x, y), train=True, rng=None, state=None)[0])(
        state.params)
    new, _ = jax.jit(TrainStep(_linear_loss).step)(state, (x, y))
    # Polyak step size by hand: min(max_lr, (f - f_min) / |g|^2) with f_min = 0.
    norm2 = sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(grads))
    size = min(2.0, float(loss) / norm2)
    _assert_trees_close(new.params, jax.tree.map(lambda p, g: p - size * g, state.params, grads), rtol=1e-5)


def test_lbfgs_gets_value_fn_and_solves_least_squares():
    """optax.lbfgs by name (lr=None: its zoom line search, which calls value_fn, picks the step)."""
    x, y = _linear_problem(n=32)
    tx = make_optimizer({"optimizer": "lbfgs", "lr": None, "schedule": "constant", "gradient_clip": None}, 10)
    state = _linear_state(tx)
    step = jax.jit(TrainStep(_linear_loss).step, donate_argnums=0)  # donated, as the trainer does
    for _ in range(12):
        state, metrics = step(state, (x, y))
    design = np.concatenate([x, np.ones((len(x), 1), np.float32)], axis=1)
    solution = np.linalg.lstsq(design, y, rcond=None)[0].ravel()
    found = np.concatenate([np.asarray(state.params["kernel"]).ravel(), np.asarray(state.params["bias"])])
    np.testing.assert_allclose(found, solution, atol=1e-4)
    assert float(metrics["loss"]) < 1e-6



def test_train_state_apply_gradients_drives_lbfgs_in_a_hand_loop():
    """TrainState.apply_gradients passes grad= and value_fn= as well as value= (it passed value
    only, and optax.lbfgs failed), so a hand-written step gets optax's own iterates."""
    x, y = _linear_problem(n=32)
    tx = optax.lbfgs()

    def loss(params):
        return _linear_loss(params, (x, y), train=True, rng=None, state=None)[0]

    @jax.jit
    def step(state):
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads, value=value, value_fn=loss)

    @jax.jit
    def optax_step(params, opt_state):  # optax's own loop (jitted: its line search runs op by op otherwise)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params, value=value, grad=grads, value_fn=loss)
        return optax.apply_updates(params, updates), opt_state

    state = _linear_state(tx)
    params, opt_state = state.params, tx.init(state.params)
    for _ in range(5):
        state = step(state)
        params, opt_state = optax_step(params, opt_state)
    _assert_trees_close(state.params, params, rtol=1e-6)
    assert float(loss(state.params)) < 1e-3 * float(loss(_linear_state(tx).params))

def test_an_extra_args_transformation_without_extra_kwargs_still_gets_value():
    seen = []

    def update(updates, state, params=None, *, value):
        seen.append(value)
        return updates, state

    tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    TrainStep(_linear_loss).step(_linear_state(tx), _linear_problem())
    assert len(seen) == 1


# --------------------------------------------------------------------------- learned-optimizer interface
def loss_aware_sgd(total_steps: int, lr: float = 0.05) -> optax.GradientTransformationExtraArgs:
    """A tiny 'learned optimizer': SGD annealed to 0 over ``total_steps``, step scaled by loss/(1+loss).

    It follows the interface documented in docs/optimizers.md: built from the run's length,
    given the loss every step as ``value=`` (and keeps their sum, to prove it).
    """

    def init(params):
        del params
        return {"count": jnp.zeros([], jnp.int32), "value_sum": jnp.zeros([], jnp.float32)}

    def update(updates, state, params=None, *, value, **extra_args):
        del params, extra_args
        anneal = 1.0 - state["count"] / total_steps
        scale = -lr * anneal * value / (1.0 + value)
        updates = jax.tree.map(lambda g: scale * g, updates)
        return updates, {"count": state["count"] + 1, "value_sum": state["value_sum"] + value}

    return optax.GradientTransformationExtraArgs(init, update)


# --------------------------------------------------------------------------- TrainerModule runs
class Linear(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1)(x)


class Regressor(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        lr = current_learning_rate(state)  # None for optimizers that keep no learning rate
        return jnp.mean((pred - y) ** 2), ({} if lr is None else {"lr": lr}, updates)


def _trainer(tmp_path, optimizer_hparams, x):
    return Regressor(model_class=Linear, model_hparams={}, optimizer_hparams=optimizer_hparams, exmp_input=x[:1],
                     enable_progress_bar=False, enable_model_summary=False,
                     logger_params={"log_dir": str(tmp_path), "logger_type": "csv"})


def test_trainer_reduce_on_plateau_lowers_lr_after_plateau(tmp_path):
    x, y = _plateau_problem(n=8)
    x, y = np.tile(x, (6, 1)), np.tile(y, (6, 1))  # 6 identical batches of 8
    hp = {"optimizer": "sgd", "lr": 0.1, "schedule": "constant", "reduce_on_plateau": {"patience": 2, "factor": 0.5}}
    trainer = _trainer(tmp_path, hp, x)
    trainer.state = trainer.state.replace(params=jax.tree.map(jnp.zeros_like, trainer.state.params))
    metrics = trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=8), None, num_epochs=1)
    assert metrics["train/loss"] == pytest.approx(1.0)
    hand = optax.contrib.reduce_on_plateau(patience=2, factor=0.5)
    hand_state = hand.init(trainer.state.params)
    for _ in range(6):
        _, hand_state = hand.update(trainer.state.params, hand_state, value=jnp.float32(1.0))
    assert float(current_learning_rate(trainer.state)) == pytest.approx(0.1 * float(hand_state.scale))
    assert float(hand_state.scale) < 1.0
    assert metrics["train/lr"] < 0.1  # logged from the loss function, inside jit


def test_trainer_l2_mode_decays_once_and_reports_the_data_loss(tmp_path):
    x, y = _linear_problem(n=16)
    lr, wd = 0.05, 0.5
    hp = {"optimizer": "sgd", "lr": lr, "schedule": "constant", "gradient_clip": None, "weight_decay": wd,
          "weight_decay_mode": "l2"}
    trainer = _trainer(tmp_path, hp, x)
    params = jax.tree.map(jnp.array, trainer.state.params)
    metrics = trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=8), None, num_epochs=2)

    def data_loss(p, xb, yb):
        return jnp.mean((xb @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"] - yb) ** 2)

    losses = []
    for _ in range(2):
        for i in range(0, 16, 8):
            xb, yb = x[i:i + 8], y[i:i + 8]
            losses.append(float(data_loss(params, xb, yb)))
            g = jax.grad(data_loss)(params, xb, yb)
            g["Dense_0"]["kernel"] = g["Dense_0"]["kernel"] + wd * params["Dense_0"]["kernel"]  # bias: not decayed
            params = jax.tree.map(lambda p, gi: p - lr * gi, params, g)
    _assert_trees_close(trainer.state.params, params, rtol=1e-5, atol=1e-6)
    assert metrics["train/loss"] == pytest.approx(np.mean(losses[2:]), rel=1e-5)  # last epoch, penalty excluded
    assert metrics["train/penalty"] > 0


def test_trainer_passes_loss_and_total_steps_to_a_learned_optimizer(tmp_path):
    x, y = _linear_problem(n=24)
    built = []

    def factory(total_steps):
        built.append(total_steps)
        return loss_aware_sgd(total_steps)

    trainer = _trainer(tmp_path, factory, x)
    metrics = trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=8), None, num_epochs=1)
    assert built == [3]  # num_epochs * steps_per_epoch, known at construction
    state = trainer.state.opt_state
    assert int(state["count"]) == 3
    # The optimizer saw every step's loss: their sum == 3 * the epoch's mean train loss.
    assert float(state["value_sum"]) == pytest.approx(3 * metrics["train/loss"], rel=1e-5)


@pytest.mark.parametrize("hp", [{"optimizer": "polyak_sgd", "lr": 1.0},  # docs/optimizers.md's recipe
                                {"optimizer": "polyak_sgd", "lr": 1.0, "schedule": "constant", "gradient_clip": None}])
def test_trainer_with_polyak_sgd_matches_the_hand_loop(tmp_path, hp):
    x, y = _linear_problem(n=16)
    trainer = _trainer(tmp_path, hp, x)
    params = jax.tree.map(jnp.array, trainer.state.params)
    trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=8), None, num_epochs=1)
    tx = optax.polyak_sgd(max_learning_rate=1.0)
    opt_state = tx.init(params)

    def loss(p, xb, yb):
        return jnp.mean((xb @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"] - yb) ** 2)

    for i in range(0, 16, 8):
        value, grads = jax.value_and_grad(loss)(params, x[i:i + 8], y[i:i + 8])
        updates, opt_state = tx.update(grads, opt_state, params, value=value)
        params = optax.apply_updates(params, updates)
    _assert_trees_close(trainer.state.params, params, rtol=1e-5, atol=1e-6)


def test_trainer_warns_when_a_custom_step_would_drop_the_l2_term(tmp_path, caplog):
    class Custom(Regressor):
        def create_functions(self):
            step = TrainStep(self.loss_fn)  # no regularizer: the L2 term would be lost
            return step.step, step.eval_step

    x, y = _linear_problem(n=8)
    trainer = Custom(model_class=Linear, model_hparams={}, exmp_input=x[:1], enable_progress_bar=False,
                     enable_model_summary=False, logger_params={"log_dir": str(tmp_path), "logger_type": "csv"},
                     optimizer_hparams={"optimizer": "sgd", "weight_decay": 0.1, "weight_decay_mode": "l2"})
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer.init_optimizer(1, 1)
    assert any("weight_decay_mode='l2'" in r.getMessage() for r in caplog.records)

    class WithPenalty(Regressor):  # docs/optimizers.md's recipe: no warning
        def create_functions(self):
            config = flaxlight.optim.as_optimizer_config(self.optimizer_hparams)
            step = TrainStep(self.loss_fn, regularizer=config.l2_regularizer(), precision=config.precision)
            return step.step, step.eval_step

    caplog.clear()
    trainer = WithPenalty(model_class=Linear, model_hparams={}, exmp_input=x[:1], enable_progress_bar=False,
                          enable_model_summary=False,
                          logger_params={"log_dir": str(tmp_path / "b"), "logger_type": "csv"},
                          optimizer_hparams={"optimizer": "sgd", "weight_decay": 0.1, "weight_decay_mode": "l2"})
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer.init_optimizer(1, 1)
    assert not any("weight_decay_mode='l2'" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- training tricks

def test_trainer_warns_when_a_custom_step_would_drop_bf16(tmp_path, caplog):
    """A TrainStep built without precision= computed in fp32 while hparams.yaml said bf16."""
    class Custom(Regressor):
        def create_functions(self):
            return TrainStep(self.loss_fn).step, TrainStep(self.loss_fn).eval_step

    class WithPrecision(Regressor):
        def create_functions(self):
            step = TrainStep(self.loss_fn, precision=flaxlight.optim.as_optimizer_config(self.optimizer_hparams).precision)
            return step.step, step.eval_step

    x, _ = _linear_problem(n=8)
    warnings = {}
    for trainer_class in (Custom, WithPrecision, Regressor):
        caplog.clear()
        trainer = trainer_class(model_class=Linear, model_hparams={}, exmp_input=x[:1], enable_progress_bar=False,
                                enable_model_summary=False, optimizer_hparams={"optimizer": "sgd", "precision": "bf16"},
                                logger_params={"log_dir": str(tmp_path / trainer_class.__name__), "logger_type": "csv"})
        with caplog.at_level(logging.WARNING, logger="flaxlight"):
            trainer.init_optimizer(1, 1)
        warnings[trainer_class] = [r.getMessage() for r in caplog.records if "precision='bf16'" in r.getMessage()]
    assert not warnings[WithPrecision] and not warnings[Regressor]
    assert len(warnings[Custom]) == 1 and "computes in fp32: pass `precision='bf16'`" in warnings[Custom][0]

def test_gradient_accumulation_equals_one_big_batch():
    x, y = _linear_problem(n=16)
    hp = {"optimizer": "adam", "lr": 0.01, "warmup": 2, "weight_decay": 0.1, "weight_decay_exclude": ()}
    big = _linear_state(make_optimizer(hp, total_steps=4))
    small = _linear_state(make_optimizer({**hp, "accumulate_grad_batches": 2}, total_steps=8))
    step = jax.jit(TrainStep(_linear_loss).step)
    for _ in range(4):
        big, _ = step(big, (x, y))
        small, _ = step(small, (x[:8], y[:8]))
        small, _ = step(small, (x[8:], y[8:]))
    _assert_trees_close(small.params, big.params, rtol=1e-5, atol=1e-6)


def test_ema_of_parameters_is_tracked_and_used_for_evaluation():
    x, y = _linear_problem()
    decay, lr = 0.9, 0.1
    plan = make_optimizer_plan({"optimizer": "sgd", "lr": lr, "schedule": "constant", "gradient_clip": None,
                                "ema_decay": decay, "weight_decay": 0}, 10)
    ts = TrainStep(_linear_loss)
    state = _linear_state(plan.tx)  # the average starts as a copy: the donated step below takes both
    ema = jax.tree.map(jnp.copy, state.params)
    for _ in range(3):
        state, _ = jax.jit(ts.step, donate_argnums=0)(state, (x, y))
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, state.params)
    _assert_trees_close(ema_params(state), ema)
    expected = _linear_loss(ema, (x, y), train=False, rng=None, state=None)[0]
    np.testing.assert_allclose(ts.eval_step(state, (x, y))["loss"], expected, rtol=1e-6)
    raw = TrainStep(_linear_loss, eval_with_ema=False).eval_step(state, (x, y))["loss"]
    np.testing.assert_allclose(raw, _linear_loss(state.params, (x, y), train=False, rng=None, state=None)[0],
                               rtol=1e-6)


def test_bf16_precision_computes_in_bf16_and_keeps_fp32_master_weights():
    class BNNet(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dense(8)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(1)(x)

    x, y = _linear_problem(n=32)
    model = BNNet()
    variables = model.init(jax.random.PRNGKey(0), x[:2], train=True)
    seen = []

    def loss_fn(params, batch, *, train, rng, state):
        xb, yb = batch
        seen.append(jax.tree.leaves(params)[0].dtype)
        pred, updates = state.apply_model(params, xb, train=train, rng=rng)
        return jnp.mean((pred.astype(jnp.float32) - yb) ** 2), ({}, updates)

    def make_state():
        return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.05),
                                 batch_stats=variables["batch_stats"], rng=jax.random.PRNGKey(1))

    s32, m32 = jax.jit(TrainStep(loss_fn, precision="fp32").step)(make_state(), (x, y))
    s16, m16 = jax.jit(TrainStep(loss_fn, precision="bf16").step)(make_state(), (x, y))
    assert jnp.bfloat16 in seen and jnp.float32 in seen
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves((s16.params, s16.opt_state, s16.batch_stats)))
    assert m16["loss"].dtype == jnp.float32
    np.testing.assert_allclose(m16["loss"], m32["loss"], rtol=2e-2)
    _assert_trees_close(s16.params, s32.params, rtol=2e-2, atol=2e-3)


def test_predict_export_and_bind_model_serve_the_ema_weights_evaluation_used(tmp_path, regression_loaders):
    from conftest import RegressTrainer, TinyMLP, quiet

    train, val, _ = regression_loaders
    x, y = next(iter(val))
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "ema_decay": 0.9}, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    tested = trainer.test((x, y), batch_size=len(x), which="best")["test/loss"]  # evaluated with the EMA weights
    exported = flaxlight.load_exported(trainer.export(tmp_path / "export", which="best"))
    loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=x[:1])  # inference: the average too
    assert loaded.test((x, y), batch_size=len(x))["test/loss"] == pytest.approx(tested, rel=1e-4)
    for outputs in (trainer.predict(x, batch_size=len(x), which="best"), trainer.predict(x, batch_size=len(x)),
                    trainer.bind_model()(x, train=False), exported(x), loaded.predict(x, batch_size=len(x), which="best"),
                    loaded.bind_model()(x, train=False)):
        assert float(np.mean((np.asarray(outputs) - y) ** 2)) == pytest.approx(tested, rel=1e-4)


# --------------------------------------------------------------------------- mistakes that used to run silently
@pytest.mark.parametrize("function, shown", [(optax.adam, "optax.adam"), (optax.sgd, "optax.sgd"),
                                             (optax.polyak_sgd, "optax.polyak_sgd")])
def test_an_uncalled_optax_optimizer_fails_when_the_trainer_is_built(tmp_path, function, shown):
    """optimizer_hparams=optax.adam (no parentheses) was taken for a factory total_steps -> tx,
    so optax.adam(total_steps) trained with the run's length as its learning rate."""
    x, _ = _linear_problem(n=8)
    with pytest.raises(TypeError) as info:
        _trainer(tmp_path, function, x)
    message = str(info.value)
    assert f"optimizer_hparams={shown} is an optimizer function, not a transformation" in message
    assert f"pass {shown}(1e-3)" in message and f"{{'optimizer': '{shown[6:]}', 'lr': 1e-3}}" in message


def test_a_function_whose_first_argument_is_the_learning_rate_is_refused_and_a_factory_is_not():
    def my_optimizer(learning_rate, momentum=0.9):
        return optax.sgd(learning_rate, momentum)

    with pytest.raises(TypeError, match=r"optimizer_hparams=my_optimizer is an optimizer function.*my_optimizer\(1e-3\)"):
        make_optimizer(my_optimizer, total_steps=10)
    assert isinstance(make_optimizer(loss_aware_sgd, total_steps=10), optax.GradientTransformation)
    with pytest.raises(TypeError, match=r"optimizer_hparams\['optimizer'\] must be an optax optimizer's name"):
        make_optimizer({"optimizer": optax.adam(1e-3)}, total_steps=10)


def test_a_schedule_function_refuses_lr_and_warmup_steps_it_would_not_use(tmp_path):
    """An explicit optax schedule ran alone while the summary and hparams.yaml reported lr=0.5
    and warmup_steps=10."""
    x, _ = _linear_problem(n=8)

    def schedule(count):
        return jnp.full([], 0.05)
    with pytest.raises(ValueError) as info:
        _trainer(tmp_path, {"optimizer": "sgd", "lr": 0.5, "warmup_steps": 10, "schedule": schedule}, x)
    message = str(info.value)
    assert "optimizer_hparams['schedule'] is a function" in message
    assert "lr=0.5 and warmup_steps=10 would not be used. Remove 'lr' and 'warmup_steps'" in message
    with pytest.raises(ValueError, match=r"warmup_steps=3 would not be used"):
        OptimizerConfig(optimizer="sgd", schedule=schedule, warmup_steps=3)
    with pytest.raises(flaxlight.config.ConfigError, match=r"optimizer: .*lr=0.5 would not be used"):
        flaxlight.config.load_config(_config({"optimizer": "sgd", "lr": 0.5, "schedule": schedule}))
    # Without them the function is the rate, and that is what is shown and recorded.
    hparams = {"optimizer": "sgd", "schedule": schedule, "gradient_clip": None}
    assert optim.describe_optimizer(hparams) == "sgd(lr=schedule schedule)"
    assert optim.recorded_optimizer(hparams)["lr"] is None
    assert OptimizerConfig(optimizer="sgd", schedule=schedule).lr is None
    plan = make_optimizer_plan(hparams, total_steps=10)
    params = {"w": jnp.ones(2)}
    updates, _ = plan.tx.update({"w": jnp.ones(2)}, plan.tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.05)


def test_current_learning_rate_of_an_inject_hyperparams_state_is_the_next_updates():
    """inject_hyperparams stores the rate it used for the last update; the docs promise the next one's."""
    schedule = optax.piecewise_constant_schedule(0.1, {3: 0.1})  # 0.1 for updates 1-3, 0.01 from update 4
    params = {"w": jnp.ones(2)}
    for tx in (optax.inject_hyperparams(optax.sgd)(learning_rate=schedule),
               optax.chain(optax.clip(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=schedule))):
        state = TrainState.create(apply_fn=None, params=params, tx=tx)
        seen, in_jit = [], []
        for _ in range(5):
            seen.append(float(current_learning_rate(state)))
            in_jit.append(float(jax.jit(current_learning_rate)(state)))
            state = state.apply_gradients(grads={"w": jnp.ones(2)})
        np.testing.assert_allclose(seen, [float(schedule(n)) for n in range(5)], rtol=1e-6)  # [0.1] * 3 + [0.01] * 2
        np.testing.assert_allclose(in_jit, seen, rtol=1e-6)
    # The optimizer state alone does not hold the schedule: the rate optax stored (the last update's).
    assert float(current_learning_rate(state.opt_state)) == pytest.approx(0.01)
    constant = TrainState.create(apply_fn=None, params=params, tx=optax.inject_hyperparams(optax.sgd)(learning_rate=0.3))
    assert float(current_learning_rate(constant)) == pytest.approx(0.3)


def test_reading_the_next_inject_rate_costs_no_optimizer_work():
    params = {"w": jnp.ones((256, 256))}
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(1.0, 0.0, 10))
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    cost = jax.jit(current_learning_rate).lower(state).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert cost.get("flops", 0.0) < 100  # an Adam update of 65536 parameters would be ~10^6


@pytest.mark.parametrize(
    "hparams, fragments",
    [
        ({"lr": float("inf")}, ["optimizer_hparams['lr'] must be > 0 and finite", "got inf"]),
        ({"gradient_clip": float("inf")}, ["'gradient_clip'", "finite", "None: off"]),
        ({"optimizer": "adam", "clipnorm": 1.0}, ["'clipnorm'", "Did you mean 'gradient_clip'?"]),
        ({"optimizer": "adam", "clipvalue": 0.5}, ["'clipvalue'", "Did you mean 'gradient_clip_value'?"]),
        ({"optimizer": "adam", "betas": (0.9, 0.99)}, ["'betas'", "Did you mean 'b1' and 'b2' (one key each)?"]),
        ({"optimizer": "adam", "decay": 0.01}, ["'decay'", "Did you mean 'weight_decay'?"]),
        ({"optimizer": "adam", "decay": 0.999}, ["'decay'", "Did you mean 'ema_decay' (a moving average of the "
                                                 "parameters) or 'weight_decay'?"]),
        ({"reduce_on_plateau": {"rtol": 0.0}}, ["optimizer_hparams['reduce_on_plateau']={'rtol': 0.0} is refused",
                                                "At least one of rtol or atol must be positive"]),
        ({"reduce_on_plateau": {"factor": 2.0}}, ["Factor must be in the range (0, 1)"]),
        ({"reduce_on_plateau": {"patience": -1}}, ["optimizer_hparams['reduce_on_plateau']['patience'] must be an "
                                                   "integer >= 0, got -1"]),
        ({"reduce_on_plateau": {"accumulation_size": 0}}, ["['accumulation_size'] must be an integer >= 1"]),
    ],
)
def test_more_mistakes_fail_with_a_helpful_message(hparams, fragments):
    with pytest.raises(ValueError) as info:
        OptimizerConfig.from_dict(hparams)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_bad_reduce_on_plateau_values_fail_when_the_trainer_is_built(tmp_path):
    x, _ = _linear_problem(n=8)
    with pytest.raises(ValueError, match="At least one of rtol or atol must be positive"):
        _trainer(tmp_path, {"optimizer": "sgd", "schedule": "constant", "reduce_on_plateau": {"rtol": 0.0}}, x)


def test_an_optax_argument_given_to_optimizer_config_points_at_optimizer_kwargs():
    with pytest.raises(TypeError) as info:
        OptimizerConfig(optimizer="sgd", momentum=0.9)
    assert str(info.value) == (
        "OptimizerConfig() got momentum=0.9, an argument of optax.sgd: put it in optimizer_kwargs: "
        "OptimizerConfig(optimizer='sgd', ..., optimizer_kwargs={'momentum': 0.9}) (the dict form takes it as a key "
        "of its own: {'optimizer': 'sgd', 'momentum': 0.9}).")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'learning_rate'\. Did you mean 'lr'\?"):
        OptimizerConfig(learning_rate=1e-3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'clipnorm'\. Did you mean 'gradient_clip'\?"):
        OptimizerConfig(clipnorm=1.0)
    assert OptimizerConfig(optimizer="sgd", optimizer_kwargs={"momentum": 0.9}).optimizer_kwargs == {"momentum": 0.9}


def _config(optimizer: dict) -> dict:
    return {"trainer": {"name": "regression"}, "model": {"name": "mlp_regressor"}, "data": {"name": "sine"},
            "optimizer": optimizer}


def test_keras_and_pytorch_spellings_get_hints_in_a_config_file_too(tmp_path):
    for line, hint in (("clipnorm: 1.0", "'optimizer.gradient_clip'"), ("decay: 1.0e-4", "'optimizer.weight_decay'"),
                       ("betas: [0.9, 0.99]", "'optimizer.b1' and 'optimizer.b2'")):
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(_config({"optimizer": "adam", **yaml.safe_load(line)})))
        with pytest.raises(flaxlight.config.ConfigError) as info:
            flaxlight.config.load_config(path)
        assert f"Unknown key 'optimizer.{line.split(':')[0]}'. Did you mean {hint}" in str(info.value)


class FlaxWayStep(Regressor):
    """A step of the user's written the Flax way: ``state.apply_gradients(grads=grads)``, no loss."""

    def create_functions(self):
        def train_step(state, batch):
            loss, grads = jax.value_and_grad(lambda p: self.loss_fn(p, batch, train=True, rng=None, state=state)[0])(
                state.params)
            return state.apply_gradients(grads=grads), {"loss": loss}

        def eval_step(state, batch):
            return {"loss": self.loss_fn(state.params, batch, train=False, rng=None, state=state)[0]}

        return train_step, eval_step


@pytest.mark.parametrize("hp, name", [
    ({"optimizer": "sgd", "lr": 0.1, "schedule": "constant", "reduce_on_plateau": {"patience": 2}},
     "reduce_on_plateau"),
    ({"optimizer": "polyak_sgd", "lr": 1.0}, "polyak_sgd"),
    (optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau()), "reduce_on_plateau"),
])
def test_a_step_that_gives_no_loss_to_an_optimizer_that_needs_it_is_told_to_pass_value(tmp_path, hp, name):
    """It got optax's own 'update_fn() missing 1 required keyword-only argument: 'value''."""
    x, y = _linear_problem(n=8)
    trainer = FlaxWayStep(model_class=Linear, model_hparams={}, optimizer_hparams=hp, exmp_input=x[:1],
                          enable_progress_bar=False, enable_model_summary=False,
                          logger_params={"log_dir": str(tmp_path), "logger_type": "csv"})
    with pytest.raises(TypeError) as info:
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=8), None, num_epochs=1)
    message = str(info.value)
    assert f"The optimizer needs the loss at every update (optax's {name} takes it as `value`)" in message
    assert "state.apply_gradients(grads=grads, value=loss)" in message


def test_an_optax_multisteps_object_is_refused_with_what_to_pass_instead(tmp_path):
    x, _ = _linear_problem(n=8)
    multi = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3)
    with pytest.raises(TypeError) as info:
        _trainer(tmp_path, multi, x)
    message = str(info.value)
    assert "optimizer_hparams is an optax.MultiSteps object, which is not a GradientTransformation itself" in message
    assert ".gradient_transformation()" in message and "'accumulate_grad_batches': k" in message
    assert isinstance(make_optimizer(multi.gradient_transformation(), 10), optax.GradientTransformation)  # as said
    assert OptimizerConfig.from_dict({"optimizer": "sgd", "lr": 0.1, "accumulate_grad_batches": 3})  # the key exists


def test_weight_decay_exclude_names_that_match_no_parameter_are_refused(tmp_path):
    """'biases' (a typo) and 'Dense_0' (a layer) used to exclude nothing, silently: every bias was decayed."""
    x, y = _linear_problem(n=8)
    trainer = _trainer(tmp_path, {"optimizer": "adamw", "weight_decay": 0.1,
                                  "weight_decay_exclude": ("biases", "Dense_0")}, x)
    with pytest.raises(ValueError) as info:
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=8), None, num_epochs=1)
    message = str(info.value)
    assert "weight_decay_exclude names 'Dense_0', 'biases', which match no parameter of this model" in message
    assert "this model's are 'bias', 'kernel'." in message and "Did you mean 'bias' for 'biases'?" in message
    assert "'Dense_0' is a layer (module), not a parameter's name" in message and "weight_decay_mask" in message
    # The defaults are not refused on a model without them (no norm layer: no 'scale'); a name that matches is taken.
    params = {"Dense_0": {"kernel": jnp.ones((3, 1)), "bias": jnp.zeros(1)}}
    assert make_weight_decay_mask(("bias", "scale", "kernel"))(params) == {"Dense_0": {"bias": False, "kernel": False}}
    with pytest.raises(ValueError, match=r"names 'kernels', which match no parameter.*Did you mean 'kernel'"):
        make_l2_regularizer(0.1, make_weight_decay_mask(("bias", "scale", "kernels")))(params)


def test_a_schedule_passed_as_lr_is_pointed_to_the_schedule_key():
    schedule = optax.cosine_decay_schedule(1e-3, 100)
    with pytest.raises(ValueError) as info:
        make_optimizer({"optimizer": "adam", "lr": schedule}, 100)
    message = str(info.value)
    assert "optimizer_hparams['lr'] is a function (cosine_decay_schedule.<locals>.schedule): 'lr' takes a " \
           "number" in message
    assert "{'optimizer': 'adam', 'schedule': your_schedule}" in message
    assert "optimizer_hparams=optax.adam(your_schedule)" in message
    for works in ({"optimizer": "adam", "schedule": schedule}, optax.adam(schedule)):  # both ways the message names
        assert isinstance(make_optimizer(works, 100), optax.GradientTransformation)
    with pytest.raises(ValueError, match=r"optax.polyak_sgd takes a fixed step size \(max_learning_rate\), not a "
                                         r"schedule: give lr a number"):
        OptimizerConfig(optimizer="polyak_sgd", lr=schedule, schedule="constant")


# --------------------------------------------------------------------------- a weight-decay mask for some layers only
def _two_layer_params():
    return {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)},
            "Dense_1": {"kernel": jnp.ones((2, 1)), "bias": jnp.ones(1)},
            "BatchNorm_0": {"scale": jnp.ones(2), "bias": jnp.ones(2)}}


@pytest.mark.parametrize("hparams", [{"optimizer": "adamw"}, {"optimizer": "sgd"},
                                     {"optimizer": "adamw", "weight_decay_mode": "l2"},
                                     {"optimizer": "adamw", "freeze": ["BatchNorm_0"]}])
def test_a_mask_that_leaves_layers_out_is_refused_naming_them(hparams):
    """{Dense_0: true} for a model with more layers gave JAX's 'pytree structure error ... tree_map tree' (or,
    with weight_decay_mode='l2', a zip() error inside the first train step), naming no setting."""
    tx = make_optimizer({**hparams, "lr": 0.1, "weight_decay": 0.1, "weight_decay_mask": {"Dense_0": True}}, 5)
    with pytest.raises(ValueError) as info:
        tx.init(_two_layer_params())  # the trainer builds it before training: refused before the first step
    message = str(info.value)
    assert message.startswith("optimizer_hparams['weight_decay_mask'] does not cover every parameter: it has no "
                              "entry for Dense_1, BatchNorm_0. A mask must cover every parameter: a bool for each "
                              "layer or parameter (here, e.g. {'Dense_0': True, 'Dense_1': False, 'BatchNorm_0': "
                              "False}), one bool for all, or a function params -> pytree of bools"), message
    assert "weight_decay_exclude is simpler" in message and "pytree structure" not in message
    with pytest.raises(ValueError, match=r"it names Dense_2, which no parameter has"):
        make_optimizer({"lr": 0.1, "weight_decay": 0.1, "weight_decay_mask": {
            "Dense_0": True, "Dense_1": True, "BatchNorm_0": False, "Dense_2": True}}, 5).init(_two_layer_params())
    with pytest.raises(ValueError, match=r"no entry for Dense_0/bias"):  # a function's tree is checked too
        make_optimizer({"lr": 0.1, "weight_decay": 0.1, "weight_decay_mask": lambda p: {
            "Dense_0": {"kernel": True}, "Dense_1": True, "BatchNorm_0": False}}, 5).init(_two_layer_params())


@pytest.mark.parametrize("mode, optimizer", [("decoupled", "adamw"), ("decoupled", "sgd"), ("l2", "sgd")])
def test_a_bool_per_layer_decays_those_layers(mode, optimizer):
    """The message's advice works in each mode (l2 zipped the layer-level mask against the parameters: an error)."""
    params = _two_layer_params()
    hparams = {"optimizer": optimizer, "lr": 0.5, "schedule": "constant", "weight_decay": 0.1,
               "weight_decay_mode": mode, "weight_decay_mask": {"Dense_0": True, "Dense_1": False,
                                                                "BatchNorm_0": False}}
    if mode == "l2":
        assert float(OptimizerConfig.from_dict(hparams).l2_regularizer()(params)) == pytest.approx(0.5 * 0.1 * 8)
        return
    new, _ = _run_updates(make_optimizer(hparams, 5), params, steps=1, zero_grads=True)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new, params)
    assert changed == {"Dense_0": {"kernel": True, "bias": True}, "Dense_1": {"kernel": False, "bias": False},
                       "BatchNorm_0": {"scale": False, "bias": False}}
