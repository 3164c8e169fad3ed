"""Runs never overwrite runs; resume is exact around a save made at validation; misspelt keywords fail."""

import csv
import warnings
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CrashAfterEpoch, RegressTrainer, TinyMLP, linear_data, quiet

from flaxlight import ArrayLoader, cli
from flaxlight.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, NaNGuard
from flaxlight.runfiles import RunInUseError, RunLock, next_version_dir

X0 = np.zeros((1, 4), np.float32)
CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def _trainer(log_dir, **kwargs):
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 1e-2})
    params = quiet(log_dir.parent, **kwargs)
    params["logger_params"] = {"log_dir": str(log_dir)}
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0, **params)


def _rows(log_dir):
    with open(log_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if v and k != "epoch_time"} for row in csv.DictReader(f)]


def test_resume_after_a_validation_time_save_neither_repeats_nor_skips_the_validation(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    plateau = dict(monitor="val/loss", patience=3, min_delta=10.0)  # never improves "enough": wait counts up

    straight_stopper = EarlyStopping(**plateau)
    _trainer(tmp_path / "straight", callbacks=[straight_stopper]).train_model(train, val, num_epochs=4)

    # ModelCheckpoint saves the epoch-2 best at validation time; the crash comes right after.
    with pytest.raises(RuntimeError, match="crash after the save"):
        _trainer(tmp_path / "cut", callbacks=[EarlyStopping(**plateau), CrashAfterEpoch(2)]).train_model(
            train, val, num_epochs=4)
    resumed_stopper = EarlyStopping(**plateau)
    _trainer(tmp_path / "cut", callbacks=[resumed_stopper]).train_model(train, val, num_epochs=4, resume=True)

    assert resumed_stopper.state_dict() == straight_stopper.state_dict()
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "straight")  # no validation row twice, none missing
    assert len([r for r in _rows(tmp_path / "cut") if "val/loss" in r]) == 4


def test_training_into_a_folder_with_a_run_needs_resume_or_overwrite(tmp_path, regression_loaders, capsys):
    train, val, _ = regression_loaders
    run = tmp_path / "run"
    _trainer(run).train_model(train, val, num_epochs=2)
    before = {name: (run / name).read_bytes() for name in ("hparams.yaml", "metrics.csv")}
    checkpoints = sorted(os.listdir(run / "checkpoints"))

    with pytest.raises(FileExistsError, match=r"already holds a run .*resume=True.*overwrite=True"):
        _trainer(run).train_model(train, val, num_epochs=1)
    assert {name: (run / name).read_bytes() for name in before} == before  # nothing touched
    assert sorted(os.listdir(run / "checkpoints")) == checkpoints

    capsys.readouterr()
    _trainer(run).train_model(train, val, num_epochs=1, overwrite=True)  # replaced: a fresh run of 1 epoch
    said = capsys.readouterr().err
    assert f"overwrite=True: deleting the run in {run}: checkpoint {', '.join(checkpoints)}, metrics.csv (" in said
    assert "hparams.yaml" in said.split("overwrite=True")[1].splitlines()[0]  # one line names what goes
    assert sorted(os.listdir(run / "checkpoints")) == ["8"]
    assert [int(r["step"]) for r in _rows(run) if "train/loss" in r] == [8]


def test_the_same_trainer_may_train_again_into_its_own_run(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path / "run")
    trainer.train_model(train, val, num_epochs=1)
    trainer.train_model(train, val, num_epochs=1)  # this process wrote the folder: no error
    assert int(trainer.state.step) == 16


def test_a_live_run_folder_is_refused_and_a_stale_lock_is_taken_over(tmp_path, regression_loaders, capsys):
    train, val, _ = regression_loaders
    run = tmp_path / "run"
    run.mkdir()
    # Killed below; it must outlive the test, which may take minutes on a busy machine.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (run / RunLock.FILE).write_text(f"{sleeper.pid} {os.uname().nodename}")
        with pytest.raises(RunInUseError, match=rf"in use by process {sleeper.pid}.*delete the lock file") as busy:
            _trainer(run).train_model(train, val, num_epochs=1)
        assert busy.value.__context__ is None  # one error shown, not the lock file's FileExistsError before it
        code = cli.main(["fit", "--config", str(CONFIGS / "sine_regression.yaml"), "trainer.max_epochs=1",
                         "trainer.check_val_every_n_epoch=1", "--log-dir", str(run)])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and f"in use by process {sleeper.pid}" in err
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.warns(RuntimeWarning, match=f"process {sleeper.pid}, which held it, no longer runs"):
        _trainer(run).train_model(train, val, num_epochs=1)
    assert not (run / RunLock.FILE).exists()  # released at the end


def _claim(base, queue):
    queue.put(next_version_dir(base))


def test_runs_started_together_get_distinct_versions(tmp_path):
    queue = multiprocessing.get_context("spawn").Queue()
    processes = [multiprocessing.get_context("spawn").Process(target=_claim, args=(str(tmp_path), queue))
                 for _ in range(6)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
    claimed = sorted(queue.get(timeout=5) for _ in processes)
    assert len(set(claimed)) == 6
    assert sorted(os.listdir(tmp_path)) == [f"version_{i}" for i in range(6)]


def test_a_version_folder_of_a_trainer_refused_before_training_is_given_back_at_exit(tmp_path, regression_loaders):
    """Its folder holds only the empty metrics/; at interpreter exit the trainer's finalizer runs while
    the trainer still lives, and took its own folder for one in use: version_N folders piled up."""
    import weakref

    from flaxlight.options import MetricNotLoggedError

    train, val, _ = regression_loaders
    params = quiet(tmp_path, monitor="val/accuracy", mode="max", logger_params={"base_log_dir": str(tmp_path)},
                   optimizer_hparams={"optimizer": "adam", "lr": 1e-2})
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0, **params)
    with pytest.raises(MetricNotLoggedError):
        trainer.train_model(train, val, num_epochs=1)
    folder = Path(trainer.log_dir)
    assert sorted(p.name for p in folder.iterdir()) == ["metrics"]
    (finalizer,) = [f for f in list(weakref.finalize._registry) if (f.peek() or [None])[0] is trainer.checkpointer]
    finalizer()  # as at exit: the trainer still alive
    assert not folder.exists()

    kept = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                          **quiet(tmp_path, logger_params={"base_log_dir": str(tmp_path)},
                                  optimizer_hparams={"optimizer": "adam", "lr": 1e-2}))
    (Path(kept.log_dir) / "notes.txt").write_text("mine")  # anything else in it: never removed
    (finalizer,) = [f for f in list(weakref.finalize._registry) if (f.peek() or [None])[0] is kept.checkpointer]
    finalizer()
    assert (Path(kept.log_dir) / "notes.txt").exists()


def test_a_misspelt_keyword_fails_and_names_the_right_one(tmp_path):
    with pytest.raises(TypeError, match=r"unknown keyword argument 'max_step'\. Did you mean 'max_steps'\?"):
        _trainer(tmp_path / "run", max_step=3)


def test_resume_with_nothing_to_resume_warns_with_the_folder(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    with pytest.warns(RuntimeWarning, match=r"no checkpoint in .*typo.*: a new run starts from the trainer.s current "
                                            r"state"):
        _trainer(tmp_path / "typo").train_model(train, val, num_epochs=1, resume=True)


def test_resume_in_a_new_version_folder_names_the_run_beside_it_to_continue(tmp_path, regression_loaders):
    """base_log_dir (Lightning's default_root_dir) gives a resumed trainer a new version_N: the warning
    named only the empty new folder, not the interrupted run beside it (trials21 porter 6)."""
    def versioned(base):
        return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                              **quiet(tmp_path, logger_params={"base_log_dir": str(base)},
                                      optimizer_hparams={"optimizer": "adam", "lr": 1e-2}))

    train, val, _ = regression_loaders
    first = versioned(tmp_path)
    first.train_model(train, val, num_epochs=1)
    step = max(first.checkpointer.all_steps())
    again = versioned(tmp_path)
    assert os.path.basename(again.log_dir) == "version_1"  # the folder used is still a new one
    with pytest.warns(RuntimeWarning) as said:
        again.train_model(train, val, num_epochs=1, resume=True)
    message = str(said[0].message)
    assert f"no checkpoint in {again.log_dir}" in message
    assert (f"The newest run beside it that holds a checkpoint is {first.log_dir} (step {step}): " in message
            and f"logger_params={{'log_dir': {first.log_dir!r}}}" in message
            and f"resume_from={first.log_dir!r}" in message), message


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": "42"}, r"seed must be an int, got '42' \(str\)"),
    ({"model_class": TinyMLP()}, r"model_class must be a class, got an instance of TinyMLP"),
])
def test_constructor_arguments_of_the_wrong_kind_are_named(tmp_path, kwargs, message):
    args = dict(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                **quiet(tmp_path))
    args.update(kwargs)
    with pytest.raises(TypeError, match=message):
        RegressTrainer(**args)


# ------------------------------------------------------------------------------------ NaN and damage
class NaNGradient(RegressTrainer):
    """A finite loss whose gradient is NaN (d/dw sqrt(0 * w) = inf * 0) from step ``bad_from`` on."""

    bad_from = 0

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, aux = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        kernel = params["Dense_0"]["kernel"]
        poison = jax.lax.cond(state.step >= self.bad_from, lambda k: jnp.sqrt(jnp.sum(k) * 0.0), jnp.zeros_like,
                              jnp.sum(kernel))
        return loss + poison, aux


def test_a_nan_gradient_with_a_finite_loss_is_never_applied_with_skip(tmp_path, regression_loaders):
    train, _, _ = regression_loaders
    skipping = NaNGradient(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                           optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                           callbacks=[NaNGuard("skip")], **quiet(tmp_path))
    before = jax.tree.map(np.asarray, skipping.state.params)
    skipping.train_model(train, None, num_epochs=1)
    after = jax.tree.map(np.asarray, skipping.state.params)
    jax.tree.map(np.testing.assert_array_equal, after, before)  # every update was NaN: none applied
    assert skipping.nonfinite_steps == 8 and int(skipping.state.step) == 8


def test_no_checkpoint_holds_nonfinite_params(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class LateNaN(NaNGradient):
        bad_from = 12  # epoch 1 is clean (checkpoint 8), epoch 2 turns the params NaN

    trainer = LateNaN(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                      optimizer_hparams={"optimizer": "sgd", "lr": 1e-2},
                      callbacks=[ModelCheckpoint(every_n_epochs=1)], **quiet(tmp_path))
    with pytest.warns(RuntimeWarning, match="Not saving checkpoint 16: the parameters hold NaN/Inf"):
        trainer.train_model(train, None, num_epochs=2)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["8"]


def test_resuming_with_another_optimizer_says_what_differs(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    _trainer(tmp_path / "run", optimizer_hparams={"optimizer": "adam", "lr": 1e-2}).train_model(train, val, num_epochs=1)
    changed = _trainer(tmp_path / "run", optimizer_hparams={"optimizer": "sgd", "lr": 1e-2, "momentum": 0.9})
    with pytest.raises(ValueError, match=r"state of a different optimizer .*with_optimizer=False"):
        changed.train_model(train, val, num_epochs=2, resume=True)


@pytest.mark.parametrize("which", ["best", "last"])
def test_load_from_checkpoint_skips_a_damaged_newest_checkpoint(tmp_path, regression_loaders, which):
    train, val, _ = regression_loaders

    class KeepAll(ModelCheckpoint):
        def _prune(self, trainer, also_keep=None):  # keep every checkpoint, so there is one to fall back to
            pass

    _trainer(tmp_path / "run", callbacks=[KeepAll()]).train_model(train, val, num_epochs=2)
    newest = tmp_path / "run" / "checkpoints" / "16"
    for path in newest.rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.warns(RuntimeWarning, match="Checkpoint 16 .* damaged"):  # its arrays, or (best) its meta
        loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which=which)
    assert int(loaded.state.step) == 8


@pytest.mark.parametrize("case", ["finished-run", "cold-compile-error"])
def test_exits_never_abort_the_interpreter(tmp_path, case):
    """Background threads (the eval step compiling ahead) are joined before train_model returns."""
    script = os.path.join(os.path.dirname(__file__), "exit_script.py")

    def run(log_dir, what):
        return subprocess.run([sys.executable, script, str(log_dir), what], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, CI="true"))

    if case == "finished-run":
        assert run(tmp_path / "run", "train").returncode == 0
    for attempt in range(3):
        log_dir = tmp_path / ("run" if case == "finished-run" else f"run{attempt}")
        result = run(log_dir, case)
        assert result.returncode == 0 and "clean exit" in result.stdout, (attempt, result.stderr[-2000:])


def test_resuming_with_gradient_accumulation_restores_without_calling_it_damaged(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    optimizer = {"optimizer": "adam", "lr": 1e-2, "accumulate_grad_batches": 2}
    _trainer(tmp_path / "run", optimizer_hparams=optimizer).train_model(train, val, num_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "damaged or partial" fallback
        resumed = _trainer(tmp_path / "run", optimizer_hparams=optimizer)
        resumed.train_model(train, val, num_epochs=2, resume=True)
    assert int(resumed.state.step) == 16


def test_a_cut_metrics_row_and_loggers_failing_at_the_end_leave_the_run_continuable(tmp_path, regression_loaders):
    """A full disk can cut metrics.csv's last row and make the loggers fail while the run ends: the
    lock is still released, and the run loads and resumes."""
    from flaxlight.loggers import Logger

    class FailsAtTheEnd(Logger):
        def log_metrics(self, metrics, step):
            pass

        def finalize(self, status):
            raise OSError(28, "No space left on device")

    class Crash(Callback):
        def on_epoch_end(self, trainer, epoch):
            if epoch == 2:
                raise RuntimeError("crash")

    train, val, _ = regression_loaders
    kwargs = dict(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                  exmp_input=np.zeros((1, 4), np.float32))
    with pytest.warns(RuntimeWarning, match="the loggers failed: .*No space left"), pytest.raises(RuntimeError):
        RegressTrainer(**kwargs, **quiet(tmp_path, loggers=[FailsAtTheEnd()],
                                         callbacks=[ModelCheckpoint(every_n_epochs=1), Crash()])
                       ).train_model(train, val, num_epochs=3)
    assert not (tmp_path / "run" / RunLock.FILE).exists()
    metrics = tmp_path / "run" / "metrics.csv"
    metrics.write_text(metrics.read_text().rstrip("\n")[:-7] + "\n")  # the last row cut mid-number
    RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=kwargs["exmp_input"])
    resumed = RegressTrainer(**kwargs, **quiet(tmp_path))
    resumed.train_model(train, val, num_epochs=3, resume=True)
    assert resumed.current_epoch == 3


def test_overwrite_replaces_the_tensorboard_curves_too(tmp_path, regression_loaders):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val, _ = regression_loaders
    run = tmp_path / "run"
    _trainer(run).train_model(train, val, num_epochs=2)  # CSV + TensorBoard, the default loggers
    _trainer(run).train_model(train, val, num_epochs=1, overwrite=True)
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [8]  # the replaced run's two points are gone


def test_a_baseline_test_before_training_stays_in_the_run_it_starts(tmp_path, regression_loaders):
    """test() or log_metrics before train_model wrote metrics.csv, and train_model then refused the
    trainer's own folder as "already holds a run" (a record not yet flushed was dropped instead)."""
    train, val, test = regression_loaders
    trainer = _trainer(tmp_path / "run")
    baseline = trainer.test(test)["test/loss"]
    trainer.log_metrics({"baseline/note": 1.0})  # not flushed before the run starts
    trainer.train_model(train, val, num_epochs=1)
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert float(rows[0]["test/loss"]) == pytest.approx(baseline) and rows[0]["step"] == "0"
    assert any(r["baseline/note"] for r in rows) and any(r["val/loss"] for r in rows)

    _trainer(tmp_path / "other").train_model(train, val, num_epochs=1)
    before = (tmp_path / "other" / "metrics.csv").read_bytes()
    stranger = _trainer(tmp_path / "other")
    start = jax.device_get(stranger.state.params)
    with pytest.raises(FileExistsError, match="already holds a run .*would log into it before training"):
        stranger.test(test)
    assert (tmp_path / "other" / "metrics.csv").read_bytes() == before
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(stranger.state.params), start)  # not the run's


def test_a_trainer_whose_run_another_trainer_continued_is_refused_and_sees_the_folder_as_it_is(
        tmp_path, regression_loaders):
    """Trainer A trained, trainer B (built again on the same log_dir) continued the run and pruned A's
    checkpoint: A's train_model went on from its stale model (duplicate metrics.csv steps, its own best
    over B's), its test() called the pruned checkpoint damaged, its resume found no readable checkpoint."""
    train, val, test = regression_loaders
    run = tmp_path / "run"
    first = _trainer(run, callbacks=[ModelCheckpoint(monitor="val/loss", save_last=False)])
    first.train_model(train, val, num_epochs=1)
    second = _trainer(run, callbacks=[ModelCheckpoint(monitor="val/loss", save_last=False)])
    second.train_model(train, val, num_epochs=3, resume=True)
    newest = max(map(int, os.listdir(run / "checkpoints")))
    assert "8" not in os.listdir(run / "checkpoints") and newest > 8  # first's only checkpoint pruned
    records = {name: (run / name).read_bytes() for name in ("metrics.csv", "metrics/best_eval.json")}

    with pytest.raises(FileExistsError, match=rf"Another trainer continued the run in .* after this trainer's last "
                                              rf"write at step 8 .*newest checkpoint is {newest}.*resume=True"):
        first.train_model(train, val, num_epochs=1)
    assert {name: (run / name).read_bytes() for name in records} == records  # nothing written
    assert first.test(test)["test/loss"] == pytest.approx(second.test(test, which="best")["test/loss"])
    first.train_model(train, val, num_epochs=4, resume=True)  # from the newest, the other trainer's
    assert first.global_step == 32 and not (run / "abandoned").exists()
    steps = [int(r["step"]) for r in _rows(run) if "val/loss" in r]
    assert steps == [8, 16, 24, 32]


def test_a_second_trainer_in_the_process_of_a_live_run_is_refused_and_the_runs_lock_stays(tmp_path, regression_loaders):
    """A loaded copy of a run tested from a callback of that run's train_model (one process) took
    its lock as a stale one (same pid) and deleted it: another process could then train there too."""
    train, val, test = regression_loaders
    run = tmp_path / "run"
    run.mkdir()
    (run / RunLock.FILE).write_text(f"{os.getpid()} {os.uname().nodename}")  # an earlier process's, same pid
    seen = []

    class TestACopy(Callback):
        def on_train_epoch_start(self, trainer, epoch):
            if epoch == 2:
                trainer.checkpointer.wait()  # checkpoint 8 written
                copy = RegressTrainer.load_from_checkpoint(run, exmp_input=X0, enable_progress_bar=False)
                with pytest.raises(RunInUseError) as refused:
                    copy.test(test)
                seen.append((str(refused.value), (run / RunLock.FILE).read_text(), trainer._run_lock.held))

    trainer = _trainer(run, callbacks=[ModelCheckpoint(every_n_epochs=1), TestACopy()])
    trainer.train_model(train, val, num_epochs=2)  # the earlier process's lock is taken over
    ((message, lock, held),) = seen
    assert lock == f"{os.getpid()} {os.uname().nodename}" and held  # the live run's lock, still there
    assert "another trainer object in this process" in message and "Nothing was written" in message
    assert "logger_params={'log_dir': 'runs/eval'}" in message
    assert not any(row.get("test/loss") for row in _rows(run)) and not (run / "metrics" / "test.json").exists()
    assert not (run / RunLock.FILE).exists()  # released at the end


def test_a_run_whose_loggers_fail_to_start_leaves_no_lock_that_would_refuse_a_retry(tmp_path, regression_loaders):
    from flaxlight.loggers import Logger

    class FailsToStart(Logger):
        def start_run(self):
            raise ConnectionError("the tracking server is down")

    train, val, _ = regression_loaders
    with pytest.raises(ConnectionError, match="tracking server is down"):
        _trainer(tmp_path / "run", loggers=[FailsToStart()]).train_model(train, val, num_epochs=1)
    assert not (tmp_path / "run" / RunLock.FILE).exists()
    _trainer(tmp_path / "run").train_model(train, val, num_epochs=1)  # the retry, in this process


def test_a_loop_of_ones_own_calling_train_epoch_takes_no_lock_per_log_point(tmp_path, monkeypatch):
    """A lock file made, synced and removed at every log point (the loop's own, and a callback's
    log_metrics) cost such a loop ~15% on a small model; its records go on being written (the
    folder is claimed once), and log_metrics called by the user still takes the lock."""
    taken = []
    acquire = RunLock.acquire
    monkeypatch.setattr(RunLock, "acquire", lambda self: (taken.append(1), acquire(self))[1])
    x, y = linear_data(256)
    train = ArrayLoader(x, y, batch_size=16, shuffle=True)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=x[:1],
                             **quiet(tmp_path, log_every_n_steps=4, callbacks=[LearningRateMonitor()]))
    trainer.init_optimizer(3, len(train))
    for epoch in (1, 2, 3):
        train.set_epoch(epoch)
        trainer.train_epoch(train)
    assert taken == []
    trainer.log_metrics({"mine": 1.0})
    assert taken == [1]
    trainer.logger.flush()
    with open(tmp_path / "run" / "metrics.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss_step")]
    assert steps == list(range(4, 49, 4))
