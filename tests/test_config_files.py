"""Config files and overrides as a user writes and reads them: what flaxlight writes reads back the
same, YAML merge keys, list indices, errors that name the file or override at fault, and what
``--allow-import`` lets the working directory import."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import yaml

from flaxlight import cli, config
from flaxlight.config import config_to_dict, dump_config, load_config, save_config
from test_config import error_of, minimal

TRICKY = ["3e-4", "1e5", "null", "yes", "0x10", "1_000", ".inf", "2026-11-26", "1:30", "~", "No", "-2.5E+3", ""]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------ what is written reads back
@pytest.mark.parametrize("text", TRICKY)
def test_a_saved_config_reads_back_as_the_same_config_whatever_its_strings(text, tmp_path):
    """run_name: 3e-4 was saved unquoted and read back as the float 0.0003: the run's own
    config.yaml was refused by test --ckpt, validate, predict and fit --resume."""
    cfg = load_config(minimal(trainer={"name": "regression", "logger_params": {"run_name": text,
                                                                                "project_name": text}},
                              data={"name": "sine", "kwargs": {"note": text, text or "empty": [text]}},
                              tune={"text": text}), check=False)
    again = load_config(save_config(cfg, tmp_path / "config.yaml"), check=False)
    assert config_to_dict(again) == config_to_dict(cfg)
    assert again.trainer.logger_params.run_name == text and again.data.kwargs["note"] == text
    printed = tmp_path / "printed.yaml"
    printed.write_text(dump_config(cfg))
    assert dump_config(load_config(printed, check=False)) == dump_config(cfg)


def test_print_config_output_reads_back_through_the_command_line(tmp_path, capsys):
    sine = Path(__file__).resolve().parents[1] / "examples" / "configs" / "sine_regression.yaml"
    code, out, err = run(capsys, "fit", "-c", sine, 'trainer.logger_params.run_name="1e5"',
                         'trainer.logger_params.project_name="2026-11-26"', "--print-config")
    assert code == 0, err
    (tmp_path / "printed.yaml").write_text(out)
    code, again, err = run(capsys, "fit", "-c", tmp_path / "printed.yaml", "--print-config")
    assert code == 0, err
    assert again == out
    assert yaml.safe_load(again)["trainer"]["logger_params"]["run_name"] == "1e5"


# ------------------------------------------------------------------------------------ YAML merge keys
def test_yaml_merge_keys_work_and_a_key_given_twice_is_still_refused(tmp_path):
    """`<<: *anchor` failed with "could not determine a constructor for the tag merge"."""
    merged = tmp_path / "merge.yaml"
    merged.write_text(yaml.safe_dump(minimal())
                      + "callbacks:\n"
                        "  - {name: early_stopping, args: &watch {monitor: val/loss, mode: min}}\n"
                        "  - {name: model_checkpoint, args: {<<: *watch, save_top_k: 2, mode: max}}\n")
    cfg = load_config(merged)
    assert cfg.callbacks[1].args == {"monitor": "val/loss", "mode": "max", "save_top_k": 2}
    assert cfg.callbacks[0].args == {"monitor": "val/loss", "mode": "min"}
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump(minimal()) + "callbacks:\n  - {name: early_stopping, args: {<<: {mode: min}, "
                                                 "patience: 2, patience: 3}}\n")
    message = error_of(twice)
    assert "the key 'patience' is given twice" in message and "line " in message
    twice.write_text(yaml.safe_dump(minimal()) + "callbacks:\n  - {name: early_stopping, args: {<<: {mode: min, "
                                                 "mode: max}}}\n")
    assert "the key 'mode' is given twice" in error_of(twice)


# ------------------------------------------------------------------------------------ list indices
def test_an_override_one_past_the_end_of_a_list_is_an_error_not_an_append():
    """hidden_dims.2=128 on [8, 8] silently added a third layer."""
    base = minimal(model={"name": "mlp_regressor", "hparams": {"hidden_dims": [8, 8], "output_dim": 1}})
    message = error_of(base, ["model.hparams.hidden_dims.2=128"])
    assert message == ("Override 'model.hparams.hidden_dims.2=128': model.hparams.hidden_dims is a list of 2 items "
                       "(indices 0 to 1); '2' is not an index into it. To add or remove items, give the whole list: "
                       "model.hparams.hidden_dims=[...].")
    message = error_of(minimal(callbacks=["early_stopping"]), ["callbacks.1={name: early_stopping}"])
    assert "callbacks is a list of 1 item (index 0); '1' is not an index" in message and "callbacks=[...]" in message
    assert load_config(base, ["model.hparams.hidden_dims.1=128"]).model.hparams["hidden_dims"] == [8, 128]
    assert load_config(base, ["model.hparams.hidden_dims=[8,8,128]"]).model.hparams["hidden_dims"] == [8, 8, 128]


# ------------------------------------------------------------------------------------ which source set it
def test_errors_name_the_file_or_the_override_that_set_the_bad_value(tmp_path):
    files = []
    for name, data in (("base.yaml", minimal()), ("a.yaml", {"optimizer": {"lr": 1e-3}}),
                       ("b.yaml", {"trainer": {"seed": 1, "max_epochs": "ten"}}), ("c.yaml", {"data": {"seed": 1}})):
        (tmp_path / name).write_text(yaml.safe_dump(data))
        files.append(tmp_path / name)
    message = error_of(files)
    assert message.startswith(" + ".join(map(str, files)) + ": trainer.max_epochs: expected int, got str 'ten'.")
    assert message.endswith(f"It was set in {tmp_path / 'b.yaml'}.")
    message = error_of(files[:2], ["optimizer.lr=1e-3", "trainer.seed=x", "data.batch_size=8"])
    assert message.endswith("trainer.seed: expected int, got str 'x'. It was set by the override 'trainer.seed=x'.")
    assert error_of(files[:2], ["trainer.mode=maximum"]).endswith("It was set by the override 'trainer.mode=maximum'.")
    assert error_of(files[:2], ["optimizer.lrr=1"]).endswith("It was set by the override 'optimizer.lrr=1'.")
    message = error_of(files[:2], ["model.hparams.hiden_dims=[4]"])  # checked against the model's signature
    assert "Did you mean 'model.hparams.hidden_dims'?" in message
    assert message.endswith("It was set by the override 'model.hparams.hiden_dims=[4]'.")
    assert error_of(files[:1] + files[2:3]).endswith(f"It was set in {tmp_path / 'b.yaml'}.")


def test_a_whole_number_for_a_text_field_is_its_text_and_other_numbers_say_to_quote():
    """run_name=123 was refused ("expected str or null, got int 123"); jsonargparse keeps "123"."""
    cfg = load_config(minimal(), ["trainer.logger_params.run_name=123", "trainer.logger_params.project_name=7"])
    assert cfg.trainer.logger_params.run_name == "123" and cfg.trainer.logger_params.project_name == "7"
    message = error_of(minimal(), ["trainer.logger_params.run_name=3e-4"])
    assert "run_name: expected str or null, got float 0.0003. YAML reads that value as a number: quote it" in message
    assert "'trainer.logger_params.run_name=\"...\"' as an override" in message
    assert "as a boolean" in error_of(minimal(), ["trainer.logger_params.run_name=yes"])
    assert "expected bool or str" in error_of(minimal(), ["trainer.compilation_cache=1"])  # not the cache folder "1"
    # A callback's argument is passed as it is: a number there is no text.
    assert "expected str, got int 5" in error_of(minimal(callbacks=[{"name": "early_stopping",
                                                                     "args": {"monitor": 5}}]))


# ------------------------------------------------------------------------------------ --allow-import and the cwd
@pytest.fixture
def bare_path(monkeypatch, tmp_path):
    """As the `flaxlight` console script runs: the working directory (tmp_path/cwd) is not on sys.path."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(cwd))])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    finder = getattr(config, "_WORKING_DIRECTORY_FINDER", None)
    if finder is not None:
        monkeypatch.setattr(finder, "folders", {})
    before = set(sys.modules)
    yield cwd
    for name in set(sys.modules) - before:
        if name.startswith("cwdtest_"):
            sys.modules.pop(name, None)


def marker_module(folder: Path, name: str) -> Path:
    marker = folder / f"{name}.ran"
    (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return marker


def test_allow_import_lets_the_working_directory_serve_only_the_allowed_modules_after_the_installed_ones(
        bare_path, tmp_path, monkeypatch):
    """--allow-import mypkg put the working directory first on sys.path: any file there (a
    sklearn.py in a folder someone sent) shadowed the installed module and ran."""
    site = tmp_path / "site"
    site.mkdir()
    installed = marker_module(site, "cwdtest_pkg")
    monkeypatch.syspath_prepend(str(site))
    shadow = marker_module(bare_path, "cwdtest_pkg")  # same name as the installed one
    stranger = marker_module(bare_path, "cwdtest_stranger")  # not allowed: e.g. ./sklearn.py
    local = marker_module(bare_path, "cwdtest_local")  # allowed, only here
    load_config(minimal(imports=["cwdtest_pkg", "cwdtest_local"]), allow_imports=["cwdtest_pkg", "cwdtest_local"])
    assert installed.exists() and not shadow.exists()  # the installed module wins
    assert local.exists()  # an allowed module found in the working directory
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("cwdtest_stranger")  # nothing else there became importable
    assert not stranger.exists() and str(bare_path) not in sys.path


def test_a_module_an_allowed_one_imports_from_the_working_directory_is_named_in_the_error(bare_path):
    (bare_path / "cwdtest_main.py").write_text("import cwdtest_helper\n")
    helper = marker_module(bare_path, "cwdtest_helper")
    message = error_of(minimal(imports=["cwdtest_main"]), allow_imports=["cwdtest_main"])
    assert "No module named 'cwdtest_helper'" in message and "add --allow-import cwdtest_helper" in message
    assert not helper.exists()
    load_config(minimal(imports=["cwdtest_main"]), allow_imports=["cwdtest_main", "cwdtest_helper"])
    assert helper.exists()


def test_trust_config_appends_the_working_directory_after_the_installed_modules(bare_path, tmp_path,
                                                                                 monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    installed = marker_module(site, "cwdtest_trusted")
    monkeypatch.syspath_prepend(str(site))
    shadow = marker_module(bare_path, "cwdtest_trusted")
    load_config(minimal(imports=["cwdtest_trusted"]), trust_config=True)
    assert installed.exists() and not shadow.exists()
    assert sys.path[-1] == str(bare_path)
