"""tune(): set-up mistakes in ``hparams`` are refused before the first trial.

- a ``monitor``/``mode`` in ``hparams`` other than the study's metric/direction (it used to be
  half-kept: the user's monitor ranked with the study's mode, so each trial kept its worst
  checkpoint and the study recorded that epoch's value);
- a search-space key that cannot be set inside ``hparams`` (an optax transformation taken for a
  list, an index into a short list): it used to fail in every trial, recorded in the study.
"""

from __future__ import annotations

import csv
import os

import numpy as np
import optax
import pytest
import yaml

optuna = pytest.importorskip("optuna")

import flaxlight  # noqa: E402
from flaxlight.tune import Float, load_study, tune  # noqa: E402

from conftest import ClassifyTrainer, TinyMLP  # noqa: E402


def data(num: int = 128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num, 4)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32)


@pytest.fixture
def loaders():
    x, y = data()
    return (flaxlight.ArrayLoader(x[:96], y[:96], batch_size=32, shuffle=True, seed=0),
            flaxlight.ArrayLoader(x[96:], y[96:], batch_size=32))


def tiny_hparams(**extra):
    return dict(model_class=TinyMLP, model_hparams={"hidden_dims": (8,), "output_dim": 2},
                optimizer_hparams={"optimizer": "sgd", "lr": 0.1}, exmp_input=data()[0][:1], **extra)


LR = {"optimizer_hparams.lr": Float(1e-2, 0.5, log=True)}


# ----------------------------------------------------------------------------- monitor / mode
@pytest.mark.parametrize("metric, extra, message", [
    ("val/acc", {"monitor": "val/loss"},
     r"hparams\['monitor'\]='val/loss' would rank a trial's checkpoints by another metric than the study's "
     r"'val/acc'.*remove 'monitor' \(and 'mode'\) from hparams, or optimise that metric \(metric='val/loss'\)"),
    ("val/loss", {"monitor": "val/acc", "mode": "max"}, r"hparams\['monitor'\]='val/acc'.*study's 'val/loss'"),
    ("val/acc", {"mode": "min"},
     r"hparams\['mode'\]='min' is the opposite of the study's direction='maximize' \(mode='max' for 'val/acc'\), "
     r"so each trial would keep its worst checkpoint.*remove 'mode' from hparams, or pass direction='minimize'"),
    ("val/acc", {"monitor": "val/acc", "mode": "min"}, r"hparams\['mode'\]='min' is the opposite"),
    ("val/loss", {"mode": "minimize"}, r"hparams\['mode'\]='minimize' is neither 'min' nor 'max'"),
])
def test_a_monitor_or_mode_in_hparams_other_than_the_studys_is_refused_before_any_trial(
        tmp_path, loaders, metric, extra, message):
    with pytest.raises(ValueError, match=message):
        tune(ClassifyTrainer, LR, hparams=tiny_hparams(**extra), train_loader=loaders[0], val_loader=loaders[1],
             num_epochs=1, metric=metric, n_trials=1, base_dir=tmp_path, pruner="none")
    assert not (tmp_path / "study").exists()  # no study, no trial


@pytest.mark.parametrize("extra", [{"monitor": "val/acc", "mode": "max"}, {"monitor": "val/acc"}, {"mode": "max"},
                                   {"monitor": None}])
def test_a_monitor_and_mode_equal_to_the_studys_are_fine_and_the_value_is_the_best_epochs(tmp_path, loaders, extra):
    study = tune(ClassifyTrainer, LR, hparams=tiny_hparams(**extra), train_loader=loaders[0],
                 val_loader=loaders[1], num_epochs=3, metric="val/acc", n_trials=1, base_dir=tmp_path,
                 pruner="none")
    (trial,) = study.trials
    with open(os.path.join(trial.user_attrs["log_dir"], "metrics.csv")) as f:
        accs = [float(row["val/acc"]) for row in csv.DictReader(f) if row.get("val/acc")]
    assert len(accs) == 3 and trial.value == pytest.approx(max(accs))
    with open(os.path.join(trial.user_attrs["log_dir"], "hparams.yaml")) as f:
        saved = yaml.safe_load(f)
    assert (saved["monitor"], saved["mode"]) == ("val/acc", "max")


# ----------------------------------------------------------------------------- keys set inside hparams
def test_tuning_the_lr_of_an_optax_transformation_fails_before_any_trial_and_names_the_ways_that_work(
        tmp_path, loaders):
    hparams = tiny_hparams()
    hparams["optimizer_hparams"] = optax.adamw(1e-3)
    common = dict(hparams=hparams, train_loader=loaders[0], val_loader=loaders[1], num_epochs=1, metric="val/acc",
                  n_trials=6, base_dir=tmp_path, pruner="none")
    message = (r"search_space key 'optimizer_hparams.lr': 'optimizer_hparams' is an optax GradientTransformation, "
               r"a ready optimizer whose settings \(its learning rate included\) are fixed inside it, so 'lr' "
               r"cannot be set by key\. To tune it, give optimizer_hparams in the dict form .*"
               r"flaxlight\.OptimizerConfig\(optimizer='adamw', lr=1e-3\).*trainer factory f\(hparams\) -> trainer")
    with pytest.raises(ValueError, match=message):
        tune(ClassifyTrainer, LR, **common)
    with pytest.raises(ValueError, match=message):  # a factory's hparams are set the same way
        tune(lambda h: ClassifyTrainer(**h), LR, **common)
    assert not (tmp_path / "study").exists()  # no trial recorded as failed, no study


def test_every_key_and_every_choice_is_set_inside_hparams_before_the_first_trial(tmp_path, loaders):
    common = dict(hparams=tiny_hparams(), train_loader=loaders[0], val_loader=loaders[1], num_epochs=1,
                  metric="val/acc", n_trials=3, base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"'model_hparams.hidden_dims' is a list of 1 items; '2' is not an index"):
        tune(ClassifyTrainer, {"model_hparams.hidden_dims.2": Float(4, 8)}, **common)
    with pytest.raises(ValueError, match=r"'optimizer_hparams.lr' is float \(0.1\), not a dict, so 'scale'"):
        tune(ClassifyTrainer, {"optimizer_hparams.lr.scale": Float(0.1, 1.0)}, **common)
    assert not (tmp_path / "study").exists()


def test_an_optimizer_config_lr_is_tuned_by_key(tmp_path, loaders):
    hparams = tiny_hparams()
    hparams["optimizer_hparams"] = flaxlight.OptimizerConfig(optimizer="sgd", lr=0.1)
    study = tune(ClassifyTrainer, LR, hparams=hparams, train_loader=loaders[0], val_loader=loaders[1],
                 num_epochs=1, metric="val/acc", n_trials=1, base_dir=tmp_path, pruner="none")
    (trial,) = load_study(tmp_path / "study").trials
    with open(os.path.join(trial.user_attrs["log_dir"], "hparams.yaml")) as f:
        saved = yaml.safe_load(f)["optimizer_hparams"]
    assert trial.state.name == "COMPLETE" and study.best_trial.number == 0
    assert saved["optimizer"] == "sgd" and saved["lr"] == pytest.approx(trial.params["optimizer_hparams.lr"])


def test_the_factory_route_the_message_names_tunes_an_optax_chains_lr(tmp_path, loaders):
    def make(h):
        return ClassifyTrainer(**{k: v for k, v in h.items() if k != "lr"}, optimizer_hparams=optax.sgd(h["lr"]))

    hparams = {k: v for k, v in tiny_hparams().items() if k != "optimizer_hparams"}
    study = tune(make, {"lr": Float(1e-2, 0.5, log=True)}, hparams=hparams, train_loader=loaders[0],
                 val_loader=loaders[1], num_epochs=1, metric="val/acc", n_trials=1, base_dir=tmp_path, pruner="none")
    assert [t.state.name for t in study.trials] == ["COMPLETE"]


# ----------------------------------------------------------------------------- the same from a config
def digits_config(tmp_path, trainer, **tune_section):
    return {
        "trainer": {"name": "classification", "max_epochs": 3, "enable_progress_bar": False,
                    "enable_model_summary": False, **trainer},
        "model": {"name": "mlp_classifier", "hparams": {"hidden_dims": [16], "num_classes": 10}},
        "optimizer": {"optimizer": "adam", "lr": 3e-3},
        "data": {"name": "digits", "batch_size": 128},
        "tune": {"search_space": {"optimizer.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}},
                 "metric": "val/acc", "n_trials": 1, "base_dir": str(tmp_path), "study_name": "cfg",
                 "pruner": "none", **tune_section},
    }


def test_a_config_trainer_monitor_other_than_the_studys_is_refused_before_any_trial(tmp_path):
    from flaxlight.config import ConfigError
    from flaxlight.tune import tune_from_config

    with pytest.raises(ConfigError, match=r"trainer.monitor='val/loss' would rank a trial's checkpoints by another "
                                          r"metric.*remove 'monitor' \(and 'mode'\) from the trainer section"):
        tune_from_config(digits_config(tmp_path, {"monitor": "val/loss", "mode": "min"}))
    assert not (tmp_path / "cfg").exists()


@pytest.mark.parametrize("trainer", [{"monitor": "val/acc"}, {"monitor": "val/acc", "mode": "min"}])
def test_a_config_trainer_monitor_gets_the_studys_mode(tmp_path, trainer):
    """``trainer: {monitor: val/acc}`` kept the trainer's mode, by default 'min', in each trial: the
    trial ranked by the lowest accuracy and the study recorded its worst epoch. A config's mode
    cannot be told from the default (the CLI passes the config with its defaults), so it follows
    the study's direction."""
    pytest.importorskip("sklearn")
    from flaxlight.tune import tune_from_config

    study = tune_from_config(digits_config(tmp_path, trainer))
    (trial,) = study.trials
    log_dir = trial.user_attrs["log_dir"]
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        accs = [float(row["val/acc"]) for row in csv.DictReader(f) if row.get("val/acc")]
    assert len(accs) == 3 and trial.value == pytest.approx(max(accs)) and max(accs) > min(accs)
    with open(os.path.join(log_dir, "config.yaml")) as f:
        saved = yaml.safe_load(f)["trainer"]
    assert (saved["monitor"], saved["mode"]) == ("val/acc", "max")


# ----------------------------------------------------------------------------- a study continued with another set-up
def test_a_study_continued_with_other_fixed_settings_is_warned_about_naming_them(tmp_path, loaders, recwarn):
    """Optuna loads an existing study and mixes the new trials with the old ones, and the best trial is
    picked across both set-ups: the change is said, naming each setting; the same set-up continued is
    not warned about, and neither is a changed range of a searched key's base value."""
    train, val = loaders

    def run(num_epochs, hidden, lr=0.1):
        hparams = tiny_hparams()
        hparams["model_hparams"] = {"hidden_dims": hidden, "output_dim": 2}
        hparams["optimizer_hparams"] = {"optimizer": "sgd", "lr": lr}
        return tune(ClassifyTrainer, LR, hparams=hparams, train_loader=train, val_loader=val, num_epochs=num_epochs,
                    metric="val/acc", n_trials=1, base_dir=tmp_path, study_name="s", seed=0)

    run(1, (8,))
    run(1, (8,), lr=0.3)  # the base value of a searched key: overridden in every trial anyway
    assert not [w for w in recwarn if "other fixed settings" in str(w.message)]
    with pytest.warns(UserWarning, match=r"Study 's' is continued with other fixed settings than its last call "
                                         r"\(hparams\.model_hparams\.hidden_dims: \[8\] -> \[16\]; num_epochs: 1 -> 2\)"
                                         r".*give this set-up another study_name") as caught:
        study = run(2, (16,))
    assert [w.filename for w in caught if "other fixed settings" in str(w.message)] == [__file__]
    assert len(study.trials) == 3


# ----------------------------------------------------------------------------- a run too short for its warmup
def sine_warmup_config(tmp_path, warmup, search_space=None):
    """Trials of 2 train steps (64 examples, batch 32, 1 epoch) with ``warmup`` optimizer updates."""
    search = search_space or {"optimizer.lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}}
    return {
        "trainer": {"name": "regression", "max_epochs": 1, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "model": {"name": "mlp_regressor", "hparams": {"hidden_dims": [8], "output_dim": 1}},
        "optimizer": {"optimizer": "adam", "lr": 0.01, "warmup_steps": warmup},
        "data": {"name": "sine", "batch_size": 32, "kwargs": {"num_train": 64, "num_val": 32, "num_test": 32}},
        "tune": {"search_space": search, "metric": "val/loss", "n_trials": 3, "base_dir": str(tmp_path),
                 "study_name": "cfg", "pruner": "none"},
    }


def test_flaxlight_tune_refuses_a_warmup_longer_than_every_trial_before_the_first_one(tmp_path, capsys):
    """Five trials failed, each with two tracebacks, then 'Stopped study', exit 1 (fit: one line, exit 2)."""
    from flaxlight import cli

    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(sine_warmup_config(tmp_path, warmup=5)))
    code = cli.main(["tune", "-c", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"flaxlight tune: error: {path}: no trial can start: optimizer.warmup_steps=5 "
                          f"is longer than the run: 2 optimizer updates")
    assert "Nothing in the search space (optimizer.lr) changes the run's length or warmup" in err
    assert not (tmp_path / "cfg").exists()  # no study, no trial folder


def test_tune_refuses_a_warmup_longer_than_every_trial_before_the_first_one(tmp_path, loaders):
    hparams = tiny_hparams()
    hparams["optimizer_hparams"] = {"optimizer": "sgd", "lr": 0.1, "warmup": 10}  # 3 batches per trial
    with pytest.raises(ValueError, match=r"no trial can start: optimizer_hparams\['warmup_steps'\]=10 is longer than "
                                         r"the run: 3 optimizer updates.*search space \(hparams.optimizer_hparams.lr\)"):
        tune(ClassifyTrainer, LR, hparams=hparams, train_loader=loaders[0], val_loader=loaders[1], num_epochs=1,
             metric="val/acc", n_trials=1, base_dir=tmp_path)
    assert not (tmp_path / "study").exists()
    study = tune(ClassifyTrainer, LR, hparams=hparams, train_loader=loaders[0], val_loader=loaders[1], num_epochs=4,
                 metric="val/acc", n_trials=1, base_dir=tmp_path, pruner="none")  # 12 updates: fits
    assert [t.state.name for t in study.trials] == ["COMPLETE"]


def test_a_searched_warmup_too_long_fails_its_trials_without_tracebacks(tmp_path, caplog):
    """The search space changes the warmup, so only a trial can tell: each fails with one line."""
    from flaxlight.tune import TuneError, tune_from_config

    config = sine_warmup_config(tmp_path, warmup=0, search_space={"optimizer.warmup_steps": {
        "type": "int", "low": 3, "high": 5}})
    with pytest.raises(TuneError, match=r"Every trial of study 'cfg' failed.*warmup_steps'\]=\d is longer than"):
        tune_from_config(config, n_trials=2)
    failed = [r for r in caplog.records if r.name.startswith("optuna") and "is longer than the run" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info is None for r in failed)  # was: two chained tracebacks each
    assert [t.state.name for t in load_study(tmp_path / "cfg").trials] == ["FAIL", "FAIL"]
