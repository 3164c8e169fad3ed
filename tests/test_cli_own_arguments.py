"""A trainer's own constructor arguments from a config (fit, resume, tune), and `flaxlight predict`
on a model of several outputs (a dict or a tuple): what the command line does with them."""

from __future__ import annotations

import logging
import shutil

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import flaxlight
from flaxlight import cli, registry
from flaxlight.config import ConfigError, build_data, build_trainer, example_input, load_config, load_trainer


class TwoHeads(nn.Module):
    """A regression head and an auxiliary one, in a nested dict."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(4)(x))
        y, aux = nn.Dense(1)(h), nn.Dense(2)(h)
        return {"y": y, "extra": {"aux": aux}}


class WeightedTwoHeads(flaxlight.TrainerModule):
    """docs/models.md's pattern: a loss weight of its own, the rest (model_class, ...) passed on."""

    def __init__(self, w_aux: float = 0.0, **kwargs):
        self.w_aux = w_aux
        super().__init__(w_aux=w_aux, **kwargs)

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        out, updates = state.apply_model(params, x, train=train, rng=rng)
        loss = jnp.mean((out["y"] - y) ** 2) + self.w_aux * jnp.mean(out["extra"]["aux"] ** 2)
        return loss, ({}, updates)


registry.register_model("two_heads_for_cli_tests", TwoHeads)
registry.register_trainer("weighted_two_heads_for_cli_tests", WeightedTwoHeads)
CONFIG = {
    "trainer": {"name": "weighted_two_heads_for_cli_tests", "w_aux": 0.25, "max_epochs": 1,
                "enable_progress_bar": False, "enable_model_summary": False},
    "model": {"name": "two_heads_for_cli_tests"},
    "optimizer": {"optimizer": "adam", "lr": 1e-2},
    "data": {"name": "sine", "batch_size": 32, "kwargs": {"num_train": 64, "num_val": 32, "num_test": 32}},
}


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def dict_run(tmp_path_factory):
    """A run of the dict-output model, its loss weight set on the command line."""
    tmp_path = tmp_path_factory.mktemp("own")
    config = tmp_path / "dict.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    assert cli.main([str(a) for a in ("fit", "-c", config, "--log-dir", tmp_path / "dict", "trainer.w_aux=2.0")]) == 0
    return config, tmp_path / "dict"


def test_a_trainers_own_argument_is_a_key_of_the_trainer_section(dict_run, tmp_path, capsys):
    """A trainer with **kwargs was taken for one that picks its model itself, and trainer.w_aux
    was an unknown key: such a trainer could not run from a config at all."""
    config, run_dir = dict_run
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["w_aux"] == 2.0  # the override's
    assert yaml.safe_load((run_dir / "hparams.yaml").read_text())["w_aux"] == 2.0  # what the trainer got
    assert load_config(run_dir / "config.yaml").trainer.own_args == {"w_aux": 2.0}
    # A typo and a wrong type are refused in one line, before anything is written.
    code, _, err = run(capsys, "fit", "-c", config, "--log-dir", tmp_path / "typo", "trainer.w_axu=1.0")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "Unknown key 'trainer.w_axu'. Did you mean 'trainer.w_aux'?" in err
    assert f"sharding_rules; and {__name__}.WeightedTwoHeads's own arguments (its __init__ declares them): w_aux." \
        in err
    code, _, err = run(capsys, "fit", "-c", config, "--log-dir", tmp_path / "typo", "trainer.w_aux=heavy")
    assert code == 2 and "trainer.w_aux: expected float, got str 'heavy'." in err
    assert not (tmp_path / "typo").exists()
    code, out, _ = run(capsys, "fit", "-c", config, "--print-config", "trainer.w_aux=0.5")  # imports nothing
    assert code == 0 and yaml.safe_load(out)["trainer"]["w_aux"] == 0.5
    code, _, err = run(capsys, "fit", "-c", config, "--print-config", "--trainer.w_axu=0.5")
    assert code == 2 and "Did you mean 'trainer.w_aux'?" in err
    # A resume with another weight: announced, recorded, the earlier config and hparams kept.
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    code, _, err = run(capsys, "fit", "-c", config, "--resume", resumed, "trainer.max_epochs=2", "trainer.w_aux=3.0")
    assert code == 0, err
    assert "(w_aux: 2.0 -> 3.0)" in err and "trainer.w_aux" not in err  # said once: with hparams.yaml's changes
    assert "config.yaml recorded (trainer.max_epochs: 1 -> 2)" in err  # no hparam: said with config.yaml's
    assert yaml.safe_load((resumed / "config.yaml").read_text())["trainer"]["w_aux"] == 3.0
    assert yaml.safe_load((resumed / "config.1.yaml").read_text())["trainer"]["w_aux"] == 2.0
    assert yaml.safe_load((resumed / "hparams.yaml").read_text())["w_aux"] == 3.0


def test_tune_searches_a_trainers_own_argument(dict_run, tmp_path, capsys):
    config, _ = dict_run
    tune = {**CONFIG, "tune": {"search_space": {"trainer.w_aux": {"type": "categorical", "choices": [0.5]}},
                               "metric": "val/loss", "n_trials": 1, "base_dir": str(tmp_path / "studies")}}
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(tune))
    code, out, err = run(capsys, "tune", "-c", tmp_path / "tune.yaml")
    assert code == 0, err
    assert "trainer.w_aux: 0.5" in out
    trial = tmp_path / "studies" / "study" / "trial_0000"
    assert yaml.safe_load((trial / "config.yaml").read_text())["trainer"]["w_aux"] == 0.5
    assert yaml.safe_load((trial / "hparams.yaml").read_text())["w_aux"] == 0.5
    tune["tune"]["search_space"] = {"trainer.w_axu": {"type": "float", "low": 0.1, "high": 1.0}}
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(tune))
    code, _, err = run(capsys, "tune", "-c", tmp_path / "typo.yaml")
    assert code == 2 and "Did you mean 'trainer.w_aux'?" in err


def test_predict_writes_a_dict_of_outputs_as_one_npz(dict_run, capsys):
    """It predicted the whole split, then failed with a TypeError traceback (exit 1), writing nothing."""
    config, run_dir = dict_run
    code, out, err = run(capsys, "predict", "--ckpt", run_dir, "--split", "val")
    path = run_dir / "predictions_val.npz"
    assert code == 0, err
    assert out.rstrip().endswith(f"an array per key: extra/aux (32, 2) float32, y (32, 1) float32): {path}")
    saved = np.load(path)
    assert sorted(saved.files) == ["extra/aux", "y"]
    cfg = load_config(config)
    train, val, _ = build_data(cfg)
    expected = load_trainer(cfg, run_dir, example_input(train)).predict(val)
    np.testing.assert_allclose(saved["y"], expected["y"], rtol=1e-6)
    np.testing.assert_allclose(saved["extra/aux"], expected["extra"]["aux"], rtol=1e-6)


def test_predict_writes_a_tuple_of_outputs_by_position_and_refuses_what_is_no_array(dict_run, tmp_path, capsys,
                                                                                    monkeypatch):
    """A tuple, as trainer.predict returns it for a model of two outputs (faked here: no second run)."""
    _, run_dir = dict_run
    monkeypatch.setattr(WeightedTwoHeads, "predict", lambda self, data, **kwargs: (np.zeros((32, 1), np.float32),
                                                                                   np.ones((32, 2), np.float32)))
    code, out, err = run(capsys, "predict", "--ckpt", run_dir, "-o", tmp_path / "out" / "preds.npy")
    assert code == 0, err
    assert out.rstrip().endswith(str(tmp_path / "out" / "preds.npz"))  # the file written: .npz, not .npy
    saved = np.load(tmp_path / "out" / "preds.npz")
    assert saved.files == ["0", "1"] and saved["0"].shape == (32, 1) and (saved["1"] == 1).all()
    monkeypatch.setattr(WeightedTwoHeads, "predict", lambda self, data, **kwargs: {"label": ["cat", "dog"]})
    code, _, err = run(capsys, "predict", "--ckpt", run_dir, "-o", tmp_path / "labels")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "the model's output label/0 is str; nothing was written" in err
    assert not list(tmp_path.glob("labels*"))


# --------------------------------------------------------------------------- own arguments kept as attributes only
class KeptWeight(flaxlight.TrainerModule):
    """A loss weight kept as an attribute, not passed up: hparams.yaml does not hold it."""

    def __init__(self, w: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.w = w

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        out, updates = state.apply_model(params, x, train=train, rng=rng)
        return self.w * jnp.mean((out["y"] - y) ** 2), ({}, updates)


registry.register_trainer("kept_weight_for_cli_tests", KeptWeight)
PLAIN = {key: value for key, value in CONFIG["trainer"].items() if key not in ("name", "w_aux", "max_epochs")}
X_EXAMPLE = np.zeros((1, 1), np.float32)


def test_test_uses_the_runs_own_argument_that_the_class_does_not_pass_up(tmp_path, capsys):
    """`flaxlight test` rebuilt the trainer with w's default: a metric 100 times smaller than fit's, silently."""
    config = tmp_path / "kept.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "trainer": {**PLAIN, "name": "kept_weight_for_cli_tests", "w": 100.0,
                                                         "max_epochs": 1}}))
    code, fitted, err = run(capsys, "fit", "-c", config, "--log-dir", tmp_path / "kept")
    assert code == 0, err
    code, tested, err = run(capsys, "test", "--ckpt", tmp_path / "kept")
    assert code == 0, err
    loss = [line for line in fitted.splitlines() if "test/loss" in line]
    assert loss and loss[0] in tested.splitlines()  # the same metric as fit's own test
    cfg = load_config(config)
    assert load_trainer(cfg, tmp_path / "kept", X_EXAMPLE).w == 100.0
    other = tmp_path / "other.yaml"  # a --config that says otherwise: the run's value, said
    other.write_text(config.read_text().replace("w: 100.0", "w: 5.0"))
    code, out, err = run(capsys, "test", "--ckpt", tmp_path / "kept", "--config", other)
    assert code == 0 and loss[0] in out.splitlines()
    assert "The config's trainer arguments differ from the run's (trainer.w: 5.0 here, 100.0 in the run): the " \
           "trainer is built with the run's" in err
    # A resume with it: hparams.yaml does not change, config.yaml does; said once, as an hparams change is.
    code, _, err = run(capsys, "fit", "-c", other, "--resume", tmp_path / "kept", "trainer.max_epochs=2")
    assert code == 0, err
    said = [line for line in err.splitlines() if "settings differ" in line]
    assert said == ["This run's settings differ from the ones config.yaml recorded (trainer.w: 100.0 -> 5.0; "
                    "trainer.max_epochs: 1 -> 2): they apply from now on; the earlier file is kept as config.1.yaml."]
    assert not (tmp_path / "kept" / "hparams.1.yaml").exists()
    # Only a longer run: information (silenced with the flaxlight logger at WARNING), not a warning.
    flaxlight_logger = logging.getLogger("flaxlight")
    level = flaxlight_logger.level
    try:
        flaxlight_logger.setLevel(logging.WARNING)
        code, _, err = run(capsys, "fit", "-c", other, "--resume", tmp_path / "kept", "trainer.max_epochs=3")
    finally:
        flaxlight_logger.setLevel(level)
    assert code == 0, err
    assert "settings differ" not in err and yaml.safe_load((tmp_path / "kept" / "config.2.yaml").read_text())[
        "trainer"]["max_epochs"] == 2


# --------------------------------------------------------------------------- types taken from a default
class Untyped(flaxlight.TrainerModule):
    def __init__(self, w_aux=1, scale=1.0, flag=False, n: int = 1, **kwargs):
        super().__init__(w_aux=w_aux, scale=scale, flag=flag, n=n, **kwargs)


registry.register_trainer("untyped_for_cli_tests", Untyped)


def _untyped(**trainer):
    return load_config({**CONFIG, "trainer": {"name": "untyped_for_cli_tests", **trainer}})


def test_a_number_default_takes_any_number_an_annotation_stays_strict():
    """`w_aux=1` refused 0.5 (`expected int, got float 0.5`), from a config and from a tune float space alike."""
    assert _untyped(w_aux=0.5, scale=2).trainer.own_args == {"w_aux": 0.5, "scale": 2}
    with pytest.raises(ConfigError, match=r"^trainer\.w_aux: expected int or float, got str 'heavy'\.$"):
        _untyped(w_aux="heavy")
    with pytest.raises(ConfigError, match=r"^trainer\.flag: expected bool, got str 'yes'\."):
        _untyped(flag="yes")
    with pytest.raises(ConfigError, match=r"^trainer\.n: expected int, got float 0\.5\.$"):
        _untyped(n=0.5)


# --------------------------------------------------------------------------- named like the section's settings
class Scheduled(KeptWeight):
    """Its LR schedule's length: max_epochs, a setting of the section that TrainerModule does not take."""

    def __init__(self, max_epochs: int = 100, **kwargs):
        super().__init__(max_epochs=max_epochs, **kwargs)
        self.schedule_epochs = max_epochs


class NeedsEpochs(KeptWeight):
    """The seed's spelling, required."""

    def __init__(self, num_epochs: int, **kwargs):
        super().__init__(num_epochs=num_epochs, **kwargs)
        self.schedule_epochs = num_epochs


class Named(flaxlight.TrainerModule):
    def __init__(self, name: str = "baseline", **kwargs):
        super().__init__(**kwargs)


registry.register_trainer("scheduled_for_cli_tests", Scheduled)
registry.register_trainer("needs_epochs_for_cli_tests", NeedsEpochs)
registry.register_trainer("named_for_cli_tests", Named)


def test_an_argument_named_like_a_section_setting_gets_its_value_or_is_refused(tmp_path):
    """max_epochs never reached the class's argument (it got its default, silently); `name` neither."""
    for name, key in (("scheduled", "max_epochs"), ("scheduled", "num_epochs"), ("needs_epochs", "max_epochs")):
        section = {"name": f"{name}_for_cli_tests", key: 3, "logger_params": {"log_dir": str(tmp_path / name / key)}}
        cfg = load_config({**CONFIG, "trainer": {**PLAIN, **section}})
        trainer = build_trainer(cfg, X_EXAMPLE)
        assert (cfg.trainer.max_epochs, trainer.schedule_epochs) == (3, 3)
    refused = (rf"^trainer {__name__}\.Named declares an argument 'name', but trainer\.name is the trainer class "
               r"itself \('named_for_cli_tests'\), so the config cannot set that argument\. Rename it in Named\.__init__")
    with pytest.raises(ConfigError, match=refused):
        load_config({**CONFIG, "trainer": {"name": "named_for_cli_tests"}})
