"""Damaged, foreign and unwritable checkpoints; loading for inference and fine-tuning."""

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

from flaxlight import ModelCheckpoint

X0 = np.zeros((1, 4), np.float32)


def _trainer(tmp_path, hidden=(8,), **kwargs):
    kwargs.setdefault("callbacks", [ModelCheckpoint(monitor="val/loss", save_top_k=2)])
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": list(hidden), "batch_norm": True},
                          optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X0,
                          **quiet(tmp_path, **kwargs))


def _steps(run_dir):
    return sorted(int(s) for s in os.listdir(Path(run_dir) / "checkpoints") if s.isdigit())


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    _trainer(tmp_path).train_model(train, val, num_epochs=3)
    steps = _steps(tmp_path / "run")
    assert len(steps) >= 2
    latest = tmp_path / "run" / "checkpoints" / str(steps[-1])
    for path in (latest / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncate every array file

    trainer = _trainer(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"Checkpoint {steps[-1]} .* damaged .* falling back to checkpoint {steps[-2]}"):
        trainer.train_model(train, val, num_epochs=4, resume=True)
    assert int(trainer.state.step) == 4 * len(train)


def test_checkpoint_of_a_different_model_lists_the_mismatching_paths(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    _trainer(tmp_path, hidden=(8,)).train_model(train, val, num_epochs=1)
    with pytest.raises(ValueError, match=r"different model(.|\n)*Dense_0/kernel: checkpoint \(4, 8\), model \(4, 16\)"):
        _trainer(tmp_path, hidden=(16,)).train_model(train, val, num_epochs=2, resume=True)


FULL_DISK_SCRIPT = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
import numpy as np
import flaxlight
from conftest import RegressTrainer, TinyMLP, linear_data

class DiskFills(flaxlight.Callback):
    every_n_steps = 2
    def on_step(self, trainer, step):
        if step == 10:  # checkpoint 8 is written (ModelCheckpoint hears of each step last); now the disk is full
            trainer.checkpointer.wait()
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

x, y = linear_data(256, 0)
trainer = RegressTrainer(model_class=TinyMLP, model_hparams={{"hidden_dims": [256]}}, optimizer_hparams={{}},
                         exmp_input=x[:1], logger_params={{"log_dir": {log_dir!r}, "logger_type": "csv"}},
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1000,
                         callbacks=[flaxlight.ModelCheckpoint(every_n_steps=4), DiskFills()])
trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=32), None, num_epochs=3)
"""


def test_a_full_disk_fails_loudly_and_keeps_the_previous_checkpoint(tmp_path):
    import subprocess
    import sys

    script = FULL_DISK_SCRIPT.format(tests=str(Path(__file__).parent), log_dir=str(tmp_path / "run"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, CI="true"))
    assert result.returncode != 0
    assert "Error" in result.stderr  # the write error surfaces, with its traceback
    assert 8 in _steps(tmp_path / "run")
    restored = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [256]}, optimizer_hparams={},
                              exmp_input=X0, **quiet(tmp_path / "check"))
    from flaxlight import Checkpointer

    state = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True).restore(restored.state, step=8)
    assert int(state.step) == 8


def test_load_for_inference_or_fine_tuning_best_or_last(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, callbacks=[ModelCheckpoint(monitor="val/loss", save_top_k=1)])
    trainer.train_model(train, val, num_epochs=3)
    x = next(iter(val))[0]
    last_predictions = np.asarray(trainer.bind_model()(x, train=False))

    last = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0, which="last")
    np.testing.assert_array_equal(np.asarray(last.bind_model()(x, train=False)), last_predictions)
    assert last.state.opt_state is None

    tuned = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0, which="last", with_optimizer=True)
    jax.tree.map(np.testing.assert_array_equal, tuned.state.opt_state, trainer.state.opt_state)
    tuned.init_optimizer  # the optimizer exists: training continues from the saved moments
    assert tuned.train_epoch(train)["train/loss"] > 0

    best = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    best_step = trainer._checkpoint_callback.best_step
    assert int(best.state.step) == best_step


def test_pruned_checkpoints_are_gone_after_fit_also_those_a_killed_run_left(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    checkpoints = tmp_path / "run" / "checkpoints"
    leftover = checkpoints / ".deleting-7-deadbeef" / "state"  # a deletion a killed run did not finish
    leftover.mkdir(parents=True)
    (leftover / "data").write_bytes(b"x" * 100)
    _trainer(tmp_path, callbacks=[ModelCheckpoint(save_top_k=0, save_last=True)]).train_model(train, val, num_epochs=4)
    assert os.listdir(checkpoints) == [str(4 * len(train))]  # only the last: three pruned, the leftover removed


def test_a_damaged_meta_in_the_newest_checkpoint_still_loads_the_best(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    worst = ModelCheckpoint(monitor="val/loss", mode="max")  # best: the first epoch; the last: a later one
    trainer = _trainer(tmp_path, callbacks=[worst])
    trainer.train_model(train, val, num_epochs=3)
    best, newest = worst.best_step, max(_steps(tmp_path / "run"))
    assert best < newest
    meta_file = next(p for p in (tmp_path / "run" / "checkpoints" / str(newest) / "meta").iterdir() if p.is_file())
    meta_file.write_text(meta_file.read_text()[: len(meta_file.read_text()) // 2])
    with pytest.warns(RuntimeWarning, match=f"Checkpoint {newest} .* damaged meta item"):
        loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=np.zeros((1, 4), np.float32))
    assert loaded.global_step == best


def test_a_damaged_best_checkpoint_is_an_error_not_the_last_one_under_its_name(tmp_path, regression_loaders):
    """which='best' loaded the newest checkpoint instead (another model) with only a warning, and
    `flaxlight test` printed its numbers as the best checkpoint's."""
    from flaxlight.checkpoint import DamagedCheckpointError

    train, val, _ = regression_loaders
    worst = ModelCheckpoint(monitor="val/loss", mode="max")  # keeps the first (worst) epoch as the best
    _trainer(tmp_path, callbacks=[worst]).train_model(train, val, num_epochs=3)
    best, last = _steps(tmp_path / "run")
    assert best < last
    for path in (tmp_path / "run" / "checkpoints" / str(best) / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DamagedCheckpointError, match=f"Checkpoint {best} .* damaged.*best checkpoint and no other "
                                                     f"holds that model: load which='last' \\(step {last}\\)"):
        RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which="last")
    assert int(loaded.state.step) == last
    # in process too: the error says damaged (it said "changed hyperparameters?" as a plain ValueError)
    with pytest.raises(DamagedCheckpointError, match=f"Could not restore checkpoint {best} .* damaged or partial"):
        loaded.predict(X0, batch_size=1, which="best")


def test_a_best_checkpoint_removed_by_hand_is_said_before_the_newest_loads(tmp_path, regression_loaders):
    """which='best' loaded the newest checkpoint without a word when the best's folder was gone."""
    import shutil

    train, val, _ = regression_loaders
    worst = ModelCheckpoint(monitor="val/loss", mode="max")  # keeps the first (worst) epoch as the best
    _trainer(tmp_path, callbacks=[worst]).train_model(train, val, num_epochs=3)
    best, last = _steps(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / str(best))
    with pytest.warns(RuntimeWarning, match=f"The best checkpoint, step {best}, is not in .*checkpoints \\(removed\\?\\); "
                                            f"loading the newest, step {last}, instead"):
        loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    assert int(loaded.state.step) == last


def test_flaxlight_test_of_a_damaged_best_checkpoint_fails_in_one_line(tmp_path, capsys):
    from flaxlight import cli

    configs = Path(__file__).resolve().parents[1] / "examples" / "configs"
    run = tmp_path / "run"  # the best by val/loss, mode max: the first validation's, not the last
    assert cli.main(["fit", "--config", str(configs / "sine_regression.yaml"), "trainer.max_epochs=2",
                     "trainer.check_val_every_n_epoch=1", "trainer.monitor=val/loss", "trainer.mode=max",
                     "trainer.enable_progress_bar=false", "--log-dir", str(run)]) == 0
    best, last = _steps(run)
    for path in (run / "checkpoints" / str(best) / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    capsys.readouterr()
    code = cli.main(["test", "--ckpt", str(run), "--which", "best"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and f"Checkpoint {best}" in err and "which='last'" in err


def test_flaxlight_test_of_a_bit_flipped_only_checkpoint_fails_in_one_line(tmp_path):
    """Corrupted bytes (not a truncation) in a run's only checkpoint: orbax's reads left behind
    printed dozens of "RuntimeError: Event loop is closed" tracebacks (and, on a busy machine, asyncio's
    "exception was never retrieved"), and a warning said "loading the newest readable checkpoint instead"
    though there was none."""
    import subprocess
    import sys

    from flaxlight import cli

    configs = Path(__file__).resolve().parents[1] / "examples" / "configs"
    run = tmp_path / "run"
    assert cli.main(["fit", "--config", str(configs / "sine_regression.yaml"), "trainer.max_epochs=1",
                     "trainer.check_val_every_n_epoch=1", "trainer.enable_progress_bar=false",
                     "--log-dir", str(run)]) == 0
    (only,) = _steps(run)
    for path in (run / "checkpoints" / str(only) / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":  # the array data: every 7th byte flipped
            data = bytearray(path.read_bytes())
            data[::7] = bytes(b ^ 0xFF for b in data[::7])
            path.write_bytes(bytes(data))
    done = subprocess.run([sys.executable, "-m", "flaxlight", "test", "--ckpt", str(run)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, CI="true"))
    err = done.stderr
    assert done.returncode == 1 and err.count("\n") == 1, err[-3000:]  # one line: no tracebacks, no warning
    assert err.startswith(f"flaxlight test: error: Checkpoint {only} in ") and "damaged or partial" in err
    assert "run's only checkpoint" in err


def test_a_failed_orbax_call_finishes_its_other_reads_before_its_event_loop_closes(monkeypatch, caplog):
    """orbax closed its event loop as soon as one read failed: the reads still in flight in tensorstore
    finished into the closed loop ("RuntimeError: Event loop is closed", dozens of tracebacks) or left a
    future whose exception nobody retrieved (asyncio's "never retrieved", now and then on a busy machine)."""
    import asyncio
    import gc
    import sys
    import threading

    import tensorstore as ts
    from orbax.checkpoint._src import asyncio_utils

    from flaxlight import checkpoint

    checkpoint._ocp()  # flaxlight's first use of orbax
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    promise, late = ts.Promise.new()  # a read tensorstore finishes after the first one failed
    reads = []

    async def read_late():
        await late

    async def read_damaged():
        raise ValueError("DATA_LOSS: first")

    async def restore():
        reads.extend(asyncio.ensure_future(read()) for read in (read_late, read_damaged))
        threading.Timer(0.05, promise.set_exception, [ValueError("DATA_LOSS: second")]).start()
        await asyncio.gather(*reads)  # as orbax's restore: no return_exceptions

    with pytest.raises(ValueError, match="DATA_LOSS: first"):
        asyncio_utils.run_sync(restore())
    assert all(read.done() for read in reads), "a read was still running when orbax closed its event loop"
    reads.clear()
    gc.collect()
    assert not unraisable and "never retrieved" not in caplog.text
