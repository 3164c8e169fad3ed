"""The `flaxlight` command line, run in-process (one subprocess test for `python -m flaxlight`)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import yaml

from flaxlight import cli
from flaxlight.config import build_data, example_input, load_config, load_trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def sine_run(tmp_path_factory):
    """One short run of the sine example through the CLI, shared by the read-only tests below
    (batch sizes that divide the splits: one compiled shape per step, a faster test)."""
    run_dir = tmp_path_factory.mktemp("cli") / "sine"
    argv = ["fit", "--config", CONFIGS / "sine_regression.yaml", "trainer.max_epochs=2",
            "trainer.check_val_every_n_epoch=1", "data.batch_size=50", "data.eval_batch_size=500", *QUIET,
            "--log-dir", run_dir]
    code = cli.main([str(a) for a in argv])
    assert code == 0
    return run_dir


def test_python_m_flaxlight_help():
    result = subprocess.run([sys.executable, "-m", "flaxlight", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    for command in ("fit", "validate", "test", "predict", "tune", "plot"):
        assert command in result.stdout


@pytest.mark.parametrize("command, option", [("fit", "--print-config"), ("validate", "--ckpt"), ("test", "--which"),
                                             ("export", "--batch-size"),
                                             ("predict", "--output"), ("tune", "--n-trials"), ("plot", "--study")])
def test_each_subcommand_has_help(capsys, command, option):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert option in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "fit" in err


def _import_example(name: str):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.mark.parametrize("example, epochs", [("sine_regression", 50), ("digits_mlp", 40)])
def test_yaml_builds_what_the_script_builds(example, epochs, monkeypatch, tmp_path, capsys):
    """Each example's YAML makes the same trainer settings, model, optimizer and data as its script
    (train_model is stubbed out: this compares what is built, not a training run)."""
    if example == "digits_mlp":
        pytest.importorskip("sklearn")
    import flaxlight

    calls = []

    def fake_train_model(self, train, val, test_loader=None, num_epochs=500, **kwargs):
        calls.append((dict(self.config), train, val, test_loader, num_epochs))
        return {"test/loss": 0.0, "val/loss": 0.0, "test/acc": 0.0, "val/acc": 0.0}

    monkeypatch.setattr(flaxlight.TrainerModule, "train_model", fake_train_model)
    monkeypatch.setattr(flaxlight.TrainerModule, "init_model", lambda self, exmp_input: None)
    monkeypatch.setattr(flaxlight.TrainerModule, "print_tabulate", lambda self, exmp_input: None)
    monkeypatch.setattr(flaxlight.TrainerModule, "predict", lambda self, data, **kwargs: np.zeros((len(data), 10)))
    monkeypatch.setattr(flaxlight.TrainerModule, "export", lambda self, path, **kwargs: str(path))
    _import_example(example).main(["--log-dir", str(tmp_path / "script"), "--no-progress-bar"])
    assert cli.main(["fit", "-c", str(CONFIGS / f"{example}.yaml"), "trainer.enable_progress_bar=false",
                     "--log-dir", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    (script, *script_loaders, script_epochs), (ours, *our_loaders, our_epochs) = calls
    assert script_epochs == our_epochs == epochs
    for config in (script, ours):
        config["optimizer_hparams"] = dict(flaxlight.OptimizerConfig.from_dict(config["optimizer_hparams"])
                                           if not isinstance(config["optimizer_hparams"], flaxlight.OptimizerConfig)
                                           else config["optimizer_hparams"])
        config.pop("logger_params")
        config.setdefault("enable_model_summary", True)
    assert ours == script
    for a, b in zip(script_loaders, our_loaders):
        assert (a.batch_size, a.shuffle, a.seed, a.drop_last) == (b.batch_size, b.shuffle, b.seed, b.drop_last)
        for x, y in zip(a.data, b.data):
            np.testing.assert_array_equal(x, y)


def test_fit_sine_writes_config_and_checkpoints(sine_run):
    config = yaml.safe_load((sine_run / "config.yaml").read_text())
    assert config["trainer"]["max_epochs"] == 2 and config["model"]["name"] == "mlp_regressor"
    assert load_config(sine_run / "config.yaml").optimizer.lr == pytest.approx(4e-3)
    assert (sine_run / "hparams.yaml").is_file() and (sine_run / "checkpoints").is_dir()


def test_fit_prints_metrics_and_log_dir(tmp_path, capsys):
    pytest.importorskip("sklearn")
    run_dir = tmp_path / "digits"
    code, out, _ = run(capsys, "fit", "-c", CONFIGS / "digits_mlp.yaml", "trainer.max_epochs=2", *QUIET,
                       "data.batch_size=63", "data.eval_batch_size=300",  # 1197 and 300 examples: one shape each
                       "callbacks=[{name: early_stopping, args: {monitor: val/acc, mode: max, patience: 3}}]",
                       "loggers=[{name: csv, args: {filename: extra.csv}}]", "trainer.logger_params.log_dir=" +
                       str(run_dir))
    assert code == 0
    assert "test/acc:" in out and "val/acc:" in out and f"log dir: {run_dir}" in out
    assert (run_dir / "config.yaml").is_file() and (run_dir / "extra.csv").is_file()
    saved = load_config(run_dir / "config.yaml")
    assert saved.callbacks[0].name == "early_stopping" and saved.model.hparams["dropout_prob"] == 0.2


def test_validate_and_predict(sine_run, tmp_path, capsys):
    code, out, _ = run(capsys, "validate", "--ckpt", sine_run, "--config", sine_run / "config.yaml")
    assert code == 0 and "val/loss:" in out
    best_val = yaml.safe_load((sine_run / "metrics" / "best_eval.json").read_text())["val/loss"]
    assert float(out.split("val/loss:")[1].split()[0]) == pytest.approx(best_val, rel=1e-5)
    output = tmp_path / "preds.npy"
    code, out, _ = run(capsys, "predict", "--ckpt", sine_run, "-o", output)  # the config saved in the run dir
    assert code == 0 and str(output) in out
    predictions = np.load(output)
    assert predictions.shape == (500, 1) and np.isfinite(predictions).all()
    # They are the best model's outputs on the test split, in order: the same as applying the loaded
    # model, and their MSE against the targets is the test loss that `fit` wrote for that model.
    cfg = load_config(sine_run / "config.yaml")
    _, _, test = build_data(cfg)
    x_test = np.concatenate([np.asarray(batch[0]) for batch in test])
    y_test = np.concatenate([np.asarray(batch[1]) for batch in test])
    trainer = load_trainer(cfg, sine_run, example_input(test), which="best")
    expected, _ = trainer.state.apply_model(trainer.state.params, x_test, train=False)
    np.testing.assert_allclose(predictions, np.asarray(expected), rtol=1e-5, atol=1e-6)
    fit_test_loss = yaml.safe_load((sine_run / "metrics" / "test.json").read_text())["test/loss"]
    assert float(np.mean((predictions - y_test) ** 2)) == pytest.approx(fit_test_loss, rel=1e-4)


def test_export_writes_what_plain_jax_serves(sine_run, tmp_path, capsys):
    import jax

    code, out, _ = run(capsys, "export", "--ckpt", sine_run, "-o", tmp_path / "export")
    assert code == 0 and str(tmp_path / "export") in out
    exported = jax.export.deserialize(bytearray((tmp_path / "export" / "model.jax_exported").read_bytes()))
    cfg = load_config(sine_run / "config.yaml")
    _, _, test = build_data(cfg)
    x_test = np.concatenate([np.asarray(batch[0]) for batch in test])
    trainer = load_trainer(cfg, sine_run, example_input(test), which="best")
    expected, _ = trainer.state.apply_model(trainer.state.params, x_test[:7], train=False)
    np.testing.assert_allclose(np.asarray(exported.call(x_test[:7])), np.asarray(expected), rtol=1e-5, atol=1e-6)
    info = yaml.safe_load((tmp_path / "export" / "export.json").read_text())  # JSON is YAML
    assert info["which"] == "best" and info["model"] == "MLPRegressor"


def test_print_config_applies_overrides_and_exits(tmp_path, capsys):
    code, out, _ = run(capsys, "fit", "--config", CONFIGS / "digits_mlp.yaml", "--print-config", "optimizer.lr=3e-4",
                       "model.hparams.hidden_dims=[32,32]", "--log-dir", tmp_path / "never")
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["optimizer"]["lr"] == pytest.approx(3e-4)
    assert printed["model"]["hparams"]["hidden_dims"] == [32, 32]
    assert printed["trainer"]["logger_params"]["log_dir"] == str(tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_config_errors_exit_2_with_the_message(tmp_path, capsys):
    code, _, err = run(capsys, "fit", "-c", CONFIGS / "sine_regression.yaml", "trainer.max_epoch=3")
    assert code == 2 and "Did you mean 'trainer.max_epochs'?" in err
    code, _, err = run(capsys, "test", "--ckpt", tmp_path)
    assert code == 2 and "pass --config" in err
    code, _, err = run(capsys, "test", "--ckpt", tmp_path, "-c", CONFIGS / "sine_regression.yaml")
    assert code == 2 and "hparams.yaml" in err


def test_tune_delegates_the_whole_config(monkeypatch, capsys):
    calls = {}

    def tune_from_config(config, n_trials=None):
        calls.update(config=config, n_trials=n_trials)
        trial = types.SimpleNamespace(number=3, value=0.5, params={"optimizer.lr": 0.01}, user_attrs={})
        return types.SimpleNamespace(study_name="s", best_trial=trial)

    monkeypatch.setitem(sys.modules, "flaxlight.tune", types.SimpleNamespace(tune_from_config=tune_from_config))
    code, out, _ = run(capsys, "tune", "-c", CONFIGS / "digits_mlp.yaml", "--n-trials", "4",
                       "tune={metric: val/acc, search_space: {optimizer.lr: {type: float, low: 1e-4, high: 1e-2}}}")
    assert code == 0
    assert calls["n_trials"] == 4
    assert calls["config"]["tune"]["metric"] == "val/acc"
    assert calls["config"]["model"]["name"] == "mlp_classifier" and calls["config"]["optimizer"]["lr"] == 2e-3
    assert "best trial #3" in out and "optimizer.lr: 0.01" in out


def test_plot_delegates(monkeypatch, tmp_path, capsys):
    calls = {}

    def plot_runs(run_dirs, out_path, metrics=None):
        calls["runs"] = (list(run_dirs), out_path, metrics)
        return out_path

    def plot_study(storage, study_name, out_dir):
        calls["study"] = (storage, study_name, out_dir)
        return [f"{out_dir}/history.png"]

    monkeypatch.setitem(sys.modules, "flaxlight.tune", types.SimpleNamespace(plot_study=plot_study))
    import flaxlight.plot

    monkeypatch.setattr(flaxlight.plot, "plot_runs", plot_runs)
    code, out, _ = run(capsys, "plot", "runs/a", "runs/b", "-o", tmp_path / "c.png", "--metrics", "loss")
    assert code == 0 and calls["runs"] == (["runs/a", "runs/b"], str(tmp_path / "c.png"), ["loss"])
    code, out, _ = run(capsys, "plot", "--study", "sqlite:///s.db", "--study-name", "s", "-o", tmp_path / "plots")
    assert code == 0 and calls["study"] == ("sqlite:///s.db", "s", str(tmp_path / "plots"))
    assert "history.png" in out
    assert run(capsys, "plot")[0] == 2
    assert run(capsys, "plot", "runs/a", "--study", "sqlite:///s.db")[0] == 2


def test_plot_real_learning_curves(sine_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code, out, _ = run(capsys, "plot", sine_run, "-o", tmp_path / "curves.png")
    assert code == 0 and (tmp_path / "curves.png").stat().st_size > 0


def test_list_registered_names(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    assert "mlp_classifier" in out and "digits" in out and "classification" in out and "early_stopping" in out


# ------------------------------------------------------------------------------------ configs are data (trust)
def write_config(path: Path, **changes) -> Path:
    """The sine example's config with top-level sections replaced, as a YAML file."""
    config = yaml.safe_load((CONFIGS / "sine_regression.yaml").read_text())
    config.update(changes)
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def run_copy(sine_run, tmp_path):
    """A copy of the shared run's folder, to edit as if someone had sent it."""
    import shutil

    return Path(shutil.copytree(sine_run, tmp_path / "sent_run", ignore=shutil.ignore_patterns("*.lock")))


def test_fit_refuses_an_import_path_without_opt_in(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = write_config(tmp_path / "cfg.yaml", data={"name": "os.system", "kwargs": {"command": f"touch {marker}"}})
    code, out, err = run(capsys, "fit", "-c", path, "--log-dir", tmp_path / "run")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"{path}: data.name: 'os.system' is an import path, which was not imported" in err
    assert "--trust-config" in err and "--allow-import os" in err
    code, _, err = run(capsys, "fit", "-c", path, "--trust-config", "--log-dir", tmp_path / "run")
    assert code == 2 and "not a dataset factory" in err and "it was not called" in err
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_print_config_never_imports(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "marker_print_mod.ran"
    (tmp_path / "marker_print_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = write_config(tmp_path / "cfg.yaml", imports=["marker_print_mod"])
    for opt_in in ([], ["--trust-config"], ["--allow-import", "marker_print_mod"]):
        code, out, err = run(capsys, "fit", "-c", path, "--print-config", *opt_in)
        assert code == 0, err
        assert yaml.safe_load(out)["imports"] == ["marker_print_mod"]
        assert not marker.exists()
    code, _, err = run(capsys, "fit", "-c", path, "--log-dir", tmp_path / "run")  # a real run checks it: refused
    assert code == 2 and "imports[0]: 'marker_print_mod' was not imported" in err and not marker.exists()


def test_a_run_folder_someone_sent_runs_no_code(run_copy, tmp_path, capsys):
    """--ckpt RUN_DIR reads RUN_DIR/config.yaml: data, not code, unless the opt-in is given."""
    marker = tmp_path / "pwned"
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["data"] = {"name": "os.system", "kwargs": {"command": f"touch {marker}"}}
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config))
    for command in ("test", "validate", "predict"):
        code, out, err = run(capsys, command, "--ckpt", run_copy)
        assert code == 2 and out == ""
        assert f"{run_copy / 'config.yaml'}: data.name: 'os.system' is an import path" in err
    assert not marker.exists()


def test_the_model_class_in_a_sent_hparams_yaml_is_not_imported(run_copy, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "marker_model_mod.ran"
    (tmp_path / "marker_model_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hparams = yaml.safe_load((run_copy / "hparams.yaml").read_text())
    hparams["model_class"] = "marker_model_mod.Net"
    (run_copy / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    code, out, err = run(capsys, "test", "--ckpt", run_copy)
    assert code == 0, err
    assert "test/loss:" in out and not marker.exists()  # the config's registered model was used
    sys.modules.pop("marker_model_mod", None)


def test_allow_import_and_trust_config_let_a_run_use_import_paths(run_copy, capsys):
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["model"]["name"] = "flaxlight.zoo.models.MLPRegressor"
    config["data"]["name"] = "flaxlight.zoo.datasets:sine"
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config))
    code, _, err = run(capsys, "validate", "--ckpt", run_copy)  # flaxlight's own model class needs no opt-in
    assert code == 2 and "data.name: 'flaxlight.zoo.datasets:sine' is an import path" in err
    code, _, err = run(capsys, "validate", "--ckpt", run_copy, "--allow-import", "flaxlight.zoo.models")
    assert code == 2 and "data.name: 'flaxlight.zoo.datasets:sine' is an import path" in err
    for opt_in in (["--allow-import", "flaxlight.zoo.datasets"],
                   ["--allow-import", "flaxlight.zoo"], ["--trust-config"]):
        code, out, err = run(capsys, "validate", "--ckpt", run_copy, *opt_in)
        assert code == 0 and "val/loss:" in out, err


def test_help_states_the_trust_model(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--trust-config" in out and "--allow-import PREFIX" in out and "imports nothing" in out


def test_resume_from_a_folder_without_a_run_exits_2(tmp_path, capsys):
    code, _, err = run(capsys, "fit", "-c", CONFIGS / "sine_regression.yaml", "--resume", tmp_path / "typo")
    assert code == 2 and "--resume" in err and "no run to continue" in err
    assert not (tmp_path / "typo").exists()  # nothing written


# ---------------------------------------------------------------------------------------- LightningCLI habits
def test_lightning_style_print_config_and_dashed_dotted_keys(tmp_path, capsys):
    code, out, _ = run(capsys, "fit", "--config", CONFIGS / "digits_mlp.yaml", "--print_config",
                       "--trainer.max_epochs=5", "--optimizer.lr", "3e-4", "data.batch_size=32")
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["trainer"]["max_epochs"] == 5 and printed["optimizer"]["lr"] == pytest.approx(3e-4)
    assert printed["data"]["batch_size"] == 32
    code, _, err = run(capsys, "fit", "--config", CONFIGS / "digits_mlp.yaml", "--print_config", "--trainer.max_epoch=5")
    assert code == 2 and "Did you mean 'trainer.max_epochs'?" in err  # the same message as key=value
    code, _, err = run(capsys, "fit", "--config", CONFIGS / "digits_mlp.yaml", "--trainer.max_epochs")
    assert code == 2 and "--trainer.max_epochs expects a value" in err


@pytest.mark.parametrize("option", ["--print-config", "--help", "-h", "-c", "--resume", "--overwrite",
                                    "--optimizer.lr=3e-4", "--optimizer.lr"])
def test_a_dashed_key_does_not_take_an_option_as_its_value(tmp_path, capsys, option):
    """`--trainer.logger_params.run_name --print-config` (a forgotten value) trained a whole run named
    '--print-config' instead of printing the config; `... --help` trained instead of helping."""
    code, out, err = run(capsys, "fit", "-c", CONFIGS / "sine_regression.yaml", "--log-dir", tmp_path / "run",
                         "--trainer.logger_params.run_name", option, "x.yaml")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("flaxlight fit: error: --trainer.logger_params.run_name expects a value")
    assert f"the next argument, {option}, is an option" in err and "--trainer.logger_params.run_name=-x" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", [["--trainer.max_epochs", "5"], ["--trainer.max_epochs=5"]])
def test_an_option_missing_its_value_does_not_take_a_dashed_key(tmp_path, capsys, monkeypatch, flag):
    """`--log-dir --trainer.max_epochs 5` trained in a folder named 'trainer.max_epochs=5' for the config's epochs."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "fit", "-c", CONFIGS / "sine_regression.yaml", "--log-dir", *flag)
    assert code == 2 and out == "" and not os.listdir(tmp_path), err
    assert err == f"flaxlight fit: error: --log-dir expects a value: --log-dir VALUE (the next argument, {flag[0]}, " \
                  f"is an option).\n"


def test_a_dashed_key_takes_a_negative_number_and_text_after_equals(capsys):
    code, out, err = run(capsys, "fit", "-c", CONFIGS / "sine_regression.yaml", "--print-config", "--trainer.seed",
                         "-1", "--optimizer.b2", "-1e-3", "--trainer.logger_params.run_name=-x")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["trainer"]["seed"] == -1 and printed["optimizer"]["b2"] == -1e-3
    assert printed["trainer"]["logger_params"]["run_name"] == "-x"


def test_repeated_config_files_merge_in_order(tmp_path, capsys):
    (tmp_path / "fast.yaml").write_text("trainer:\n  max_epochs: 3\noptimizer:\n  lr: 0.01\n")
    (tmp_path / "small.yaml").write_text("model:\n  hparams:\n    hidden_dims: [16]\ntrainer:\n  max_epochs: 4\n")
    code, out, _ = run(capsys, "fit", "-c", CONFIGS / "digits_mlp.yaml", "-c", tmp_path / "fast.yaml",
                       "--config", tmp_path / "small.yaml", "--print-config")
    assert code == 0
    printed, base = yaml.safe_load(out), yaml.safe_load((CONFIGS / "digits_mlp.yaml").read_text())
    assert printed["trainer"]["max_epochs"] == 4  # the last file wins
    assert printed["optimizer"]["lr"] == pytest.approx(0.01)  # the second file's, merged into the section
    assert printed["model"]["hparams"]["hidden_dims"] == [16]
    assert printed["model"]["name"] == base["model"]["name"]  # kept from the first file
    assert printed["data"]["name"] == base["data"]["name"]


def test_help_lists_every_config_field_with_type_and_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "config fields" in out
    for line in ("trainer.max_epochs", "int = 500"), ("optimizer.lr",), ("data.batch_size", "int = 64"):
        assert any(all(part in row for part in line) for row in out.splitlines()), line


def test_class_path_and_init_args_as_lightning_cli_writes_them(tmp_path, capsys):
    """LightningCLI's ``class_path`` / ``init_args`` spellings load as ``name`` / ``hparams`` / ``args``;
    flaxlight's own classes may be named by their import path without an opt-in."""
    (tmp_path / "lightning.yaml").write_text(
        "trainer:\n  class_path: classification\n  init_args:\n    max_epochs: 2\n    monitor: val/acc\n    mode: max\n"
        "model:\n  class_path: flaxlight.zoo.models.MLPClassifier\n  init_args:\n    hidden_dims: [16]\n    num_classes: 10\n"
        "data:\n  class_path: digits\n  init_args: {}\n  batch_size: 64\n"
        "callbacks:\n  - class_path: flaxlight.callbacks.EarlyStopping\n    init_args:\n      monitor: val/acc\n"
        "      mode: max\n      patience: 7\n")
    code, out, err = run(capsys, "fit", "--config", tmp_path / "lightning.yaml", "--print_config",
                         "--callbacks.0.init_args.patience=3")
    assert code == 0, err
    printed = yaml.safe_load(out)  # saved in our own spelling
    assert printed["trainer"]["name"] == "classification" and printed["trainer"]["max_epochs"] == 2
    assert printed["model"] == {"name": "flaxlight.zoo.models.MLPClassifier",
                                "hparams": {"hidden_dims": [16], "num_classes": 10}}
    assert printed["callbacks"] == [{"name": "flaxlight.callbacks.EarlyStopping",
                                     "args": {"monitor": "val/acc", "mode": "max", "patience": 3}}]
    cfg = load_config(tmp_path / "lightning.yaml")  # resolves without trust_config: flaxlight's own classes
    assert cfg.model.hparams["hidden_dims"] == [16]
    (tmp_path / "both.yaml").write_text("trainer:\n  name: classification\n  max_epochs: 3\n"
                                        "  init_args: {max_epochs: 2}\nmodel: {name: mlp_classifier}\n"
                                        "data: {name: digits}\n")
    code, _, err = run(capsys, "fit", "--config", tmp_path / "both.yaml", "--print_config")
    assert code == 2 and "'trainer.max_epochs' is set both" in err
    (tmp_path / "other.yaml").write_text("trainer: {name: classification}\ndata: {name: digits}\n"
                                         "model: {class_path: mypkg.models.Net}\n")
    code, _, err = run(capsys, "fit", "--config", tmp_path / "other.yaml")
    assert code == 2 and "mypkg.models.Net" in err and "--allow-import" in err  # others still need the opt-in


def test_later_files_and_flags_win_whichever_spelling_each_uses(tmp_path, capsys):
    """A LightningCLI-style file (``class_path`` / ``init_args``) takes ``--trainer.max_epochs=5``,
    ``--model.init_args.x=`` / ``model.hparams.x=``, the seed's ``warmup`` under a later
    ``warmup_steps``, and a second ``--config`` in our spelling: the later value wins; one
    source setting a key both ways is still an error."""
    (tmp_path / "lightning.yaml").write_text(
        "trainer:\n  class_path: regression\n  init_args: {max_epochs: 9}\n"
        "model:\n  class_path: mlp_regressor\n  init_args: {hidden_dims: [16], output_dim: 1}\n"
        "data:\n  class_path: sine\n  init_args: {batch_size: 32, num_train: 256}\n"
        "optimizer: {lr: 0.001, warmup: 20}\n")
    (tmp_path / "short.yaml").write_text("trainer: {max_epochs: 2}\nmodel: {hparams: {hidden_dims: [8]}}\n")
    code, out, err = run(capsys, "fit", "--config", tmp_path / "lightning.yaml", "--print_config",
                         "--trainer.max_epochs=5", "--model.init_args.hidden_dims=[4, 4]", "optimizer.warmup_steps=5",
                         "--data.init_args.batch_size=64")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["trainer"]["max_epochs"] == 5 and printed["optimizer"]["warmup_steps"] == 5
    assert printed["model"]["hparams"] == {"hidden_dims": [4, 4], "output_dim": 1}
    assert printed["data"]["batch_size"] == 64 and printed["data"]["kwargs"] == {"num_train": 256}
    code, out, err = run(capsys, "fit", "-c", tmp_path / "lightning.yaml", "-c", tmp_path / "short.yaml",
                         "--print_config", "trainer.num_epochs=3")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["trainer"]["max_epochs"] == 3
    assert printed["model"]["hparams"] == {"hidden_dims": [8], "output_dim": 1}
    (tmp_path / "both.yaml").write_text("optimizer: {warmup: 3, warmup_steps: 4}\n")
    code, _, err = run(capsys, "fit", "-c", tmp_path / "lightning.yaml", "-c", tmp_path / "both.yaml", "--print_config")
    assert code == 2 and "both.yaml" in err and "'optimizer.warmup' and 'optimizer.warmup_steps'" in err


def test_a_run_that_fails_to_start_leaves_the_runs_config_alone(tmp_path):
    """config.yaml is written once training starts: a second fit into a finished run's folder and
    a resume with another model fail without touching it; a resume with changed settings writes
    the new config and keeps the old one as config.1.yaml."""
    from flaxlight.config import fit

    run_dir = tmp_path / "run"
    short = ["trainer.max_epochs=1", "trainer.check_val_every_n_epoch=1", "data.batch_size=100",
             "data.eval_batch_size=500", *QUIET, f"trainer.logger_params.log_dir={run_dir}"]
    fit(CONFIGS / "sine_regression.yaml", short)
    saved = (run_dir / "config.yaml").read_text()
    with pytest.raises(FileExistsError):
        fit(CONFIGS / "sine_regression.yaml", [*short, "model.hparams.hidden_dims=[16]"])
    with pytest.raises(ValueError, match="different model"):
        fit(CONFIGS / "sine_regression.yaml", [*short, "model.hparams.hidden_dims=[16]"], resume=True)
    assert (run_dir / "config.yaml").read_text() == saved and not (run_dir / "config.1.yaml").exists()
    fit(CONFIGS / "sine_regression.yaml", [*short, "trainer.max_epochs=2"], resume=True)
    assert (run_dir / "config.1.yaml").read_text() == saved
    assert load_config(run_dir / "config.yaml").trainer.max_epochs == 2


def test_fast_dev_run_smoke_tests_a_shipped_config_whose_warmup_is_longer_than_one_step(capsys):
    """fast_dev_run runs one step of the configured run: the schedule (here 20 warmup steps)
    still spans the requested epochs, so the warmup check does not refuse the smoke test."""
    code, out, err = run(capsys, "fit", "--config", CONFIGS / "digits_mlp.yaml", "trainer.fast_dev_run=true", *QUIET)
    assert code == 0, err
    assert "warmup_steps" in (CONFIGS / "digits_mlp.yaml").read_text()


def test_fit_into_a_finished_runs_folder_says_resume_or_overwrite(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["fit", "--config", CONFIGS / "sine_regression.yaml", "trainer.max_epochs=1",
            "trainer.check_val_every_n_epoch=1", "data.batch_size=100", "data.eval_batch_size=500", *QUIET,
            "--log-dir", run_dir]
    assert run(capsys, *argv)[0] == 0
    metrics_before = (run_dir / "metrics.csv").read_text()
    code, _, err = run(capsys, *argv)
    assert code == 2 and f"--resume {run_dir} continues it, --overwrite replaces it" in err
    assert "Traceback" not in err and (run_dir / "metrics.csv").read_text() == metrics_before
    code, _, err = run(capsys, *argv, "--overwrite")
    assert code == 0, err


def test_a_run_whose_settings_fail_its_checks_is_a_one_line_config_error(tmp_path, capsys):
    """Checks that need the data (validation never due, a warmup longer than the run) fail before
    training as a config error: one line, exit 2, no config.yaml written."""
    code, _, err = run(capsys, "fit", "--config", CONFIGS / "sine_regression.yaml", "trainer.max_epochs=2", *QUIET,
                       "--log-dir", tmp_path / "run")
    assert code == 2 and "Traceback" not in err
    assert "the run cannot start: check_val_every_n_epoch=5 > num_epochs=2" in err and "Lower" in err
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_sigterm_during_a_config_run_says_how_to_resume_it_from_the_command_line(tmp_path, capsys):
    import os
    import signal

    import flaxlight
    from flaxlight.config import fit

    class Terminate(flaxlight.Callback):
        def on_train_epoch_end(self, trainer, epoch, metrics):
            os.kill(os.getpid(), signal.SIGTERM)

    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        fit(CONFIGS / "sine_regression.yaml", ["trainer.max_epochs=5", "trainer.check_val_every_n_epoch=1", *QUIET,
                                               f"trainer.logger_params.log_dir={run_dir}"], callbacks=[Terminate()])
    assert exited.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "SIGTERM received" in err and f"flaxlight fit --config CONFIG --resume {run_dir}" in err
    code, out, err = run(capsys, "fit", "--config", CONFIGS / "sine_regression.yaml", "trainer.max_epochs=5",
                         "trainer.check_val_every_n_epoch=1", *QUIET, "--resume", run_dir)
    assert code == 0, err


def test_ckpt_of_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    code, _, err = run(capsys, "test", "--ckpt", tmp_path / "no_such_run")
    assert code == 2 and f"--ckpt {tmp_path / 'no_such_run'}: no such folder" in err


def test_a_checkpoint_callback_ranking_by_another_monitor_than_the_trainer_is_a_config_error(tmp_path, capsys):
    """The run's summary showed the trainer's best val metrics next to test metrics of the
    callback's best checkpoint (two models), and exited 0."""
    code, _, err = run(capsys, "fit", "--config", CONFIGS / "digits_mlp.yaml", *QUIET, "--log-dir", tmp_path / "run",
                       "callbacks=[{name: model_checkpoint, args: {monitor: val/loss, mode: min}}]")
    assert code == 2 and "Traceback" not in err
    assert "ModelCheckpoint(monitor='val/loss', mode='min') ranks checkpoints by another measure than the " \
           "trainer's monitor='val/acc' (mode='max')" in err
    assert not (tmp_path / "run").exists()


def test_a_config_for_another_model_than_the_run_is_a_config_error(sine_run, capsys):
    """`test --ckpt RUN -c other.yaml` ended in a TypeError traceback (exit 1)."""
    code, _, err = run(capsys, "test", "--ckpt", sine_run, "--config", CONFIGS / "digits_mlp.yaml")
    assert code == 2 and "Traceback" not in err  # its data first: another data set than the run's
    assert "data.name: 'digits' here, 'sine' in the run's config" in err
    code, _, err = run(capsys, "test", "--ckpt", sine_run, "--config", CONFIGS / "digits_mlp.yaml", "--allow-resplit")
    assert code == 2 and "Traceback" not in err and err.splitlines()[-1].startswith("flaxlight test: error: ")
    assert ("does not fit this config's model flaxlight.zoo.models.MLPClassifier (the run's is "
            "flaxlight.zoo.models.MLPRegressor)") in err and "different model" in err
    assert "se the run's model section (its config.yaml, the default without --config)" in err


def test_predict_and_export_outputs_of_best_and_last_do_not_replace_each_other(sine_run, tmp_path, capsys):
    """Default paths ignored --which (a later --which last replaced the best's files); `-o X` wrote
    X.npy and printed X; train-split rows came in the shuffled order of epoch 0."""
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(sine_run, run_dir)
    for which, name in (("best", "predictions_train.npy"), ("last", "predictions_train_last.npy")):
        code, out, _ = run(capsys, "predict", "--ckpt", run_dir, "--split", "train", "--which", which)
        assert code == 0 and str(run_dir / name) in out
    cfg = load_config(run_dir / "config.yaml")
    train, _, _ = build_data(cfg)
    x_train = np.asarray(train.data[0])
    trainer = load_trainer(cfg, run_dir, example_input(train), which="best")
    expected, _ = trainer.state.apply_model(trainer.state.params, x_train, train=False)
    np.testing.assert_allclose(np.load(run_dir / "predictions_train.npy"), np.asarray(expected), rtol=1e-5, atol=1e-6)
    code, out, _ = run(capsys, "predict", "--ckpt", run_dir, "-o", tmp_path / "preds")
    assert code == 0 and out.rstrip().endswith(str(tmp_path / "preds.npy")) and (tmp_path / "preds.npy").exists()
    for which, folder in (("best", "export"), ("last", "export_last")):
        assert run(capsys, "export", "--ckpt", run_dir, "--which", which)[0] == 0
        assert yaml.safe_load((run_dir / folder / "export.json").read_text())["which"] == which


@pytest.mark.parametrize("argv, message", [
    (["export", "--batch-size", "0"], "argument --batch-size: expected a positive whole number, got '0'"),
    (["export", "-o", "{file}"], "File exists"),
    (["test", "data.kwargs.num_test=0", "--allow-resplit"], "data 'sine' has no test split"),
    (["predict", "data.kwargs.num_test=0", "--allow-resplit"], "data 'sine' has no test split"),
])
def test_evaluation_verbs_turn_user_mistakes_into_one_line(sine_run, tmp_path, capsys, argv, message):
    """Each ended in a traceback (ZeroDivisionError, FileExistsError, ValueError) with exit 1."""
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    try:
        code, _, err = run(capsys, argv[0], "--ckpt", sine_run, *argv[1:])
    except SystemExit as usage:  # argparse's own: usage line, then the message
        code, err = usage.code, capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and message in err, err


def test_a_config_that_is_not_text_and_a_missing_study_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    code, _, err = run(capsys, "fit", "--config", tmp_path / "binary.yaml")
    assert code == 2 and "cannot be read as UTF-8 text" in err and "Traceback" not in err
    pytest.importorskip("optuna")
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name="mine", storage=storage)
    code, _, err = run(capsys, "plot", "--study", storage, "--study-name", "yours", "-o", tmp_path / "plots")
    assert code == 2 and "No study named 'yours' in this storage; it holds ['mine']" in err


def test_validate_uses_the_runs_limit_val_batches(tmp_path, capsys):
    """`validate` evaluated the whole split, so it never reproduced the score the best was chosen by."""
    run_dir = tmp_path / "run"
    assert run(capsys, "fit", "--config", CONFIGS / "sine_regression.yaml", "trainer.max_epochs=2",
               "trainer.check_val_every_n_epoch=1", "trainer.limit_val_batches=1", "data.eval_batch_size=50",
               *QUIET, "--log-dir", run_dir)[0] == 0
    code, out, _ = run(capsys, "validate", "--ckpt", run_dir)
    best_val = yaml.safe_load((run_dir / "metrics" / "best_eval.json").read_text())["val/loss"]
    assert code == 0 and "limit_val_batches=1 as in the run" in out
    assert float(out.split("val/loss:")[1].split()[0]) == pytest.approx(best_val, rel=1e-5)
    code, out, _ = run(capsys, "validate", "--ckpt", run_dir, "trainer.limit_val_batches=null")  # the whole split
    assert code == 0 and "limit_val_batches" not in out
    assert float(out.split("val/loss:")[1].split()[0]) != pytest.approx(best_val, rel=1e-5)


def test_evaluation_verbs_refuse_overrides_they_would_ignore(sine_run, capsys):
    """model.*, optimizer.* and trainer.* overrides were parsed, checked and dropped (exit 0)."""
    code, _, err = run(capsys, "validate", "--ckpt", sine_run, "model.hparams.hidden_dims=[8]", "data.batch_size=10")
    assert code == 2 and "only data.* overrides apply (and trainer.limit_val_batches for validate); " \
                         "model.hparams.hidden_dims=[8] would be ignored" in err
    code, out, _ = run(capsys, "validate", "--ckpt", sine_run, "data.eval_batch_size=100")
    assert code == 0 and "val/loss:" in out
    code, out, err = run(capsys, "test", "--ckpt", sine_run, "--print_config", "optimizer.lr=0.5")  # printed as if applied
    assert code == 2 and "optimizer.lr=0.5 would be ignored" in err and not out
    code, out, _ = run(capsys, "test", "--ckpt", sine_run, "--print_config", "data.eval_batch_size=100")
    assert code == 0 and "eval_batch_size: 100" in out


@pytest.mark.parametrize("command", ["validate", "test", "predict", "export"])
def test_evaluation_verbs_help_suggests_overrides_they_accept(sine_run, capsys, command):
    """Their --help suggested optimizer.lr=3e-4 trainer.max_epochs=20, which they refuse."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    help_text = capsys.readouterr().out.split("\nconfig fields")[0]
    assert "optimizer.lr=" not in help_text and "max_epochs=" not in help_text
    example = help_text.split("overrides apply, e.g.")[1].split(";")[0].split()
    assert example and all("=" in pair for pair in example)
    code, _, err = run(capsys, command, "--ckpt", sine_run, "--print_config", *example)
    assert code == 0, err


def test_a_runs_saved_config_says_how_to_run_it_again(sine_run, tmp_path, capsys):
    """The header said `fit --config <this file>`, which the log_dir saved in it refuses, and the
    error blamed a --log-dir that was not given."""
    saved = sine_run / "config.yaml"
    header = saved.read_text().split("\ntrainer:")[0]
    assert "--resume <its folder>" in header and "--log-dir NEW_DIR" in header
    code, _, err = run(capsys, "fit", "--config", saved)
    assert code == 2 and f"The config's trainer.logger_params.log_dir {sine_run} already holds a run" in err
    assert "trainer.logger_params.log_dir=null" in err
    assert run(capsys, "fit", "--config", saved, "--log-dir", tmp_path / "again")[0] == 0


def test_ckpt_of_one_checkpoint_folder_names_the_run_and_ckpt_path_is_accepted(sine_run, capsys):
    """The error said "pass --config PATH", which only led to a second error (also for the run's
    checkpoints/ folder itself)."""
    step = sorted(p.name for p in (sine_run / "checkpoints").iterdir() if p.name.isdigit())[-1]
    code, _, err = run(capsys, "test", "--ckpt", sine_run / "checkpoints" / step)
    assert code == 2 and f"one checkpoint of the run in {sine_run}" in err and f"--ckpt {sine_run} --which" in err
    code, _, err = run(capsys, "test", "--ckpt", sine_run / "checkpoints")  # Lightning's dirpath
    assert code == 2 and f"the checkpoints folder of the run in {sine_run}" in err and f"--ckpt {sine_run} --which" in err
    code, out, _ = run(capsys, "test", "--ckpt_path", sine_run)  # LightningCLI's spelling
    assert code == 0 and "test/loss:" in out


def test_a_bug_in_the_users_model_keeps_its_traceback(tmp_path, monkeypatch):
    """Only flaxlight's own checks become one-line config errors; a ValueError raised in the
    user's model code is raised as it is."""
    from flaxlight.config import ConfigError, fit

    (tmp_path / "usermodels.py").write_text(
        "import flax.linen as nn\n\n"
        "class Broken(nn.Module):\n"
        "    @nn.compact\n"
        "    def __call__(self, x, train=False):\n"
        "        raise ValueError('a bug in the model')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="a bug in the model") as info:
        fit(CONFIGS / "sine_regression.yaml", ["model.name=usermodels.Broken", "model.hparams={}", *QUIET],
            allow_imports=["usermodels"])
    assert not isinstance(info.value, ConfigError)


def test_predict_reads_an_array_loader_whole_and_in_order_keeping_its_class():
    """A shuffling train loader gave rows in epoch 0's order; drop_last=True lost the last rows; a
    subclass's own batches were replaced by plain ones."""
    from flaxlight import ArrayLoader

    class Scaled(ArrayLoader):
        def __iter__(self):
            for x, y in super().__iter__():
                yield x * 10, y

    x = np.arange(10, dtype=np.float32)[:, None]
    loader = Scaled(x, x, batch_size=4, shuffle=True, drop_last=True, seed=3)
    ordered = cli._in_order(loader)
    rows = np.concatenate([batch[0] for batch in ordered])
    np.testing.assert_array_equal(rows, x * 10)
    assert loader.shuffle and loader.drop_last  # the run's loader itself is left alone


def test_a_refused_run_folder_exits_2_in_a_fresh_process(sine_run, tmp_path):
    """The eval steps compiling in a background thread when the refusal ended the process aborted
    it ("terminate called after throwing", exit 134)."""
    config = tmp_path / "uneven_val.yaml"  # two validation batch shapes: two eval steps to compile
    config.write_text(yaml.safe_dump({
        "trainer": {"name": "regression", "max_epochs": 4, "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"name": "mlp_regressor", "hparams": {"hidden_dims": [64, 64], "output_dim": 1}},
        "optimizer": {"optimizer": "adamw", "lr": 4e-3},
        "data": {"name": "sine", "batch_size": 64, "eval_batch_size": 36, "seed": 0,
                 "kwargs": {"num_train": 1000, "num_val": 203, "num_test": 101}}}))
    done = subprocess.run([sys.executable, "-m", "flaxlight", "fit", "--config", str(config), "--log-dir", str(sine_run)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "already holds a run" in done.stderr, done.stderr[-2000:]


def test_a_2d_mesh_from_the_config(tmp_path):
    """trainer.mesh was an unknown key: the CLI could not make a {data, model} mesh."""
    env = dict(__import__("os").environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "flaxlight", "fit", "--config", str(CONFIGS / "sine_regression.yaml"),
                           "trainer.max_epochs=1", "trainer.check_val_every_n_epoch=1",
                           "trainer.mesh={data: 2, model: 2}", *QUIET, "--log-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    hparams = yaml.safe_load((tmp_path / "run" / "hparams.yaml").read_text())
    assert "{'data': 2, 'model': 2}" in str(hparams), hparams


def test_paths_mistyped_before_training_are_one_line_errors(tmp_path, capsys):
    """`--allow-import mypkg/` (the shell's completion of a package folder), a --log-dir or
    base_log_dir at a file ended in a traceback with exit 1."""
    (tmp_path / "afile").write_text("")
    sine = ["fit", "--config", CONFIGS / "sine_regression.yaml"]
    code, out, err = run(capsys, *sine, "--allow-import", "mypkg/", "--print-config")
    assert code == 0, err
    code, out, err = run(capsys, *sine, "--allow-import", "mypkg/models/", "--print-config")  # mypkg.models
    assert code == 0, err
    code, _, err = run(capsys, *sine, "--allow-import", "my pkg", "--print-config")
    assert code == 2 and err.count("\n") == 1 and "'my pkg' is not a module prefix" in err
    code, _, err = run(capsys, *sine, "--log-dir", tmp_path / "afile")
    assert code == 2 and err == (f"flaxlight fit: error: trainer.logger_params.log_dir: {tmp_path / 'afile'} is a "
                                 f"file, not a folder; move the file away or choose another log_dir.\n")
    code, _, err = run(capsys, *sine, f"trainer.logger_params.base_log_dir={tmp_path / 'afile' / 'runs'}")
    assert code == 2 and err.count("\n") == 1 and (f"trainer.logger_params.base_log_dir: {tmp_path / 'afile' / 'runs'} "
                                                   f"lies under the file {tmp_path / 'afile'}, not a folder") in err


def test_a_misspelt_monitor_is_a_one_line_error_before_the_run_is_written(tmp_path, capsys):
    code, _, err = run(capsys, "fit", "--config", CONFIGS / "sine_regression.yaml", "trainer.max_epochs=5",
                       "trainer.monitor=val/los", "--log-dir", tmp_path / "run")
    assert code == 2 and "Traceback" not in err and "Did you mean 'val/loss'?" in err, err
    assert not (tmp_path / "run" / "hparams.yaml").exists()


def test_config_n_yaml_holds_only_this_runs_earlier_settings(tmp_path, capsys):
    """A resume whose only difference was the log_dir it fills in wrote config.1.yaml, and
    --overwrite kept the replaced run's config as config.1.yaml."""
    short = ["trainer.max_epochs=1", "trainer.check_val_every_n_epoch=1", "data.batch_size=100",
             "data.eval_batch_size=500", *QUIET]
    code, out, err = run(capsys, "fit", "-c", CONFIGS / "sine_regression.yaml", *short,
                         f"trainer.logger_params.base_log_dir={tmp_path}")
    assert code == 0, err
    run_dir = Path(out.split("log dir: ")[1].strip())
    saved = (run_dir / "config.yaml").read_text()
    assert "log_dir: null" in saved
    code, _, err = run(capsys, "fit", "-c", run_dir / "config.yaml", "--resume", run_dir)
    assert code == 0, err
    assert sorted(p.name for p in run_dir.glob("config*")) == ["config.yaml"]
    assert (run_dir / "config.yaml").read_text() == saved
    code, _, err = run(capsys, "fit", "-c", run_dir / "config.yaml", "--resume", run_dir, "trainer.max_epochs=2")
    assert code == 0, err
    assert (run_dir / "config.1.yaml").read_text() == saved  # a changed resume keeps the earlier settings
    code, _, err = run(capsys, "fit", "-c", CONFIGS / "sine_regression.yaml", *short, "optimizer.lr=0.01",
                       "--log-dir", run_dir, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in run_dir.glob("config*")) == ["config.yaml"]
    assert load_config(run_dir / "config.yaml").optimizer.lr == 0.01


def test_evaluation_verbs_refuse_a_config_whose_model_differs_from_the_runs(sine_run, tmp_path, capsys):
    """`test --ckpt RUN -c other.yaml` evaluated the run's model and ignored other.yaml's model.hparams."""
    config = yaml.safe_load((sine_run / "config.yaml").read_text())
    config["model"]["hparams"]["hidden_dims"] = [512, 512]
    config["data"]["eval_batch_size"] = 100  # data settings apply
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(config))
    code, _, err = run(capsys, "test", "--ckpt", sine_run, "-c", tmp_path / "other.yaml")
    assert code == 2 and err.count("\n") == 1
    assert "the config's model differs from the run's (model.hparams.hidden_dims: [512, 512] here, [128, 128] in " \
           "the run)" in err and "would be ignored" in err
    config["model"]["hparams"]["hidden_dims"] = [128, 128]
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(config))
    code, out, err = run(capsys, "test", "--ckpt", sine_run, "-c", tmp_path / "other.yaml")
    assert code == 0 and "test/loss:" in out, err
