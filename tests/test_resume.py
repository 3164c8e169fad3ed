"""Exact resume after SIGKILL, SIGTERM during training and evaluation, in real subprocesses."""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).with_name("resume_script.py")


def _run(log_dir, out, *flags):
    # A persistent compilation cache shared by the subprocesses keeps each start-up short.
    env = dict(os.environ, CI="true", JAX_COMPILATION_CACHE_DIR=str(Path(log_dir).parents[1] / "jax-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.run([sys.executable, str(SCRIPT), str(log_dir), str(out), *flags],
                          capture_output=True, text=True, env=env, timeout=300)


def _arrays(path):
    with np.load(path) as data:
        return [data[f"p{i}"] for i in range(len(data.files))]


def _csv_rows(log_dir):
    with open(Path(log_dir) / "metrics.csv") as f:
        return [{k: v for k, v in row.items() if k != "epoch_time"} for row in csv.DictReader(f)]


def _tb_steps(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run (shared by the tests of this module, computed once)."""
    root = tmp_path_factory.mktemp("straight")
    result = _run(root / "run", root / "final.npz")
    assert result.returncode == 0, result.stderr
    return root / "run", _arrays(root / "final.npz")


def _assert_same_run(straight, log_dir, out):
    reference_dir, reference = straight
    for got, want in zip(_arrays(out), reference, strict=True):
        np.testing.assert_array_equal(got, want)  # bitwise
    assert _csv_rows(log_dir) == _csv_rows(reference_dir)
    for tag in ("train/loss", "train/loss_step", "val/loss"):
        assert _tb_steps(log_dir, tag) == _tb_steps(reference_dir, tag)


def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(straight, tmp_path):
    killed = _run(tmp_path / "run", tmp_path / "unused.npz", "--kill-at", "28")
    assert killed.returncode == -signal.SIGKILL
    assert 25 in [int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit()]
    resumed = _run(tmp_path / "run", tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from checkpoint 25" in resumed.stderr  # mid-epoch 4 (8 steps per epoch)
    _assert_same_run(straight, tmp_path / "run", tmp_path / "final.npz")


def test_sigterm_during_training_saves_and_says_how_to_resume(straight, tmp_path):
    stopped = _run(tmp_path / "run", tmp_path / "unused.npz", "--sigterm-at", "19")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "SIGTERM received" in stopped.stderr and "resume=True" in stopped.stderr
    assert "19" in os.listdir(tmp_path / "run" / "checkpoints")
    resumed = _run(tmp_path / "run", tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from checkpoint 19" in resumed.stderr
    _assert_same_run(straight, tmp_path / "run", tmp_path / "final.npz")


def test_sigterm_during_evaluation_resumes_with_that_validation(straight, tmp_path):
    stopped = _run(tmp_path / "run", tmp_path / "unused.npz", "--sigterm-in-eval", "2")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "16" in os.listdir(tmp_path / "run" / "checkpoints")  # end of epoch 2's training
    resumed = _run(tmp_path / "run", tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_run(straight, tmp_path / "run", tmp_path / "final.npz")


def test_users_loader_with_set_epoch_resumes_exactly(tmp_path):
    """In-process: a crash (an exception at step 28) and a resume give the uninterrupted result."""
    from resume_script import SeededLoader

    import flaxlight
    from conftest import RegressTrainer, TinyMLP, linear_data

    class Crash(flaxlight.Callback):
        every_n_steps = 28

        def on_step(self, trainer, step):
            raise RuntimeError("crash")

    def run(log_dir, callbacks=(), resume=False):
        x, y = linear_data(256, 0)
        trainer = RegressTrainer(
            model_class=TinyMLP, model_hparams={"hidden_dims": [16], "dropout_prob": 0.2},
            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1],
            logger_params={"log_dir": str(log_dir)}, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[flaxlight.ModelCheckpoint(every_n_steps=5), *callbacks])
        trainer.train_model(SeededLoader(x, y, 32), None, num_epochs=5, resume=resume)
        return trainer.state.params

    reference = run(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "run", callbacks=[Crash()])
    resumed = run(tmp_path / "run", resume=True)
    import jax

    jax.tree.map(np.testing.assert_array_equal, resumed, reference)
    assert _csv_rows(tmp_path / "run") == _csv_rows(tmp_path / "ref")


def test_resuming_with_a_loader_without_set_epoch_warns(tmp_path, regression_loaders):
    from conftest import RegressTrainer, TinyMLP, quiet

    train, val, _ = regression_loaders
    batches = list(train)
    kwargs = dict(model_class=TinyMLP, model_hparams={}, optimizer_hparams={"lr": 1e-2},
                  exmp_input=batches[0][0][:1], **quiet(tmp_path))
    RegressTrainer(**kwargs).train_model(batches, val, num_epochs=1)
    with pytest.warns(RuntimeWarning, match="set_epoch"):
        RegressTrainer(**kwargs).train_model(batches, val, num_epochs=2, resume=True)


class _SignalAtStep:
    """A user's loader (``set_epoch``: resumes exactly) that sends SIGTERM to this process while it
    hands out the batch of step ``at``: the signal arrives during that step, before its events."""

    def __init__(self, x, y, at=None):
        from resume_script import SeededLoader

        self.inner, self.at, self.served = SeededLoader(x, y, 32), at, 0

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        for batch in self.inner:
            self.served += 1
            if self.served == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch


class _SignalInValidation:
    """A validation list that sends SIGTERM during its ``at``-th pass."""

    def __init__(self, batches, at=None):
        self.batches, self.at, self.passes = batches, at, 0

    def __iter__(self):
        self.passes += 1
        for i, batch in enumerate(self.batches):
            if self.passes == self.at and i == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch


def _step_events_run(log_dir, *, train_at=None, val_at=None, resume=False):
    """8 steps per epoch; a log point, a step validation and an on_step callback every 5 steps."""
    import flaxlight
    from conftest import RegressTrainer, TinyMLP, linear_data

    class Steps(flaxlight.Callback):
        every_n_steps = 5

        def __init__(self):
            self.seen = []

        def on_step(self, trainer, step):
            self.seen.append(step)

    x, y = linear_data(256, 0)
    xv, yv = linear_data(96, 1)
    steps = Steps()
    trainer = RegressTrainer(
        model_class=TinyMLP, model_hparams={"hidden_dims": [16]}, optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
        exmp_input=x[:1], logger_params={"log_dir": str(log_dir)}, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[steps], log_every_n_steps=5, val_check_interval=5)
    val = _SignalInValidation([(xv[i:i + 32], yv[i:i + 32]) for i in range(0, 96, 32)], val_at)
    trainer.train_model(_SignalAtStep(x, y, train_at), val, num_epochs=2, resume=resume)
    return trainer, steps.seen


def _rows_with(log_dir, key):
    return [int(row["step"]) for row in _csv_rows(log_dir) if row.get(key)]


@pytest.mark.parametrize("interrupt", [{"train_at": 10}, {"val_at": 3}], ids=["during-the-step", "in-its-validation"])
def test_sigterm_at_a_step_with_events_runs_them_after_the_resume(tmp_path, interrupt):
    """The step-10 log point, step validation and on_step callbacks are owed by the interrupt's
    checkpoint and run first after the resume: the run's records equal an uninterrupted run's."""
    import jax

    reference, seen = _step_events_run(tmp_path / "ref")
    with pytest.raises(SystemExit):
        _step_events_run(tmp_path / "run", **interrupt)
    resumed, seen_after = _step_events_run(tmp_path / "run", resume=True)
    assert 10 in seen_after and seen[seen.index(10):] == seen_after
    for key in ("val/loss", "train/loss_step"):
        assert _rows_with(tmp_path / "run", key) == _rows_with(tmp_path / "ref", key) == \
            ([5, 8, 10, 15, 16] if key == "val/loss" else [5, 10, 15])
    assert [round(h["val/loss"], 6) for h in resumed.history] == [round(h["val/loss"], 6) for h in reference.history]
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


@pytest.mark.parametrize("how", ["max_steps", "stop"])
def test_a_run_stopped_mid_epoch_continues_that_epoch_when_resumed(tmp_path, how, capsys):
    """max_steps / stop() (max_time's path) mid-epoch, then a longer resumed run: the epoch's rest
    is trained, as in an uninterrupted run (bitwise, with a schedule that does not depend on the
    run's length)."""
    import jax

    import flaxlight
    from conftest import RegressTrainer, TinyMLP, linear_data
    from resume_script import SeededLoader

    class StopAt(flaxlight.Callback):
        every_n_steps = 1

        def on_step(self, trainer, step):
            if step == 11:
                trainer.stop("time budget spent")

    def run(log_dir, resume=False, **options):
        x, y = linear_data(256, 0)
        trainer = RegressTrainer(
            model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
            optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "schedule": "constant"}, exmp_input=x[:1],
            logger_params={"log_dir": str(log_dir)}, enable_progress_bar=False, enable_model_summary=False, **options)
        trainer.train_model(SeededLoader(x, y, 32), None, num_epochs=3, resume=resume)
        return trainer

    reference = run(tmp_path / "ref")
    first = run(tmp_path / "run", **({"max_steps": 11} if how == "max_steps" else {"callbacks": [StopAt()]}))
    assert first.global_step == 11
    capsys.readouterr()
    resumed = run(tmp_path / "run", resume=True)
    said = capsys.readouterr().err
    assert "schedule spanned" not in said  # a constant rate: the run's length changes nothing
    assert resumed.global_step == 24 and [h["step"] for h in resumed.history] == [8, 11, 16, 24]  # 11: the stop's
    assert resumed.history[-2]["train/loss"] == pytest.approx(reference.history[1]["train/loss"], rel=1e-6)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


def test_a_stop_asked_by_an_owed_validation_ends_the_resumed_run_there(tmp_path):
    """EarlyStopping-like: the step-10 validation stops the run; a SIGTERM during step 10 owes it."""
    import flaxlight
    from conftest import RegressTrainer, TinyMLP, linear_data

    class StopAtTen(flaxlight.Callback):
        def on_validation_end(self, trainer, epoch, metrics):
            if trainer.global_step == 10:
                trainer.stop("enough")

    def run(log_dir, at=None, resume=False):
        x, y = linear_data(256, 0)
        xv, yv = linear_data(96, 1)
        trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                                 optimizer_hparams={"lr": 1e-2}, exmp_input=x[:1], logger_params={"log_dir": str(log_dir)},
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[StopAtTen()],
                                 val_check_interval=5)
        trainer.train_model(_SignalAtStep(x, y, at), [(xv, yv)], num_epochs=3, resume=resume)
        return trainer

    reference = run(tmp_path / "ref")
    with pytest.raises(SystemExit):
        run(tmp_path / "run", at=10)
    resumed = run(tmp_path / "run", resume=True)
    assert reference.global_step == resumed.global_step == 10


def test_a_ctrl_c_after_the_loops_last_check_still_stops_the_process(tmp_path):
    """A SIGINT during the final test or on_fit_end was dropped: `tune` went on to its next trial
    and `fit` exited 0. The run completes (its final checkpoint written), then the process stops."""
    import flaxlight
    from conftest import RegressTrainer, TinyMLP, linear_data, quiet

    class CtrlCAtFitEnd(flaxlight.Callback):
        def on_fit_end(self, trainer):
            os.kill(os.getpid(), signal.SIGINT)

    x, y = linear_data(64, 0)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=x[:1],
                             callbacks=[CtrlCAtFitEnd()], **quiet(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=16), None, num_epochs=2)
    assert stopped.value.code == 128 + signal.SIGINT
    assert trainer.checkpointer.latest_step() == 8 and trainer.global_step == 8
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back


def test_resume_that_finds_no_checkpoint_hides_the_killed_runs_tensorboard_events(tmp_path):
    """A run killed before its first checkpoint, continued with resume=True (a fresh start): the
    killed run's event file stayed visible, and TensorBoard showed each of its points twice."""
    from conftest import RegressTrainer, TinyMLP, linear_data

    import flaxlight

    def run(resume, **kwargs):
        trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                                 optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=linear_data(1)[0],
                                 logger_params={"log_dir": str(tmp_path / "run"), "logger_type": ["csv", "tensorboard"]},
                                 enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2, **kwargs)
        trainer.train_model(flaxlight.ArrayLoader(*linear_data(64, 0), batch_size=16), None, num_epochs=2,
                            resume=resume)

    run(False, enable_checkpointing=False)  # as a run killed before it saved anything leaves its folder
    # it said "starting from scratch": the run starts from the trainer's state, which a script may have set (a new head)
    with pytest.warns(RuntimeWarning, match="there is no checkpoint .*: a new run starts from the trainer.s current "
                                            "state .*not from a checkpoint"):
        run(True)
    steps = [step for step, _ in _tb_steps(tmp_path / "run", "train/loss_step")]
    assert steps == [2, 4, 6, 8]


def test_a_kill_after_an_epochs_records_resumes_without_logging_them_twice(straight, tmp_path):
    """Epoch 5 ends at step 40, a multiple of every_n_steps=5: the step save there is made at the
    epoch's end, after the epoch's rows and validation at that step, so a kill once they are on disk
    resumes without logging them twice (params, metrics.csv and TensorBoard as uninterrupted)."""
    killed = _run(tmp_path / "run", tmp_path / "unused.npz", "--kill-after-epoch", "5")
    assert killed.returncode == -signal.SIGKILL
    resumed = _run(tmp_path / "run", tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_run(straight, tmp_path / "run", tmp_path / "final.npz")


@pytest.mark.parametrize("when", ["epoch_end", "fit_end"])
def test_a_ctrl_c_in_an_interactive_session_saves_and_leaves_a_keyboard_interrupt(tmp_path, monkeypatch, capsys, when):
    """SystemExit(130) ended a `python -i` / REPL session (every variable lost); in an interactive
    interpreter Ctrl-C saves as in a script, then raises KeyboardInterrupt, as Keras leaves it, and
    the same trainer object resumes. SIGTERM, a request to end the process, still exits."""
    import flaxlight
    from conftest import RegressTrainer, TinyMLP, linear_data, quiet

    class CtrlC(flaxlight.Callback):
        signum = signal.SIGINT

        def on_train_epoch_end(self, trainer, epoch, metrics):
            if when == "epoch_end" and epoch == 1 and trainer.global_step == 4:
                os.kill(os.getpid(), self.signum)

        def on_fit_end(self, trainer):
            if self.signum and (when == "fit_end" or self.signum == signal.SIGTERM):
                os.kill(os.getpid(), self.signum)

    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # as in the REPL
    x, y = linear_data(64, 0)
    ctrl_c = CtrlC()
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=x[:1],
                             callbacks=[ctrl_c], **quiet(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=16), None, num_epochs=2)
    step = 5 if when == "epoch_end" else 8  # epoch_end: the signal is taken at the next step's end
    assert trainer.checkpointer.latest_step() == step and trainer.global_step == step
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if when == "epoch_end":
        assert "call train_model(..., resume=True) on this trainer" in capsys.readouterr().err
        ctrl_c.signum = None
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=16), None, num_epochs=2, resume=True)
        assert trainer.global_step == 8
    ctrl_c.signum = signal.SIGTERM
    with pytest.raises(SystemExit) as stopped:
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=16), None, num_epochs=1)
    assert stopped.value.code == 128 + signal.SIGTERM
