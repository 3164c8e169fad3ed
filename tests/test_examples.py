"""The shipped examples run end to end (fewer epochs than their full runs)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def test_sine_regression_fast(tmp_path, capsys):
    import sine_regression

    metrics = sine_regression.main(["--epochs", "10", "--log-dir", str(tmp_path), "--no-progress-bar"])
    assert metrics["test/loss"] < 0.05
    assert "test MSE" in capsys.readouterr().out


def test_digits_mlp_fast(tmp_path):
    pytest.importorskip("sklearn")
    import digits_mlp

    metrics = digits_mlp.main(["--epochs", "6", "--log-dir", str(tmp_path), "--no-progress-bar"])
    assert metrics["test/acc"] > 0.9
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "hparams.yaml").is_file()
    assert (tmp_path / "export" / "model.jax_exported").is_file()
