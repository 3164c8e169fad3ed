"""flaxlight.tune: search spaces, trials in their own dirs, pruning, failures, storage, workers, plots.

Trials are tiny (an 8-unit MLP on 128 synthetic examples, 1-2 epochs); the bookkeeping of failures
uses a stand-in trainer that trains nothing.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

import flaxlight  # noqa: E402
import flaxlight.loggers  # noqa: E402
from flaxlight.callbacks import PruningCallback  # noqa: E402
from flaxlight.tune import (  # noqa: E402
    Categorical,
    Float,
    Int,
    MetricNotLoggedError,
    SearchSpace,
    StorageError,
    TuneError,
    _check_direction,
    infer_direction,
    load_best,
    load_study,
    make_pruner,
    make_sampler,
    make_storage,
    param_importances,
    plot_study,
    tune,
    tune_from_config,
)

from conftest import ClassifyTrainer, TinyMLP  # noqa: E402

TESTS = Path(__file__).resolve().parent
State = optuna.trial.TrialState


def classification_data(num: int = 128, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, 4)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32)


@pytest.fixture
def loaders():
    x, y = classification_data()
    train = flaxlight.ArrayLoader(x[:96], y[:96], batch_size=32, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(x[96:], y[96:], batch_size=32)
    return train, val


def tiny_hparams(x0):
    return dict(model_class=TinyMLP, model_hparams={"hidden_dims": (8,), "output_dim": 2},
                optimizer_hparams={"optimizer": "sgd", "lr": 0.1}, exmp_input=x0)


LR_SPACE = {"optimizer_hparams.lr": Float(1e-3, 0.5, log=True)}


# ----------------------------------------------------------------------------- search spaces
def test_search_space_python_yaml_and_nested_forms_agree():
    python = SearchSpace({
        "optimizer_hparams.lr": Float(1e-4, 1e-2, log=True),
        "model_hparams.dropout_prob": Float(0.0, 0.6),
        "model_hparams.num_layers": Int(1, 4),
        "model_hparams.hidden_dims": Categorical([[16], [32, 32]]),
    })
    yaml_style = SearchSpace({
        "optimizer_hparams": {"lr": {"type": "float", "low": "1e-4", "high": 1e-2, "log": True}},  # PyYAML: "1e-4"
        "model_hparams.dropout_prob": {"type": "float", "low": 0, "high": 0.6},
        "model_hparams.num_layers": {"type": "int", "low": 1, "high": 4},
        "model_hparams.hidden_dims": {"type": "categorical", "choices": [[16], [32, 32]]},
    })
    assert python.to_config() == yaml_style.to_config()
    assert SearchSpace(python.to_config()).to_config() == python.to_config()
    from_optuna = SearchSpace({"optimizer_hparams.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)})
    assert from_optuna["optimizer_hparams.lr"] == Float(1e-4, 1e-2, log=True)
    # Lists as choices are stored as JSON text and decoded for the trainer.
    trial = optuna.trial.FixedTrial({"optimizer_hparams.lr": 1e-3, "model_hparams.dropout_prob": 0.1,
                                     "model_hparams.num_layers": 2, "model_hparams.hidden_dims": "[32, 32]"})
    values = python.suggest(trial)
    assert values["model_hparams.hidden_dims"] == [32, 32] and values["model_hparams.num_layers"] == 2
    assert python.decode({"model_hparams.hidden_dims": "[16]"}) == {"model_hparams.hidden_dims": [16]}


@pytest.mark.parametrize("space, message", [
    ({}, "search_space is empty"),
    ([("optimizer_hparams.lr", Float(0.1, 1))], "must be a dict"),
    ({"optimizer_hparams.lr": 0.1}, "is not a parameter"),
    ({"optimizer_hparams.lr": {"low": 0.1, "high": 1.0}}, "no 'type'"),
    ({"optimizer_hparams.lr": {"type": "uniform_float", "low": 0.1, "high": 1.0}}, "unknown type"),
    ({"optimizer_hparams.lr": {"type": "loguniform", "low": 0.1, "high": 1.0}},  # was "did you mean 'uniform'"
     r"unknown type 'loguniform'. A log scale is \{type: float, low: ..., high: ..., log: true\}"),
    ({"optimizer_hparams.lr": {"type": "float", "low": 0.1, "hihg": 1.0}}, "Did you mean 'high'"),
    ({"optimizer_hparams.lr": {"type": "float", "low": 0.1}}, "needs high"),
    ({"optimizer_hparams.lr": Float(1e-2, 1e-4, log=True)}, r"low=0.01 > high=0.0001"),
    ({"optimizer_hparams.lr": Float(0.0, 1e-2, log=True)}, "log-scale range needs low > 0"),
    ({"optimizer_hparams.lr": {"type": "float", "low": -1, "high": 1, "log": True}}, "needs low > 0"),
    ({"optimizer_hparams.lr": Float(1e-4, 1e-2, log=True, step=1e-4)}, "cannot be combined"),
    ({"model_hparams.num_layers": Int(1, 2.5)}, "whole number"),
    ({"model_hparams.num_layers": Int(1, 3, step=0)}, "step must be > 0"),
    ({"optimizer_hparams.optimizer": Categorical([])}, "non-empty list"),
    ({"optimizer_hparams.optimizer": Categorical(["adam", "adam"])}, "repeat"),
    ({"optimizer_hparams.lr": {"type": "float", "low": "small", "high": 1}}, "must be a number"),
    ({"optimizer_hparams..lr": Float(0.1, 1)}, "no empty parts"),
])
def test_bad_search_space_is_a_clear_error(space, message):
    with pytest.raises(ValueError, match=message) as info:
        SearchSpace(space)
    if isinstance(space, dict) and space and "optimizer_hparams..lr" not in space:
        assert repr(next(iter(space))) in str(info.value) or "optimizer_hparams" in str(info.value)


def test_keys_that_cannot_reach_the_trainer_fail_before_any_trial(tmp_path, loaders):
    x0 = classification_data()[0][:1]
    common = dict(hparams=tiny_hparams(x0), train_loader=loaders[0], val_loader=loaders[1], metric="val/acc",
                  base_dir=tmp_path, n_trials=1)
    with pytest.raises(ValueError, match="takes no argument 'optimzer_hparams'. Did you mean 'optimizer_hparams'"):
        tune(ClassifyTrainer, {"optimzer_hparams.lr": Float(1e-3, 1e-1)}, **common)
    with pytest.raises(ValueError, match=r"TinyMLP has no hyperparameter 'dropuot_prob'. Did you mean 'dropout_prob'"):
        tune(ClassifyTrainer, {"model_hparams.dropuot_prob": Float(0.0, 0.5)}, **common)
    with pytest.raises(ValueError, match="Cannot tell whether to maximize or minimize 'val/r2x'"):
        tune(ClassifyTrainer, LR_SPACE, **{**common, "metric": "val/r2x"})
    assert not (tmp_path / "study").exists()  # nothing was created


def test_a_per_task_metrics_direction_is_inferred_from_its_words_and_a_name_that_tells_nothing_is_refused():
    """tune refused val/acc_digit, val/loss_digit, val/digit/f1_macro ("Cannot tell whether ...")."""
    assert infer_direction("val/acc_digit") == "maximize" and infer_direction("val/digit/f1_macro") == "maximize"
    assert infer_direction("val/loss_digit") == "minimize" and infer_direction("val/mse_target") == "minimize"
    assert infer_direction("val/err_top5") == "minimize" and infer_direction("val/error_rate_top5") == "minimize"
    assert infer_direction("val/accuracy_top5") == "maximize" and infer_direction("val/recall@10") == "maximize"
    for name in ("val/loss_scale", "val/brier_score", "val/neg_log_loss", "val/acc_stderr", "val/loss_acc"):
        with pytest.raises(ValueError, match=f"Cannot tell whether to maximize or minimize '{name}'"):
            infer_direction(name)


def test_direction_sampler_pruner_and_storage_specs(tmp_path):
    assert infer_direction("val/acc") == "maximize" and infer_direction("val/loss") == "minimize"
    assert isinstance(make_sampler(None, seed=1), optuna.samplers.TPESampler)
    assert isinstance(make_sampler({"name": "random", "seed": 3}), optuna.samplers.RandomSampler)
    assert isinstance(make_pruner(None), optuna.pruners.MedianPruner)
    assert isinstance(make_pruner("none"), optuna.pruners.NopPruner)
    assert make_pruner({"name": "median", "n_warmup_steps": 2})._n_warmup_steps == 2
    with pytest.raises(ValueError, match="Unknown sampler 'tpee'. Did you mean 'tpe'"):
        make_sampler("tpee")
    with pytest.raises(ValueError, match="pruner 'median'.*n_warmup.*Did you mean 'n_warmup_steps'.*takes: n_startup"):
        make_pruner({"name": "median", "n_warmup": 2})
    with pytest.raises(ValueError, match="sampler 'tpe'.*Did you mean 'n_startup_trials'"):
        make_sampler({"name": "tpe", "n_startup_trial": 2})
    assert isinstance(make_storage(tmp_path / "a.db"), optuna.storages.RDBStorage)
    assert isinstance(make_storage(str(tmp_path / "a.log")), optuna.storages.JournalStorage)


@pytest.mark.parametrize("url, message", [
    ("sqlite:////nonexistent-flaxlight-dir/sub/study.db", "does not exist"),
    ("nosuchdb://user@localhost/db", "driver is missing or the URL's scheme is wrong"),
    ("postgresql+nosuchdriver://user:secret@127.0.0.1:1/db", "Cannot open the study storage"),
])
def test_unreachable_storage_is_a_clear_error(url, message, tmp_path, loaders):
    with pytest.raises(StorageError, match=message) as info:
        tune(ClassifyTrainer, LR_SPACE, hparams=tiny_hparams(classification_data()[0][:1]),
             train_loader=loaders[0], val_loader=loaders[1], metric="val/acc", storage=url, base_dir=tmp_path)
    assert "secret" not in str(info.value)  # passwords are not printed
    with pytest.raises(ValueError, match="neither a database URL"):
        make_storage(str(tmp_path / "study.txt"))


# ----------------------------------------------------------------------------- real trials
class PruneTrialOne(optuna.pruners.BasePruner):
    """Prunes trial 1 at its first report, never the others (a deterministic pruner for tests)."""

    def prune(self, study, trial) -> bool:
        return trial.number == 1


def test_trials_run_in_their_own_dirs_pruned_ones_keep_files_best_loads_and_study_resumes(tmp_path, loaders):
    train, val = loaders
    x0 = classification_data()[0][:1]
    kwargs = dict(hparams=tiny_hparams(x0), train_loader=train, val_loader=val, num_epochs=2, metric="val/acc",
                  base_dir=tmp_path, study_name="tiny", seed=0, pruner=PruneTrialOne())
    study = tune(ClassifyTrainer, LR_SPACE, n_trials=3, **kwargs)

    trials = study.trials
    assert [t.state for t in trials] == [State.COMPLETE, State.PRUNED, State.COMPLETE]
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert study.user_attrs["metric"] == "val/acc"
    for trial in trials:
        log_dir = Path(trial.user_attrs["log_dir"])
        assert log_dir == tmp_path / "tiny" / f"trial_{trial.number:04d}"
        assert (log_dir / "hparams.yaml").is_file() and (log_dir / "metrics.csv").is_file()
        assert Path(trial.user_attrs["best_checkpoint"]).is_dir()
        assert trial.user_attrs["best_checkpoint"].startswith(str(log_dir))
    complete, pruned = trials[0], trials[1]
    assert sorted(complete.intermediate_values) == [1, 2] and complete.value == complete.user_attrs["metrics"]["val/acc"]
    assert sorted(pruned.intermediate_values) == [1] and pruned.user_attrs["epochs"] == 1  # stopped after epoch 1
    assert "pruned at epoch 1" in pruned.user_attrs["stop_reason"]
    assert (tmp_path / "tiny" / "study.db").is_file()

    best = load_best(study, ClassifyTrainer, exmp_input=x0)
    assert best.log_dir == study.best_trial.user_attrs["log_dir"]
    assert math.isclose(best.eval_model(val, log_prefix="val/")["val/acc"], study.best_value, abs_tol=1e-6)

    # The study lives in its SQLite file: a second call adds trials to it (resume / "more later").
    again = tune(ClassifyTrainer, LR_SPACE, n_trials=1, **kwargs)
    assert [t.number for t in again.trials] == [0, 1, 2, 3] and again.trials[3].state == State.COMPLETE
    assert load_study(tmp_path / "tiny").best_value == again.best_value
    with pytest.raises(ValueError, match="created to maximize"):
        tune(ClassifyTrainer, LR_SPACE, n_trials=1, **{**kwargs, "metric": "val/acc", "direction": "minimize"})


def test_a_metric_the_trainer_never_logs_stops_the_study_in_its_first_trial(tmp_path, loaders):
    with pytest.raises(MetricNotLoggedError, match=r"'val/accuracy', which was never logged.*'val/acc'") as info:
        tune(ClassifyTrainer, LR_SPACE, hparams=tiny_hparams(classification_data()[0][:1]),
             train_loader=loaders[0], val_loader=loaders[1], num_epochs=2, metric="val/accuracy",
             direction="maximize", n_trials=3, base_dir=tmp_path)
    assert "Logged metrics: [" in str(info.value) and "'val/loss'" in str(info.value)
    study = load_study(tmp_path / "study")
    assert [t.state for t in study.trials] == [State.FAIL]  # recorded, and no second trial
    assert "never logged" in study.trials[0].user_attrs["error"]


WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import flaxlight
    from conftest import ClassifyTrainer, TinyMLP
    from flaxlight.tune import Float, tune

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    tune(ClassifyTrainer, {"optimizer_hparams.lr": Float(1e-3, 1e-1, log=True)},
         hparams=dict(model_class=TinyMLP, model_hparams={"hidden_dims": (8,), "output_dim": 2},
                      optimizer_hparams={"optimizer": "sgd", "lr": 0.1}, exmp_input=x[:1]),
         train_loader=flaxlight.ArrayLoader(x[:32], y[:32], batch_size=32),
         val_loader=flaxlight.ArrayLoader(x[32:], y[32:], batch_size=32),
         num_epochs=1, metric="val/acc", n_trials=int(sys.argv[3]), storage=sys.argv[2],
         study_name="shared", base_dir=sys.argv[4], pruner="none")
""")


def test_two_processes_share_one_sqlite_study(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    workers = [subprocess.Popen([sys.executable, str(script), str(TESTS), storage, "2", str(tmp_path / "runs")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
               for _ in range(2)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    study = load_study(storage, "shared")
    trials = study.trials
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert all(t.state == State.COMPLETE for t in trials)
    dirs = {t.user_attrs["log_dir"] for t in trials}
    assert len(dirs) == 4 and all((Path(d) / "checkpoints").is_dir() for d in dirs)
    assert sorted(os.listdir(tmp_path / "runs" / "shared")) == [f"trial_{i:04d}" for i in range(4)]


# ----------------------------------------------------------------------------- failures (no training)
class StandInTrainer:
    """What tune uses of a trainer, without training: validation values come from ``values``."""

    def __init__(self, hparams, values, error=None):
        self.callbacks = list(hparams["callbacks"])
        self.log_dir = hparams["logger_params"]["log_dir"]
        self.values, self.error = values, error
        self.callback_metrics, self.should_stop, self.stop_reason = {}, False, None
        self.current_epoch, self.global_step, self.options = 0, 0, flaxlight.TrainerOptions()

    def monitored_value(self, name, owner="monitor"):
        return flaxlight.TrainerModule.monitored_value(self, name, owner)

    def stop(self, reason):
        self.should_stop, self.stop_reason = True, reason

    def train_model(self, train_loader, val_loader, num_epochs):
        if self.error is not None:
            raise self.error
        for epoch, value in enumerate(self.values[:num_epochs], start=1):
            self.current_epoch = epoch
            self.callback_metrics["val/loss"] = value
            for callback in self.callbacks:
                callback.on_validation_end(self, epoch, {"val/loss": value})
            if self.should_stop:
                break
        return {"val/loss": self.callback_metrics["val/loss"]}


def stand_in_tune(tmp_path, plan, **kwargs):
    """tune() with trainers from ``plan``: one (values, error) per trial, in order."""
    calls = iter(plan)

    def factory(hparams):
        values, error = next(calls)
        if isinstance(error, RuntimeError) and "in the factory" in str(error):
            raise error
        return StandInTrainer(hparams, values, error)

    kwargs.setdefault("n_trials", len(plan))
    return tune(factory, LR_SPACE, train_loader=[], val_loader=[], num_epochs=3, metric="val/loss",
                base_dir=tmp_path, pruner="none", **kwargs)


def test_failed_trials_are_recorded_and_the_study_goes_on(tmp_path):
    study = stand_in_tune(tmp_path, [
        (None, RuntimeError("boom in the factory")),
        ([0.5, float("inf"), 0.1], None),  # Inf at epoch 2: stopped, failed
        (None, ValueError("bad batch")),
        ([0.5, 0.4, 0.3], None),
    ])
    trials = study.trials
    assert [t.state for t in trials] == [State.FAIL, State.FAIL, State.FAIL, State.COMPLETE]
    assert trials[0].user_attrs["error"] == "RuntimeError: boom in the factory"
    assert "val/loss is inf at epoch 2" in trials[1].user_attrs["error"]
    assert trials[1].user_attrs["epochs"] == 2 and trials[1].intermediate_values == {1: 0.5}
    assert trials[2].user_attrs["error"] == "ValueError: bad batch"
    assert study.best_value == 0.3 and study.best_trial.number == 3


def test_a_nan_validation_of_a_finite_training_is_not_reported_and_the_trial_goes_on(tmp_path):
    """A NaN (a 0/0: a validation that counted nothing for a masked metric) stopped the trial and
    failed it; a NaN of a training whose loss went NaN/Inf still does."""
    study = stand_in_tune(tmp_path, [([0.5, float("nan"), 0.3], None)])
    trial = study.trials[0]
    assert trial.state == State.COMPLETE and trial.value == 0.3 and trial.intermediate_values == {1: 0.5, 3: 0.3}
    diverged = PruningCallback(study.ask(), monitor="val/loss")
    trainer = StandInTrainer({"callbacks": [diverged], "logger_params": {"log_dir": str(tmp_path)}}, [float("nan")])
    trainer.nonfinite_steps = 2
    trainer.train_model(None, None, num_epochs=1)
    assert diverged.nonfinite and trainer.should_stop and "val/loss is nan at epoch 1" in trainer.stop_reason


def test_sigterm_while_a_trial_is_built_marks_it_failed_and_saves_the_study(tmp_path, caplog):
    """The process died at once, leaving the trial RUNNING until a later run's heartbeat check."""
    import os
    import signal

    def factory(hparams):
        if len(load_study(tmp_path / "study").trials) == 2:  # trial 1, while it is being built
            os.kill(os.getpid(), signal.SIGTERM)
        return StandInTrainer(hparams, [0.5])

    with pytest.raises(SystemExit) as exited:
        tune(factory, LR_SPACE, train_loader=[], val_loader=[], num_epochs=1, metric="val/loss", base_dir=tmp_path,
             n_trials=3, pruner="none")
    assert exited.value.code == 128 + signal.SIGTERM
    trials = load_study(tmp_path / "study").trials
    assert [t.state for t in trials] == [State.COMPLETE, State.FAIL]
    assert trials[1].user_attrs["error"] == "interrupted by SIGTERM before it trained"
    said = caplog.text
    assert "Interrupted while trial 1 was being built: tune does not resume a trial: trial 1 is marked failed" in said
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back

    def own_handler(signum, frame):
        pass

    def sets_a_handler(hparams):  # the user's own handler, set during the study, stays after it
        signal.signal(signal.SIGTERM, own_handler)
        return StandInTrainer(hparams, [0.5])

    try:
        tune(sets_a_handler, LR_SPACE, train_loader=[], val_loader=[], num_epochs=1, metric="val/loss",
             base_dir=tmp_path, study_name="own", n_trials=1, pruner="none")
        assert signal.getsignal(signal.SIGTERM) is own_handler
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_sigterm_while_a_trial_trains_says_tune_does_not_resume_it(tmp_path, loaders, caplog):
    """The trainer's message said "build the same trainer ... train_model(resume=True)", which tune never does."""
    import os
    import signal

    class TermAtStep(flaxlight.Callback):
        every_n_steps = 2

        def on_step(self, trainer, step):
            os.kill(os.getpid(), signal.SIGTERM)

    train, val = loaders
    hparams = dict(tiny_hparams(train.data[0][:1]), callbacks=[TermAtStep()], logger_params={"logger_type": "csv"})
    with pytest.raises(SystemExit):
        tune(ClassifyTrainer, LR_SPACE, hparams=hparams, train_loader=train, val_loader=val, num_epochs=2,
             metric="val/acc", base_dir=tmp_path, n_trials=2, pruner="none")
    assert [t.state for t in load_study(tmp_path / "study").trials] == [State.FAIL]
    assert "SIGTERM received: stopped after step 2" in caplog.text
    assert "tune does not resume a trial: trial 0 is marked failed" in caplog.text and "To resume" not in caplog.text


def test_a_continued_study_checks_its_search_space_against_its_trials_before_any_trial(tmp_path, caplog, recwarn):
    """Changed choices or a changed type failed every new trial (a wrong message, or a traceback not
    naming the key), a changed range went unsaid, a fixed value now searched read "0.1 -> '(not set)'"."""
    def run(space):
        hparams = {"model_hparams": {"hidden_dims": [8]}, "optimizer_hparams": {"lr": 0.1}}
        return tune(lambda hparams: StandInTrainer(hparams, [0.5]), space, hparams=hparams, train_loader=[],
                    val_loader=[], num_epochs=1, metric="val/loss", base_dir=tmp_path, n_trials=1, pruner="none")

    hidden = {"model_hparams.hidden_dims": Categorical([[8], [16]])}
    run(LR_SPACE)
    caplog.set_level("INFO", logger="flaxlight")
    with pytest.warns(UserWarning, match=r"model_hparams\.hidden_dims: \[8\] -> searched\)"):
        run({"optimizer_hparams.lr": Float(1e-2, 0.5, log=True), **hidden})
    assert ("search_space['optimizer_hparams.lr'] is float [0.01, 0.5] (log) now, float [0.001, 0.5] (log) in its "
            "earlier trials") in caplog.text
    refusals = [
        ({**LR_SPACE, "model_hparams.hidden_dims": Categorical([[4], [16]])},
         r"^search_space\['model_hparams.hidden_dims'\]: study 'study' searched it as choices \['\[8\]', '\[16\]'\] in "
         r"its earlier trials; this call gives choices \['\[4\]', '\[16\]'\]. A study cannot change a parameter's "
         r"choices .*another study_name, or keep choices \['\[8\]', '\[16\]'\]\.$"),
        ({"optimizer_hparams.lr": Categorical([0.1, 0.2]), **hidden},
         r"'optimizer_hparams.lr'\]: study 'study' searched it as float \[0.01, 0.5\] \(log\) .* this call gives "
         r"choices \[0.1, 0.2\]. A study cannot change a parameter's type"),
        ({"optimizer_hparams.lr": Float(1e-3, 0.5), **hidden}, r"cannot change a parameter's scale"),
    ]
    for space, message in refusals:
        with pytest.raises(ValueError, match=message):
            run(space)
    assert len(load_study(tmp_path / "study").trials) == 2  # no trial started, none failed


def test_a_study_says_its_best_model_metric_once_and_a_pruned_trial_once(tmp_path, loaders, caplog):
    """Each trial said "The best model is picked by val/acc (max)."; optuna repeated the pruning reason."""
    records = []  # optuna's own lines (its handler writes to the stderr of its first use)
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("optuna").addHandler(handler)
    caplog.set_level("INFO", logger="flaxlight")
    try:
        tune(ClassifyTrainer, LR_SPACE, hparams=tiny_hparams(classification_data()[0][:1]), train_loader=loaders[0],
             val_loader=loaders[1], num_epochs=1, metric="val/acc", n_trials=2, base_dir=tmp_path,
             pruner={"name": "threshold", "lower": 2.0})  # every trial pruned at its first validation
    finally:
        logging.getLogger("optuna").removeHandler(handler)
    assert caplog.text.count("The best model is picked by val/acc (max).") == 1
    assert caplog.text.count("PruningCallback: trial 1 pruned at epoch 1") == 1
    pruned = [r.getMessage() for r in records if "pruned" in r.getMessage()]
    assert len(pruned) == 2 and not [m for m in pruned if "PruningCallback" in m], pruned


def test_flaxlight_warnings_on_the_command_line_have_no_stray_source_line():
    """A warning attributed to the user's line showed the flaxlight script's `sys.exit(main())`."""
    from flaxlight import cli

    assert cli._command_line_warning("Study 's' is continued", UserWarning, sys.argv[0], 6) == \
        "UserWarning: Study 's' is continued\n"
    assert cli._command_line_warning("m", UserWarning, "/home/me/train.py", 3) == "/home/me/train.py:3: UserWarning: m\n"
    assert warnings.formatwarning is not cli._command_line_warning  # only while a command runs


def test_an_interrupted_trial_keeps_its_best_checkpoint_and_value_so_far(tmp_path, loaders):
    """It was FAIL with 'interrupted: SystemExit: 143' and no link to its checkpoint: its model was lost."""
    import signal

    class TermInSecondEpoch(flaxlight.Callback):
        every_n_steps = 4  # 3 steps an epoch: after the first validation

        def on_step(self, trainer, step):
            os.kill(os.getpid(), signal.SIGTERM)

    train, val = loaders
    hparams = dict(tiny_hparams(train.data[0][:1]), callbacks=[TermInSecondEpoch()])
    with pytest.raises(SystemExit):
        tune(ClassifyTrainer, LR_SPACE, hparams=hparams, train_loader=train, val_loader=val, num_epochs=3,
             metric="val/acc", base_dir=tmp_path, n_trials=1, pruner="none")
    (trial,) = load_study(tmp_path / "study").trials
    attrs = trial.user_attrs
    assert trial.state == State.FAIL and attrs["value_so_far"] == trial.intermediate_values[1]
    assert attrs["error"] == (f"interrupted by SIGTERM at epoch 2 (best val/acc {attrs['value_so_far']:.6g} so far, "
                              f"at {attrs['best_checkpoint']})")
    assert Path(attrs["best_checkpoint"]).parent == Path(attrs["log_dir"]) / "checkpoints"
    reloaded = ClassifyTrainer.load_from_checkpoint(attrs["log_dir"], train.data[0][:1], enable_progress_bar=False)
    assert reloaded.global_step >= 3


def test_a_misspelt_metric_can_be_fixed_on_the_same_study(tmp_path):
    """The error said "set metric= to a logged metric"; doing so was refused: "Study optimises 'val/los'"."""
    def run(metric):
        return tune(lambda hparams: StandInTrainer(hparams, [0.5]), LR_SPACE, train_loader=[], val_loader=[],
                    num_epochs=1, metric=metric, direction="minimize", base_dir=tmp_path, n_trials=1, pruner="none")

    with pytest.raises(MetricNotLoggedError, match="Did you mean 'val/loss'"):
        run("val/los")
    study = run("val/loss")  # the study had no value of 'val/los': it now optimises val/loss
    assert [t.state for t in study.trials] == [State.FAIL, State.COMPLETE] and study.user_attrs["metric"] == "val/loss"
    with pytest.raises(ValueError, match=r"optimises 'val/loss' \(1 trial\(s\) have values of it or are running\); "
                                         r"this call asks for 'val/mse'"):
        run("val/mse")


def test_too_many_failures_in_a_row_stop_the_study_and_uncaught_errors_propagate(tmp_path):
    with pytest.raises(TuneError, match="3 trials in a row failed.*boom"):
        stand_in_tune(tmp_path, [(None, RuntimeError("boom"))] * 5, max_failed_in_a_row=3, study_name="a")
    assert len(load_study(tmp_path / "a").trials) == 3
    with pytest.raises(RuntimeError, match="not caught"):
        stand_in_tune(tmp_path, [(None, RuntimeError("not caught"))], catch=(ValueError,), study_name="b")
    assert [t.state for t in load_study(tmp_path / "b").trials] == [State.FAIL]
    with pytest.raises(KeyboardInterrupt):
        stand_in_tune(tmp_path, [(None, KeyboardInterrupt())], study_name="c")
    trial = load_study(tmp_path / "c").trials[0]
    assert trial.state == State.FAIL and trial.user_attrs["error"].startswith("interrupted")


def test_pruning_callback_reports_stops_and_raises(tmp_path):
    study = optuna.create_study(direction="minimize", pruner=PruneTrialOne())
    study.optimize(lambda t: 1.0, n_trials=1)
    trial = study.ask()  # trial 1: pruned at its first report
    callback = PruningCallback(trial, monitor="val/loss")
    trainer = StandInTrainer({"callbacks": [callback], "logger_params": {"log_dir": str(tmp_path)}}, [0.9, 0.8, 0.7])
    trainer.train_model(None, None, num_epochs=3)
    assert callback.pruned and callback.pruned_epoch == 1 and trainer.should_stop
    assert trial.storage.get_trial(trial._trial_id).intermediate_values == {1: 0.9}
    with pytest.raises(optuna.TrialPruned, match="pruned at epoch 1"):
        callback.raise_if_pruned()
    with pytest.raises(TypeError, match="needs an optuna trial"):
        PruningCallback(object())
    with pytest.raises(ValueError, match="no completed trial"):
        load_best(optuna.create_study(), ClassifyTrainer, exmp_input=None)


# ----------------------------------------------------------------------------- plots
def test_plot_study_writes_the_four_pngs(tmp_path):
    storage = f"sqlite:///{tmp_path / 'plots.db'}"
    study = optuna.create_study(storage=storage, study_name="p", sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(8):
        trial = study.ask()
        lr, dropout = trial.suggest_float("optimizer_hparams.lr", 1e-4, 1e-1, log=True), trial.suggest_float("d", 0, 1)
        for epoch in (1, 2, 3):
            trial.report(abs(math.log10(lr) + 2) + 0.1 * dropout + 1 / epoch, epoch)
        study.tell(trial, abs(math.log10(lr) + 2) + 0.1 * dropout)
    paths = plot_study(storage, "p", tmp_path / "out")
    names = [Path(p).name for p in paths]
    assert names == ["optimization_history.png", "intermediate_values.png", "param_importances.png", "contour.png"]
    assert all(Path(p).stat().st_size > 5000 for p in paths)
    assert set(param_importances(study)) == {"optimizer_hparams.lr", "d"}
    # One trial: no importances or contour, the rest is still drawn.
    single = optuna.create_study(storage=f"sqlite:///{tmp_path / 'one.db'}")
    single.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    assert [Path(p).name for p in plot_study(tmp_path / "one.db", None, tmp_path / "one")] == [
        "optimization_history.png", "intermediate_values.png"]


# ----------------------------------------------------------------------------- configs (the CLI's entry)
def sine_config(tmp_path, **tune_section):
    return {
        "trainer": {"name": "regression", "max_epochs": 1, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "model": {"name": "mlp_regressor", "hparams": {"hidden_dims": [8], "output_dim": 1}},
        "optimizer": {"optimizer": "sgd", "lr": 0.01},
        "data": {"name": "sine", "batch_size": 32, "kwargs": {"num_train": 64, "num_val": 32, "num_test": 32}},
        "tune": {"search_space": {"optimizer_hparams.lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}},
                 "metric": "val/loss", "n_trials": 5, "base_dir": str(tmp_path), "study_name": "cfg",
                 **tune_section},
    }


def test_flaxlight_tune_and_plot_from_a_yaml_config(tmp_path, capsys):
    import yaml

    from flaxlight import cli
    from flaxlight.config import load_config
    from flaxlight.tune import parse_tune_config

    config = sine_config(tmp_path, pruner="none", sampler={"name": "random", "seed": 0})
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["tune", "-c", str(tmp_path / "tune.yaml"), "--n-trials", "1"]) == 0
    assert "best trial #0" in capsys.readouterr().out
    study = load_study(tmp_path / "cfg")
    trial = study.trials[0]
    assert trial.state == State.COMPLETE and study.direction == optuna.study.StudyDirection.MINIMIZE
    assert list(trial.params) == ["optimizer.lr"]  # the trainer-argument spelling maps to the config key
    log_dir = Path(trial.user_attrs["log_dir"])
    assert log_dir == tmp_path / "cfg" / "trial_0000" and (log_dir / "config.yaml").is_file()
    assert f"lr: {trial.params['optimizer.lr']}" in (log_dir / "config.yaml").read_text()
    assert cli.main(["plot", "--study", str(tmp_path / "cfg"), "-o", str(tmp_path / "plots")]) == 0
    assert sorted(os.listdir(tmp_path / "plots")) == ["intermediate_values.png", "optimization_history.png"]
    # The shipped config of the digits study parses (its run is the example's, tested below).
    shipped = load_config(TESTS.parent / "examples" / "configs" / "tune_digits_mlp.yaml")
    assert sorted(parse_tune_config(shipped.tune)["search_space"]) == [
        "model.hparams.dropout_prob", "optimizer.lr", "optimizer.weight_decay"]


def test_tune_from_config_checks_its_section_and_keys_before_any_trial(tmp_path):
    from flaxlight.config import ConfigError

    with pytest.raises(ValueError, match="no 'tune' section"):
        tune_from_config({k: v for k, v in sine_config(tmp_path).items() if k != "tune"})
    with pytest.raises(ValueError, match="Unknown key tune.n_trail. Did you mean 'n_trials'"):
        tune_from_config(sine_config(tmp_path, n_trail=3))
    bad = sine_config(tmp_path)
    bad["tune"]["search_space"] = {"model.hparams.hiden_dims": {"type": "categorical", "choices": [[8], [16]]}}
    with pytest.raises(ConfigError, match="hiden_dims"):
        tune_from_config(bad)
    from flaxlight.tune import _top

    assert _top(Float(0.95, 1.0, step=0.02)) == 0.99 and _top(Int(2, 9, step=2)) == 8  # the grid's top, not high
    later = sine_config(tmp_path)  # only the first choice was checked: every trial drawing 'adamz' failed
    later["tune"]["search_space"] = {"optimizer.optimizer": {"type": "categorical", "choices": ["adamw", "adamz"]}}
    with pytest.raises(ConfigError, match="Unknown optimizer 'adamz'.*Did you mean 'adam'"):
        tune_from_config(later)
    empty = sine_config(tmp_path)
    empty["tune"]["search_space"] = {}
    with pytest.raises(ValueError, match="search_space is empty"):
        tune_from_config(empty)
    assert not (tmp_path / "cfg").exists()


# ----------------------------------------------------------------------------- the example
def test_tune_digits_mlp_example_fast(tmp_path, capsys):
    pytest.importorskip("sklearn")
    sys.path.insert(0, str(TESTS.parent / "examples"))
    try:
        import tune_digits_mlp
    finally:
        sys.path.remove(str(TESTS.parent / "examples"))

    result = tune_digits_mlp.main(["--n-trials", "2", "--epochs", "1", "--hidden-dims", "32", "--base-dir",
                                   str(tmp_path), "--seed", "0"])
    out = capsys.readouterr().out
    assert "best trial: #" in out and "test accuracy of the reloaded best model" in out
    assert math.isclose(result["reloaded_val/acc"], result["best_value"], abs_tol=1e-6)  # the best checkpoint
    assert result["test/acc"] > 0.1 and set(result["best_params"]) == set(tune_digits_mlp.SEARCH_SPACE)
    assert set(result["importances"]) == set(tune_digits_mlp.SEARCH_SPACE)


# ----------------------------------------------------------------------------- set-up errors, clearly
def write_tune_config(tmp_path, **tune_section) -> Path:
    import yaml

    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(sine_config(tmp_path, **tune_section)))
    return path


@pytest.mark.parametrize("override, expected", [
    ("tune.search_space={optimizer.lr: {type: float, low: 0.5, high: 0.1}}",
     "tune.search_space['optimizer.lr']: low=0.5 > high=0.1; give the range as low <= high."),
    ("tune.search_space={optimizer.lr: {type: float, low: 0.1, hihg: 1.0}}", "Did you mean 'high'?"),
    ("tune.search_space={optimizer.lr: 0.1}", "tune.search_space['optimizer.lr'] = 0.1 is not a parameter"),
    ("tune.search_space={}", "tune.search_space is empty"),
    ("tune.direction=up", "tune.direction must be 'maximize' or 'minimize', got 'up'."),
    ("tune.study_name=..", "tune.study_name '..' is not a plain name"),
])
def test_flaxlight_tune_set_up_errors_are_one_line_exit_2(tmp_path, capsys, override, expected):
    from flaxlight import cli

    path = write_tune_config(tmp_path)
    code = cli.main(["tune", "-c", str(path), override])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith(f"flaxlight tune: error: {path}: ") and expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "cfg").exists() and not (tmp_path / "study.db").exists()


@pytest.mark.parametrize("name", ["..", "../..", "a/../../b", "a\\b", ".", ""])
def test_a_study_name_must_be_a_plain_name(tmp_path, name):
    base = tmp_path / "base"
    with pytest.raises(ValueError, match="study_name") as info:
        stand_in_tune(base, [([0.5], None)], study_name=name)
    if name:
        assert f"study_name {name!r} is not a plain name" in str(info.value) and "base_dir" in str(info.value)
    assert not base.exists() and sorted(os.listdir(tmp_path)) == []  # nothing written, inside or out
    with pytest.raises(flaxlight.config.ConfigError, match=r"^tune.study_name '../..' is not a plain name"):
        tune_from_config(sine_config(base, study_name="../.."))


def test_a_study_whose_every_trial_failed_raises_after_it_is_saved(tmp_path):
    with pytest.raises(TuneError) as info:
        stand_in_tune(tmp_path, [(None, RuntimeError("boom in the factory.")), (None, ValueError("bad batch"))],
                      study_name="broken")
    message = str(info.value)
    assert "Every trial of study 'broken' failed (2 of 2" in message
    assert "the first, trial 0: RuntimeError: boom in the factory. The study is saved" in message  # one period
    assert "run tune again" in message
    study = load_study(tmp_path / "broken")  # saved: both trials, with their errors
    assert [t.state for t in study.trials] == [State.FAIL, State.FAIL]
    assert study.trials[1].user_attrs["error"] == "ValueError: bad batch"
    # One trial that did not fail is a study that ran: no error.
    mixed = stand_in_tune(tmp_path, [(None, RuntimeError("boom")), ([0.5, 0.4], None)], study_name="mixed")
    assert [t.state for t in mixed.trials] == [State.FAIL, State.COMPLETE]


def test_flaxlight_tune_reports_a_study_that_failed_in_one_line(tmp_path, capsys, monkeypatch):
    from flaxlight import cli

    def failing_build_run(*args, **kwargs):
        raise RuntimeError("no GPU today")

    monkeypatch.setattr(flaxlight.config, "build_run", failing_build_run)
    code = cli.main(["tune", "-c", str(write_tune_config(tmp_path)), "--n-trials", "2"])
    out, err = capsys.readouterr()
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "flaxlight tune: error: Every trial of study 'cfg' failed" in err and "RuntimeError: no GPU today" in err


def test_a_metric_never_logged_names_the_closest_and_stops_at_the_first_validation(tmp_path, capsys):
    from flaxlight import cli

    config = sine_config(tmp_path, metric="val/accuracy", direction="maximize", n_trials=3)
    config["trainer"]["max_epochs"] = 3
    with pytest.raises(MetricNotLoggedError) as info:
        tune_from_config(config)
    message = str(info.value)
    assert message.startswith("tune(metric='val/accuracy'): the study optimises 'val/accuracy', which was never logged")
    assert "found before trial 0 trained" in message and "The closest logged name is 'val/loss'." in message
    assert "Logged metrics: ['val/loss']" in message
    study = load_study(tmp_path / "cfg")
    assert [t.state for t in study.trials] == [State.FAIL]
    metrics_dir = Path(study.trials[0].user_attrs["log_dir"]) / "metrics"
    assert not list(metrics_dir.glob("eval_epoch_*"))  # found before any training
    # The command line: one line, exit status 2, the config named.
    path = write_tune_config(tmp_path, metric="val/accuracy", direction="maximize", study_name="cli")
    code = cli.main(["tune", "-c", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"flaxlight tune: error: {path}: tune(metric='val/accuracy')" in err and "'val/loss'" in err


class RecordingStandIn(StandInTrainer):
    """A stand-in that records each train_model call (in ``trained``, shared by the class)."""

    trained: list = []

    def train_model(self, *args, **kwargs):
        self.trained.append(True)
        return super().train_model(*args, **kwargs)


def test_a_val_metric_without_validation_data_stops_before_training(tmp_path):
    trained = RecordingStandIn.trained = []
    Recording = RecordingStandIn
    with pytest.raises(MetricNotLoggedError, match=r"trial 0 has no validation data \(val_loader is None\), so "
                                                   r"the trainer never logs 'val/loss'"):
        tune(lambda hparams: Recording(hparams, [0.5]), LR_SPACE, train_loader=[], val_loader=None, num_epochs=1,
             metric="val/loss", base_dir=tmp_path, n_trials=2, pruner="none")
    assert trained == [] and [t.state for t in load_study(tmp_path / "study").trials] == [State.FAIL]


def test_a_train_metric_with_validation_data_stops_before_training_and_a_contradicting_direction_warns(tmp_path):
    """metric='train/loss' got the train/loss of the best validation's epoch (not the best, nor the
    last); direction='minimize' for 'val/acc' silently kept each trial's worst model."""
    trained = RecordingStandIn.trained = []
    Recording = RecordingStandIn
    with pytest.raises(TuneError, match=r"tune\(metric='train/loss'\) with validation data: .* give no validation "
                                        r"data to optimise the last epoch's train/loss"):
        tune(lambda hparams: Recording(hparams, [0.5]), LR_SPACE, train_loader=[], val_loader=[], num_epochs=1,
             metric="train/loss", base_dir=tmp_path, n_trials=3, pruner="none")
    assert trained == [] and [t.state for t in load_study(tmp_path / "study").trials] == [State.FAIL]
    with pytest.raises(MetricNotLoggedError, match=r"Did you mean 'val/loss'"):  # a typo, not a train/ metric
        tune(lambda hparams: Recording(hparams, [0.5]), LR_SPACE, train_loader=[], val_loader=[], num_epochs=1,
             metric="loss", base_dir=tmp_path, study_name="typo", n_trials=1, pruner="none")
    with pytest.warns(UserWarning, match=r"direction='minimize' for 'val/acc', whose name reads as a metric to "
                                         r"maximize: the study will keep each trial's lowest val/acc"):
        _check_direction("minimize", "val/acc")


def test_tune_from_config_import_paths_need_the_opt_in(tmp_path):
    config = sine_config(tmp_path, n_trials=1)
    config["data"]["name"] = "flaxlight.zoo.datasets.sine"
    with pytest.raises(flaxlight.config.ConfigError, match="^data.name: 'flaxlight.zoo.datasets.sine' is an "
                                                           "import path, which was not imported"):
        tune_from_config(config)
    assert not (tmp_path / "cfg").exists()
    study = tune_from_config(config, allow_imports=["flaxlight.zoo.datasets"])
    assert [t.state for t in study.trials] == [State.COMPLETE]


# ----------------------------------------------------------------------------- session 9: reruns and refusals
def test_a_journal_in_the_study_folder_is_created_and_found_by_the_folder(tmp_path, loaders):
    x0 = classification_data()[0][:1]
    journal = tmp_path / "studies" / "digits" / "journal.log"  # the folder does not exist yet
    tune(ClassifyTrainer, LR_SPACE, hparams=tiny_hparams(x0), train_loader=loaders[0], val_loader=loaders[1],
         num_epochs=1, metric="val/acc", n_trials=1, storage=str(journal), study_name="digits",
         base_dir=tmp_path / "studies", seed=0)
    assert len(load_study(tmp_path / "studies" / "digits").trials) == 1


def test_a_seeded_rerun_continues_the_search_instead_of_replaying_it(tmp_path, loaders):
    x0 = classification_data()[0][:1]
    for _ in range(2):
        study = tune(ClassifyTrainer, LR_SPACE, hparams=tiny_hparams(x0), train_loader=loaders[0],
                     val_loader=loaders[1], num_epochs=1, metric="val/acc", n_trials=2, base_dir=tmp_path, seed=0)
    rates = [t.params["optimizer_hparams.lr"] for t in study.trials]
    assert len(rates) == 4 and len(set(rates)) == 4


def test_workers_given_different_seeds_draw_different_trials_whenever_they_join(tmp_path, loaders):
    """Seed 1 joining a study of 1 trial was re-seeded 1 + 1 = 2: the same samples as seed 2 at 0 trials."""
    x0 = classification_data()[0][:1]
    common = dict(hparams=tiny_hparams(x0), train_loader=loaders[0], val_loader=loaders[1], num_epochs=1,
                  metric="val/acc", n_trials=1)
    fresh = tune(ClassifyTrainer, LR_SPACE, **common, base_dir=tmp_path / "a", seed=2)  # the first worker

    def join_with_seed_1(base_dir):  # the other worker, joining once trial 0 is there
        storage = make_storage(None, default_path=base_dir / "study" / "study.db")
        study = optuna.create_study(storage=storage, study_name="study", direction="maximize")
        study.add_trial(optuna.trial.create_trial(state=State.FAIL))
        return tune(ClassifyTrainer, LR_SPACE, **common, base_dir=base_dir, seed=1).trials[1].params

    lr = "optimizer_hparams.lr"
    joined = join_with_seed_1(tmp_path / "b")
    assert joined[lr] != fresh.trials[0].params[lr]
    assert join_with_seed_1(tmp_path / "c") == joined  # a continued study stays reproducible for its seed


def test_a_trial_whose_loss_went_nan_fails_even_when_its_accuracy_is_finite(tmp_path, loaders, capfd):
    x0 = classification_data()[0][:1]
    hparams = {**tiny_hparams(x0), "optimizer_hparams": {"optimizer": "sgd", "lr": 1e30, "schedule": "constant",
                                                         "gradient_clip": None}}
    optuna_log = []  # optuna's "Trial 0 failed" records (its handler writes to the stderr of its first use)
    handler = logging.Handler()
    handler.emit = optuna_log.append
    logging.getLogger("optuna.study._optimize").addHandler(handler)
    with pytest.raises(TuneError, match=r"FloatingPointError: PruningCallback: by epoch 1, the loss was NaN/Inf in "
                                        r"\d+ step\(s\), the first between steps 1 and 3 \(epoch 1, batches 1-3\); "
                                        r"the parameters hold NaN/Inf, so the model is damaged"):
        tune(ClassifyTrainer, {"seed": Int(0, 3)}, hparams=hparams, train_loader=loaders[0], val_loader=loaders[1],
             num_epochs=3, metric="val/acc", n_trials=1, base_dir=tmp_path)
    (trial,) = load_study(tmp_path / "study").trials
    assert trial.state == State.FAIL and "NaN/Inf" in trial.user_attrs["error"]
    # said once (the PruningCallback line), without a traceback through flaxlight's code or a checkpoint warning
    logging.getLogger("optuna.study._optimize").removeHandler(handler)
    err = capfd.readouterr().err + "".join(f"{r.getMessage()} {r.exc_info}\n" for r in optuna_log)
    assert err.count("the parameters hold NaN/Inf") == 1 and "Traceback" not in err and "_TrialFailed" not in err, err
    assert "trial 0 diverged (NaN/Inf): see the PruningCallback line above" in err and " None\n" in err
    # stopped at its first validation, its chance-level accuracy never reported to the pruner (it trained on)
    assert trial.user_attrs["epochs"] == 1 and trial.intermediate_values == {}


class NaNLossAtSecondStep(ClassifyTrainer):
    """One bad batch: the second step's loss is NaN, its gradient zero (the parameters stay finite)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        import jax.numpy as jnp

        loss, aux = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return jnp.where(train & (state.step == 1), jnp.nan, loss), aux


def test_a_trial_whose_loss_went_nan_with_finite_parameters_says_so_not_that_the_model_is_damaged(tmp_path, loaders):
    """A NaN loss of a finite model (a bad batch) failed the trial as "the model is damaged"."""
    x0 = classification_data()[0][:1]
    with pytest.raises(TuneError) as failed:
        tune(NaNLossAtSecondStep, {"seed": Int(0, 3)}, hparams={**tiny_hparams(x0), "log_every_n_steps": 1},
             train_loader=loaders[0], val_loader=loaders[1], num_epochs=1, metric="val/acc", n_trials=1,
             base_dir=tmp_path)
    assert "so the model is damaged" not in str(failed.value)
    assert ("PruningCallback: by epoch 1, the loss was NaN/Inf in 1 step(s), the first at step 2 (epoch 1, batch 2), "
            "but the parameters and the optimizer state stayed finite: a data problem") in str(failed.value)


def test_shared_loggers_and_a_checkpoint_ranking_by_another_metric_are_refused(tmp_path, loaders):
    x0 = classification_data()[0][:1]
    common = dict(train_loader=loaders[0], val_loader=loaders[1], metric="val/acc", base_dir=tmp_path, n_trials=1)
    with pytest.raises(ValueError, match=r"every trial would share.*logger_params=\{'logger_type'"):
        tune(ClassifyTrainer, LR_SPACE, hparams={**tiny_hparams(x0), "loggers": [flaxlight.loggers.CSVLogger(tmp_path)]},
             **common)
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(monitor='val/loss'\).*give it monitor='val/acc'"):
        tune(ClassifyTrainer, LR_SPACE, **common,
             hparams={**tiny_hparams(x0), "callbacks": [flaxlight.ModelCheckpoint(monitor="val/loss")]})
    # its default mode 'min' against a maximised accuracy: every trial failed in the trainer's check
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(monitor='val/acc', mode='min'\) keeps the opposite"):
        tune(ClassifyTrainer, LR_SPACE, **common, direction="maximize",
             hparams={**tiny_hparams(x0), "callbacks": [flaxlight.ModelCheckpoint(monitor="val/acc")]})
    assert not (tmp_path / "study").exists()


def test_a_new_study_over_an_earlier_ones_trial_folders_is_refused_before_any_trial(tmp_path, loaders, capsys):
    x0 = classification_data()[0][:1]
    common = dict(hparams=tiny_hparams(x0), train_loader=loaders[0], val_loader=loaders[1], num_epochs=1,
                  metric="val/acc", n_trials=1, base_dir=tmp_path)
    tune(ClassifyTrainer, LR_SPACE, **common)
    os.remove(tmp_path / "study" / "study.db")  # started over: a new study in the same folder
    with pytest.raises(FileExistsError, match=r"holds the trial folders of an earlier study \(trial_0000\).*another "
                                              r"study_name or base_dir"):
        tune(ClassifyTrainer, LR_SPACE, **common)
    assert not (tmp_path / "study" / "study.db").exists()  # it left an empty study there (and exited 1)
    storage = str(tmp_path / "elsewhere.db")  # another storage: refused before the study is created in it
    with pytest.raises(FileExistsError, match=r"\(0 trials\)"):
        tune(ClassifyTrainer, LR_SPACE, **common, storage=storage)
    assert optuna.get_all_study_summaries(make_storage(storage)) == []
    from flaxlight import cli

    os.makedirs(tmp_path / "cfg" / "trial_0000")
    (tmp_path / "cfg" / "trial_0000" / "metrics.csv").write_text("epoch\n1\n")
    capsys.readouterr()
    assert cli.main(["tune", "--config", str(write_tune_config(tmp_path))]) == 2  # a set-up error, not a failed run
    err = capsys.readouterr().err
    assert err.startswith("flaxlight tune: error: ") and "holds the trial folders" in err and err.count("\n") == 1
    assert os.listdir(tmp_path / "cfg") == ["trial_0000"]


@pytest.mark.parametrize("settings, message", [
    ({"timeout": "10"}, "timeout must be a number of seconds > 0"),
    ({"timeout": -5}, "timeout must be a number of seconds > 0"),
    ({"seed": "zero"}, "seed must be an int >= 0"),
    ({"base_dir": 5}, "base_dir must be a folder's path"),
    ({"sampler": "tpes"}, "Unknown sampler 'tpes'. Did you mean 'tpe'"),  # it left an empty study.db behind
])
def test_bad_study_settings_are_refused_before_any_trial(tmp_path, loaders, settings, message):
    x0 = classification_data()[0][:1]
    options = dict(hparams=tiny_hparams(x0), train_loader=loaders[0], val_loader=loaders[1], metric="val/acc",
                   n_trials=1, base_dir=tmp_path)
    with pytest.raises(ValueError, match=message):
        tune(ClassifyTrainer, LR_SPACE, **{**options, **settings})
    assert not (tmp_path / "study").exists()
