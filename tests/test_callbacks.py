"""Callbacks and loop controls, checked by what a user sees: hooks, files, messages."""

import csv
import os
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
import flaxlight.loop
from flaxlight import ArrayLoader
from flaxlight.resume import CheckpointMeta
from flaxlight.options import MetricNotLoggedError
from flaxlight.callbacks import (Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, NaNGuard,
                                 ThroughputMonitor, Timer)

X0 = np.zeros((1, 4), np.float32)


def _trainer(tmp_path, trainer_class=RegressTrainer, **kwargs):
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 1e-2})
    return trainer_class(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                         **quiet(tmp_path, **kwargs))


def _rows(tmp_path):
    with open(tmp_path / "run" / "metrics.csv") as f:
        return list(csv.DictReader(f))


class Recorder(Callback):
    every_n_steps = 4

    def __init__(self):
        self.calls = []

    def on_fit_start(self, trainer):
        self.calls.append("fit_start")

    def on_train_epoch_start(self, trainer, epoch):
        self.calls.append(f"train_epoch_start {epoch}")

    def on_step(self, trainer, step):
        self.calls.append(f"step {step}")

    def on_log(self, trainer, step, metrics):
        self.calls.append(f"log {step} {','.join(sorted(k for k in metrics if k != 'epoch'))}")

    def on_train_epoch_end(self, trainer, epoch, metrics):
        self.calls.append(f"train_epoch_end {epoch}")

    def on_validation_end(self, trainer, epoch, metrics):
        self.calls.append(f"validation_end {epoch}")

    def on_epoch_end(self, trainer, epoch):
        self.calls.append(f"epoch_end {epoch}")

    def on_test_end(self, trainer, metrics):
        self.calls.append("test_end")

    def on_fit_end(self, trainer):
        self.calls.append("fit_end")


class SeedHooks(RegressTrainer):
    def on_training_start(self):
        self.recorder.calls.append("seed on_training_start")

    def on_training_epoch_end(self, epoch_idx):
        self.recorder.calls.append(f"seed on_training_epoch_end {epoch_idx}")

    def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader):
        self.recorder.calls.append(f"seed on_validation_epoch_end {epoch_idx}")

    def on_training_end(self):
        self.recorder.calls.append("seed on_training_end")


GOLDEN = """\
seed on_training_start
fit_start
train_epoch_start 1
step 4
log 4 train/loss_step
step 8
log 8 train/loss_step
log 8 epoch_time,train/loss
seed on_training_epoch_end 1
train_epoch_end 1
epoch_end 1
train_epoch_start 2
step 12
log 12 train/loss_step
step 16
log 16 train/loss_step
log 16 epoch_time,train/loss
seed on_training_epoch_end 2
train_epoch_end 2
seed on_validation_epoch_end 2
log 16 val/loss
validation_end 2
epoch_end 2
train_epoch_start 3
step 20
log 20 train/loss_step
step 24
log 24 train/loss_step
log 24 epoch_time,train/loss
seed on_training_epoch_end 3
train_epoch_end 3
epoch_end 3
train_epoch_start 4
step 28
log 28 train/loss_step
step 32
log 32 train/loss_step
log 32 epoch_time,train/loss
seed on_training_epoch_end 4
train_epoch_end 4
seed on_validation_epoch_end 4
log 32 val/loss
validation_end 4
epoch_end 4
log 32 test/loss
test_end
seed on_training_end
fit_end"""


def test_golden_hook_order(tmp_path, regression_loaders):
    """Train 4 epochs of 8 steps, validate every 2 epochs, test: the full sequence of hook calls."""
    train, val, test = regression_loaders
    recorder = Recorder()
    trainer = _trainer(tmp_path, SeedHooks, callbacks=[recorder], check_val_every_n_epoch=2, log_every_n_steps=4,
                       enable_checkpointing=False)
    trainer.recorder = recorder
    trainer.train_model(train, val, test_loader=test, num_epochs=4)
    assert "\n".join(recorder.calls) == GOLDEN


def test_callbacks_run_in_the_order_given(tmp_path, regression_loaders):
    order = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_epoch_end(self, trainer, epoch):
            order.append(self.name)

    train, val, _ = regression_loaders
    _trainer(tmp_path, callbacks=[Named("b"), Named("a"), Named("c")]).train_model(train, val, num_epochs=1)
    assert order == ["b", "a", "c"]


def test_early_stopping_stops_and_says_why(tmp_path, regression_loaders, capsys):
    train, val, _ = regression_loaders
    stopper = EarlyStopping(monitor="val/loss", patience=2, min_delta=10.0)  # no improvement is ever big enough
    trainer = _trainer(tmp_path, callbacks=[stopper])
    trainer.train_model(train, val, num_epochs=10)
    assert trainer.current_epoch == 3  # best at 1, then patience 2: two epochs without improvement
    assert "EarlyStopping: val/loss did not improve" in capsys.readouterr().err
    assert stopper.state_dict()["wait"] == 2


def test_learning_rate_monitor_logs_the_schedule(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, callbacks=[LearningRateMonitor()], log_every_n_steps=4,
                       optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "warmup": 8})
    trainer.train_model(train, val, num_epochs=2)
    lrs = {int(r["step"]): float(r["train/lr"]) for r in _rows(tmp_path) if r.get("train/lr")}
    assert sorted(lrs) == [4, 8, 12, 16]
    assert lrs[4] == pytest.approx(0.5e-2)  # halfway through the linear warmup
    assert lrs[8] == pytest.approx(1e-2)
    assert lrs[16] < lrs[12] < lrs[8]  # cosine decay after the warmup


def test_learning_rate_monitor_logs_the_rate_in_effect_with_gradient_accumulation(tmp_path, regression_loaders):
    """Accumulating 4 batches per update: the schedule runs over updates, and so does the logged rate."""
    from flaxlight.optim import current_learning_rate

    class Recorder(Callback):
        every_n_steps = 4

        def __init__(self):
            self.rates = {}

        def on_step(self, trainer, step):
            self.rates[step] = float(current_learning_rate(trainer.state))

    train, val, _ = regression_loaders
    recorder = Recorder()
    trainer = _trainer(tmp_path, callbacks=[LearningRateMonitor(), recorder], log_every_n_steps=4,
                       optimizer_hparams={"optimizer": "sgd", "lr": 0.1, "schedule": "linear",
                                          "accumulate_grad_batches": 4})
    trainer.train_model(train, val, num_epochs=2)
    logged = {int(r["step"]): float(r["train/lr"]) for r in _rows(tmp_path) if r.get("train/lr")}
    assert logged == pytest.approx(recorder.rates) and len(set(logged.values())) == 4  # 4 updates, 4 rates


class RiseThenFall(RegressTrainer):
    """Adds a ``score`` metric that depends only on the completed epochs: 1, 3, 2 at the
    validations of epochs 1, 2, 3 (the highest at epoch 2, the lowest at epoch 1)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, (metrics, updates) = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        score = jnp.asarray([0.0, 1.0, 3.0, 2.0])[state.epoch]
        return loss, ({**metrics, "score": score}, updates)


@pytest.mark.parametrize("mode, best_step, best_score", [("max", 16, 3.0), ("min", 8, 1.0)])
def test_model_checkpoint_mode_decides_which_checkpoint_is_best(tmp_path, regression_loaders, mode, best_step,
                                                                 best_score):
    train, val, _ = regression_loaders
    checkpoint = ModelCheckpoint(monitor="val/score", mode=mode, save_top_k=1, save_last=False)
    trainer = _trainer(tmp_path, RiseThenFall, callbacks=[checkpoint])
    trainer.train_model(train, val, num_epochs=3)
    assert [float(r["val/score"]) for r in _rows(tmp_path) if r.get("val/score")] == [1.0, 3.0, 2.0]
    assert sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit()) == [best_step]
    assert checkpoint.best_step == best_step and checkpoint.best_metrics["val/score"] == best_score
    loaded = RiseThenFall.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which="best", callbacks=[])
    assert int(loaded.state.step) == best_step


class NaNAfterStep(RegressTrainer):
    """The loss becomes NaN from optimizer step ``nan_from`` on, and its gradient too (the params go NaN)."""

    nan_from = 10

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, aux = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return loss * jnp.where(state.step >= self.nan_from, jnp.nan, 1.0), aux


def test_nan_guard_stops_and_keeps_the_good_checkpoints(tmp_path, regression_loaders, capsys):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, NaNAfterStep, log_every_n_steps=2,
                       callbacks=[NaNGuard(), ModelCheckpoint(every_n_steps=4)])
    with pytest.warns(RuntimeWarning, match="Not saving checkpoint"):
        trainer.train_model(train, val, num_epochs=5)
    assert "NaNGuard: the loss was NaN/Inf" in capsys.readouterr().err
    steps = sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints"))
    assert max(steps) <= 10 and trainer.current_epoch == 2


def test_nan_guard_skip_leaves_params_untouched_by_bad_steps(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    import jax

    class NaNFromSecondEpoch(NaNAfterStep):
        nan_from = 8

    trainer = _trainer(tmp_path, NaNFromSecondEpoch, callbacks=[NaNGuard(action="skip")])
    trainer.train_model(train, val, num_epochs=1)
    params_after_epoch_1 = jax.device_get(trainer.state.params)
    trainer.train_model(train, None, num_epochs=1)  # every step of this run is non-finite
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.state.params), params_after_epoch_1)
    assert int(trainer.state.step) == 16 and trainer.nonfinite_steps == 8  # skipped, but counted


class NaNLossAtStep(RegressTrainer):
    """One bad batch: the loss of the 6th step (state.step 5) is NaN, its gradient zero (the params stay finite)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, aux = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return jnp.where(train & (state.step == 5), jnp.nan, loss), aux


def test_a_nan_loss_with_a_finite_state_is_saved_said_once_and_advises_checking_the_data(tmp_path, regression_loaders,
                                                                                           capsys):
    """A bad batch (a label out of range) made one step's loss NaN while the model stayed finite: every save
    was refused ("the model is damaged") and the run ended with no checkpoint; NaNGuard advised a lower
    learning rate, and its "skip" dropped the step without a word."""
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path / "plain", NaNLossAtStep, log_every_n_steps=2,
                       callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_model(train, val, num_epochs=2)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "Not saving" not in said[0], said
    assert said[0].startswith("The loss was NaN/Inf in 1 step(s) of this run, the first between steps 5 and 6 "
                              "(epoch 1, batches 5-6), but the parameters and the optimizer state stayed finite")
    assert "check the data for labels out of range" in said[0]
    assert sorted(int(s) for s in os.listdir(tmp_path / "plain" / "run" / "checkpoints")) == [8, 16]
    NaNLossAtStep.load_from_checkpoint(tmp_path / "plain" / "run", exmp_input=X0)
    # Resumed, the run still knows where its first NaN was (it said "at or before step 16").
    resumed = _trainer(tmp_path / "plain", NaNLossAtStep, log_every_n_steps=2,
                       callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train_model(train, val, num_epochs=3, resume=True)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and said[0].startswith("The loss was NaN/Inf in 1 step(s) of this run, the first between "
                                                 "steps 5 and 6 (epoch 1, batches 5-6), but"), said
    assert resumed.nonfinite_first == "between steps 5 and 6 (epoch 1, batches 5-6)"
    old = flaxlight.loop.NonfiniteTally()  # a checkpoint from before the tally kept where the first was
    old.load_state_dict(CheckpointMeta.from_json({"step": 16, "nonfinite": [1, 0]}).nonfinite, 16)
    assert (old.steps, old.before_epoch, old.where_first()) == (1, 0, "between steps 1 and 16")

    stopping = _trainer(tmp_path / "stop", NaNLossAtStep, log_every_n_steps=2, callbacks=[NaNGuard()])
    stopping.train_model(train, val, num_epochs=2)
    assert "NaNGuard: the loss was NaN/Inf" in stopping.stop_reason
    assert "still finite" in stopping.stop_reason and "check the data" in stopping.stop_reason

    capsys.readouterr()
    _trainer(tmp_path / "skip", NaNLossAtStep, callbacks=[NaNGuard(action="skip")]).train_model(train, val, num_epochs=2)
    err = capsys.readouterr().err
    assert err.count("NaNGuard(action='skip') skipped") == 1  # once per epoch that had any
    assert "skipped 1 step(s) in epoch 1 (1 in all, up to step 8)" in err and "check the data" in err


def test_max_time_stops_training(tmp_path, regression_loaders, capsys):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, max_time=0.2)
    trainer.train_model(train, val, num_epochs=1000)
    assert trainer.current_epoch < 1000
    assert "Timer: the time budget" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_time"):
        Timer("soon")


def test_throughput_monitor_logs_rates_and_compile_time(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, callbacks=[ThroughputMonitor()], log_every_n_steps=4)
    trainer.train_model(train, val, num_epochs=2)
    rows = _rows(tmp_path)
    rates = [float(r["perf/samples_per_sec"]) for r in rows if r.get("perf/samples_per_sec")]
    assert len(rates) >= 3 and all(rate > 0 for rate in rates)
    compile_rows = [r for r in rows if r.get("perf/compile_time_s")]
    assert len(compile_rows) == 1 and float(compile_rows[0]["perf/compile_time_s"]) > 0


def test_progress_bar_shows_loss_on_a_terminal(tmp_path, regression_loaders, capsys, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # as on a terminal
    train, val, _ = regression_loaders
    _trainer(tmp_path, enable_progress_bar=True, log_every_n_steps=2).train_model(train, val, num_epochs=2)
    err = capsys.readouterr().err
    assert "Epochs" in err and "loss=" in err and "val/loss=" in err


def test_progress_in_a_log_file_is_one_plain_line_per_epoch(tmp_path, regression_loaders, capsys, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # stderr redirected to a file
    train, val, _ = regression_loaders
    _trainer(tmp_path, enable_progress_bar=True, log_every_n_steps=2).train_model(train, val, num_epochs=3)
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" (")[0] for line in lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert all("val/loss=" in line for line in lines)
    assert "\r" not in out + err and "\x1b[" not in out + err  # no bar redraws, no cursor moves
    # Resumed from the end of epoch 3: its restored end is not printed again, as an empty line (it was).
    _trainer(tmp_path, enable_progress_bar=True, log_every_n_steps=2).train_model(train, val, num_epochs=4,
                                                                                  resume=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" (")[0] for line in lines] == ["Epoch 4/4"] and "val/loss=" in lines[0]


def test_max_steps_stops_mid_epoch(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, max_steps=13)
    trainer.train_model(train, val, num_epochs=10)
    assert int(trainer.state.step) == 13 and trainer.current_epoch == 2
    with pytest.raises(ValueError, match="max_steps must be a positive int"):
        _trainer(tmp_path, max_steps=0)


def test_val_check_interval_validates_within_epochs(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    _trainer(tmp_path, val_check_interval=3).train_model(train, val, num_epochs=2)
    val_steps = [int(r["step"]) for r in _rows(tmp_path) if r.get("val/loss")]
    assert val_steps == [3, 6, 8, 9, 12, 15, 16]


def test_limit_batches(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, limit_train_batches=0.5, limit_val_batches=1)
    trainer.train_model(train, val, num_epochs=2)
    assert int(trainer.state.step) == 8  # 4 of 8 batches per epoch
    with pytest.warns(RuntimeWarning, match="limit_train_batches=100 is more than the loader's 8 batches"):
        _trainer(tmp_path / "second", limit_train_batches=100).train_model(train, val, num_epochs=1)


def test_fast_dev_run_touches_one_batch_and_writes_nothing(tmp_path, regression_loaders):
    train, val, test = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                             logger_params={"base_log_dir": str(tmp_path)}, enable_progress_bar=False,
                             enable_model_summary=False, fast_dev_run=True)
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=50)
    assert int(trainer.state.step) == 1 and "val/loss" in metrics and "test/loss" in metrics
    assert os.listdir(tmp_path) == []


class _CountedBatches:
    """The batches each pass served (the run's start peeks at the first batch: a pass of 1)."""

    def __init__(self, batches):
        self.batches, self.passes = batches, []

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.passes.append(0)
        for batch in self.batches:
            self.passes[-1] += 1
            yield batch


def test_fast_dev_run_n_runs_n_batches_of_each_and_refuses_other_values(tmp_path, regression_loaders):
    """Lightning's fast_dev_run=N: N train and N validation batches (an int was taken for True: 1 batch)."""
    train, _, _ = regression_loaders
    val = _CountedBatches([linear_data(8, seed) for seed in range(5)])
    test = _CountedBatches([linear_data(8, seed) for seed in range(5, 10)])
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                             logger_params={"base_log_dir": str(tmp_path)}, enable_progress_bar=False,
                             enable_model_summary=False, fast_dev_run=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "limit_val_batches=... is more than" for a short loader either
        trainer.train_model(train, val, test_loader=test, num_epochs=50)
    assert int(trainer.state.step) == 3 and val.passes[-1] == 3 and os.listdir(tmp_path) == []
    assert test.passes[-1] == 3  # the test loader's first 3 too, as Lightning's (it tested all 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a loader without len() with fewer batches: used whole, not warned of
        RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                       fast_dev_run=3, **quiet(tmp_path / "short")).train_model(iter(list(train)[:2]), num_epochs=5)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                             fast_dev_run=20, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=5)
    assert int(trainer.state.step) == 8 and val.passes[-1] == 5  # as many as each loader has, once
    for bad in ("yes", 1.0, -1):
        with pytest.raises(ValueError, match=r"fast_dev_run must be True or False, or an int N \(N train and N "
                                             r"validation batches.*; got"):
            RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                           fast_dev_run=bad, **quiet(tmp_path))


def test_bad_callback_settings_are_explained(tmp_path, regression_loaders):
    with pytest.raises(TypeError, match=r"Callback instances; got the string 'early_stopping'\. Build it: e\.g\. "
                                        r"flaxlight\.callbacks\.EarlyStopping\(monitor='val/loss', patience=3\)"):
        _trainer(tmp_path, callbacks=["early_stopping"])
    with pytest.raises(TypeError, match=r"got the class EarlyStopping itself: write EarlyStopping\(\.\.\.\)\."):
        _trainer(tmp_path, callbacks=[EarlyStopping])
    # two of them deleted each other's checkpoints, the best included, and test() got another model
    with pytest.raises(ValueError, match="2 ModelCheckpoint callbacks; give one: they share the run's checkpoints"):
        _trainer(tmp_path, callbacks=[ModelCheckpoint(monitor="val/loss", save_top_k=2),
                                      ModelCheckpoint(every_n_epochs=1, save_top_k=0)])
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        EarlyStopping(mode="lowest")
    with pytest.raises(ValueError, match="patience must be an int >= 0"):
        EarlyStopping(patience=-1)
    train, val, _ = regression_loaders
    with pytest.raises(MetricNotLoggedError, match=r"'val/acc', which no validation of this run logs: it is not "
                                                   r"among the eval step's metrics \['val/loss'\]") \
            as info:  # before training now; a KeyError too, printed as written (not in quotes)
        _trainer(tmp_path, callbacks=[EarlyStopping(monitor="val/acc")]).train_model(train, val, num_epochs=2)
    assert isinstance(info.value, KeyError) and str(info.value).startswith("EarlyStopping monitors 'val/acc'")


def test_a_callback_whose_on_exception_raises_does_not_stop_the_runs_cleanup(tmp_path, regression_loaders):
    class Broken(Callback):
        def on_validation_end(self, trainer, epoch, metrics):
            if epoch == 2:
                raise ValueError("a bug in my callback")

    class Alerting(Callback):
        def on_exception(self, trainer, exc):
            raise ConnectionError("no network to send the alert")

    train, val, _ = regression_loaders
    with pytest.warns(RuntimeWarning, match="Alerting.on_exception raised ConnectionError"), \
            pytest.raises(ValueError, match="a bug in my callback"):
        _trainer(tmp_path, callbacks=[Broken(), Alerting(), ModelCheckpoint(every_n_epochs=1)]).train_model(
            train, val, num_epochs=3)
    resumed = _trainer(tmp_path)  # the folder is not locked: the run can be continued at once
    resumed.train_model(train, val, num_epochs=3, resume=True)
    assert resumed.current_epoch == 3


def test_a_loaded_model_training_on_logs_the_learning_rate_its_new_optimizer_applies(tmp_path, regression_loaders):
    """The new optimizer counts its updates from 0 while the model's step goes on from the checkpoint's."""
    train, val, _ = regression_loaders
    optimizer = {"optimizer": "adam", "lr": 1e-2, "warmup": 4}
    fresh = _trainer(tmp_path / "fresh", callbacks=[LearningRateMonitor()], log_every_n_steps=4,
                     optimizer_hparams=optimizer)
    fresh.train_model(train, val, num_epochs=2)
    fresh_rates = {int(r["step"]): float(r["train/lr"]) for r in _rows(tmp_path / "fresh") if r.get("train/lr")}
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "fresh" / "run", exmp_input=X0, which="last",
                                                 logger_params={"log_dir": str(tmp_path / "tuned" / "run")},
                                                 callbacks=[LearningRateMonitor()], log_every_n_steps=4)
    loaded.train_model(train, val, num_epochs=2)
    tuned = {int(r["step"]) - 16: float(r["train/lr"]) for r in _rows(tmp_path / "tuned") if r.get("train/lr")}
    assert tuned == pytest.approx(fresh_rates)


def test_learning_rate_monitor_includes_the_plateau_reductions(tmp_path, regression_loaders):
    from flaxlight.optim import current_learning_rate

    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, callbacks=[LearningRateMonitor()], log_every_n_steps=8,
                       optimizer_hparams={"optimizer": "sgd", "lr": 0.5, "schedule": "constant",
                                          "reduce_on_plateau": {"patience": 1, "factor": 0.5, "cooldown": 0}})
    trainer.train_model(train, val, num_epochs=6)
    rows = [r for r in _rows(tmp_path) if r.get("train/lr")]
    assert float(rows[-1]["train/lr"]) == pytest.approx(float(current_learning_rate(trainer.state)), rel=1e-5)
    assert float(rows[-1]["train/lr_scale"]) < 1.0  # the plateau reduced the rate


def test_start_fresh_forgets_the_time_a_resumed_run_had_spent():
    from flaxlight.callbacks import Timer, start_fresh

    timer = Timer(60)
    timer.load_state_dict({"elapsed": 59.0})  # a resumed run that had almost spent its budget
    start_fresh([timer])
    assert timer.state_dict()["elapsed"] < 1.0


def test_the_advice_for_a_checkpoint_ranking_unlike_the_trainer_works_when_followed():
    """{monitor: val/acc, save_top_k: 2} (mode left at 'min') was told to drop its monitor, and that was refused next:
    'save_top_k=2 needs a monitor'."""
    from flaxlight.callbacks.defaults import one_best
    from flaxlight.options import TrainerOptions

    options = TrainerOptions(monitor="val/acc", mode="max")
    with pytest.warns(UserWarning, match="pass mode='max'"), pytest.raises(ValueError) as info:
        one_best(options, [ModelCheckpoint(monitor="val/acc", save_top_k=2)])
    assert "Give both the same monitor and mode: pass mode='max' to the callback (ModelCheckpoint(monitor='val/acc', " \
           "mode='max', save_top_k=2)), or mode='min' to the trainer." in str(info.value) and "drop the callback's monitor" not in str(info.value)
    with pytest.raises(ValueError) as info:
        one_best(options, [ModelCheckpoint(monitor="val/loss", save_top_k=2)])
    assert "e.g. ModelCheckpoint(monitor='val/acc', mode='max', save_top_k=2) (its save_top_k=2 needs a monitor of " \
           "its own" in str(info.value) and "drop the callback's monitor" not in str(info.value)
    assert one_best(options, [ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=2)])[0] == options  # as said
    with pytest.raises(ValueError, match=r"save_top_k=2 needs a monitor.*e\.g\. ModelCheckpoint\(monitor='val/acc', "
                                         r"mode='max', save_top_k=2\)"):
        ModelCheckpoint(save_top_k=2)
    with pytest.raises(ValueError, match=r"or drop the callback's monitor \(it then follows the trainer's\)"):
        one_best(options, [ModelCheckpoint(monitor="val/loss")])  # save_top_k=1: dropping it works
    assert one_best(options, [ModelCheckpoint()])[0] == options


def test_nan_guard_stops_at_a_validation_within_the_epoch_naming_the_steps_counted_by_then(tmp_path):
    """A validation within an epoch counts the non-finite steps up to its step (they were counted only
    at delivered log points: NaNGuard stopped at step 15, "5 step(s) up to step 10"). The log point
    of before is delivered before the validation (as an interrupt there writes it), with its own count."""

    class Counts(Callback):
        def __init__(self):
            self.seen = []

        def on_log(self, trainer, step, metrics):
            self.seen.append((step, trainer.nonfinite_steps, trainer.nonfinite_checked_step))

    x, y = linear_data(16 * 32, 0)
    x[5 * 32 + 3] = np.nan  # steps 6, 7, 8 are NaN before the validation at step 8
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                             **quiet(tmp_path, callbacks=[NaNGuard(), counts := Counts()], val_check_interval=8,
                                     log_every_n_steps=5, enable_checkpointing=False))
    trainer.train_model(ArrayLoader(x, y, batch_size=32), ArrayLoader(*linear_data(64, 1), batch_size=32), num_epochs=1)
    assert trainer.global_step == 8  # at the validation's record
    assert trainer.stop_reason.startswith("NaNGuard: the loss was NaN/Inf (or the update made the params NaN/Inf) "
                                          "in 3 step(s) up to step 8;")
    assert counts.seen[:2] == [(5, 0, 5), (8, 3, 8)]  # the point of step 5 first, then the validation's record
