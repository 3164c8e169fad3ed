"""Validation by steps: ``check_val_every_n_epoch=None`` with ``val_check_interval``; never twice at one step."""

import csv

import numpy as np
import pytest

from conftest import RegressTrainer, TinyMLP, linear_data, quiet
from flaxlight.callbacks import EarlyStopping


def _trainer(tmp_path, optimizer_hparams=None, **kwargs):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 1},
                          optimizer_hparams=optimizer_hparams or {"optimizer": "adam", "lr": 1e-2},
                          exmp_input=np.zeros((1, 4), np.float32), **quiet(tmp_path, **kwargs))


def _val_steps(tmp_path):
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("val/loss")]


TRAIN, VAL = linear_data(40, 0), linear_data(16, 1)  # 5 batches of 8 per epoch


def test_step_only_validation_runs_every_interval_and_never_at_epoch_ends(tmp_path):
    trainer = _trainer(tmp_path, check_val_every_n_epoch=None, val_check_interval=4, max_steps=12)
    result = trainer.train_model(TRAIN, VAL, num_epochs=10, batch_size=8)
    assert _val_steps(tmp_path) == [4, 8, 12]  # not at steps 5 and 10 (epoch ends), once at 12 (the end)
    assert result["val/loss"] == min(row["val/loss"] for row in trainer.history if "val/loss" in row)
    assert trainer.checkpointer.all_steps()  # the best model was saved at a step validation


def test_an_interval_step_at_an_epoch_end_is_validated_once(tmp_path):
    trainer = _trainer(tmp_path, val_check_interval=5)  # every epoch end is also an interval step
    trainer.train_model(TRAIN, VAL, num_epochs=2, batch_size=8)
    assert _val_steps(tmp_path) == [5, 10]


def test_max_steps_on_an_interval_step_mid_epoch_is_validated_once(tmp_path):
    trainer = _trainer(tmp_path, val_check_interval=3, max_steps=6)
    trainer.train_model(TRAIN, VAL, num_epochs=10, batch_size=8)
    assert _val_steps(tmp_path) == [3, 5, 6]  # 5: the epoch end; 6: the interval and the last step, once


def test_step_validations_run_only_in_the_epochs_check_val_every_n_epoch_names(tmp_path):
    """As in Lightning: with check_val_every_n_epoch=2, the interval validates in epochs 2, 4, ...
    only (it validated in every epoch, 7 times here, where Lightning validates 3 times)."""
    trainer = _trainer(tmp_path, check_val_every_n_epoch=2, val_check_interval=2)
    trainer.train_model(TRAIN, VAL, num_epochs=3, batch_size=8)
    assert _val_steps(tmp_path) == [6, 8, 10]  # epoch 2 is steps 6-10; 10: its end, validated once


def test_a_run_resumed_mid_epoch_validates_at_the_steps_of_an_uninterrupted_one(tmp_path):
    import os
    import signal

    import jax

    from flaxlight import Callback

    class SigtermAt(Callback):
        every_n_steps = 1

        def on_step(self, trainer, step):
            if step == 7:  # in epoch 2 (steps 6-10), after its first interval validation
                os.kill(os.getpid(), signal.SIGTERM)

    options = {"check_val_every_n_epoch": 2, "val_check_interval": 2}
    reference = _trainer(tmp_path / "ref", **options)
    reference.train_model(TRAIN, VAL, num_epochs=4, batch_size=8)
    with pytest.raises(SystemExit):
        _trainer(tmp_path / "cut", callbacks=[SigtermAt()], **options).train_model(TRAIN, VAL, num_epochs=4,
                                                                                   batch_size=8)
    resumed = _trainer(tmp_path / "cut", **options)
    resumed.train_model(TRAIN, VAL, num_epochs=4, batch_size=8, resume=True)
    assert _val_steps(tmp_path / "cut") == _val_steps(tmp_path / "ref") == [6, 8, 10, 16, 18, 20]
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


def test_early_stopping_counts_step_validations(tmp_path):
    stopper = EarlyStopping(monitor="val/loss", patience=2, min_delta=1e9)  # nothing counts as an improvement
    trainer = _trainer(tmp_path, check_val_every_n_epoch=None, val_check_interval=2, callbacks=[stopper])
    trainer.train_model(TRAIN, VAL, num_epochs=10, batch_size=8)
    assert _val_steps(tmp_path) == [2, 4, 6] and trainer.global_step == 6


def test_settings_with_no_validation_say_how_to_get_one(tmp_path):
    with pytest.raises(ValueError, match="val_check_interval is not set: no validation would run"):
        _trainer(tmp_path / "a", check_val_every_n_epoch=None).train_model(TRAIN, VAL, num_epochs=2, batch_size=8)
    with pytest.raises(ValueError, match="check_val_every_n_epoch=5 > num_epochs=2.*val_check_interval"):
        _trainer(tmp_path / "b", check_val_every_n_epoch=5).train_model(TRAIN, VAL, num_epochs=2, batch_size=8)
    with pytest.raises(ValueError, match=r"val_check_interval=1000 steps is longer than the run \(\d+ steps\), and "
                                         r"check_val_every_n_epoch=None: no validation would run"):  # trained silently
        _trainer(tmp_path / "d", check_val_every_n_epoch=None, val_check_interval=1000).train_model(
            TRAIN, VAL, num_epochs=2, batch_size=8)
    assert not (tmp_path / "d" / "checkpoints").exists()
    with pytest.raises(ValueError, match="check_val_every_n_epoch=5 > num_epochs=2: no validation would run "
                                         r"\(val_check_interval validates only within the epochs"):
        _trainer(tmp_path / "c", check_val_every_n_epoch=5, val_check_interval=5).train_model(
            TRAIN, VAL, num_epochs=2, batch_size=8)
    with pytest.raises(ValueError, match="positive int, or None"):
        _trainer(tmp_path / "d", check_val_every_n_epoch=0)


def test_a_run_interrupted_as_a_step_validation_comes_resumes_to_the_same_records(tmp_path):
    """SIGTERM while step 6 (a step validation's) runs: the interrupt writes the pending train log
    point (step 4) before the checkpoint and the resumed run then validates; the uninterrupted run
    wrote that point after its validation, so metrics.csv differed in order. It is written first now."""
    import os
    import signal

    class Loader:  # 16 batches of 8; SIGTERM as the 6th is handed out (once)
        def __init__(self, at=None):
            self.x, self.y = linear_data(16 * 8, 0)
            self.at = at

        def __len__(self):
            return 16

        def set_epoch(self, epoch):  # the order is the same in every epoch
            pass

        def __iter__(self):
            for i in range(16):
                if i == self.at:
                    self.at = None
                    os.kill(os.getpid(), signal.SIGTERM)
                yield self.x[i * 8:(i + 1) * 8], self.y[i * 8:(i + 1) * 8]

    def rows(folder):
        with open(folder / "run" / "metrics.csv", newline="") as f:
            return [{key: value for key, value in row.items() if key != "epoch_time" and value}
                    for row in csv.DictReader(f)]

    options = {"val_check_interval": 6, "log_every_n_steps": 4, "seed": 3}
    _trainer(tmp_path / "ref", **options).train_model(Loader(), [VAL], num_epochs=2)
    with pytest.raises(SystemExit):
        _trainer(tmp_path / "cut", **options).train_model(Loader(at=5), [VAL], num_epochs=2)
    _trainer(tmp_path / "cut", **options).train_model(Loader(), [VAL], num_epochs=2, resume=True)
    assert rows(tmp_path / "cut") == rows(tmp_path / "ref")
    assert [row["step"] for row in rows(tmp_path / "ref")][:3] == ["4", "6", "8"]  # train, val, train
