"""Learning-curve PNGs as a user sees them: the file, its size, and that something is drawn."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

pytest.importorskip("matplotlib")

from flaxlight.loggers import CSVLogger  # noqa: E402
from flaxlight.plot import main, plot_runs, read_metrics  # noqa: E402


def _fake_run(run_dir, scale=1.0, epochs=4, steps_per_epoch=5):
    """A run's metrics.csv as the trainer writes it: running train values, epoch and val rows, a test row."""
    logger = CSVLogger(run_dir)
    for epoch in range(1, epochs + 1):
        for step in range((epoch - 1) * steps_per_epoch + 1, epoch * steps_per_epoch + 1, 2):
            logger.log_metrics({"train/loss_step": scale / step}, step)
        step = epoch * steps_per_epoch
        logger.log_metrics({"train/loss": scale / step, "train/acc": 1 - 0.5 / epoch, "epoch_time": 0.1,
                            "epoch": epoch}, step)
        logger.log_metrics({"val/loss": 1.2 * scale / step, "val/acc": 1 - 0.6 / epoch, "epoch": epoch}, step)
    logger.log_metrics({"test/acc": 0.8}, epochs * steps_per_epoch)
    logger.finalize("success")
    return run_dir


def _pixels(path):
    import matplotlib.image

    return matplotlib.image.imread(os.fspath(path))


def _assert_drawn(pixels):
    assert pixels.std() > 0.01
    colours = {tuple(p) for p in (pixels[..., :3].reshape(-1, 3) * 255).round().astype(int)[::7]}
    assert len(colours) > 10  # lines in several colours, text, grid: not a blank canvas


def test_plot_runs_draws_one_panel_per_metric_with_runs_overlaid(tmp_path):
    runs = [_fake_run(tmp_path / "MLP" / f"version_{i}", scale=1.0 + i) for i in range(2)]
    out = plot_runs(runs, tmp_path / "out" / "curves.png")
    assert out == os.fspath(tmp_path / "out" / "curves.png")
    pixels = _pixels(out)
    assert pixels.shape[:2] == (340, 960)  # two panels (loss, acc) of 4.8 x 3.4 inches at 100 dpi
    _assert_drawn(pixels)


def test_plot_metrics_pick_and_order_panels_and_unknown_ones_are_named(tmp_path):
    run = _fake_run(tmp_path / "run")
    assert read_metrics(run)["val/acc"][0] == [5, 10, 15, 20]
    assert "epoch" not in read_metrics(run) and "epoch_time" not in read_metrics(run)
    out = plot_runs(run, tmp_path / "acc.png", metrics=["val/acc"], include_step=False)
    assert _pixels(out).shape[:2] == (340, 480)  # one panel
    with pytest.raises(ValueError, match=r"No metric 'f1'.*logged: acc, loss"):
        plot_runs(run, tmp_path / "x.png", metrics=["f1"])
    with pytest.raises(FileNotFoundError, match="No metrics.csv"):
        plot_runs(tmp_path / "missing", tmp_path / "x.png")


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'flaxlight\[plot\]'"):
        plot_runs(_fake_run(tmp_path / "run"), tmp_path / "x.png")


def test_main_reports_errors_without_a_traceback(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.png")]) == 2
    assert "No metrics.csv" in capsys.readouterr().err


def test_command_line_plots_a_real_training_run(tmp_path, regression_loaders):
    train, val, test = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2},
                             exmp_input=np.zeros((1, 4), np.float32), log_every_n_steps=2,
                             **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / "run"), "logger_type": "csv"}))
    trainer.train_model(train, val, test_loader=test, num_epochs=2)

    out = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, "-m", "flaxlight.plot", str(tmp_path / "run"), "-o", str(out)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(out)
    pixels = _pixels(out)
    assert pixels.shape[:2] == (340, 480)  # one panel: loss (train, train per step, val, test)
    _assert_drawn(pixels)
