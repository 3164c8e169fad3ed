"""What the best model and ModelCheckpoint rank by: the eval step's metrics, and those a hook or a
callback logs during the validation (as Lightning ranks by anything logged before its checkpoint
callback); a monitor name checked before training where it can be known."""

from __future__ import annotations

import csv
import json
import os
import warnings

import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight.callbacks import EarlyStopping, ModelCheckpoint
from flaxlight.options import MetricNotLoggedError

F1 = [0.5, 0.7, 0.6, 0.9, 0.8]  # a validation metric of the user's (an sklearn F1, say), by epoch
BEST_STEPS = [32, 40]  # epochs 4 and 5 (8 steps each): the two highest


def _trainer(tmp_path, callbacks=(), trainer_class=RegressTrainer, **kwargs):
    x, _ = linear_data(8)
    return trainer_class(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
                         optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, callbacks=list(callbacks),
                         **quiet(tmp_path, **kwargs))


class LogsF1(flaxlight.Callback):
    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"val/f1": F1[epoch - 1]})


class LogsF1FromTheHook(RegressTrainer):
    def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader):
        self.log_metrics({"val/f1": F1[epoch_idx - 1]})


def _orbax_scores(run):
    """``{step: the metrics orbax keeps with it}`` for the checkpoints of ``run``."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(best_fn=lambda metrics: metrics["val/f1"], best_mode="max", read_only=True)
    with ocp.CheckpointManager(str(run / "checkpoints"), options=options) as manager:
        return {info.step: info.metrics for info in manager._checkpoints}, manager.best_step()


@pytest.mark.parametrize("where", ["callback", "hook"])
def test_a_validation_metric_logged_with_log_metrics_ranks_the_checkpoints_and_the_best_model(
        tmp_path, regression_loaders, where):
    """It was refused: before training ("val/f1 ... was never logged", from a callback) or at the
    first validation (from the hook), with val/f1 already in metrics.csv."""
    train, val, _ = regression_loaders
    checkpoint = ModelCheckpoint(monitor="val/f1", mode="max", save_top_k=2, save_last=False)
    if where == "callback":
        trainer = _trainer(tmp_path, [LogsF1(), checkpoint])
    else:
        trainer = _trainer(tmp_path, [checkpoint], trainer_class=LogsF1FromTheHook)
    result = trainer.train_model(train, val, num_epochs=5)
    trainer.checkpointer.wait()
    assert result["val/f1"] == 0.9 and trainer.options.monitor == "val/f1"
    assert sorted(trainer.checkpointer.all_steps()) == sorted(BEST_STEPS) and checkpoint.best_step == 32
    scores, best = _orbax_scores(tmp_path / "run")
    assert best == 32 and scores == {32: {"val/f1": 0.9}, 40: {"val/f1": 0.8}}  # the scores logged
    best_eval = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    assert best_eval["val/f1"] == 0.9
    with open(tmp_path / "run" / "metrics.csv") as f:
        logged = [float(row["val/f1"]) for row in csv.DictReader(f) if row.get("val/f1")]
    assert logged == F1


def test_the_trainers_monitor_on_a_callbacks_metric_picks_the_best_model_after_that_callback(
        tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class ReadsBest(flaxlight.Callback):
        def __init__(self):
            self.answers = []

        def on_validation_end(self, trainer, epoch, metrics):
            self.answers.append(trainer.is_best_validation)

    reads = ReadsBest()
    trainer = _trainer(tmp_path, [LogsF1(), reads], monitor="val/f1", mode="max")
    assert trainer.train_model(train, val, num_epochs=5)["val/f1"] == 0.9
    assert reads.answers == [True, True, False, True, False]
    assert trainer.validation_metrics["val/f1"] == 0.8 and "val/loss" in trainer.validation_metrics


def test_a_monitor_logged_at_an_earlier_validation_only_is_not_said_to_be_never_logged(tmp_path, regression_loaders):
    class LogsF1EveryOtherEpoch(LogsF1):  # an expensive metric, computed every other validation
        def on_validation_end(self, trainer, epoch, metrics):
            if epoch % 2:
                super().on_validation_end(trainer, epoch, metrics)

    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [LogsF1EveryOtherEpoch(), ModelCheckpoint(monitor="val/f1", mode="max")])
    with pytest.raises(MetricNotLoggedError) as info:
        trainer.train_model(train, val, num_epochs=2)
    message = str(info.value)
    assert "never logged" not in message and trainer.global_step == 16  # the second validation
    assert message.startswith("The best model is picked by monitor 'val/f1', which is logged, but not during this "
                              "validation: the best model (and ModelCheckpoint's ranking) is chosen at each validation "
                              "among the eval step's metrics ['val/loss'] and the values logged during the validation.")
    assert "a callback's on_validation_end (ModelCheckpoint runs after the other callbacks" in message


def test_a_lightning_style_val_loss_monitor_is_refused_before_training_with_the_right_name(
        tmp_path, regression_loaders):
    """monitor="val_loss" failed after a whole epoch (rows written), saying to use
    EarlyStopping(monitor='val_loss') for "a train metric"."""
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [ModelCheckpoint(monitor="val_loss")])
    with pytest.raises(MetricNotLoggedError) as info:
        trainer.train_model(train, val, num_epochs=2)
    message = str(info.value)
    assert "Did you mean 'val/loss'?" in message and "names validation metrics 'val/<name>'" in message
    assert "EarlyStopping" not in message and "train metric" not in message
    assert trainer.global_step == 0 and not os.path.exists(tmp_path / "run" / "metrics.csv")


def test_a_val_loss_monitor_beside_a_callback_that_logs_is_looked_for_at_the_first_validation(
        tmp_path, regression_loaders):
    """A callback of the user's may log any name during validation: the name is not refused ahead, and
    the first validation without it says what was meant."""
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [LogsF1(), ModelCheckpoint(monitor="val_loss")])
    with pytest.raises(MetricNotLoggedError, match=r"'val_loss'.*Did you mean 'val/loss'\?"):
        trainer.train_model(train, val, num_epochs=2)
    assert trainer.current_epoch == 1


class LogsValLossTheLightningWay(RegressTrainer):
    def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader):
        self.log_metrics({"val_loss": float(eval_metrics["val/loss"]) + epoch_idx})  # worse each epoch


def test_a_val_loss_the_users_hook_logs_ranks_the_best_model(tmp_path, regression_loaders):
    """A hook logging "val_loss" itself (Lightning's self.log("val_loss", ...)) and monitoring it was
    refused before training as a misspelling of val/loss."""
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, trainer_class=LogsValLossTheLightningWay, monitor="val_loss")
    best = trainer.train_model(train, val, num_epochs=3)
    assert best["val_loss"] == pytest.approx(float(best["val/loss"]) + 1)  # the first epoch's: lowest val_loss


def test_a_monitor_nothing_can_log_is_refused_before_training_and_one_a_callback_may_log_is_not(
        tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path / "a", [ModelCheckpoint(monitor="val/f1", mode="max")])
    with pytest.raises(MetricNotLoggedError, match=r"'val/f1', which no validation of this run logs: it is not among "
                                                   r"the eval step's metrics \['val/loss'\], and nothing of yours runs"):
        trainer.train_model(train, val, num_epochs=1)
    assert trainer.global_step == 0

    class LogsF1FromTheSecondEpoch(flaxlight.Callback):
        def on_validation_end(self, trainer, epoch, metrics):
            if epoch > 1:
                trainer.log_metrics({"val/f1": F1[epoch - 1]})

    late = _trainer(tmp_path / "b", [LogsF1FromTheSecondEpoch(), ModelCheckpoint(monitor="val/f1", mode="max")])
    with pytest.raises(MetricNotLoggedError, match=r"'val/f1', which was never logged"):
        late.train_model(train, val, num_epochs=2)
    assert late.global_step == 8  # looked for at the first validation, where it is missing


def test_early_stopping_and_the_checkpoint_agree_on_a_callbacks_metric(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    stopper = EarlyStopping("val/f1", mode="max", patience=1)
    trainer = _trainer(tmp_path, [LogsF1(), stopper, ModelCheckpoint(monitor="val/f1", mode="max")])
    result = trainer.train_model(train, val, num_epochs=5)
    assert trainer.current_epoch == 3 and result["val/f1"] == 0.7 and stopper.best == 0.7


def test_an_early_stopping_on_val_loss_is_refused_before_training_with_the_right_name(tmp_path, regression_loaders):
    """EarlyStopping(monitor="val_loss") failed only at the first validation, after an epoch."""
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [flaxlight.callbacks.EarlyStopping(monitor="val_loss")])
    with pytest.raises(MetricNotLoggedError, match=r"EarlyStopping monitors 'val_loss', which is not a metric of this "
                                                   r"run.*Did you mean 'val/loss'\? Pass EarlyStopping\(monitor="
                                                   r"'val/loss'\)"):
        trainer.train_model(train, val, num_epochs=2)
    assert trainer.global_step == 0 and not os.path.exists(tmp_path / "run" / "metrics.csv")
    _trainer(tmp_path / "b", [flaxlight.callbacks.EarlyStopping(monitor="train/loss")]).train_model(
        train, val, num_epochs=1)  # any other logged name is looked for as before


R2 = [0.1, 0.2, 0.3, 0.4, 0.5]  # another validation metric of the user's, by epoch


class LogsR2(flaxlight.Callback):
    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"val/r2": R2[epoch - 1], "val_examples": 64})  # any name logged then


class LogsFromTheHook(RegressTrainer):  # the seed's hook, e.g. an sklearn score over the validation set
    def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader):
        self.log_metrics({"val/hook_r2": -R2[epoch_idx - 1]})


class KeepsBest(flaxlight.loggers.Logger):
    """What the loggers' ``log_best_metrics`` (TensorBoard's ``best/*``) is given."""

    best = None

    def log_best_metrics(self, metrics, step):
        self.best = dict(metrics)


def _validation_files(run):
    return {int(path.stem.rsplit("_", 1)[1]): json.loads(path.read_text())
            for path in (run / "metrics").glob("eval_epoch_*.json")}


@pytest.mark.parametrize("monitor, mode", [("val/loss", "min"), ("val/f1", "max")])
def test_the_best_validations_record_holds_everything_logged_during_it(tmp_path, regression_loaders, monitor, mode):
    """best_eval.json, train_model's result and the loggers' best metrics held the eval step's
    metrics and the monitor only: what a callback's on_validation_end or the trainer's
    on_validation_epoch_end logged (per-task sklearn scores) was missing, though the validation's
    eval_epoch_N.json holds it; for an eval-step monitor, the best was kept before the callbacks ran."""
    train, val, _ = regression_loaders
    logger = KeepsBest()
    trainer = _trainer(tmp_path, [LogsR2(), LogsF1()], trainer_class=LogsFromTheHook, monitor=monitor, mode=mode,
                       loggers=[logger])
    result = trainer.train_model(train, val, num_epochs=5)
    files = _validation_files(tmp_path / "run")
    pick = max if mode == "max" else min
    epoch = pick(files, key=lambda number: files[number][monitor])
    if monitor == "val/f1":
        assert epoch == 4  # the best model's choice is the one made before: after the callbacks logged it
    best_eval = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    assert best_eval == files[epoch] and {"val/r2", "val/hook_r2", "val_examples"} <= set(best_eval)
    assert best_eval["val/r2"] == R2[epoch - 1] and best_eval["val/hook_r2"] == -R2[epoch - 1]
    assert {key: result[key] for key in best_eval} == best_eval and "train/loss" in result
    assert logger.best == {key: float(value) for key, value in result.items()}


def test_a_resumed_runs_best_record_still_holds_what_callbacks_logged(tmp_path, regression_loaders):
    """The checkpoint's meta keeps the best record as kept: a resumed run whose best validation came
    before the resume returns (and its records name) what was logged during it."""
    train, val, _ = regression_loaders
    _trainer(tmp_path, [LogsR2(), LogsF1()], monitor="val/f1", mode="max").train_model(train, val, num_epochs=4)
    resumed = _trainer(tmp_path, [LogsR2(), LogsF1()], monitor="val/f1", mode="max")
    result = resumed.train_model(train, val, num_epochs=5, resume=True)
    assert result["val/f1"] == 0.9 and result["val/r2"] == R2[3] and result["val_examples"] == 64
    best_eval = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    assert best_eval == _validation_files(tmp_path / "run")[4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the records and the checkpoints name the same best validation
        loaded = RegressTrainer.load_from_checkpoint(str(tmp_path / "run"), exmp_input=linear_data(8)[0][:1])
    assert loaded.global_step == 32


class ScoresByStep(RegressTrainer):
    """Adds ``score`` = -(step - 16)**2: at the validations of epochs 1-3 (8 steps each), -64, 0, -64."""

    def loss_fn(self, params, batch, *, train, rng, state):
        import jax.numpy as jnp

        loss, (metrics, updates) = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return loss, ({**metrics, "score": -(state.step.astype(jnp.float32) - 16) ** 2}, updates)


class RelogsScore(flaxlight.Callback):
    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"val/score": metrics["val/score"] - 1000})  # the monitor's name, another scale


def test_a_callback_relogging_the_monitors_name_leaves_the_choice_of_the_best_as_it_was(tmp_path, regression_loaders):
    """The best is chosen on the eval step's val/score, but the best record kept the callback's value
    (-1000 at epoch 2): epoch 3's -64 then beat it, and the last validation always won."""
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [RelogsScore()], trainer_class=ScoresByStep, monitor="val/score", mode="max")
    result = trainer.train_model(train, val, num_epochs=3)
    assert [row["val/score"] for row in trainer.history] == [-1064.0, -1000.0, -1064.0]  # what the callback logged
    assert trainer.checkpoint_callback.best_model_path == str(tmp_path / "run" / "checkpoints" / "16")
    loaded = ScoresByStep.load_from_checkpoint(str(tmp_path / "run"), exmp_input=linear_data(8)[0][:1], which="best")
    assert loaded.global_step == 16
    best_eval = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    assert best_eval["val/score"] == result["val/score"] == 0.0  # the value the choice was made on
