"""Exact resume after SIGKILL, SIGTERM during training and evaluation, in real subprocesses."""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).with_name("resume_script.py")


def _run(log_dir, out, *flags):
    # A persistent compilation cache shared by the subprocesses keeps each start-up short.
    env = dict(os.environ, CI="true", JAX_COMPILATION_CACHE_DIR=str(Path(log_dir).parents[1] / "jax-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.run([sys.executable, str(SCRIPT), str(log_dir), str(out), *flags],
                          capture_output=True, text=True, env=env, timeout=300)


def _arrays(path):
    with np.load(path) as data:
        return [data[f"p{i}"] for i in range(len(data.files))]


def _csv_rows(log_dir):
    with open(Path(log_dir) / "metrics.csv") as f:
        return [{k: v for k, v in row.items() if k != "epoch_time"} for row in csv.DictReader(f)]


def _tb_steps(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run (shared by the tests of this module, computed once)."""
    root = tmp_path_factory.mktemp("straight")
    result = _run(root / "run", root / "final.npz")
    assert result.returncode == 0, result.stderr
    return root / "run", _arrays(root / "final.npz")


def _assert_same_run(straight, log_dir, out):
    reference_dir, reference = straight
    for got, want in zip(_arrays(out), reference, strict=True):
        np.testing.assert_array_equal(got, want)  # bitwise
    assert _csv_rows(log_dir) == _csv_rows(reference_dir)
    for tag in ("train/loss", "train/loss_step", "val/loss"):
        assert _tb_steps(log_dir, tag) == _tb_steps(reference_dir, tag)


def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(straight, tmp_path):
    killed = _run(tmp_path / "run", tmp_path / "unused.npz", "--kill-at", "28")
    assert killed.returncode == -signal.SIGKILL
    assert 25 in [int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit()]
    resumed = _run(tmp_path / "run", tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from checkpoint 25" in resumed.stderr  # mid-epoch 4 (8 steps per epoch)
    _assert_same_run(straight, tmp_path / "run", tmp_path / "final.npz")


def test_sigterm_during_training_saves_and_says_how_to_resume(straight, tmp_path):
    stopped = _run(tmp_path / "run", tmp_path / "unused.npz", "--sigterm-at", "19")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "SIGTERM received" in stopped.stderr and "resume=True" in stopped.stderr
    assert "19" in os.listdir(tmp_path / "run" / "checkpoints")
    resumed = _run(tmp_path / "run", tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from checkpoint 19" in resumed.stderr
    _assert_same_run(straight, tmp_path / "run", tmp_path / "final.npz")


def test_sigterm_during_evaluation_resumes_with_that_validation(straight, tmp_path):
    stopped = _run(tmp_path / "run", tmp_path / "unused.npz", "--sigterm-in-eval", "2")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "16" in os.listdir(tmp_path / "run" / "checkpoints")  # end of epoch 2's training
    resumed = _run(tmp_path / "run", tmp_path / "final.npz", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_run(straight, tmp_path / "run", tmp_path / "final.npz")


def test_users_loader_with_set_epoch_resumes_exactly(tmp_path):
    """In-process: a crash (an exception at step 28) and a resume give the uninterrupted result."""
    from resume_script import SeededLoader

    import flaxlight
    from conftest import RegressTrainer, TinyMLP, linear_data

    class Crash(flaxlight.Callback):
        every_n_steps = 28

        def on_step(self, trainer, step):
            raise RuntimeError("crash")

    def run(log_dir, callbacks=(), resume=False):
        x, y = linear_data(256, 0)
        trainer = RegressTrainer(
            model_class=TinyMLP, model_hparams={"hidden_dims": [16], "dropout_prob": 0.2},
            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1],
            logger_params={"log_dir": str(log_dir)}, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[flaxlight.ModelCheckpoint(every_n_steps=5), *callbacks])
        trainer.train_model(SeededLoader(x, y, 32), None, num_epochs=5, resume=resume)
        return trainer.state.params

    reference = run(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "run", callbacks=[Crash()])
    resumed = run(tmp_path / "run", resume=True)
    import jax

    jax.tree.map(np.testing.assert_array_equal, resumed, reference)
    assert _csv_rows(tmp_path / "run") == _csv_rows(tmp_path / "ref")


def test_resuming_with_a_loader_without_set_epoch_warns(tmp_path, regression_loaders):
    from conftest import RegressTrainer, TinyMLP, quiet

    train, val, _ = regression_loaders
    batches = list(train)
    kwargs = dict(model_class=TinyMLP, model_hparams={}, optimizer_hparams={"lr": 1e-2},
                  exmp_input=batches[0][0][:1], **quiet(tmp_path))
    RegressTrainer(**kwargs).train_model(batches, val, num_epochs=1)
    with pytest.warns(RuntimeWarning, match="set_epoch"):
        RegressTrainer(**kwargs).train_model(batches, val, num_epochs=2, resume=True)
