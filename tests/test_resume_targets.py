"""What a resume may start from and what it leaves on disk (docs/failure-modes.md): another run's
checkpoint into a folder holding a run, a rewind to an older checkpoint of the same run, a
mid-epoch checkpoint with another batch size, an interrupt whose save was refused, and metrics
files that a failed write leaves whole."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import jax.numpy as jnp
import pytest
from conftest import RegressTrainer, SigtermAt, StopAt, TinyMLP, linear_data

import flaxlight
from flaxlight.callbacks import ModelCheckpoint
from flaxlight.checkpoint import Checkpointer

X0 = linear_data(1)[0]


def _trainer(log_dir, lr=1e-2, callbacks=None, cls=RegressTrainer, **options):
    """8 steps per epoch with the loaders below; a checkpoint at every epoch end, all kept."""
    return cls(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
               optimizer_hparams={"optimizer": "adam", "lr": lr, "schedule": "constant"}, exmp_input=X0,
               logger_params={"log_dir": str(log_dir), "logger_type": "csv"}, enable_progress_bar=False,
               enable_model_summary=False,
               callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)] if callbacks is None else callbacks,
               **options)


def _loaders(batch_size=32):
    return (flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=batch_size, shuffle=True, seed=0),
            flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32))


def _steps(folder) -> list[int]:
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def _csv_steps(run) -> list[int]:
    with open(Path(run) / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def _files(folder) -> dict[str, bytes]:
    folder = Path(folder)
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def _json(path) -> dict:
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------------------------ another run's checkpoint
def test_resume_from_another_run_into_a_folder_holding_a_run_is_refused_and_writes_nothing(tmp_path):
    _trainer(tmp_path / "a").train_model(*_loaders(), num_epochs=2)
    b = _trainer(tmp_path / "b", lr=3e-2)
    b.train_model(*_loaders(), num_epochs=3)
    before = _files(tmp_path / "b")
    refusal = (r"log_dir .*b already holds a run \(hparams.yaml, checkpoints/\), and resume_from=.*a' is a "
               r"checkpoint of another run .*Give a new log_dir to continue it as a copy .*pass overwrite=True to "
               r"replace the run in .*b, or use resume=True without resume_from")
    with pytest.raises(FileExistsError, match=refusal):  # a new trainer on that folder
        _trainer(tmp_path / "b").train_model(*_loaders(), num_epochs=3, resume_from=tmp_path / "a")
    with pytest.raises(FileExistsError, match=refusal):  # the trainer that trained it
        b.train_model(*_loaders(), num_epochs=3, resume_from=tmp_path / "a")
    assert _files(tmp_path / "b") == before

    _trainer(tmp_path / "c").train_model(*_loaders(), num_epochs=3, resume_from=tmp_path / "a")  # a copy: fine
    assert _steps(tmp_path / "c" / "checkpoints") == [24] and min(_csv_steps(tmp_path / "c")) > 16
    b.train_model(*_loaders(), num_epochs=3, resume_from=tmp_path / "a", overwrite=True)  # replaces b's run
    assert _steps(tmp_path / "b" / "checkpoints") == [24] and min(_csv_steps(tmp_path / "b")) > 16
    assert "lr: 0.03" in (tmp_path / "b" / "hparams.yaml").read_text()  # b's trainer's settings, no hparams.1.yaml
    assert not (tmp_path / "b" / "hparams.1.yaml").exists()
    assert _steps(tmp_path / "a" / "checkpoints") == [8, 16]


def test_a_baseline_test_before_resuming_another_run_into_a_new_folder_is_not_taken_for_a_run(tmp_path):
    _trainer(tmp_path / "a").train_model(*_loaders(), num_epochs=2)
    trainer = _trainer(tmp_path / "c")
    trainer.test(_loaders()[1], which="current")  # its records make the new folder its own
    trainer.logger.flush()
    assert (tmp_path / "c" / "metrics.csv").exists()
    trainer.train_model(*_loaders(), num_epochs=3, resume_from=tmp_path / "a")
    assert _steps(tmp_path / "c" / "checkpoints") == [24] and 0 in _csv_steps(tmp_path / "c")


# ------------------------------------------------------------------------------------ rewinding a run
def test_rewinding_a_run_sets_its_later_checkpoints_aside_and_its_files_follow_the_new_branch(tmp_path, capsys):
    run = tmp_path / "run"
    _trainer(run).train_model(*_loaders(), num_epochs=4)
    old_csv, old_metrics = (run / "metrics.csv").read_bytes(), _files(run / "metrics")
    capsys.readouterr()
    result = _trainer(run, lr=1e-3).train_model(*_loaders(), num_epochs=2, resume_from=run / "checkpoints" / "8")
    said = capsys.readouterr().err

    aside = run / "abandoned" / "after_step_8"
    assert f"checkpoints 16, 24, 32 came after it, on a branch this run leaves. They are moved to {aside}" in said
    assert _steps(aside / "checkpoints") == [16, 24, 32]  # nothing deleted ...
    assert (aside / "metrics.csv").read_bytes() == old_csv and _files(aside / "metrics") == old_metrics
    assert _steps(run / "checkpoints") == [8, 16]  # ... and the run is the new branch only
    assert max(_csv_steps(run)) == 16 and not (run / "metrics" / "eval_epoch_003.json").exists()
    assert _json(run / "metrics" / "best_eval.json") == {k: v for k, v in result.items() if k.startswith("val/")}
    for which in ("best", "last"):  # no abandoned checkpoint is taken for this run's
        loaded = RegressTrainer.load_from_checkpoint(run, exmp_input=X0, which=which)
        assert int(loaded.state.step) in (8, 16) and loaded.optimizer_hparams["lr"] == 1e-3
    assert int(RegressTrainer.load_from_checkpoint(aside, exmp_input=X0, which="last").state.step) == 32

    _trainer(run, lr=1e-3).train_model(*_loaders(), num_epochs=3, resume=True)
    assert "Resumed from checkpoint 16 " in capsys.readouterr().err
    assert _steps(run / "checkpoints") == [8, 16, 24] and _steps(aside / "checkpoints") == [16, 24, 32]


def test_a_rewind_makes_best_eval_json_the_best_up_to_that_checkpoint(tmp_path):
    """Rewound to step 16 with nothing left to train: best_eval.json no longer names a later
    validation of the abandoned branch (default ModelCheckpoint kept several: none is deleted)."""
    run = tmp_path / "run"
    _trainer(run, callbacks=[ModelCheckpoint(monitor="val/loss", save_top_k=3, every_n_epochs=1)]).train_model(
        *_loaders(), num_epochs=4)
    kept = _steps(run / "checkpoints")
    evals = [_json(run / "metrics" / f"eval_epoch_{epoch:03d}.json") for epoch in (1, 2)]
    _trainer(run, callbacks=[ModelCheckpoint(monitor="val/loss", save_top_k=3, every_n_epochs=1)]).train_model(
        *_loaders(), num_epochs=2, resume_from=run / "checkpoints" / "16")
    assert _json(run / "metrics" / "best_eval.json") == min(evals, key=lambda m: m["val/loss"])
    later = [step for step in kept if step > 16]
    assert _steps(run / "checkpoints") == [step for step in kept if step <= 16]
    assert _steps(run / "abandoned" / "after_step_16" / "checkpoints") == later


# ------------------------------------------------------------------------------------ another batch size
def test_a_mid_epoch_checkpoint_resumed_with_another_batch_size_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _trainer(run, callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1), StopAt(12)]).train_model(
        *_loaders(), num_epochs=3)  # checkpoint 12: epoch 2, after batch 4 of 8
    assert _steps(run / "checkpoints") == [8, 12]
    before = _files(run)
    with pytest.raises(ValueError, match=r"Checkpoint 12 in .*checkpoints was saved mid-epoch \(epoch 2, after batch 4 "
                                         r"of 8\), and this run's epochs have 16 batches: another batch size .*twice or "
                                         r"skip some\. Resume with the run's train_loader .*resume_from='.*checkpoints/"
                                         r"<step>' \(steps there: 8\)"):
        _trainer(run).train_model(*_loaders(batch_size=16), num_epochs=3, resume=True)
    assert _files(run) == before
    capsys.readouterr()
    _trainer(run).train_model(*_loaders(batch_size=16), num_epochs=3, resume_from=run / "checkpoints" / "8")
    assert "The run's epochs had 8 batches and this run's have 16" in capsys.readouterr().err  # an epoch's end: fine
    assert _steps(run / "checkpoints") == [8, 24, 40]


def test_a_stream_resumed_with_a_larger_max_steps_is_not_taken_for_another_batch_size(tmp_path):
    """A loader without len(): its one epoch is max_steps long, so a longer run has a longer epoch."""
    def stream():
        x, y = linear_data(256, 0)
        while True:
            yield from ((x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32))

    _trainer(tmp_path / "run", callbacks=[StopAt(5)], max_steps=12).train_model(stream(), None, num_epochs=1)
    longer = _trainer(tmp_path / "run", callbacks=[], max_steps=20)
    with pytest.warns(RuntimeWarning, match="is a stream"):
        longer.train_model(stream(), None, num_epochs=1, resume=True)  # checkpoint 5: batch 5 of an epoch of 12
    assert longer.global_step == 20


# ------------------------------------------------------------------------------------ interrupts and failed writes
class NaNFrom(RegressTrainer):
    """The loss (and its gradient: the params) turns NaN from step 10 on; SIGTERM arrives after step 14."""

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, aux = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return loss * jnp.where(state.step >= 10, jnp.nan, 1.0), aux


def test_sigterm_after_a_nan_step_says_which_checkpoint_is_on_disk_not_that_it_saved_one(tmp_path, capsys):
    run = tmp_path / "run"
    trainer = _trainer(run, cls=NaNFrom, callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1), SigtermAt(14)])
    with pytest.warns(RuntimeWarning, match="Not saving checkpoint 14"), pytest.raises(SystemExit) as stopped:
        trainer.train_model(*_loaders(), num_epochs=3)
    said = capsys.readouterr().err
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "SIGTERM received: stopped after step 14 (epoch 2). No checkpoint of step 14 was saved: the parameters and the " \
           "optimizer state hold NaN/Inf; the loss was NaN/Inf in 4 step(s), the first between steps 9 and 14" in said
    assert f"The newest checkpoint in {run / 'checkpoints'} is step 8: a resume continues from there." in said
    assert "saved a checkpoint" not in said and _steps(run / "checkpoints") == [8]


def test_a_metrics_file_whose_write_fails_keeps_what_it_held(tmp_path):
    trainer = _trainer(tmp_path / "run")
    trainer.save_metrics("best_eval", {"val/loss": 0.5})
    with pytest.raises(TypeError):  # fails while the file is written (as a full disk would)
        trainer.save_metrics("best_eval", {"val/loss": 0.25, "val/bad": object()})
    assert _json(tmp_path / "run" / "metrics" / "best_eval.json") == {"val/loss": 0.5}
    assert os.listdir(tmp_path / "run" / "metrics") == ["best_eval.json"]  # no temporary file left



class SigtermAfter(flaxlight.Callback):
    every_n_steps = 1

    def __init__(self, step):
        self.step = step

    def on_step(self, trainer, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_checkpoint_after_an_epochs_last_batch_resumes_with_another_batch_size(tmp_path, capsys):
    """SIGTERM after the last batch of epoch 1 (checkpoint 8: batch 8 of 8) was refused as
    "mid-epoch" with another batch size, suggesting that same checkpoint; the epoch ends listed
    (step % steps_per_epoch) missed those of an earlier batch size; "Resumed from" came first."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        _trainer(run, callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1), SigtermAfter(8)]).train_model(
            *_loaders(), num_epochs=3)
    assert _steps(run / "checkpoints") == [8]
    capsys.readouterr()
    with pytest.raises(SystemExit):  # 16 batches per epoch from epoch 2 on; SIGTERM in epoch 3, after batch 4
        _trainer(run, callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1), SigtermAfter(28)]).train_model(
            *_loaders(batch_size=16), num_epochs=3, resume=True)
    assert "this run's have 16 (another batch size or limit): from epoch 2 on, each has 16" in capsys.readouterr().err
    assert _steps(run / "checkpoints") == [8, 24, 28]  # epoch 1 trained no batch again: epoch 2 ended at 8 + 16
    assert Checkpointer(str(run / "checkpoints"), read_only=True).read_meta(24)["epoch"] == 2

    with pytest.raises(ValueError, match=r"Checkpoint 28 .*saved mid-epoch \(epoch 3, after batch 4 of 16\), and this "
                                         r"run's epochs have 8 batches.*\(steps there: 8, 24\)"):
        _trainer(run).train_model(*_loaders(), num_epochs=3, resume=True)
    assert "Resumed from" not in capsys.readouterr().err
    resumed = _trainer(run)
    resumed.train_model(*_loaders(), num_epochs=3, resume_from=run / "checkpoints" / "24")  # a listed one: taken
    assert resumed.global_step == 32 and _steps(run / "checkpoints") == [8, 24, 32]


def test_a_rewind_moves_the_later_tests_results_aside_and_keeps_the_earlier_ones(tmp_path):
    """A rewind left the abandoned branch's metrics/test.json in the run (its metrics.csv row
    dropped), so the rewound run's next test() was saved as test.2.json."""
    run = tmp_path / "run"
    train, val = _loaders()
    _trainer(run).train_model(train, val, test_loader=val, num_epochs=2)  # test.json: logged at step 16
    early = RegressTrainer.load_from_checkpoint(run / "checkpoints" / "8", exmp_input=X0, enable_progress_bar=False)
    early.test(val, name="early")  # test_early.json: checkpoint 8's, logged at step 8
    RegressTrainer.load_from_checkpoint(run, exmp_input=X0, which="last", enable_progress_bar=False).test(
        val, name="late")  # test_late.json: logged at step 16
    files = _files(run / "metrics")
    assert {"test.json", "test_early.json", "test_late.json"} <= set(files)

    rewound = _trainer(run)
    rewound.train_model(train, val, num_epochs=1, resume_from=run / "checkpoints" / "8")
    aside = run / "abandoned" / "after_step_8" / "metrics"
    assert sorted(os.listdir(run / "metrics")) == ["best_eval.json", "eval_epoch_001.json", "test_early.json"]
    assert {name: files[name] for name in ("test.json", "test_late.json")} == {
        name: (aside / name).read_bytes() for name in ("test.json", "test_late.json")}
    rewound.test(val)
    assert (run / "metrics" / "test.json").is_file() and not (run / "metrics" / "test.2.json").exists()
