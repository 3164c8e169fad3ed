"""accumulate_grad_batches as Lightning has it: an epoch's last batch always ends an update.

An epoch of B batches makes ceil(B / N) updates, the last one from the mean of the batches it
has; no update mixes two epochs, so the validation, checkpoint and test at an epoch's end see
every batch trained on. The schedule counts those updates; max_steps counts batches (said).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import RegressTrainer, SigtermAt, TinyMLP, CrashAfterEpoch, linear_data, quiet

import flaxlight
from flaxlight import ArrayLoader, current_learning_rate
from flaxlight.optim import make_optimizer_plan

ROOT = Path(__file__).resolve().parents[1]
X, Y = linear_data(40, 0)  # 5 batches of 8
XV, YV = linear_data(16, 1)
ADAM = {"optimizer": "adam", "lr": 1e-2, "schedule": "constant", "gradient_clip": None}


def _trainer(tmp_path, optimizer_hparams, name="run", **kwargs):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]}, optimizer_hparams=optimizer_hparams,
                          exmp_input=X[:1], **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}, **kwargs))


def _loss(params, x, y):
    return jnp.mean((TinyMLP(hidden_dims=(16,)).apply({"params": params}, x) - y) ** 2)


def _by_hand(params, epochs, every, lr=1e-2):
    """optax.adam on the mean gradient of each group of ``every`` batches, groups cut at each
    epoch's end (``epochs``: a list of epochs, each a list of (x, y) batches)."""
    tx = optax.adam(lr)
    opt_state, grad = tx.init(params), jax.grad(_loss)
    for batches in epochs:
        for start in range(0, len(batches), every):
            group = [grad(params, x, y) for x, y in batches[start:start + every]]
            mean = jax.tree.map(lambda *g: sum(g) / len(g), *group)
            updates, opt_state = tx.update(mean, opt_state, params)
            params = optax.apply_updates(params, updates)
    return params


def _close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), jax.device_get(got),
                 jax.device_get(want))


def _batches(count=5):
    return [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 8 * count, 8)]


@pytest.mark.parametrize("options", [{}, {"steps_per_execution": 2}, {"steps_per_execution": 4, "prefetch": 2}],
                         ids=["single", "fused-2", "fused-4-prefetch"])
def test_an_epochs_partial_group_is_applied_once_as_the_mean_of_its_gradients(tmp_path, options):
    """5 batches, N=2: updates from batches (1, 2), (3, 4) and (5) alone, in each epoch; the
    validation at epoch 1's end evaluates the model after its 3 updates."""
    trainer = _trainer(tmp_path, {**ADAM, "accumulate_grad_batches": 2}, **options)
    start = jax.tree.map(np.array, jax.device_get(trainer.state.params))
    trainer.train_model(ArrayLoader(X, Y, batch_size=8), ArrayLoader(XV, YV, batch_size=16), num_epochs=2)
    after_one = _by_hand(start, [_batches()], every=2)
    _close(trainer.state.params, _by_hand(start, [_batches(), _batches()], every=2))
    assert int(trainer.state.opt_state.gradient_step) == 6 and int(trainer.state.opt_state.mini_step) == 0
    assert trainer.history[0]["val/loss"] == pytest.approx(float(_loss(after_one, XV, YV)), rel=1e-5)


def test_an_epoch_shorter_than_n_still_updates_and_its_checkpoint_and_test_see_it(tmp_path):
    """limit_train_batches=3 with N=4 (a quick check): one update, the mean of the 3 gradients."""
    trainer = _trainer(tmp_path, {**ADAM, "accumulate_grad_batches": 4}, limit_train_batches=3)
    start = jax.tree.map(np.array, jax.device_get(trainer.state.params))
    trainer.train_model(ArrayLoader(X, Y, batch_size=8), ArrayLoader(XV, YV, batch_size=16), num_epochs=1)
    want = _by_hand(start, [_batches(3)], every=4)
    _close(trainer.state.params, want)
    tested = trainer.test(ArrayLoader(XV, YV, batch_size=16), which="best")
    assert tested["test/loss"] == pytest.approx(float(_loss(want, XV, YV)), rel=1e-5)


def test_a_run_cut_by_max_steps_leaves_its_partial_group_pending_and_says_what_max_steps_gives(tmp_path, capsys):
    """max_steps=8 counts batches: 5 + 3 of them, updates (1,2) (3,4) (5) then (6,7); batch 8's
    gradient waits in the optimizer state (a resumed run goes on with it: see below)."""
    trainer = _trainer(tmp_path, {**ADAM, "accumulate_grad_batches": 2}, max_steps=8)
    start = jax.tree.map(np.array, jax.device_get(trainer.state.params))
    trainer.train_model(ArrayLoader(X, Y, batch_size=8), None, num_epochs=4)
    opt_state = trainer.state.opt_state
    assert trainer.global_step == 8 and int(opt_state.gradient_step) == 4 and int(opt_state.mini_step) == 1
    _close(trainer.state.params, _by_hand(start, [_batches(), _batches(2)], every=2))
    said = capsys.readouterr().err
    assert said.count("max_steps=8 counts batches") == 1
    assert "gives 4 optimizer updates" in said and "write max_steps=U * 2" in said


class _StopAt(flaxlight.Callback):
    every_n_steps = 1

    def __init__(self, step):
        self.step = step

    def on_step(self, trainer, step):
        if step == self.step:
            trainer.stop("a stop inside an accumulation group")


def test_a_run_stopped_inside_a_group_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """A stop (or max_steps, max_time) inside a group applied the partial group at the cut; the
    resumed run then grouped the rest of the epoch otherwise than the uninterrupted run."""
    straight = _resumable(tmp_path, "straight")
    _resumable(tmp_path, "run", callbacks=[_StopAt(8)])  # 5 + 3 batches: batch 8 opens the group (8, 9)
    resumed = _resumable(tmp_path, "run", resume=True)
    assert int(resumed.state.opt_state.gradient_step) == 9
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
                 jax.device_get(straight.state.params))


def _resumable(tmp_path, name, callbacks=(), resume=False):
    trainer = _trainer(tmp_path, {**ADAM, "accumulate_grad_batches": 2}, name=name, callbacks=list(callbacks))
    train = ArrayLoader(X, Y, batch_size=8, shuffle=True, seed=0)
    trainer.train_model(train, ArrayLoader(XV, YV, batch_size=16), num_epochs=3, resume=resume)
    return trainer


@pytest.mark.parametrize("interrupt", [SigtermAt(7), SigtermAt(10), CrashAfterEpoch(1)],
                         ids=["sigterm-inside-a-group", "sigterm-at-an-epochs-last-batch", "crash-after-an-epoch"])
def test_a_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one(tmp_path, interrupt):
    straight = _resumable(tmp_path, "straight")
    with pytest.raises((SystemExit, RuntimeError)):
        _resumable(tmp_path, "run", callbacks=[interrupt])
    resumed = _resumable(tmp_path, "run", resume=True)
    assert int(resumed.state.opt_state.gradient_step) == 9  # 3 per epoch of 5 batches
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
                 jax.device_get(straight.state.params))
    assert [row["val/loss"] for row in resumed.history] == [row["val/loss"] for row in straight.history]


def test_the_schedule_counts_the_updates_each_epochs_end_makes(tmp_path):
    """2 epochs of 5 batches, N=2: 6 updates; a linear decay to 0 reaches 0 exactly at the end, and
    the rate logged at a step is that of the next update."""
    hp = {"optimizer": "sgd", "lr": 0.6, "schedule": "linear", "end_lr_factor": 0.0, "gradient_clip": None,
          "accumulate_grad_batches": 2}
    trainer = _trainer(tmp_path, hp)
    trainer.train_model(ArrayLoader(X, Y, batch_size=8), None, num_epochs=2)
    assert trainer.optimizer_plan.num_updates == 6
    assert float(current_learning_rate(trainer.state)) == pytest.approx(0.0, abs=1e-7)
    rates = {step: trainer.learning_rate(step) for step in (0, 2, 4, 5, 7, 10)}  # updates made: 0 1 2 3 4 6
    assert rates == pytest.approx({0: 0.6, 2: 0.5, 4: 0.4, 5: 0.3, 7: 0.2, 10: 0.0}, abs=1e-6)


def test_accumulated_updates_and_a_plan_sized_by_epochs():
    from flaxlight.optim import accumulated_updates

    assert accumulated_updates(38, every=4, epoch_length=19) == 10  # 4+4+4+4+3, twice
    assert accumulated_updates(20, every=4, epoch_length=19) == 5  # the cut group waits (resumable)
    assert accumulated_updates(23, every=4, epoch_length=19) == 6
    assert accumulated_updates(19, every=4) == 4  # no epoch ends: a loop of your own
    plan = make_optimizer_plan({**ADAM, "accumulate_grad_batches": 4}, total_steps=38, epoch_length=19)
    assert plan.num_updates == 10


def test_apply_accumulated_applies_the_pending_mean_once_and_leaves_a_finished_group_alone():
    from flaxlight.optim import accumulate_gradients, apply_accumulated

    params = {"w": jnp.ones(3)}
    tx = accumulate_gradients(optax.adam(0.1), every=4)
    state = flaxlight.TrainState.create(apply_fn=None, params=params, tx=tx)
    grads = [{"w": jnp.array([1.0, -2.0, 3.0])}, {"w": jnp.array([3.0, 2.0, -1.0])}]
    for g in grads:
        state = state.apply_gradients(grads=g)
    np.testing.assert_array_equal(state.params["w"], params["w"])  # 2 of 4: nothing applied yet
    flushed = jax.jit(apply_accumulated)(state)
    hand = optax.adam(0.1)
    updates, _ = hand.update({"w": jnp.array([2.0, 0.0, 1.0])}, hand.init(params), params)
    np.testing.assert_allclose(flushed.params["w"], optax.apply_updates(params, updates)["w"], rtol=1e-6)
    assert int(flushed.opt_state.gradient_step) == 1 and int(flushed.opt_state.mini_step) == 0
    assert int(flushed.step) == int(state.step) == 2  # steps count batches
    again = jax.jit(apply_accumulated)(flushed)
    jax.tree.map(np.testing.assert_array_equal, again.params, flushed.params)


def test_a_plain_optax_multisteps_of_the_users_accumulates_across_epochs_as_optax_defines(tmp_path):
    """A ready optax.MultiSteps is used unchanged (an update every k batches, counted across
    epoch ends); accumulate_gradients(tx, k) gives the epoch-end updates to a ready transformation."""
    from flaxlight.optim import accumulate_gradients

    plain = _trainer(tmp_path, optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
                     name="plain")
    plain.train_model(ArrayLoader(X, Y, batch_size=8), None, num_epochs=1)
    assert int(plain.state.opt_state.gradient_step) == 2 and int(plain.state.opt_state.mini_step) == 1
    wrapped = _trainer(tmp_path, accumulate_gradients(optax.adam(1e-2), every=2), name="wrapped")
    start = jax.tree.map(np.array, jax.device_get(wrapped.state.params))
    wrapped.train_model(ArrayLoader(X, Y, batch_size=8), None, num_epochs=1)
    assert int(wrapped.state.opt_state.gradient_step) == 3
    _close(wrapped.state.params, _by_hand(start, [_batches()], every=2))


def test_lbfgs_with_accumulation_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"'lbfgs' cannot accumulate gradients.*accumulate_grad_batches=1"):
        make_optimizer_plan({"optimizer": "lbfgs", "lr": None, "schedule": "constant",
                             "accumulate_grad_batches": 2}, total_steps=10)


# --------------------------------------------------------------------------- docs say one thing
def test_every_doc_says_max_steps_counts_batches_and_how_to_port_lightnings():
    doc = inspect.getdoc(flaxlight.TrainerOptions)
    entry = doc[doc.index("max_steps:"):doc.index("max_time:")]
    assert "optimizer steps" not in entry and "batches" in entry and "max_steps=U * N" in entry
    lightning = (ROOT / "docs" / "from-lightning.md").read_text()
    same_names = next(line for line in lightning.splitlines() if "the same names" in line)
    assert "`max_steps`" not in same_names
    assert "max_steps * N" in lightning or "max_steps=U * N" in lightning
    for page in ("cli.md", "callbacks.md", "logging.md", "optimizers.md"):
        text = (ROOT / "docs" / page).read_text()
        assert "optimizer steps" not in text, page
    assert "max_steps" in (ROOT / "docs" / "logging.md").read_text()
    optimizers = (ROOT / "docs" / "optimizers.md").read_text()
    assert "Accumulation runs across epoch ends" not in optimizers and "ceil(B / N)" in optimizers


@pytest.mark.parametrize("ema", [False, True])
def test_load_from_checkpoint_rebuilds_the_runs_schedule_under_accumulation(tmp_path, ema):
    """2 epochs of 5 batches with N=2 make 3 + 3 updates; the loaded optimizer was sized 10 // 2 = 5
    (epochs unknown), and a warmup of 6 updates refused the load (an EMA run's default load too)."""
    hparams = {**ADAM, "schedule": "warmup_cosine", "warmup_steps": 6, "accumulate_grad_batches": 2,
               **({"ema_decay": 0.9} if ema else {})}
    trainer = _trainer(tmp_path, hparams)
    trainer.train_model(ArrayLoader(X, Y, batch_size=8), None, num_epochs=2)
    assert trainer.optimizer_plan.num_updates == 6
    for kwargs in ({"with_optimizer": True}, {}):
        loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X[:1], which="last", **kwargs)
        if kwargs or ema:
            assert loaded.optimizer_plan.num_updates == 6
        np.testing.assert_allclose(loaded.predict(X, batch_size=8), trainer.predict(X, batch_size=8, which="last"),
                                   rtol=1e-6)
