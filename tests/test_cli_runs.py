"""The `flaxlight` command line on real (short) runs: a run's own config read back, evaluation on
the run's own splits, resuming a run that is done, and a run folder left by a start that failed."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Sequence

import flax.linen as nn
import pytest
import yaml

import flaxlight
from flaxlight import cli, registry

SINE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "sine_regression.yaml"
SHORT = ["trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1", "data.batch_size=50", "data.eval_batch_size=500",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".flaxlight.lock"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-epoch sine run, shared by the tests that only read it."""
    run_dir = tmp_path_factory.mktemp("cli_runs") / "sine"
    code = cli.main([str(a) for a in ["fit", "-c", SINE, *SHORT, "--log-dir", run_dir]])
    assert code == 0
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def test_a_run_named_like_a_number_is_evaluated_from_its_own_config(tmp_path, capsys):
    """Its config.yaml held `run_name: 3e-4`, read back as the float 0.0003: every verb refused the run."""
    run_dir = tmp_path / "lr"
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "trainer.max_epochs=1", 'trainer.logger_params.run_name="3e-4"',
                       "--log-dir", run_dir)
    assert code == 0, err
    assert "run_name: '3e-4'" in (run_dir / "config.yaml").read_text()
    code, out, err = run(capsys, "test", "--ckpt", run_dir)
    assert code == 0 and "test/loss:" in out, err
    code, out, err = run(capsys, "validate", "--ckpt", run_dir, "-c", run_dir / "config.yaml")
    assert code == 0 and "val/loss:" in out, err


# ------------------------------------------------------------------------------------ the run's own splits
@pytest.mark.parametrize("command, override, shown", [
    ("test", "data.seed=3", "data.seed: 3 here, 0 in the run's config"),
    ("validate", "data.kwargs.num_val=600", "data.kwargs: {'num_val': 600} here, {} in the run's config"),
    ("predict", "data.name=digits", "data.name: 'digits' here, 'sine' in the run's config"),
])
def test_evaluation_refuses_data_settings_that_change_the_splits_unless_allowed(finished_run, capsys, command,
                                                                                override, shown):
    """`test --ckpt RUN data.seed=3` scored the model on a re-split whose test set held its training examples."""
    code, _, err = run(capsys, command, "--ckpt", finished_run, override)
    assert code == 2 and err.count("\n") == 1, err
    assert shown in err and f"(the override {override})" in err
    assert "may hold examples the run trained on" in err and "pass --allow-resplit" in err


def test_evaluation_takes_batch_sizes_and_an_explicit_resplit(finished_run, tmp_path, capsys):
    code, out, err = run(capsys, "test", "--ckpt", finished_run, "data.eval_batch_size=100", "data.batch_size=10")
    assert code == 0 and "test/loss:" in out, err
    code, out, err = run(capsys, "test", "--ckpt", finished_run, "data.seed=3", "--allow-resplit")
    assert code == 0 and "test/loss:" in out, err
    code, out, err = run(capsys, "test", "--ckpt", finished_run, "data.seed=3", "--print-config")
    assert code == 0 and "seed: 3" in out, err  # printing evaluates nothing
    other = yaml.safe_load((finished_run / "config.yaml").read_text())
    other["data"]["kwargs"] = {"num_test": 100}
    other["trainer"]["logger_params"]["run_name"] = "other"  # yaml.safe_dump writes "3e-4" unquoted
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    code, _, err = run(capsys, "test", "--ckpt", finished_run, "-c", tmp_path / "other.yaml")
    assert code == 2 and "data.kwargs: {'num_test': 100} here, {} in the run's config" in err
    with pytest.raises(SystemExit):
        cli.main(["test", "--help"])
    assert "--allow-resplit" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ resuming, overwriting
def test_resuming_a_run_that_reached_max_epochs_trains_and_writes_nothing(run_copy, capsys):
    """It tested again and appended a duplicate test row to metrics.csv (and metrics/test.2.json), silently."""
    before = digests(run_copy)
    code, out, err = run(capsys, "fit", "-c", run_copy / "config.yaml", "--resume", run_copy)
    assert code == 0, err
    assert out.startswith(f"Nothing to train: the run in {run_copy} has reached trainer.max_epochs=2")
    assert "trainer.max_epochs=N" in out and f"flaxlight test --ckpt {run_copy}" in out
    assert digests(run_copy) == before
    steps = {int(name) for name in os.listdir(run_copy / "checkpoints")}
    code, out, err = run(capsys, "fit", "--resume", run_copy, "trainer.max_epochs=3")  # its config.yaml: the default
    assert code == 0 and "Nothing to train" not in out, err
    assert max(int(name) for name in os.listdir(run_copy / "checkpoints")) > max(steps)  # a third epoch trained
    # the same test split tested again: no Python advice to name a second test set
    assert "metrics/test.json holds an earlier test's metrics (of the same test split)" in err, err
    assert "The earlier file is kept." in err and "name='shifted'" not in err
    code, _, err = run(capsys, "fit", "trainer.max_epochs=3")
    assert code == 2 and "pass --config PATH (or --resume RUN_DIR, which continues that run with its config.yaml)" \
        in err


def test_fit_of_a_config_into_a_folder_holding_a_run_advises_fits_own_arguments(run_copy):
    """Python's fit(cfg) advised train_model(..., resume=True) / train_model(..., overwrite=True)."""
    from flaxlight.config import fit, load_config

    cfg = load_config(run_copy / "config.yaml")
    with pytest.raises(FileExistsError) as info:
        fit(cfg)
    assert "fit(config, resume=True)" in str(info.value) and "fit(config, overwrite=True)" in str(info.value)
    assert "train_model" not in str(info.value)


def test_a_misspelt_callback_monitor_is_refused_before_the_run_starts(tmp_path, capsys):
    """EarlyStopping(monitor='val/los') from a config trained an epoch, then ended with a traceback
    (exit 1), and its folder refused the corrected command until --overwrite."""
    run_dir = tmp_path / "es"
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "trainer.max_epochs=1", "--log-dir", run_dir,
                       "callbacks=[{name: early_stopping, args: {monitor: val/los}}]")
    assert code == 2 and err.count("\n") == 1, err
    assert "EarlyStopping monitors 'val/los', which no validation of this run logs" in err
    assert "Did you mean 'val/loss'?" in err
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "hparams.yaml").exists()
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "trainer.max_epochs=1", "--log-dir", run_dir,
                       "callbacks=[{name: early_stopping, args: {monitor: val/loss}}]")
    assert code == 0, err


def test_resume_and_overwrite_together_are_refused(run_copy, capsys):
    before = digests(run_copy)
    code, _, err = run(capsys, "fit", "-c", run_copy / "config.yaml", "--resume", run_copy, "--overwrite")
    assert code == 2 and f"--resume {run_copy} continues the run there and --overwrite replaces it" in err
    assert "give one of them" in err and digests(run_copy) == before


def test_ckpt_of_a_file_in_the_run_names_the_run_folder(finished_run, capsys):
    code, _, err = run(capsys, "test", "--ckpt", finished_run / "config.yaml")
    assert code == 2 and f"--ckpt {finished_run / 'config.yaml'} is a file" in err
    assert f"(here: --ckpt {finished_run})" in err and "no such folder" not in err


# ------------------------------------------------------------------------------------ a start that failed
class FailsAtFitStart(flaxlight.Callback):
    def on_fit_start(self, trainer):
        raise RuntimeError("this callback fails at the start")


def test_a_run_that_failed_before_its_first_record_is_set_aside_and_fit_starts_there(tmp_path, capsys):
    """fit said "already holds a run. --resume continues it", and --resume said "no run to continue there"."""
    registry.register_callback("fails_at_fit_start_for_tests", FailsAtFitStart)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="fails at the start"):
        cli.main([str(a) for a in ["fit", "-c", SINE, *SHORT, "callbacks=[fails_at_fit_start_for_tests]",
                                   "--log-dir", run_dir]])
    capsys.readouterr()
    left = {name: (run_dir / name).read_bytes() for name in os.listdir(run_dir) if (run_dir / name).is_file()}
    assert "hparams.yaml" in left and not (run_dir / "checkpoints").is_dir()
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "--resume", run_dir)
    assert code == 2 and "failed before its first checkpoint and record, so there is nothing to continue" in err
    assert "Drop --resume" in err
    code, out, err = run(capsys, "fit", "-c", SINE, *SHORT, "--log-dir", run_dir)
    assert code == 0, err
    kept = run_dir / "failed_start_1"
    assert f"were moved to {kept}, and this run starts there" in err
    assert {name: (kept / name).read_bytes() for name in left} == left  # moved, not deleted or rewritten
    assert (run_dir / "checkpoints").is_dir() and "test/loss:" in out


def test_a_run_without_checkpoints_is_not_offered_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    no_checkpoints = [*SHORT, "trainer.max_epochs=1", "trainer.enable_checkpointing=false"]
    code, _, err = run(capsys, "fit", "-c", SINE, *no_checkpoints, "--log-dir", run_dir)
    assert code == 0, err
    before = digests(run_dir)
    code, _, err = run(capsys, "fit", "-c", SINE, *no_checkpoints, "--log-dir", run_dir)
    assert code == 2 and "holds a run's records (metrics) but no checkpoint, so it cannot be resumed" in err
    assert "--resume" not in err and "--overwrite replaces it" in err
    code, _, err = run(capsys, "fit", "-c", SINE, *no_checkpoints, "--resume", run_dir)
    assert code == 2 and "the run there saved no checkpoint" in err and f"--log-dir {run_dir} --overwrite" in err
    assert digests(run_dir) == before


def test_resume_refuses_data_settings_that_change_the_splits_unless_allowed(run_copy, capsys):
    """`fit --resume RUN data.seed=3` trained on, validated and tested on a re-split (its val and test
    splits held examples it had trained on) and recorded the new seed in config.yaml, silently."""
    before = digests(run_copy)
    code, _, err = run(capsys, "fit", "-c", run_copy / "config.yaml", "--resume", run_copy, "trainer.max_epochs=3",
                       "data.seed=3")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("flaxlight fit: error: fit --resume would continue the run on other data than the run's: "
                          "data.seed: 3 here, 0 in the run's config") and "(the override data.seed=3)" in err
    assert "may hold examples the run trained on" in err and "pass --allow-resplit to continue" in err
    assert digests(run_copy) == before  # nothing trained or written
    code, _, err = run(capsys, "fit", "-c", run_copy / "config.yaml", "--resume", run_copy, "trainer.max_epochs=3",
                       "data.kwargs.num_val=100")
    assert code == 2 and "data.kwargs: {'num_val': 100} here, {} in the run's config" in err
    code, out, err = run(capsys, "fit", "-c", run_copy / "config.yaml", "--resume", run_copy, "trainer.max_epochs=3",
                         "data.seed=3", "--allow-resplit")
    assert code == 0 and "test/loss:" in out, err
    assert yaml.safe_load((run_copy / "config.yaml").read_text())["data"]["seed"] == 3  # what the run now uses


def test_resume_without_the_runs_config_is_not_compared_with_the_config_files(run_copy, tmp_path, capsys):
    """A run without its config.yaml (started from Python, or a file an older flaxlight wrote) was
    compared with the --config files without their overrides: the run's own data was refused."""
    record = yaml.safe_load((run_copy / "config.yaml").read_text())
    record["data"]["seed"] = 5  # the user's base file; the run used seed 0, given as an override
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(record))
    (run_copy / "config.yaml").unlink()
    code, out, err = run(capsys, "fit", "-c", tmp_path / "base.yaml", "--resume", run_copy, "trainer.max_epochs=3",
                         "data.seed=0")
    assert code == 0 and "test/loss:" in out, err


# ------------------------------------------------------------------------------------ another model class
class ScaledRegressor(nn.Module):
    """MLPRegressor's layers (a sine run's checkpoint fits it) and an output scale it requires."""

    hidden_dims: Sequence[int]
    output_dim: int
    scale: float

    @nn.compact
    def __call__(self, x, train: bool = False):
        for dim in self.hidden_dims:
            x = nn.silu(nn.Dense(dim)(x))
        return self.scale * nn.Dense(self.output_dim)(x)


def test_a_config_naming_another_model_class_builds_it_from_its_own_hparams(finished_run, tmp_path, capsys):
    """`test --ckpt RUN -c other.yaml`, other.yaml naming another class: it was built from the run's
    hparams (other.yaml's ignored), and one missing a required argument ended in a TypeError traceback."""
    registry.register_model("scaled_regressor_for_tests", ScaledRegressor)
    code, out, err = run(capsys, "test", "--ckpt", finished_run)
    assert code == 0, err
    own_loss = float(out.split("test/loss: ")[1].split()[0])
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    config["model"] = {"name": "scaled_regressor_for_tests", "hparams": {"hidden_dims": [128, 128], "output_dim": 1,
                                                                         "scale": 1.0}}
    for scale in (1.0, 3.0):
        config["model"]["hparams"]["scale"] = scale
        (tmp_path / "other.yaml").write_text(yaml.safe_dump(config))
        code, out, err = run(capsys, "test", "--ckpt", finished_run, "-c", tmp_path / "other.yaml")
        assert code == 0 and "Traceback" not in err, err
        assert "is not the class the run recorded (flaxlight.zoo.models.MLPRegressor in " in err
        assert "it is built from the config's model.hparams" in err and "'scale': " in err
        loss = float(out.split("test/loss: ")[1].split()[0])
        assert (loss == pytest.approx(own_loss)) == (scale == 1.0)  # the config's scale is the one used
    config["model"]["hparams"]["hidden_dims"] = [64, 64]  # the run's checkpoint does not fit this one
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(config))
    code, _, err = run(capsys, "test", "--ckpt", finished_run, "-c", tmp_path / "other.yaml")
    assert code == 2 and "Traceback" not in err and err.splitlines()[-1].startswith("flaxlight test: error: the run")
    assert "does not fit this config's model " in err and ".ScaledRegressor (the run's is " \
        "flaxlight.zoo.models.MLPRegressor)" in err and "(128,)" in err


# ------------------------------------------------------------------------------------ advice in the CLI's words
def test_errors_and_log_lines_give_the_command_lines_spelling(tmp_path, capsys):
    """The CLI said "Pass which='current'", "Pass monitor='val/<name>' ... to the trainer" and
    "load_from_checkpoint(run_dir, ..., with_optimizer=False)": things only Python can do."""
    run_dir = tmp_path / "run"
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "trainer.max_epochs=1", "trainer.enable_checkpointing=false",
                       "--log-dir", run_dir)
    assert code == 0, err
    assert "Testing the model as training left it" in err and "which='current'" not in err
    assert "Turn checkpointing on (trainer.enable_checkpointing=true, or a model_checkpoint callback)" in err
    code, _, err = run(capsys, "test", "--ckpt", run_dir)
    assert code == 2 and "ModelCheckpoint(" not in err and "trainer.enable_checkpointing=true" in err
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "trainer.monitor=val_loss", "--log-dir", tmp_path / "other")
    assert code == 2 and "monitor='val/<name>'" not in err and "Set trainer.monitor=val/<name>" in err, err
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "optimizer.lr=-1", "--log-dir", tmp_path / "lr")
    assert code == 2 and "optimizer.lr must be > 0" in err and "optimizer_hparams" not in err, err
    code, _, err = run(capsys, "fit", "-c", SINE, *SHORT, "trainer.check_val_every_n_epoch=5", "--log-dir",
                       tmp_path / "short")
    assert code == 2 and "Lower trainer.check_val_every_n_epoch" in err, err
    assert "set trainer.val_check_interval=N (steps) with trainer.check_val_every_n_epoch=null" in err, err


def test_a_refused_resume_points_at_the_python_recipe_for_a_new_run_from_its_weights(run_copy, capsys):
    code, _, err = run(capsys, "fit", "-c", run_copy / "config.yaml", "--resume", run_copy, "trainer.max_epochs=3",
                       "optimizer.freeze=[Dense_0]")
    assert code == 2 and "load_from_checkpoint(" not in err and "hparams.yaml" not in err, err
    assert "Resume with the run's optimizer section (see its config.yaml)" in err
    section = "A new run from a trained run's weights"
    assert f'which the command line cannot do (the Python recipe: docs/cli.md, "{section}")' in err
    assert f"\n## {section}\n" in (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()


def test_the_docs_recipe_for_a_new_run_from_a_trained_runs_weights(run_copy, tmp_path, capsys, monkeypatch):
    """docs/cli.md's Python recipe (the command line has none) trains a new run that `flaxlight test` reads."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    recipe = text.split("## A new run from a trained run's weights")[1].split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    before = digests(run_copy)
    exec(recipe.replace('"runs/base"', repr(str(run_copy))), {})
    assert (tmp_path / "runs" / "finetune" / "config.yaml").is_file()
    assert digests(run_copy) == before  # the source run is left as it was
    code, out, err = run(capsys, "test", "--ckpt", tmp_path / "runs" / "finetune")
    assert code == 0 and "test/loss:" in out, err
