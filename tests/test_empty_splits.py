"""An empty test split: no test (zoo datasets), or refused before training (train_model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

from flaxlight import ArrayLoader, cli
from flaxlight.zoo.datasets import sine

ROOT = Path(__file__).resolve().parents[1]
X0 = np.zeros((1, 4), np.float32)


def _loader(num=16):
    return ArrayLoader(np.zeros((num, 4), np.float32), np.zeros((num, 1), np.float32), batch_size=8)


def test_an_empty_test_loader_is_refused_before_training(tmp_path):
    """It was first read after the whole run: 'The evaluation loader (test/) yielded no batches'."""
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, exmp_input=X0, optimizer_hparams={"lr": 1e-2},
                             **quiet(tmp_path))
    with pytest.raises(ValueError, match=r"test_loader yielded no batches .*pass test_loader=None"):
        trainer.train_model(_loader(), _loader(), test_loader=_loader(num=0), num_epochs=2)
    assert int(trainer.state.step) == 0 and not (tmp_path / "run" / "hparams.yaml").exists()  # nothing ran
    with pytest.raises(ValueError, match=r"test_loader yielded no batches"):
        trainer.train_model(_loader(), _loader(), test_loader=[], num_epochs=2)
    assert int(trainer.state.step) == 0


def test_zoo_datasets_have_no_test_loader_for_num_test_0():
    assert sine(batch_size=50, num_test=0)[2] is None
    assert len(sine(batch_size=50, num_test=100)[2]) == 2
    pytest.importorskip("sklearn")
    from flaxlight.zoo.datasets import digits

    train, val, test = digits(batch_size=64, num_test=0)
    assert test is None and len(val) == 5 and len(train) == 24  # the 300 test examples train


def test_fit_with_num_test_0_trains_and_does_not_test(tmp_path, capsys):
    """Ended, after the whole run, in a traceback with exit 1."""
    argv = ["fit", "--config", ROOT / "examples" / "configs" / "sine_regression.yaml", "trainer.max_epochs=1",
            "trainer.check_val_every_n_epoch=1", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "data.kwargs={num_train: 100, num_test: 0}", "data.batch_size=50",
            "--log-dir", tmp_path / "run"]
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    assert "val/loss" in out and "test/" not in out
