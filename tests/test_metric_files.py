"""A run's metrics/*.json files: written off the training thread, on disk when train_model returns
and before each checkpoint; an override of save_metrics still hears every validation; a failed
write stops the run with the file's error."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

from conftest import RegressTrainer, TinyMLP, quiet
from flaxlight import Callback, ModelCheckpoint, runfiles
from flaxlight.checkpoint import Checkpointer
from flaxlight.loggers import Logger
from flaxlight.writer import BackgroundWriter

X0 = np.zeros((1, 4), np.float32)


def _trainer(tmp_path, trainer_class=RegressTrainer, **kwargs):
    return trainer_class(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                         optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path, **kwargs))


def _read(path):
    with open(path) as f:
        return json.load(f)


def test_every_validations_file_and_the_best_are_on_disk_when_train_model_returns(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path)
    best = trainer.train_model(train, val, num_epochs=4)
    folder = tmp_path / "run" / "metrics"
    for row in best.history:
        assert _read(folder / f"eval_epoch_{row['epoch']:03d}.json")["val/loss"] == row["val/loss"]
    assert len(best.history) == 4
    assert _read(folder / "best_eval.json")["val/loss"] == best["val/loss"]


class Pauses(Callback):
    """Gives the writer's thread time between epochs (a longer epoch's work)."""

    def on_epoch_end(self, trainer, epoch):
        time.sleep(0.2)


def test_the_files_are_written_off_the_training_thread_while_it_trains(tmp_path, regression_loaders, monkeypatch):
    """During the epochs the writer's thread writes the files (within its idle time, here 20 ms);
    what is still queued when the run ends (or at a checkpoint) the training thread, which waits
    for it there, writes itself."""
    train, val, _ = regression_loaders
    writers, write = {}, runfiles.write_metrics

    def noting(log_dir, name, metrics):
        writers[name] = threading.current_thread()
        return write(log_dir, name, metrics)

    monkeypatch.setattr(runfiles, "write_metrics", noting)
    monkeypatch.setattr(BackgroundWriter, "idle_seconds", 0.02)
    _trainer(tmp_path, callbacks=[Pauses()], enable_checkpointing=False).train_model(train, val, num_epochs=3)
    assert {f"eval_epoch_{epoch:03d}" for epoch in (1, 2, 3)} <= set(writers)
    assert writers["eval_epoch_001"].name == writers["eval_epoch_002"].name == "flaxlight-metric-files"
    assert writers["eval_epoch_001"] is not threading.main_thread()


def test_queued_files_wake_their_writer_once_a_batch_is_waiting(tmp_path, monkeypatch):
    """Files are written in batches: within the writer's idle time, or as soon as a batch is queued,
    so that a flush at a checkpoint finds at most a batch left (not a second's worth of tiny epochs)."""
    monkeypatch.setattr(BackgroundWriter, "idle_seconds", 30.0)
    files, folder = runfiles.MetricFiles(), tmp_path / "metrics"
    written = lambda: len([name for name in os.listdir(folder) if name.endswith(".json")]) if folder.exists() else 0
    files.write_soon(str(tmp_path), "eval_epoch_001", {"val/loss": 1.0})  # starts the writer's thread
    deadline = time.monotonic() + 5
    while written() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the thread waits for more
    for epoch in range(2, 2 + runfiles.MetricFiles.batch - 1):
        files.write_soon(str(tmp_path), f"eval_epoch_{epoch:03d}", {"val/loss": 1.0 / epoch})
    time.sleep(0.3)
    assert written() == 1  # a batch less one: they wait (for the idle time, 30 s here)
    files.write_soon(str(tmp_path), "best_eval", {"val/loss": 0.1})  # the batch is full: the writer wakes
    while written() < 1 + runfiles.MetricFiles.batch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert written() == 1 + runfiles.MetricFiles.batch
    files.flush()


class Recorder(Logger):
    """Notes the records, and on which threads the flushes ran while a run's epochs went on."""

    def __init__(self):
        self.records, self.flushed_on, self.training = [], set(), False

    def log_metrics(self, metrics, step):
        self.records.append((step, dict(metrics)))

    def flush(self):
        if self.training:
            self.flushed_on.add(threading.current_thread().name)


class Training(Callback):
    def __init__(self, recorder):
        self.recorder = recorder

    def on_train_epoch_start(self, trainer, epoch):
        self.recorder.training = True

    def on_fit_end(self, trainer):
        self.recorder.training = False


def test_a_checkpoint_is_written_after_the_records_of_the_steps_before_it(tmp_path, regression_loaders, monkeypatch):
    """The files and logger records of the validations before a checkpoint reach the disk before it
    is written; the checkpoint's writer waits for the loggers' flush, the training thread does not
    (the loggers' flushes run on their writer)."""
    train, val, _ = regression_loaders
    seen, write, recorder = {}, Checkpointer._write, Recorder()

    def noting(self, step, *args):
        validated = {s for s, metrics in recorder.records if "val/loss" in metrics}
        seen[step] = (sorted(os.listdir(tmp_path / "run" / "metrics")), validated)
        return write(self, step, *args)

    monkeypatch.setattr(Checkpointer, "_write", noting)
    trainer = _trainer(tmp_path, loggers=[recorder], callbacks=[ModelCheckpoint(every_n_epochs=1), Training(recorder)])
    trainer.train_model(train, val, num_epochs=3)
    assert sorted(seen) == [8, 16, 24], seen
    for step, (names, validated) in seen.items():
        epoch = step // len(train)
        assert {f"eval_epoch_{e:03d}.json" for e in range(1, epoch + 1)} <= set(names), (step, names)
        assert "best_eval.json" in names
        assert {e * len(train) for e in range(1, epoch + 1)} <= validated, (step, validated)
    assert recorder.flushed_on == {"flaxlight-logs"}


class FallingError(Callback):
    """Logs ``val/error`` = 1 / epoch: every validation finds a new best model."""

    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"val/error": 1.0 / epoch})


class CountsFlushes(Recorder):
    def __init__(self):
        super().__init__()
        self.flushes = 0

    def flush(self):
        self.flushes += self.training


def test_saves_at_each_new_best_that_are_replaced_unwritten_do_not_each_flush_the_loggers(
        tmp_path, regression_loaders):
    """With the default write budget the new bests' saves wait and are replaced unwritten; the
    loggers' flush each one queued waits with the records and is replaced too (at most one a
    second, as at epoch ends), instead of a flush per new best."""
    train, val, _ = regression_loaders
    recorder = CountsFlushes()
    trainer = _trainer(tmp_path, loggers=[recorder], callbacks=[FallingError(), Training(recorder)],
                       monitor="val/error", mode="min")
    start = time.monotonic()
    trainer.train_model(train, val, num_epochs=30)
    seconds = time.monotonic() - start
    assert [row["val/error"] for row in trainer.history] == [1.0 / epoch for epoch in range(1, 31)]
    # a flush per new best was 30 (and more); now those the writer runs while it is awake anyway (at the
    # run's start, at flush_soon's at most one a second)
    assert recorder.flushes <= 2 * seconds + 8, (recorder.flushes, seconds)
    assert trainer.checkpointer.latest_step() == 30 * len(train)


def test_an_override_of_save_metrics_hears_each_validation_as_before(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    heard = []

    class Noting(RegressTrainer):
        def save_metrics(self, filename, metrics):
            heard.append(filename)
            super().save_metrics(filename, metrics)

    _trainer(tmp_path, trainer_class=Noting).train_model(train, val, num_epochs=2)
    assert [name for name in heard if name.startswith("eval_epoch")] == ["eval_epoch_001", "eval_epoch_002"]
    assert "best_eval" in heard


class FolderTurnsIntoAFile(Callback):
    """After the first epoch, ``metrics/`` is replaced by a file: the next file cannot be written."""

    def on_train_epoch_start(self, trainer, epoch):
        if epoch == 2:
            trainer.checkpointer.wait()  # epoch 1's checkpoint, written after epoch 1's files
            folder = os.path.join(trainer.log_dir, "metrics")
            shutil.rmtree(folder)
            with open(folder, "w") as f:
                f.write("not a folder")


def test_a_metrics_file_that_cannot_be_written_stops_the_run_naming_it(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, callbacks=[FolderTurnsIntoAFile()])
    with pytest.raises(OSError, match="metrics"):
        trainer.train_model(train, val, num_epochs=3)


def test_a_file_asked_for_again_before_it_was_written_is_written_once_with_the_newest_values(tmp_path, monkeypatch):
    """best_eval.json at each new best: while the writer is busy, the newer values replace the queued ones."""
    started, release, written, write = threading.Event(), threading.Event(), [], runfiles.write_metrics

    def slow_first(log_dir, name, metrics):
        written.append(name)
        if name == "eval_epoch_001":
            started.set()
            release.wait(10)
        return write(log_dir, name, metrics)

    monkeypatch.setattr(runfiles, "write_metrics", slow_first)
    files = runfiles.MetricFiles()
    files.write_soon(str(tmp_path), "eval_epoch_001", {"val/loss": 3.0})
    assert started.wait(10)
    for epoch, loss in [(2, 2.0), (3, 1.0)]:
        files.write_soon(str(tmp_path), "best_eval", {"val/loss": loss})
        files.write_soon(str(tmp_path), f"eval_epoch_{epoch:03d}", {"val/loss": loss})
    release.set()
    files.flush()
    assert sorted(written) == ["best_eval", "eval_epoch_001", "eval_epoch_002", "eval_epoch_003"]
    assert _read(tmp_path / "metrics" / "best_eval.json") == {"val/loss": 1.0}
    assert _read(tmp_path / "metrics" / "eval_epoch_002.json") == {"val/loss": 2.0}
