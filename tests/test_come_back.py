"""Coming back to yesterday's runs: a resume with another batch size (the learning-rate schedule
spans the whole run), a resume with nothing left to train (nothing written), a run killed with
``kill -9`` (its records name a best no checkpoint holds; a resume sets them aside), a ``version_N``
run resumed by its folder (no "settings differ"), and ``overwrite=True`` (the replaced run's
predictions and export go with its other files)."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import RegressTrainer, StopAt, TinyMLP, linear_data

import flaxlight
from flaxlight import cli
from flaxlight.callbacks import LearningRateMonitor, ModelCheckpoint

X0 = linear_data(1)[0]
LR, END = 1e-2, 1e-2 * 0.01  # the default warmup_cosine ends at 1% of the peak


def _trainer(log_dir, lr=LR, callbacks=None, optimizer=None, logger_params=None, **options):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                          optimizer_hparams={"optimizer": "adam", "lr": lr, **(optimizer or {})}, exmp_input=X0,
                          logger_params=logger_params or {"log_dir": str(log_dir), "logger_type": "csv"},
                          enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **options)


def _loaders(batch_size=32):
    """256 examples: 8 batches per epoch at batch size 32, 16 at 16."""
    return (flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=batch_size, shuffle=True, seed=0),
            flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32))


def _digests(folder) -> dict[str, str]:
    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _rates(run) -> dict[int, float]:
    with open(Path(run) / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/lr"]) for row in csv.DictReader(f) if row.get("train/lr")}


def _json(path) -> dict:
    return json.loads(Path(path).read_text())


# ----------------------------------------------------------------- 1. another batch size: the schedule's length
@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_resume_with_another_batch_size_ends_the_schedule_at_its_end_value(tmp_path, caplog, accumulate):
    """5 epochs of 8 batches (40 steps), resumed from the epoch-end checkpoint with batch size 16 for
    7 epochs: the run takes 40 + 2 x 16 = 72 steps, and its schedule spans them (it spanned 7 x 16 =
    112, so the run ended far above end_lr). Accumulating 3 batches per update: 5 x 3 + 2 x 6 = 27
    updates, the epochs before the change counted with their own length."""
    optimizer = {"accumulate_grad_batches": accumulate}
    _trainer(tmp_path / "run", optimizer=optimizer).train_model(*_loaders(32), num_epochs=5)
    resumed = _trainer(tmp_path / "run", optimizer=optimizer, callbacks=[LearningRateMonitor()], log_every_n_steps=8)
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        resumed.train_model(*_loaders(16), num_epochs=7, resume=True)
    assert resumed.global_step == 72
    assert "spanned 40 steps and this run's spans 72" in caplog.text
    assert resumed.optimizer_plan.num_updates == (72 if accumulate == 1 else 27)
    rates = _rates(tmp_path / "run")
    assert rates[72] == pytest.approx(END, rel=1e-4)  # the monitor's last rate: the schedule's end
    assert rates[56] > rates[64] > rates[72]
    assert float(flaxlight.current_learning_rate(resumed.state)) == pytest.approx(END, rel=1e-4)  # the optimizer's


def test_the_cli_resume_with_another_batch_size_spans_the_whole_run(tmp_path, capsys):
    """flaxlight fit --resume RUN data.batch_size=...: 2 epochs of 20 batches, then 1 of 10."""
    sine = Path(__file__).resolve().parents[1] / "examples" / "configs" / "sine_regression.yaml"
    short = ["trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1", "data.batch_size=50",
             "data.eval_batch_size=500", "trainer.enable_progress_bar=false"]
    run = tmp_path / "run"
    assert cli.main([str(a) for a in ["fit", "-c", sine, *short, "--log-dir", run]]) == 0
    capsys.readouterr()
    assert cli.main([str(a) for a in ["fit", "-c", run / "config.yaml", "--resume", run, "trainer.max_epochs=3",
                                      "data.batch_size=100"]]) == 0
    assert "spanned 40 steps and this run's spans 50" in capsys.readouterr().err


def test_a_run_resumed_twice_keeps_the_length_of_its_epochs_before_the_change(tmp_path):
    """19 -> 38 batches per epoch, then resumed again at 38: the schedule still counts the first
    epochs at their length (with accumulation their updates differ), so both resumes fit one run."""
    optimizer = {"accumulate_grad_batches": 3}
    _trainer(tmp_path / "run", optimizer=optimizer).train_model(*_loaders(32), num_epochs=2)
    _trainer(tmp_path / "run", optimizer=optimizer).train_model(*_loaders(16), num_epochs=3, resume=True)
    again = _trainer(tmp_path / "run", optimizer=optimizer)
    again.train_model(*_loaders(16), num_epochs=4, resume=True)
    assert again.global_step == 2 * 8 + 2 * 16
    assert again.optimizer_plan.num_updates == 2 * 3 + 2 * 6
    assert float(flaxlight.current_learning_rate(again.state)) == pytest.approx(END, rel=1e-4)


def test_a_run_loaded_with_its_optimizer_after_a_batch_size_change_has_the_runs_schedule(tmp_path):
    """load_from_checkpoint(with_optimizer=True) rebuilds the run's schedule: with accumulation its
    updates count the epochs before the change at their own length (it counted 26 of the 27)."""
    optimizer = {"accumulate_grad_batches": 3}
    _trainer(tmp_path / "run", optimizer=optimizer).train_model(*_loaders(32), num_epochs=5)
    resumed = _trainer(tmp_path / "run", optimizer=optimizer)
    resumed.train_model(*_loaders(16), num_epochs=7, resume=True)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which="last", with_optimizer=True)
    assert loaded.optimizer_plan.num_updates == resumed.optimizer_plan.num_updates == 5 * 3 + 2 * 6
    assert float(flaxlight.current_learning_rate(loaded.state)) == pytest.approx(END, rel=1e-4)


def test_a_resume_with_the_same_batch_size_is_still_bitwise_an_uninterrupted_run(tmp_path):
    straight = _trainer(tmp_path / "straight")
    straight.train_model(*_loaders(), num_epochs=6)
    _trainer(tmp_path / "run", callbacks=[StopAt(24)]).train_model(*_loaders(), num_epochs=6)  # stopped after epoch 3
    resumed = _trainer(tmp_path / "run")
    resumed.train_model(*_loaders(), num_epochs=6, resume=True)
    assert resumed.optimizer_plan.total_steps == straight.optimizer_plan.total_steps == 48
    for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------- 2. nothing left to train
@pytest.mark.parametrize("how", ["resume", "resume_from", "max_steps"])
def test_a_resume_with_nothing_left_to_train_writes_nothing_and_says_so(tmp_path, caplog, how):
    """A finished 3-epoch run (lr 1e-2) called again with another lr and the same (or a smaller)
    length: nothing trains, so hparams.yaml, its events and records stay as they were, as the CLI's
    'Nothing to train'; the trainer holds the run's last model and returns its best."""
    run = tmp_path / "run"
    best = _trainer(run, max_steps=24 if how == "max_steps" else None).train_model(*_loaders(), num_epochs=3)
    before = _digests(run)
    again = _trainer(run, lr=2e-3, max_steps=24 if how == "max_steps" else None)
    kwargs = {"resume_from": str(run)} if how == "resume_from" else {"resume": True}
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        result = again.train_model(*_loaders(), num_epochs={"resume": 3, "resume_from": 2, "max_steps": 9}[how], **kwargs)
    assert _digests(run) == before
    assert not (run / "hparams.1.yaml").exists() and "lr: 0.01" in (run / "hparams.yaml").read_text()
    assert "Nothing to train" in caplog.text and "nothing was run or written" in caplog.text
    assert "settings differ" not in caplog.text
    assert again.global_step == 24 and result["val/loss"] == best["val/loss"]


def test_a_resume_none_of_whose_epochs_is_validated_says_the_best_model_stays(tmp_path, caplog):
    """check_val_every_n_epoch=2: a run of 2 epochs resumed to 3 trains epoch 3 unvalidated, and
    its test tests epoch 2's model again: said; resumed to 4, epoch 4 is validated: nothing said."""
    run = tmp_path / "run"
    _trainer(run, check_val_every_n_epoch=2).train_model(*_loaders(), num_epochs=2)
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        _trainer(run, check_val_every_n_epoch=2).train_model(*_loaders(), num_epochs=3, resume=True)
    assert "This resume trains epoch 3, and none is validated (check_val_every_n_epoch=2)" in caplog.text
    assert "resume to num_epochs=4" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        _trainer(run, check_val_every_n_epoch=2).train_model(*_loaders(), num_epochs=4, resume=True)
    assert "none is validated" not in caplog.text


def test_a_trainer_whose_resume_had_nothing_to_train_tests_the_runs_best_model_into_the_run(tmp_path):
    """The message of a resume with nothing left to train says trainer.test(...) tests the run's
    best model again: it does, and the test's record joins the run's own, as after a resume that
    trains (it was refused as a new trainer's first record in another run's folder)."""
    run = tmp_path / "run"
    best = _trainer(run).train_model(*_loaders(), num_epochs=3)
    again = _trainer(run)
    again.train_model(*_loaders(), num_epochs=3, resume=True)
    tested = again.test(_loaders()[1])
    assert tested["test/loss"] == pytest.approx(best["val/loss"], rel=1e-6)  # the best model, on its validation data
    with open(run / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("test/loss")]
    assert [(int(row["step"]), float(row["test/loss"])) for row in rows] == [(24, pytest.approx(tested["test/loss"]))]


# ----------------------------------------------------------------- 3b and 4. a run killed with kill -9
KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from conftest import RegressTrainer, TinyMLP, linear_data
    import flaxlight

    class KillLater(flaxlight.Callback):
        # epoch 4: everything queued so far reaches the disk; the bests of epochs 5-7 wait for the
        # checkpoint writer's pause (seconds), and a kill -9 at the end of epoch 7 comes first
        def on_epoch_end(self, trainer, epoch):
            if epoch == 4:
                trainer.checkpointer.wait()
            if epoch == 7:
                trainer.logger.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={{"hidden_dims": [8]}},
                             optimizer_hparams={{"optimizer": "adam", "lr": 1e-2}}, exmp_input=linear_data(1)[0],
                             logger_params={{"log_dir": {run!r}, "logger_type": "csv"}}, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[KillLater()], monitor="val/loss", mode="min")
    train = flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32, shuffle=True, seed=0)
    trainer.train_model(train, flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32), num_epochs=20)
""")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run killed with SIGKILL at the end of epoch 7 whose newest checkpoint is of epoch 4 or
    before, while its records (metrics.csv, eval_epoch_005..007.json, best_eval.json) went on."""
    run = tmp_path_factory.mktemp("killed") / "run"
    script = run.parent / "train.py"
    script.write_text(KILLED_RUN.format(tests=str(Path(__file__).parent), run=str(run)))
    killed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    return run


@pytest.fixture
def killed(killed_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(killed_run, copy)
    return copy


def _on_disk(run) -> list[int]:
    return sorted(int(name) for name in os.listdir(Path(run) / "checkpoints") if name.isdigit())


def test_after_a_kill_the_best_checkpoint_loaded_is_said_to_be_older_than_the_records_best(killed):
    best_epoch = min(range(1, 8), key=lambda e: _json(killed / "metrics" / f"eval_epoch_{e:03d}.json")["val/loss"])
    assert _json(killed / "metrics" / "best_eval.json") == _json(killed / "metrics" / f"eval_epoch_{best_epoch:03d}.json")
    assert best_epoch > 4 and max(_on_disk(killed)) <= 4 * 8  # the run found a better model and died before saving it
    with pytest.warns(RuntimeWarning, match="name a better model than any checkpoint holds") as said:
        loaded = RegressTrainer.load_from_checkpoint(killed, exmp_input=X0)
    message = next(str(w.message) for w in said if "better model" in str(w.message))
    assert loaded.global_step in _on_disk(killed)
    assert f"best_eval.json is the validation of epoch {best_epoch} " in message
    assert f"Loading step {loaded.global_step}, the best checkpoint on disk" in message


def test_resuming_a_killed_run_sets_its_records_after_the_checkpoint_aside(killed, caplog):
    """The resume goes on from the newest checkpoint (epoch 4 or before): the dead branch's
    validation files and best go to abandoned/after_step_<N>/ (as a rewind's), so the run's
    metrics/ holds only the validations of the run it becomes."""
    step = max(_on_disk(killed))
    dead_branch = {name: (killed / "metrics" / name).read_bytes() for name in os.listdir(killed / "metrics")}
    trainer = _trainer(killed, monitor="val/loss", mode="min")
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        best = trainer.train_model(*_loaders(), num_epochs=5, resume=True)  # fewer epochs than the dead branch's 7
    assert sorted(name for name in os.listdir(killed / "metrics") if name.startswith("eval_")) == \
        [f"eval_epoch_{epoch:03d}.json" for epoch in range(1, 6)]
    assert _json(killed / "metrics" / "best_eval.json")["val/loss"] == best["val/loss"]
    aside = killed / "abandoned" / f"after_step_{step}"
    assert {name: (aside / "metrics" / name).read_bytes() for name in os.listdir(aside / "metrics")} == dead_branch
    assert "set aside in" in caplog.text and str(aside) in caplog.text
    assert f"went on after checkpoint {step} and ended (killed, or failed) before saving again" in caplog.text
    assert "save_last" not in caplog.text  # it kept its last checkpoints: this one was killed
    assert not (aside / "checkpoints").exists()  # no checkpoint came after the step


class Errors(flaxlight.Callback):
    """Logs ``val/error`` at each validation: the given value of each epoch (before ModelCheckpoint)."""

    def __init__(self, by_epoch):
        self.by_epoch = by_epoch

    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"val/error": self.by_epoch[epoch]})


def test_resuming_a_run_that_kept_only_its_best_says_so_not_that_it_was_killed(tmp_path, caplog):
    """Keras' ModelCheckpoint(save_best_only=True), ported as save_last=False: a finished run keeps
    its best checkpoint only, so resume=True goes on from the best epoch. The message said the run
    "ended (killed, or failed) before saving again" (Keras user's report)."""
    run = tmp_path / "run"
    errors = Errors({1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0, 5: 4.0})  # the best: epoch 2 (step 16)
    keep_best = lambda: [errors, ModelCheckpoint(monitor="val/error", mode="min", save_last=False)]  # noqa: E731
    _trainer(run, callbacks=keep_best()).train_model(*_loaders(), num_epochs=4)
    assert _on_disk(run) == [16]
    trainer = _trainer(run, callbacks=keep_best())
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        trainer.train_model(*_loaders(), num_epochs=5, resume=True)
    said = " ".join(caplog.text.split())
    assert (f"The run in {run} kept no last checkpoint (ModelCheckpoint(save_last=False): only the ones save_top_k "
            f"keeps), so it goes on from checkpoint 16, its best (the end of epoch 2), not from where it ended") in said
    assert "killed" not in said
    assert "keep ModelCheckpoint's save_last=True (the default: the best and the last checkpoint are kept)" in said
    assert trainer.global_step == 40 and [row["epoch"] for row in trainer.history] == [1, 2, 3, 4, 5]
    assert sorted(os.listdir(run / "abandoned" / "after_step_16" / "metrics")) == \
        ["best_eval.json"] + [f"eval_epoch_{epoch:03d}.json" for epoch in range(1, 5)]


@pytest.mark.parametrize("cut", [{"callbacks": [StopAt(24)]}, {"callbacks": [StopAt(20)]}, {"max_steps": 20}],
                         ids=["stop-at-epoch-end", "stop-mid-epoch", "max-steps-mid-epoch"])
def test_a_resume_after_a_clean_stop_sets_nothing_aside(tmp_path, caplog, cut):
    """A cut mid-epoch (stop(), max_steps) validates at the cut: that epoch's eval file was taken
    for a killed branch's record and set aside with a false 'killed' warning (a review)."""
    _trainer(tmp_path / "run", **cut).train_model(*_loaders(), num_epochs=6)
    with caplog.at_level(logging.WARNING):
        _trainer(tmp_path / "run").train_model(*_loaders(), num_epochs=6, resume=True)
    assert not (tmp_path / "run" / "abandoned").exists() and "killed" not in caplog.text
    assert sorted(os.listdir(tmp_path / "run" / "metrics")) == ["best_eval.json"] + [
        f"eval_epoch_{epoch:03d}.json" for epoch in range(1, 7)]


class LogsATrainValue(flaxlight.Callback):
    """Logs ``train/seen`` during each validation (a train-side value, not the epoch's train means)."""

    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"train/seen": float(epoch)})


def test_a_train_value_logged_during_validation_names_no_later_best(tmp_path, caplog):
    """best_eval.json keeps a callback's train/... value of the best validation, which the check of
    the checkpoint's best dropped: loading said the records name a better model, and a resume set
    the run's best_eval.json aside as a killed branch's."""
    _trainer(tmp_path / "run", callbacks=[LogsATrainValue()]).train_model(*_loaders(), num_epochs=2)
    assert "train/seen" in _json(tmp_path / "run" / "metrics" / "best_eval.json")
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
        _trainer(tmp_path / "run", callbacks=[LogsATrainValue()]).train_model(*_loaders(), num_epochs=3, resume=True)
    assert not (tmp_path / "run" / "abandoned").exists() and "killed" not in caplog.text


# ----------------------------------------------------------------- 5. a run's location is no setting
def test_resuming_a_versioned_or_moved_run_with_its_settings_writes_no_hparams_copy(tmp_path, caplog):
    first = _trainer(None, logger_params={"base_log_dir": str(tmp_path / "runs"), "logger_type": "csv"})
    first.train_model(*_loaders(), num_epochs=2)
    run = Path(first.log_dir)
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        _trainer(run).train_model(*_loaders(), num_epochs=3, resume=True)  # its folder named: the only way back
        moved = tmp_path / "moved"
        shutil.move(str(run), moved)
        _trainer(moved).train_model(*_loaders(), num_epochs=4, resume=True)
    assert "settings differ" not in caplog.text
    assert not list(moved.glob("hparams.*.yaml"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flaxlight"):  # a real change is still said and kept
        _trainer(moved, lr=3e-3).train_model(*_loaders(), num_epochs=5, resume=True)
    said = next(line for line in caplog.text.splitlines() if "settings differ" in line)
    assert "optimizer_hparams.lr: 0.01 -> 0.003" in said and "logger_params" not in said
    assert "lr: 0.01" in (moved / "hparams.1.yaml").read_text() and "lr: 0.003" in (moved / "hparams.yaml").read_text()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flaxlight"):  # only a longer run: information, not a warning
        _trainer(moved, lr=3e-3, max_steps=60).train_model(*_loaders(), num_epochs=8, resume=True)
        _trainer(moved, lr=3e-3, max_steps=62).train_model(*_loaders(), num_epochs=8, resume=True)
    said = [record for record in caplog.records if "settings differ" in record.getMessage()]
    assert said and all(record.levelno == logging.INFO for record in said), [r.getMessage() for r in said]


# ----------------------------------------------------------------- 6. overwrite: the replaced run's outputs
def test_overwrite_removes_the_replaced_runs_predictions_and_export(tmp_path):
    run = tmp_path / "run"
    old = _trainer(run)
    old.train_model(*_loaders(), num_epochs=2)
    x = linear_data(8, 3)[0]
    np.save(run / "predictions.npy", np.asarray(old.predict(x, batch_size=8)))  # flaxlight predict's default paths
    np.save(run / "predictions_val_last.npy", np.asarray(old.predict(x, batch_size=8)))
    old.export(run / "export")
    (run / "notes.txt").write_text("mine")  # not the run's: stays
    (run / "export_mine").mkdir()
    _trainer(run).train_model(*_loaders(), num_epochs=1, overwrite=True)
    left = sorted(os.listdir(run))
    assert not [name for name in left if name.startswith("predictions") or name == "export"], left
    assert (run / "notes.txt").read_text() == "mine" and (run / "export_mine").is_dir()


# ----------------------------------------------------------------- 6. a model set back by hand, then trained on
def test_training_on_from_an_older_checkpoint_of_the_run_is_refused_and_writes_nothing(tmp_path):
    """load_model() of the run's best (step 8) while the run's last is 48, then train_model: the new
    steps would land among the later branch's checkpoints and its epochs' records be rewritten
    (eval_epoch_001.json was): refused, naming the rewind and a new folder, which both work."""
    tr, va = _loaders(32)
    with pytest.warns(UserWarning, match="reads as a metric to minimize"):  # the highest loss: the first epoch's
        trainer = _trainer(tmp_path / "run", callbacks=[ModelCheckpoint(monitor="val/loss", mode="max")])
    trainer.train_model(tr, va, num_epochs=6)
    trainer.load_model()  # the best: the first epoch's (the highest loss)
    assert trainer.global_step == 8
    before = _digests(tmp_path / "run")
    with pytest.raises(FileExistsError, match=r"(?s)model is at step 8.*later checkpoints \(48\).*resume_from="):
        trainer.train_model(tr, va, num_epochs=2)
    assert _digests(tmp_path / "run") == before
    copy = RegressTrainer.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "8", exmp_input=X0,
                                               logger_params={"log_dir": str(tmp_path / "copy")})
    copy.train_model(tr, va, num_epochs=2)
    assert copy.global_step == 24 and _digests(tmp_path / "run") == before
    trainer.train_model(tr, va, num_epochs=3, resume_from=tmp_path / "run" / "checkpoints" / "8")
    assert trainer.global_step == 24 and (tmp_path / "run" / "abandoned" / "after_step_8" / "checkpoints" / "48").is_dir()


def test_a_second_train_model_call_goes_on_in_its_run_as_before(tmp_path):
    """The guard: a next call on a trainer at its run's newest step continues the run (epochs 3, 4)."""
    tr, va = _loaders(32)
    trainer = _trainer(tmp_path / "run")
    trainer.train_model(tr, va, num_epochs=2)
    trainer.train_model(tr, va, num_epochs=2)
    assert trainer.global_step == 32
    assert sorted(p.name for p in (tmp_path / "run" / "metrics").glob("eval_epoch_*.json"))[-1] == "eval_epoch_004.json"
