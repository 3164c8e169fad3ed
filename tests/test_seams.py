"""The seed's methods are the seams the loop calls: a subclass overriding one gets it used.

``save_model``, ``load_model``, ``is_new_model_better``, ``init_logger``, ``create_functions`` and
``create_jitted_functions`` (the UvA "Research Projects with JAX" TrainerModule's methods), plus
the two shared channels: callbacks' logged values go where the trainer's own go, and messages go
through the ``logging`` logger named ``flaxlight``.
"""

import csv
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

import flaxlight
from flaxlight import ModelCheckpoint, make_eval_step, make_train_step
from flaxlight.callbacks import EarlyStopping, LearningRateMonitor, ThroughputMonitor
from flaxlight.loggers import Logger, LoggerCollection

X0 = np.zeros((1, 4), np.float32)
STEPS_PER_EPOCH = 8  # regression_loaders: 256 examples in batches of 32


def _kwargs(tmp_path, **kwargs):
    kwargs.setdefault("model_hparams", {"hidden_dims": [16], "output_dim": 1})
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 3e-2})
    kwargs.setdefault("logger_params", {"log_dir": str(tmp_path / "run"), "logger_type": "csv"})
    return dict(model_class=TinyMLP, exmp_input=X0, **quiet(tmp_path, **kwargs))


def _build(cls, tmp_path, **kwargs):
    return cls(**_kwargs(tmp_path, **kwargs))


def _record(trainer, name, value):
    """Append to a per-instance list (also works during ``__init__``, before any attribute is set)."""
    trainer.__dict__.setdefault(name, []).append(value)


def _step_folders(log_dir):
    folder = os.path.join(log_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def _csv_rows(log_dir):
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def _saved_metrics(log_dir, name):
    with open(os.path.join(log_dir, "metrics", f"{name}.json")) as f:
        return json.load(f)


def _mse(params, batch, *, train, rng, state):
    x, y = batch
    pred, _ = state.apply_model(params, x, train=train, rng=rng)
    return jnp.mean((pred - y) ** 2), {}


# ---------------------------------------------------------------------------------- save_model
def test_model_checkpoint_saves_through_save_model(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class Recording(RegressTrainer):
        def save_model(self, step=None):
            super().save_model(step)
            self.checkpointer.wait()
            # the folder of this step is on disk, and every folder there came from a save_model call
            _record(self, "saved", (step, _step_folders(self.log_dir)))

    trainer = _build(Recording, tmp_path)
    trainer.train_model(train, val, num_epochs=4)
    steps = [step for step, _ in trainer.saved]
    assert steps == [STEPS_PER_EPOCH * e for e in (1, 2, 3, 4)]  # one call per checkpoint written
    for step, folders in trainer.saved:
        assert step in folders
        assert set(folders) <= set(steps)
    final = _step_folders(trainer.log_dir)
    assert final and set(final) <= set(steps) and max(steps) in final  # pruned to best + last


def test_save_model_override_without_super_replaces_orbax_saving(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class OwnSaving(RegressTrainer):
        def save_model(self, step=None):
            _record(self, "saved", step)
            with open(os.path.join(self.log_dir, f"my_ckpt_{step}.txt"), "w") as f:
                f.write(str(int(self.state.step)))

    trainer = _build(OwnSaving, tmp_path)
    metrics = trainer.train_model(train, val, num_epochs=3)  # a test_loader needs a load_model: test_uva_guide.py
    assert trainer.own_checkpoints
    assert trainer.saved == [8, 16, 24]  # each validation was a new best (the only saves it is asked for)
    assert not (tmp_path / "run" / "checkpoints").exists()  # no orbax checkpoint folder at all
    assert sorted(n for n in os.listdir(tmp_path / "run") if n.startswith("my_ckpt_")) == [
        "my_ckpt_16.txt", "my_ckpt_24.txt", "my_ckpt_8.txt"]
    assert trainer.global_step == 24 and {"val/loss", "train/loss"} <= set(metrics)


# ---------------------------------------------------------------------------------- load_model
class _LoadRecorder(RegressTrainer):
    def load_model(self, step=None):
        _record(self, "loaded", step)
        super().load_model(step)


def test_testing_restores_the_best_through_load_model(tmp_path, regression_loaders):
    train, val, test = regression_loaders
    checkpoint = ModelCheckpoint()
    trainer = _build(_LoadRecorder, tmp_path, callbacks=[checkpoint])
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=2)
    assert trainer.loaded == [None]
    assert int(trainer.state.step) == checkpoint.best_step
    assert trainer.eval_model(test, log_prefix="test/")["test/loss"] == pytest.approx(metrics["test/loss"])


def test_resume_loads_the_resumed_step_through_load_model(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    first = _build(RegressTrainer, tmp_path)
    first.train_model(train, val, num_epochs=2)
    assert max(_step_folders(first.log_dir)) == 16

    second = _build(_LoadRecorder, tmp_path)
    assert second.log_dir == first.log_dir
    second.train_model(train, val, num_epochs=4, resume=True)
    assert second.loaded == [16]
    assert second.global_step == 32


def test_load_from_checkpoint_goes_through_load_model(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    checkpoint = ModelCheckpoint()
    first = _build(RegressTrainer, tmp_path, callbacks=[checkpoint])
    first.train_model(train, val, num_epochs=3)

    best = _LoadRecorder.load_from_checkpoint(first.log_dir, exmp_input=X0)
    assert best.loaded == [checkpoint.best_step]
    assert best.global_step == checkpoint.best_step == int(best.state.step)
    last = _LoadRecorder.load_from_checkpoint(first.log_dir, exmp_input=X0, which="last")
    assert last.loaded == [24] and last.global_step == 24


# ---------------------------------------------------------------------------------- is_new_model_better
def test_is_new_model_better_is_asked_once_per_validation(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class Counting(RegressTrainer):  # the default ModelCheckpoint (monitor=None) must not ask again
        def is_new_model_better(self, new, old):
            _record(self, "asked", (dict(new), None if old is None else dict(old)))
            return super().is_new_model_better(new, old)

    trainer = _build(Counting, tmp_path)
    trainer.train_model(train, val, num_epochs=4)
    assert len(trainer.asked) == 4
    assert trainer.asked[0][1] is None and all(set(new) == {"val/loss"} for new, _ in trainer.asked)

    step_validations = _build(Counting, tmp_path / "steps", val_check_interval=4)
    step_validations.train_model(train, val, num_epochs=2)
    evals = [n for n in os.listdir(step_validations.log_dir + "/metrics") if n.startswith("eval_")]
    assert len(evals) == 4  # at steps 4 and 12 mid-epoch, and at each epoch's end
    assert len(step_validations.asked) == len(evals)


def test_is_new_model_better_decides_the_best_checkpoint(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class FirstIsBest(RegressTrainer):
        def is_new_model_better(self, new, old):
            _record(self, "asked", (dict(new), None if old is None else dict(old)))
            return old is None

    checkpoint = ModelCheckpoint()
    trainer = _build(FirstIsBest, tmp_path, callbacks=[checkpoint])
    metrics = trainer.train_model(train, val, num_epochs=4)
    assert len(trainer.asked) == 4
    epoch_1 = _saved_metrics(trainer.log_dir, "eval_epoch_001")
    assert all(old["val/loss"] == pytest.approx(epoch_1["val/loss"]) for _, old in trainer.asked[1:])

    assert checkpoint.best_step == 8
    assert _step_folders(trainer.log_dir) == [8, 32]  # the best (by the override) and the last
    assert not trainer.is_best_validation
    assert _saved_metrics(trainer.log_dir, "eval_epoch_004")["val/loss"] < epoch_1["val/loss"]
    assert metrics["val/loss"] == pytest.approx(epoch_1["val/loss"])
    train_loss = {int(r["step"]): float(r["train/loss"]) for r in _csv_rows(trainer.log_dir) if r["train/loss"]}
    assert metrics["train/loss"] == pytest.approx(train_loss[8])  # epoch 1's train metrics too
    assert _saved_metrics(trainer.log_dir, "best_eval") == pytest.approx(epoch_1)


# ---------------------------------------------------------------------------------- init_logger
class MemoryLogger(Logger):
    def __init__(self):
        self.records, self.hyperparams, self.finalized = [], [], []

    def log_hyperparams(self, params):
        self.hyperparams.append(dict(params))

    def log_metrics(self, metrics, step):
        self.records.append((step, dict(metrics)))

    def finalize(self, status):
        self.finalized.append(status)


def test_init_logger_override_adds_a_logger(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    memory = MemoryLogger()

    class WithMemory(RegressTrainer):
        def init_logger(self, logger_params=None):
            _record(self, "init_logger_calls", logger_params)
            super().init_logger(logger_params)
            self.logger.loggers.append(memory)

    logger_params = {"log_dir": str(tmp_path / "run"), "logger_type": "csv"}
    trainer = _build(WithMemory, tmp_path, logger_params=logger_params)
    assert trainer.init_logger_calls == [logger_params]
    assert isinstance(trainer.logger, LoggerCollection) and trainer.logger.loggers[-1] is memory
    trainer.train_model(train, val, num_epochs=2)
    assert len(trainer.init_logger_calls) == 1

    train_steps = [step for step, metrics in memory.records if "train/loss" in metrics]
    val_steps = [step for step, metrics in memory.records if "val/loss" in metrics]
    assert train_steps == [8, 16] and val_steps == [8, 16]
    csv_train = [float(r["train/loss"]) for r in _csv_rows(trainer.log_dir) if r["train/loss"]]
    assert [m["train/loss"] for _, m in memory.records if "train/loss" in m] == pytest.approx(csv_train)
    assert len(memory.hyperparams) == 1 and memory.hyperparams[0]["model_class"].endswith("TinyMLP")
    assert memory.finalized == ["success"]


# ---------------------------------------------------------------------------------- create_functions
def test_create_functions_steps_are_used_for_training(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    base_train, base_eval = make_train_step(_mse), make_eval_step(_mse)

    def train_step(state, batch):
        state, metrics = base_train(state, batch)
        return state, {**metrics, "custom": 1.0}

    def eval_step(state, batch):
        return {**base_eval(state, batch), "extra": 2.0}

    class Custom(flaxlight.TrainerModule):
        def create_functions(self):
            return train_step, eval_step

    trainer = _build(Custom, tmp_path)
    metrics = trainer.train_model(train, val, num_epochs=3)
    assert metrics["train/custom"] == pytest.approx(1.0)
    assert metrics["val/extra"] == pytest.approx(2.0)
    assert metrics["val/loss"] < 0.3
    rows = [r for r in _csv_rows(trainer.log_dir) if r["train/loss"]]
    assert [float(r["train/custom"]) for r in rows] == [1.0, 1.0, 1.0]
    assert [float(r["val/extra"]) for r in _csv_rows(trainer.log_dir) if r["val/loss"]] == [2.0, 2.0, 2.0]


# ---------------------------------------------------------------------------------- create_jitted_functions
def _hand_written_train_step(state, batch):
    x, y = batch

    def loss(params):
        pred, _ = state.apply_model(params, x, train=True)
        return jnp.mean((pred - y) ** 2)

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def _hand_written_eval_step(state, batch):
    x, y = batch
    pred, _ = state.apply_model(state.params, x, train=False)
    return {"loss": jnp.mean((pred - y) ** 2)}


@pytest.mark.parametrize("kind", ["make_steps", "hand_written"])
def test_create_jitted_functions_override_sets_only_the_seed_steps(tmp_path, regression_loaders, kind):
    train, val, _ = regression_loaders
    if kind == "make_steps":
        pure_train, pure_eval = make_train_step(_mse), make_eval_step(_mse)
    else:
        pure_train, pure_eval = _hand_written_train_step, _hand_written_eval_step
    traces = {"train": 0, "eval": 0}

    def train_fn(state, batch):
        traces["train"] += 1  # Python side: runs once per trace
        return pure_train(state, batch)

    def eval_fn(state, batch):
        traces["eval"] += 1
        return pure_eval(state, batch)

    class Seed(flaxlight.TrainerModule):  # the seed's contract: set self.train_step / self.eval_step, no super()
        def create_jitted_functions(self):
            self.train_step = jax.jit(train_fn)
            self.eval_step = jax.jit(eval_fn)

    trainer = _build(Seed, tmp_path)
    before = trainer.eval_model(val, log_prefix="val/")["val/loss"]
    assert traces["eval"] > 0
    metrics = trainer.train_model(train, val, num_epochs=5)
    assert traces["train"] > 0
    assert trainer.global_step == 40
    assert metrics["val/loss"] < 0.25 * before and metrics["val/loss"] < 0.1


def test_create_jitted_functions_override_setting_nothing_is_a_type_error(tmp_path):
    class Nothing(RegressTrainer):
        def create_jitted_functions(self):
            pass

    with pytest.raises(TypeError, match="create_jitted_functions"):
        _build(Nothing, tmp_path)


# ---------------------------------------------------------------------------------- callbacks' logging
class Recorder(flaxlight.Callback):
    def __init__(self):
        self.logged = []

    def on_log(self, trainer, step, metrics):
        self.logged.append((step, dict(metrics)))


class LogsFromHook(flaxlight.Callback):
    def on_train_epoch_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"my/metric": 3.0})


def test_callback_metrics_reach_loggers_callback_metrics_and_on_log(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    recorder = Recorder()
    trainer = _build(RegressTrainer, tmp_path, log_every_n_steps=4,
                     callbacks=[ThroughputMonitor(), LearningRateMonitor(), LogsFromHook(), recorder])
    trainer.train_model(train, val, num_epochs=2)

    recorded = {key for _, metrics in recorder.logged for key in metrics}
    rows = _csv_rows(trainer.log_dir)
    for key in ("perf/step_time_ms", "train/lr", "my/metric"):
        assert key in trainer.callback_metrics, key
        assert key in recorded, key
        assert key in rows[0], key  # a column of metrics.csv
        assert any(r[key] for r in rows), key
    assert trainer.callback_metrics["train/lr"] == pytest.approx(trainer.learning_rate(16))
    for r in rows:
        if r["train/lr"]:
            assert float(r["train/lr"]) == pytest.approx(trainer.learning_rate(int(r["step"])))
    assert trainer.callback_metrics["my/metric"] == 3.0
    assert [step for step, m in recorder.logged if "my/metric" in m] == [8, 16]
    assert [int(r["step"]) for r in rows if r["my/metric"]] == [8, 16]
    lr_steps = [step for step, m in recorder.logged if "train/lr" in m]
    assert lr_steps == [int(r["step"]) for r in rows if r["train/lr"]] and lr_steps
    assert all(float(r["perf/step_time_ms"]) > 0 for r in rows if r["perf/step_time_ms"])


@pytest.mark.parametrize("value, named", [(np.array([0.1, 0.2]), "an array of shape (2,)"),
                                          ("resnet18", "'resnet18' (str)"), (None, "None (NoneType)")])
def test_log_metrics_refuses_a_value_that_is_not_one_number_at_the_call(tmp_path, regression_loaders, value, named):
    """An array was silently dropped by every logger; a string or None crashed a later log point
    with a message naming neither the key nor the logger, and lost that epoch's records."""
    train, val, _ = regression_loaders
    trainer = _build(RegressTrainer, tmp_path)
    trainer.train_model(train, val, num_epochs=1)
    with pytest.raises(TypeError, match=f"log_metrics: 'my/value' is {re.escape(named)}; loggers take one number"):
        trainer.log_metrics({"my/value": value, "my/ok": 1.0})
    with pytest.raises(TypeError, match="non-empty strings other than 'step'"):  # it replaced the CSV's step column
        trainer.log_metrics({"step": 3.0})
    trainer.log_metrics({"my/np": np.float32(0.25), "my/jax": jnp.float32(0.5), "my/flag": True,
                         "my/bf16": jnp.bfloat16(0.75), "my/one": np.array([2.0])})
    trainer.logger.flush()
    last = _csv_rows(trainer.log_dir)[-1]
    assert [float(last[k]) for k in ("my/np", "my/jax", "my/flag", "my/bf16", "my/one")] == [0.25, 0.5, 1.0, 0.75, 2.0]
    assert "my/value" not in trainer.callback_metrics and "my/ok" not in trainer.callback_metrics


# ---------------------------------------------------------------------------------- messages
@pytest.fixture
def flaxlight_messages():
    """Records of the ``flaxlight`` logger (it does not propagate: a handler of our own)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    logger = logging.getLogger("flaxlight")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _infos(records):
    """The flaxlight INFO messages, less the one naming the monitored metric (said at every first validation)."""
    return [r.getMessage() for r in records if r.name == "flaxlight" and r.levelno == logging.INFO
            and not r.getMessage().startswith("The best model is picked by")]


def test_max_steps_stop_reason_is_a_flaxlight_info_message(tmp_path, regression_loaders, flaxlight_messages, capsys):
    train, val, _ = regression_loaders
    trainer = _build(RegressTrainer, tmp_path, max_steps=10)
    trainer.train_model(train, val, num_epochs=5)
    assert trainer.global_step == 10
    assert _infos(flaxlight_messages) == ["max_steps=10 reached."]
    out, err = capsys.readouterr()
    assert out == ""  # no progress bar, no model table: nothing on stdout
    assert "max_steps=10 reached." in err  # the logger's own stderr handler


def test_early_stopping_reason_is_a_flaxlight_info_message(tmp_path, regression_loaders, flaxlight_messages, capsys):
    train, val, _ = regression_loaders
    stopper = EarlyStopping(monitor="val/loss", patience=0, min_delta=1e9)  # never improves after the first
    trainer = _build(RegressTrainer, tmp_path, callbacks=[stopper])
    trainer.train_model(train, val, num_epochs=5)
    assert trainer.global_step == 16
    infos = _infos(flaxlight_messages)
    assert infos == [trainer.stop_reason] and infos[0].startswith("EarlyStopping: val/loss did not improve")
    assert capsys.readouterr().out == ""


def test_resume_message_is_a_flaxlight_info_message(tmp_path, regression_loaders, flaxlight_messages, capsys):
    train, val, _ = regression_loaders
    _build(RegressTrainer, tmp_path).train_model(train, val, num_epochs=1)
    assert _infos(flaxlight_messages) == []
    _build(RegressTrainer, tmp_path).train_model(train, val, num_epochs=2, resume=True)
    infos = _infos(flaxlight_messages)
    assert len(infos) == 2 and infos[0].startswith("Resumed from checkpoint 8 in ")
    assert infos[0].endswith("(the end of epoch 1).")  # saved after its last batch, as at its end
    assert infos[1].startswith("The run's learning-rate schedule spanned 8 steps and this run's spans 16")
    assert capsys.readouterr().out == ""


def test_model_table_is_the_only_stdout_and_only_when_asked(tmp_path, regression_loaders, capsys):
    train, val, _ = regression_loaders
    _build(RegressTrainer, tmp_path, enable_model_summary=True)
    assert "Dense" in capsys.readouterr().out
    _build(RegressTrainer, tmp_path / "quiet").train_model(train, val, num_epochs=1)
    assert capsys.readouterr().out == ""


def test_an_is_new_model_better_override_picks_the_best_checkpoint_also_with_a_monitor(tmp_path, regression_loaders):
    """The default ModelCheckpoint asks the trainer's rule: the override's best is what loads."""

    class FirstIsBest(RegressTrainer):
        def is_new_model_better(self, new_metrics, old_metrics):
            return old_metrics is None

    train, val, _ = regression_loaders
    trainer = _build(FirstIsBest, tmp_path, monitor="val/loss", mode="min")
    returned = trainer.train_model(train, val, num_epochs=3)
    assert returned["val/loss"] == trainer.history[0]["val/loss"]  # the first validation, by the override
    loaded = FirstIsBest.load_from_checkpoint(trainer.log_dir, exmp_input=np.zeros((1, 4), np.float32))
    assert loaded.global_step == trainer.history[0]["step"]
    assert loaded.test(val)["test/loss"] == pytest.approx(returned["val/loss"], rel=1e-5)


def test_the_resume_message_names_the_epoch_the_checkpoint_ended(tmp_path, regression_loaders, flaxlight_messages):
    """Two calls of 2 epochs: the last checkpoint ends the second call's epoch 2 (as its progress lines,
    metrics.csv and num_epochs count) and the model's epoch 4 (as eval_epoch_004.json): both are named
    (it named the model's alone, and a fine-tune's progress said epoch 3 where its resume said 9)."""
    train, val, _ = regression_loaders
    trainer = _build(RegressTrainer, tmp_path)
    trainer.train_model(train, val, num_epochs=2)
    trainer.train_model(train, val, num_epochs=2)
    assert (tmp_path / "run" / "metrics" / "eval_epoch_004.json").is_file()
    _build(RegressTrainer, tmp_path).train_model(train, val, num_epochs=5, resume=True)
    resumed = [line for line in _infos(flaxlight_messages) if line.startswith("Resumed from checkpoint")]
    assert len(resumed) == 1 and resumed[0].endswith(
        "(the end of epoch 2; the model's epoch 4, after the 2 it trained before this run).")
