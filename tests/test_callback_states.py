"""Callbacks' own states in checkpoints, stopping before an epoch, and a run that kept no best."""

from __future__ import annotations

import collections.abc
import datetime
import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import flaxlight
from conftest import RegressTrainer, TinyMLP, linear_data, quiet
from flaxlight.callbacks import EarlyStopping, ModelCheckpoint


def _trainer(tmp_path, callbacks, **kwargs):
    x, _ = linear_data(8)
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                          optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1],
                          callbacks=callbacks, **quiet(tmp_path, **kwargs))


class Remembers(flaxlight.Callback):
    """A state with the types a user keeps: int keys, tuples, sets, a JAX scalar."""

    def __init__(self):
        self.per_epoch, self.seen_steps, self.last = {}, set(), None

    def on_validation_end(self, trainer, epoch, metrics):
        self.per_epoch[epoch] = (trainer.global_step, round(float(metrics["val/loss"]), 3))
        self.seen_steps.add(trainer.global_step)
        self.last = jnp.float32(metrics["val/loss"])

    def state_dict(self):
        return {"per_epoch": self.per_epoch, "seen_steps": self.seen_steps, "last": self.last}

    def load_state_dict(self, state):
        self.per_epoch, self.seen_steps, self.last = state["per_epoch"], state["seen_steps"], state["last"]


class CrashAfterEpoch(flaxlight.Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, trainer, epoch):
        if epoch == self.epoch:
            raise RuntimeError("crash")


def test_a_callback_state_comes_back_from_a_resume_with_its_types(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    whole = Remembers()
    _trainer(tmp_path / "whole", [whole]).train_model(train, val, num_epochs=3)

    with pytest.raises(RuntimeError, match="crash"):
        _trainer(tmp_path / "resumed", [Remembers(), CrashAfterEpoch(2)], logger_params={
            "log_dir": str(tmp_path / "resumed")}).train_model(train, val, num_epochs=3)
    resumed = Remembers()
    _trainer(tmp_path / "resumed", [resumed], logger_params={"log_dir": str(tmp_path / "resumed")}).train_model(
        train, val, num_epochs=3, resume=True)
    assert resumed.per_epoch == whole.per_epoch and sorted(resumed.per_epoch) == [1, 2, 3]
    assert all(isinstance(value, tuple) for value in resumed.per_epoch.values())
    assert resumed.seen_steps == whole.seen_steps == {8, 16, 24}
    assert float(resumed.last) == float(whole.last)


class KeepsADate(flaxlight.Callback):
    def __init__(self):
        self.started = None

    def on_fit_start(self, trainer):
        self.started = datetime.datetime(2026, 1, 1)

    def state_dict(self):
        return {"started": self.started}


def test_a_callback_state_a_checkpoint_cannot_keep_fails_at_the_save_naming_it(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [KeepsADate()])
    with pytest.raises(TypeError, match=r"KeepsADate.state_dict\(\)\['started'\] holds a datetime.datetime"):
        trainer.train_model(train, val, num_epochs=2)
    assert trainer.global_step == 8  # the first save, at the first epoch's end: not after the whole run


def test_a_value_a_checkpoint_cannot_keep_is_named_by_its_place_in_the_state():
    from flaxlight.resume import decode_state, encode_state

    when = datetime.datetime(2026, 1, 1)
    with pytest.raises(TypeError, match=r"^Keeps.state_dict\(\)\['log'\]\[1\]\['when'\] holds a datetime.datetime"):
        encode_state({"log": [1.0, {"when": when}]}, "Keeps.state_dict()")
    with pytest.raises(TypeError, match=r"^Keeps.state_dict\(\)\[3\]\[0\] key holds a datetime.datetime"):
        encode_state({3: ({when: 1},)}, "Keeps.state_dict()")
    rows = {"rows": [{"epoch": 1, "val/loss": 0.5, "note": None}, {"epoch": 2, "val/loss": np.float64(0.25)}]}
    encoded = encode_state(rows)
    assert decode_state(encoded) == rows and encoded["rows"][0] is not rows["rows"][0]  # a copy, not the rows

    class Doubled(dict):  # a dict of one's own is read through its items(), as any Mapping
        def items(self):
            return [(key, 2 * value) for key, value in super().items()]

    class Listed(collections.abc.Mapping):  # keys() as a list, and a lookup that never fails
        def __getitem__(self, key):
            return 1

        def __iter__(self):
            return iter(["a"])

        def __len__(self):
            return 1

        def keys(self):
            return ["a"]

    assert encode_state({"d": Doubled(a=1), "m": Listed()}) == {"d": {"a": 2}, "m": {"a": 1}}


class StopsBeforeEpoch(flaxlight.Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, epoch):
        if epoch == self.epoch:
            trainer.stop("no time for another epoch")


def test_stop_at_an_epochs_start_ends_the_run_with_its_state_saved(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [StopsBeforeEpoch(2)])
    trainer.train_model(train, val, num_epochs=4)
    assert trainer.global_step == 8 and trainer.stop_reason == "no time for another epoch"
    assert trainer.checkpointer.latest_step() == 8
    again = _trainer(tmp_path, [])
    again.train_model(train, val, num_epochs=3, resume=True)  # continues with epoch 2
    assert again.global_step == 24 and [row["epoch"] for row in again.history if "val/loss" in row] == [1, 2, 3]


def test_stop_before_the_first_epoch_trains_nothing(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [StopsBeforeEpoch(1)])
    trainer.train_model(train, val, num_epochs=2)
    assert trainer.global_step == 0


def test_best_asked_for_when_none_was_kept_warns_that_the_newest_is_used(tmp_path, regression_loaders):
    train, val, test = regression_loaders
    trainer = _trainer(tmp_path, [ModelCheckpoint(save_top_k=0)])
    with pytest.warns(RuntimeWarning, match=r"kept no checkpoint for its best validation \(ModelCheckpoint\(save_top_k=0"):
        trainer.train_model(train, val, test, num_epochs=2)
    with pytest.warns(RuntimeWarning, match="kept no checkpoint for its best validation"):
        RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=linear_data(8)[0][:1])


class FailsAtStep(flaxlight.Callback):
    every_n_steps = 1

    def __init__(self, at):
        self.at, self.logged = at, []

    def on_log(self, trainer, step, metrics):
        self.logged.append(step)

    def on_step(self, trainer, step):
        if step == self.at:
            raise RuntimeError("data error")


def test_a_failed_run_logs_the_log_points_it_marked_before_the_failure(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    failing = FailsAtStep(13)
    trainer = _trainer(tmp_path, [failing], log_every_n_steps=2)
    with pytest.raises(RuntimeError, match="data error"):
        trainer.train_model(train, val, num_epochs=3)
    with open(os.path.join(trainer.log_dir, "metrics.csv")) as f:
        header, *rows = [line.rstrip("\n").split(",") for line in f]
    steps = [int(row[header.index("step")]) for row in rows if row[header.index("train/loss_step")]]
    assert steps[-1] == 12 and failing.logged[-1] == 12


def test_a_checkpoint_monitor_on_a_train_metric_says_the_best_is_chosen_among_validation_metrics(
        tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [ModelCheckpoint(monitor="train/loss")])
    with pytest.raises(KeyError, match=r"chosen at each validation among the eval step's metrics \['val/loss'\].*"
                                       r"EarlyStopping\(monitor='train/loss'\)"):
        trainer.train_model(train, val, num_epochs=1)


def test_training_the_same_trainer_again_keeps_the_earlier_runs_checkpoints(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [])
    trainer.train_model(train, val, num_epochs=2)
    first = set(trainer.checkpointer.all_steps())
    trainer.train_model(train, val, num_epochs=2)  # a new run into the same folder
    trainer.checkpointer.wait()
    steps = set(trainer.checkpointer.all_steps())
    assert first <= steps and max(steps) == 32


def test_stop_at_an_epochs_start_with_a_test_loader_saves_the_trained_state_not_the_tested_best(
        tmp_path, regression_loaders):
    train, val, test = regression_loaders
    trainer = _trainer(tmp_path, [StopsBeforeEpoch(3)], monitor="val/loss")
    trainer.train_model(train, val, test, num_epochs=4)  # the test loads the best model afterwards
    again = _trainer(tmp_path, [])
    again.train_model(train, val, num_epochs=4, resume=True)
    assert again.global_step == 32


def test_a_resumed_second_run_still_leaves_the_earlier_runs_checkpoints_alone(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [])
    trainer.train_model(train, val, num_epochs=1)  # checkpoint 8: the first run's
    with pytest.raises(RuntimeError, match="crash"):
        trainer.callbacks.append(CrashAfterEpoch(1))
        trainer.train_model(train, val, num_epochs=3)  # a second run, crashed after its first epoch
    resumed = _trainer(tmp_path, [])
    resumed.train_model(train, val, num_epochs=3, resume=True)
    resumed.checkpointer.wait()
    assert 8 in resumed.checkpointer.all_steps()


def test_a_misspelt_trainer_monitor_fails_before_the_run_folder_is_written(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, [], monitor="val/los")
    with pytest.raises(KeyError, match="Did you mean 'val/loss'"):
        trainer.train_model(train, val, num_epochs=2)
    assert trainer.global_step == 0 and not (tmp_path / "run" / "hparams.yaml").exists()


def test_a_resume_with_changed_settings_says_what_changed_and_keeps_the_earlier_hparams(
        tmp_path, regression_loaders, caplog):
    train, val, _ = regression_loaders
    _trainer(tmp_path, []).train_model(train, val, num_epochs=1)
    _trainer(tmp_path, []).train_model(train, val, num_epochs=2, resume=True)  # the same settings: nothing kept
    assert not (tmp_path / "run" / "hparams.1.yaml").exists()
    x, _ = linear_data(8)
    faster = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                            optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, exmp_input=x[:1], **quiet(tmp_path))
    faster.train_model(train, val, num_epochs=3, resume=True)
    assert "optimizer_hparams.lr: 0.01 -> 0.03" in caplog.text and "kept as hparams.1.yaml" in caplog.text
    assert "lr: 0.01" in (tmp_path / "run" / "hparams.1.yaml").read_text()
    assert "lr: 0.03" in (tmp_path / "run" / "hparams.yaml").read_text()


def test_the_count_of_skipped_steps_goes_on_after_a_resume(tmp_path):
    x, y = linear_data(128)
    x[40] = np.nan  # one bad example: one skipped step per epoch (unshuffled batches of 16)
    train = flaxlight.ArrayLoader(x, y, batch_size=16)
    guard = flaxlight.callbacks.NaNGuard(action="skip")
    whole = _trainer(tmp_path / "whole", [guard], logger_params={"log_dir": str(tmp_path / "whole")})
    whole.train_model(train, None, num_epochs=3)
    with pytest.raises(RuntimeError, match="data error"):
        _trainer(tmp_path / "cut", [flaxlight.callbacks.NaNGuard(action="skip"), FailsAtStep(21),
                                    ModelCheckpoint(every_n_epochs=1)],
                 logger_params={"log_dir": str(tmp_path / "cut")}).train_model(train, None, num_epochs=3)
    resumed = _trainer(tmp_path / "cut", [flaxlight.callbacks.NaNGuard(action="skip"), ModelCheckpoint(every_n_epochs=1)],
                       logger_params={"log_dir": str(tmp_path / "cut")})
    resumed.train_model(train, None, num_epochs=3, resume=True)
    assert whole.nonfinite_steps == resumed.nonfinite_steps == 3


def test_a_monitor_an_eval_model_override_adds_is_not_refused_ahead(tmp_path, regression_loaders):
    class WithR2(RegressTrainer):
        def eval_model(self, data_loader, log_prefix="", *, batch_size=None):
            metrics = super().eval_model(data_loader, log_prefix, batch_size=batch_size)
            return {**metrics, f"{log_prefix}r2": 1.0 - metrics[f"{log_prefix}loss"]} if log_prefix else metrics

    train, val, _ = regression_loaders
    x, _ = linear_data(8)
    trainer = WithR2(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
                     optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path, monitor="val/r2", mode="max"))
    assert "val/r2" in trainer.train_model(train, val, num_epochs=1)


def test_a_function_in_the_hyperparameters_is_recorded_by_its_path_and_a_resume_sees_no_change(
        tmp_path, regression_loaders):
    import flax.linen as nn

    class WithActivation(nn.Module):
        act_fn: object = nn.relu

        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(1)(self.act_fn(nn.Dense(8)(x)))

    train, val, _ = regression_loaders
    x, _ = linear_data(8)
    for epochs, resume in ((1, False), (2, True)):
        RegressTrainer(model_class=WithActivation, model_hparams={"act_fn": nn.gelu}, exmp_input=x[:1],
                       optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path)).train_model(
            train, val, num_epochs=epochs, resume=resume)
    recorded = (tmp_path / "run" / "hparams.yaml").read_text()
    assert "gelu" in recorded and " at 0x" not in recorded  # its path, the same in every process
    assert not (tmp_path / "run" / "hparams.1.yaml").exists()


def test_a_checkpoint_monitor_in_a_run_without_validation_says_nothing_will_be_ranked(tmp_path, regression_loaders):
    train, _, _ = regression_loaders
    trainer = _trainer(tmp_path, [ModelCheckpoint(monitor="train/loss")])
    with pytest.warns(RuntimeWarning, match="ranks checkpoints at validations, and this run has no validation data"):
        trainer.train_model(train, None, num_epochs=1)
    assert trainer.checkpointer.latest_step() == 8  # the last state, still kept


class OwnLoad(RegressTrainer):
    loads = 0

    def load_model(self, step=None):
        OwnLoad.loads += 1
        super().load_model(step)


def test_an_own_load_model_is_used_by_test_of_a_trainer_loaded_for_inference(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    x, _ = linear_data(8)
    OwnLoad(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path)).train_model(train, val, num_epochs=1)
    loaded = OwnLoad.load_from_checkpoint(str(tmp_path / "run"), exmp_input=x[:1])
    before = OwnLoad.loads
    loaded.test(linear_data(40, 7), batch_size=32, which="last")
    assert OwnLoad.loads == before + 1


def test_a_stopper_added_at_a_resume_starts_fresh_and_the_one_before_gets_its_own_state_back(
        tmp_path, regression_loaders):
    """States were matched by class and position: an EarlyStopping put in front at the resume got
    the val/loss stopper's state (a loss as its best) and the val/loss stopper started again."""
    from conftest import SigtermAt

    train, val, _ = regression_loaders
    whole = EarlyStopping("val/loss", patience=5, min_delta=1e9)  # only the first validation improves
    _trainer(tmp_path / "whole", [whole], logger_params={"log_dir": str(tmp_path / "whole")}).train_model(
        train, val, num_epochs=3)
    run = {"logger_params": {"log_dir": str(tmp_path / "cut")}}
    with pytest.raises(SystemExit):  # SIGTERM in epoch 3: its checkpoint holds the state after epoch 2
        _trainer(tmp_path, [EarlyStopping("val/loss", patience=5, min_delta=1e9), SigtermAt(20),
                            ModelCheckpoint(every_n_epochs=1)], **run).train_model(train, val, num_epochs=3)
    added, old = EarlyStopping("train/loss", patience=2), EarlyStopping("val/loss", patience=5, min_delta=1e9)
    resumed = _trainer(tmp_path, [added, old, ModelCheckpoint(every_n_epochs=1)], **run)
    resumed.train_model(train, val, num_epochs=3, resume=True)
    assert old.state_dict() == whole.state_dict() and old.state_dict()["wait"] == 2
    assert added.state_dict() == {"best": resumed.history[-1]["train/loss"], "best_epoch": 3, "wait": 0,
                                  "monitor": "train/loss", "mode": "min"}
    assert resumed.stop_reason is None


def test_a_saved_state_no_callback_takes_is_named_in_a_warning(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    _trainer(tmp_path, [EarlyStopping("val/loss", patience=5)]).train_model(train, val, num_epochs=1)
    stopper = EarlyStopping("val/loss", mode="max", patience=5)  # another mode: another stopper
    with pytest.warns(RuntimeWarning, match=r"holds the state of \"EarlyStopping\{'monitor': 'val/loss', 'mode': "
                                            r"'min'\}\", which no callback of this run takes .* not restored\. This "
                                            r"run's callbacks with no saved state start fresh: \"EarlyStopping\{'"
                                            r"monitor': 'val/loss', 'mode': 'max'\}\""):
        _trainer(tmp_path, [stopper]).train_model(train, val, num_epochs=2, resume=True)
    assert stopper.best_epoch == 2  # its first validation


def test_states_of_an_earlier_flaxlight_named_by_class_and_position_restore_as_they_did():
    """Checkpoints written before state_key named states "EarlyStopping", "EarlyStopping_2", ... by
    position among the callbacks of a class: they restore by that position, as they did then (two
    stoppers of an earlier version's checkpoint lost their states, so a resumed run stopped later than
    the uninterrupted one)."""
    from flaxlight.resume import CheckpointMeta

    saved = {"EarlyStopping": {"best": 0.5, "best_epoch": 2, "wait": 1}, "Remembers": {"per_epoch": {}, "last": None,
                                                                                      "seen_steps": {"__set__": [8]}}}
    meta = CheckpointMeta.from_json({"step": 16, "callbacks": saved})  # no "state_keys": the earlier naming
    stopper, remembers = EarlyStopping("val/loss"), Remembers()
    meta.restore_callbacks([remembers, stopper])
    assert (stopper.best, stopper.best_epoch, stopper.wait) == (0.5, 2, 1) and remembers.seen_steps == {8}

    two = CheckpointMeta.from_json({"step": 16, "callbacks": {"EarlyStopping": {"best": 0.9, "wait": 1},
                                                              "EarlyStopping_2": {"best": 0.4, "wait": 0}}})
    stoppers = [EarlyStopping("val/acc", mode="max"), EarlyStopping("val/loss")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left over
        two.restore_callbacks(stoppers)
    assert [(stopper.best, stopper.wait) for stopper in stoppers] == [(0.9, 1), (0.4, 0)]


def test_an_early_stopping_refuses_a_state_saved_for_another_monitor():
    saved = EarlyStopping("val/loss")
    saved.best, saved.best_epoch, saved.wait = 1.5, 2, 1
    stopper = EarlyStopping("val/acc", mode="max")
    with pytest.warns(RuntimeWarning, match=r"EarlyStopping\(monitor='val/acc', mode='max'\) was given the state of "
                                            r"an EarlyStopping on 'val/loss' \(min, best 1\.5\).*starts fresh"):
        stopper.load_state_dict(saved.state_dict())
    assert (stopper.best, stopper.best_epoch, stopper.wait) == (None, None, 0)
    stopper.load_state_dict({"best": 0.5, "best_epoch": 1, "wait": 1})  # an earlier flaxlight's: kept no monitor
    assert stopper.best == 0.5


def test_a_callback_names_its_own_state_key():
    class Smoother(flaxlight.Callback):
        def __init__(self, metric):
            self.metric, self.value = metric, None

        @property
        def state_key(self):
            return f"Smoother[{self.metric}]"

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    from flaxlight.resume import CheckpointMeta

    meta = CheckpointMeta.from_json({"step": 8, "state_keys": True, "callbacks": {
        "Smoother[val/loss]": {"value": 1.0}, "Smoother[train/loss]": {"value": 2.0}}})
    train_smoother, val_smoother = Smoother("train/loss"), Smoother("val/loss")
    meta.restore_callbacks([val_smoother, train_smoother])  # another order than when saved
    assert (train_smoother.value, val_smoother.value) == (2.0, 1.0)
