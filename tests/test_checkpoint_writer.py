"""The checkpointer's background writer: kills and SIGTERM while a save is in flight, a failed
write surfacing on the training thread, no thread/file leak, and queued steps listed at once."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight import Checkpointer, ModelCheckpoint

SCRIPT = Path(__file__).with_name("writer_script.py")
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax writes <step>.orbax-checkpoint-tmp, then renames it to <step>
AT = 15  # the step whose checkpoint is in flight when the signal comes (mid epoch 2, 8 steps per epoch)


def _run(log_dir, out, *flags):
    # The subprocesses share the tests' persistent compilation cache (FLAXLIGHT_CACHE_DIR, set by
    # conftest), small programs included: each start-up stays short.
    env = dict(os.environ, CI="true", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.run([sys.executable, str(SCRIPT), str(log_dir), str(out), *map(str, flags)],
                          capture_output=True, text=True, env=env, timeout=300)


def _arrays(path):
    with np.load(path) as data:
        return [data[f"p{i}"] for i in range(len(data.files))]


def _steps(checkpoints):
    return sorted(int(name) for name in os.listdir(checkpoints) if name.isdigit())


def _target_state(tmp_path):
    """A fresh state of the script's model and optimizer, to restore checkpoints into."""
    from writer_script import MODEL_HPARAMS, NUM_EPOCHS, OPTIMIZER_HPARAMS  # tests/ is on sys.path (conftest)

    trainer = RegressTrainer(model_class=TinyMLP, model_hparams=dict(MODEL_HPARAMS),
                             optimizer_hparams=dict(OPTIMIZER_HPARAMS), exmp_input=linear_data(1)[0],
                             **quiet(tmp_path / "target"))
    trainer.init_optimizer(NUM_EPOCHS, 8)
    return trainer.state


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The uninterrupted reference run's final arrays, computed once for the module."""
    root = tmp_path_factory.mktemp("writer")
    result = _run(root / "straight", root / "straight.npz")
    assert result.returncode == 0, result.stderr
    return _arrays(root / "straight.npz")


@pytest.mark.parametrize("when", ["queued", "writing"])
def test_sigkill_with_a_save_in_flight_then_resume_is_bitwise_equal(shared, tmp_path, when):
    """SIGKILL right after checkpoint 15 was queued (``queued``) or once orbax's temporary folder of
    it exists (``writing``): checkpoint 15 is complete or absent, and a resume ends bitwise equal."""
    reference = shared
    run, report = tmp_path / "run", tmp_path / "report.json"
    killed = _run(run, tmp_path / "unused.npz", "--signal", "kill", "--at", AT, "--when", when,
                  "--report", report)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    seen = json.loads(report.read_text())
    assert AT in seen["queued"]  # listed by the checkpointer while it was on its way to disk
    if when == "writing":
        assert f"{AT}{TMP_SUFFIX}" in seen["listing"] or str(AT) in seen["listing"], seen

    checkpoints = run / "checkpoints"
    on_disk = _steps(checkpoints)
    assert on_disk, os.listdir(checkpoints)  # the earlier checkpoints survived the kill
    reader, target = Checkpointer(checkpoints, read_only=True), _target_state(tmp_path)
    for step in on_disk:  # every <step> folder is a complete checkpoint: a partial one is only a tmp folder
        assert int(reader.restore(target, step=step).step) == step
        assert reader.read_meta(step)["step"] == step
    leftovers = [name for name in os.listdir(checkpoints) if not name.isdigit() and not name.startswith(".deleting-")]
    # At most the tmp folder of the write the kill interrupted (one of the saves still on their way),
    # or a deletion it interrupted (renamed out of the way first, so it is no checkpoint).
    assert set(leftovers) <= {f"{step}{TMP_SUFFIX}" for step in seen["queued"]}, (leftovers, seen)

    resumed = _run(run, tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resumed from checkpoint {max(on_disk)} " in resumed.stderr
    for got, want in zip(_arrays(tmp_path / "final.npz"), reference, strict=True):
        np.testing.assert_array_equal(got, want)  # bitwise
    assert not [name for name in os.listdir(checkpoints) if not name.isdigit()]  # the tmp folder is gone


def test_sigterm_with_a_save_in_flight_exits_143_with_a_complete_checkpoint(shared, tmp_path):
    run, report = tmp_path / "run", tmp_path / "report.json"
    stopped = _run(run, tmp_path / "unused.npz", "--signal", "term", "--at", AT, "--when", "writing",
                   "--report", report)
    assert stopped.returncode == 128 + signal.SIGTERM == 143, stopped.stderr
    assert f"SIGTERM received: stopped after step {AT} " in stopped.stderr
    assert f"saved a checkpoint in {run / 'checkpoints'}" in stopped.stderr
    seen = json.loads(report.read_text())
    assert f"{AT}{TMP_SUFFIX}" in seen["listing"] or str(AT) in seen["listing"], seen

    checkpoints = run / "checkpoints"
    assert max(_steps(checkpoints)) == AT
    assert not [name for name in os.listdir(checkpoints) if not name.isdigit()]  # nothing half-written
    state = Checkpointer(checkpoints, read_only=True).restore(_target_state(tmp_path), step=AT)
    assert int(state.step) == AT
    last = RegressTrainer.load_from_checkpoint(run, exmp_input=linear_data(1)[0], which="last")
    assert int(last.state.step) == AT
    jax.tree.map(np.testing.assert_array_equal, last.state.params, state.params)


# ----------------------------------------------------------------------------- in-process tests
def _trainer(tmp_path, callbacks, hidden=(8,)):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": list(hidden)},
                          optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=linear_data(1)[0],
                          **quiet(tmp_path, callbacks=callbacks, log_every_n_steps=1000))


def _settled(checkpointer, seconds=30.0):
    """Wait until the checkpointer's writer has nothing running or queued (after a failed write:
    the failure is recorded, the jobs behind it dropped). A fixed pause was not enough on a busy
    machine, where the writer thread may not run for a while after the write raised."""
    deadline = time.monotonic() + seconds
    while checkpointer.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    return not checkpointer.busy


class DiskFails(flaxlight.Callback):
    """At step 10, once checkpoint 8 is on disk, every later write fails as on a full disk (the
    writer's writes and deletions are recorded, in order); at step 16, before ModelCheckpoint
    saves, waits until the writer has failed on checkpoint 12."""

    every_n_steps = 2

    def __init__(self):
        self.events, self.failed = [], threading.Event()

    def on_step(self, trainer, step):
        if step == 16:
            assert self.failed.wait(30)
            assert _settled(trainer.checkpointer)  # the writer recorded its failure
        if step != 10:
            return
        checkpointer = trainer.checkpointer
        checkpointer.wait()  # checkpoint 8 is on disk (ModelCheckpoint heard of step 8 last)
        events, failed, delete_now = self.events, self.failed, checkpointer._delete_now

        def full_disk(step, arrays, meta, metrics):
            events.append(("write failed", step))
            failed.set()
            raise OSError(28, "No space left on device")

        def recorded_delete(step):
            events.append(("delete", step))
            delete_now(step)

        checkpointer._write = full_disk  # on the instance: the writer's _replace calls it
        checkpointer._delete_now = recorded_delete


def test_a_failed_write_is_raised_on_the_training_thread_and_keeps_the_earlier_checkpoint(tmp_path):
    disk = DiskFails()
    trainer = _trainer(tmp_path, [ModelCheckpoint(every_n_steps=4), disk])
    train = flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32)  # 8 steps per epoch
    checkpoints = tmp_path / "run" / "checkpoints"
    with pytest.raises(RuntimeError) as raised:
        trainer.train_model(train, None, num_epochs=3)
    message = str(raised.value)
    assert f"Writing a checkpoint to {checkpoints} failed" in message, message
    assert "No space left on device" in message and "the earlier checkpoints are kept" in message
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == 28
    assert trainer.global_step == 16  # raised by the next save, on the training thread

    # The pruning at step 12 deleted 4 (queued before the failed write); the deletion of 8 queued at
    # step 16 (behind the failed write) never ran, nor did any write after it.
    assert disk.events == [("delete", 4), ("write failed", 12)], disk.events
    assert _steps(checkpoints) == [8]
    assert not [name for name in os.listdir(checkpoints) if not name.isdigit()]
    state = Checkpointer(checkpoints, read_only=True).restore(_trainer(tmp_path / "check", []).state, step=8)
    assert int(state.step) == 8
    assert trainer.checkpointer.all_steps() == [8]  # after the failure, the checkpointer lists the disk again


class AfterTheFailure(flaxlight.Callback):
    """At step 14, once the writer has failed on checkpoint 12 (not yet raised): ``error`` raises a
    user's error, ``sigterm`` sends SIGTERM to this process (the trainer's handler catches it)."""

    every_n_steps = 2

    def __init__(self, disk, action):
        self.disk, self.action = disk, action

    def on_step(self, trainer, step):
        if step == 14:
            assert self.disk.failed.wait(30)
            assert _settled(trainer.checkpointer)  # the writer recorded its failure
            if self.action == "error":
                raise ValueError("a user's error at step 14")
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("action", [
    "error",  # the user's error is raised, the write failure warned about
    "sigterm",
])
def test_a_pending_write_failure_does_not_skip_the_runs_cleanup(tmp_path, action):
    disk = DiskFails()
    trainer = _trainer(tmp_path, [ModelCheckpoint(every_n_steps=4), disk, AfterTheFailure(disk, action)])
    with pytest.raises((RuntimeError, ValueError, SystemExit)):
        trainer.train_model(flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32), None, num_epochs=3)
    assert _steps(tmp_path / "run" / "checkpoints") == [8]
    assert not (tmp_path / "run" / ".flaxlight.lock").exists()  # released, as after any other failed run


class PausingCheckpointer(Checkpointer):
    """Pauses its writer thread after the first failed job, before it takes the next job (the OS may
    deschedule a thread there at any time), until ``proceed`` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed, self.proceed = threading.Event(), threading.Event()
        writer, next_job = self._writer, self._writer._next_job

        def pause_after_the_failure():
            if writer._failure is not None and not self.failed.is_set():
                self.failed.set()
                assert self.proceed.wait(10)
            return next_job()

        writer._next_job = pause_after_the_failure


def test_no_deletion_runs_after_a_failed_write_even_when_the_failure_is_raised_first(tmp_path):
    state = _trainer(tmp_path, []).state
    checkpointer = PausingCheckpointer(tmp_path / "ckpt", max_to_keep=None)
    checkpointer.save(8, state)
    checkpointer.wait()

    def full_disk(step, arrays, meta, metrics):
        raise OSError(28, "No space left on device")

    checkpointer._write = full_disk
    checkpointer.save(12, state)
    checkpointer.delete(8)  # as ModelCheckpoint prunes: queued behind the save of 12
    assert checkpointer.failed.wait(10)
    releaser = threading.Timer(0.3, checkpointer.proceed.set)  # also when the save below waits for the writer
    releaser.start()
    try:
        with pytest.raises(RuntimeError, match="the earlier checkpoints are kept"):
            checkpointer.save(16, state)
    finally:
        checkpointer.proceed.set()
        releaser.join()
    checkpointer.wait()
    assert _steps(tmp_path / "ckpt") == [8]
    checkpointer.close()


class Census(flaxlight.Callback):
    """Threads and open files of this process at the end of given epochs."""

    def __init__(self, epochs):
        self.epochs, self.seen = set(epochs), {}

    def on_epoch_end(self, trainer, epoch):
        if epoch in self.epochs:
            trainer.checkpointer.wait()  # the threads orbax starts for one write are joined by then
            writers = {t.ident for t in threading.enumerate() if t.name == "flaxlight-checkpoints"}
            self.seen[epoch] = (threading.active_count(), len(os.listdir("/proc/self/fd")), writers)


@pytest.fixture
def fast_tmp_path(tmp_path):
    """A folder in memory (/dev/shm) when there is one: 200 checkpoints take half the time there."""
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        yield tmp_path
        return
    folder = tempfile.mkdtemp(prefix="flaxlight-writer-test-", dir="/dev/shm")
    try:
        yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc/self/fd")
def test_threads_and_open_files_stay_flat_over_200_epochs_with_a_checkpoint_each(fast_tmp_path):
    tmp_path, census = fast_tmp_path, Census([20, 200])
    trainer = _trainer(tmp_path, [census, ModelCheckpoint(every_n_epochs=1)], hidden=(4,))
    train = flaxlight.ArrayLoader(*linear_data(32, 0), batch_size=16)  # 2 steps per epoch
    trainer.train_model(train, None, num_epochs=200)
    (threads_20, files_20, writers_20), (threads_200, files_200, writers_200) = census.seen[20], census.seen[200]
    # A leak per save would add ~180 threads; the slack absorbs orbax's short-lived helper threads
    # and other tests' background threads finishing or starting on this worker (seen: +3 in CI).
    assert threads_200 <= threads_20 + 8, (threads_20, threads_200)
    assert files_200 <= files_20 + 5, (files_20, files_200)
    # A writer's thread ends soon after its queue empties: at epoch 200, this run's (the one seen at
    # epoch 20, or after a stall of an idle second on a busy machine, its successor), not one per save.
    # Earlier checkpointers' threads still waiting out their idle time (or a pause) are left aside.
    started = writers_200 - writers_20
    assert len(started) <= 1 and len(writers_200) <= len(writers_20) + 1, (writers_20, writers_200)
    assert _steps(tmp_path / "run" / "checkpoints") == [400]


def test_all_steps_lists_a_queued_save_before_it_is_written(tmp_path):
    state = _trainer(tmp_path, []).state
    folder = tmp_path / "ckpt"
    checkpointer = Checkpointer(folder, max_to_keep=None)
    gate, write = threading.Event(), checkpointer._write

    def gated_write(step, arrays, meta, metrics):
        assert gate.wait(10)
        write(step, arrays, meta, metrics)

    checkpointer._write = gated_write  # the writer thread waits for the gate: nothing reaches the disk
    on_disk = lambda: _steps(folder) if folder.is_dir() else []  # noqa: E731
    checkpointer.save(3, state, meta={"n": 3})
    assert checkpointer.all_steps() == [3] and checkpointer.latest_step() == 3
    assert on_disk() == []
    checkpointer.save(5, state, meta={"n": 5})
    checkpointer.delete(3)
    assert checkpointer.all_steps() == [5]
    assert on_disk() == []
    gate.set()
    checkpointer.wait()
    assert on_disk() == checkpointer.all_steps() == [5]
    assert not [name for name in os.listdir(folder) if not name.isdigit()]
    assert Checkpointer(folder, read_only=True).all_steps() == [5]  # another reader sees the same
    assert checkpointer.read_meta(5) == {"n": 5}
    checkpointer.close()


def test_a_killed_runs_unfinished_write_is_removed_before_the_next_runs_first_write(tmp_path):
    """A folder holding checkpoint 3 and the temporary folder of an unfinished write of step 7 (as
    a SIGKILL leaves it): readers leave it alone; the next writer removes it, even when it never
    writes step 7 again."""
    state = _trainer(tmp_path, []).state
    folder = tmp_path / "ckpt"
    first = Checkpointer(folder, max_to_keep=None)
    first.save(3, state, meta={"n": 3})
    first.close()
    (folder / f"7{TMP_SUFFIX}").mkdir()
    (folder / f"7{TMP_SUFFIX}" / "half_written").write_bytes(b"\0" * 16)

    assert Checkpointer(folder, read_only=True).all_steps() == [3]
    assert (folder / f"7{TMP_SUFFIX}").is_dir()  # a reader changes nothing

    second = Checkpointer(folder, max_to_keep=None)
    assert second.all_steps() == [3]
    second.save(5, state, meta={"n": 5})
    second.wait()
    assert sorted(os.listdir(folder)) == ["3", "5"]
    assert second.read_meta(3) == {"n": 3}
    second.close()


def test_a_step_saved_again_keeps_the_first_until_the_second_is_written(tmp_path):
    """A periodic save of step 8, then step 8's validation made it the best: the finished
    checkpoint was deleted before its replacement was written, and a SIGKILL in between left the run
    with no checkpoint at all."""
    state = _trainer(tmp_path, []).state
    folder = tmp_path / "ckpt"
    first = Checkpointer(folder, max_to_keep=None)
    first.save(8, state, meta={"n": "periodic"})
    first.wait()

    def failing_write(step, arrays, meta, metrics):
        raise OSError(28, "No space left on device")

    first._write = failing_write  # the replacement fails: the first save is there again
    first.save(8, state, meta={"n": "best"})
    with pytest.raises(RuntimeError, match=r"OSError: \[Errno 28\] No space left on device\); the earlier "
                                           r"checkpoints are kept"):  # not an AttributeError of the put-back
        first.wait()
    assert sorted(os.listdir(folder)) == ["8"] and Checkpointer(folder, read_only=True).read_meta(8) == {"n": "periodic"}
    first.close()

    os.rename(folder / "8", folder / ".replacing-8-0123abcd")  # what a kill during the replacement leaves
    second = Checkpointer(folder, max_to_keep=None)
    assert second.all_steps() == [8] and second.read_meta(8) == {"n": "periodic"}  # put back
    second.save(8, state, meta={"n": "best"})
    second.wait()
    assert sorted(os.listdir(folder)) == ["8"] and second.read_meta(8) == {"n": "best"}
    second.close()
