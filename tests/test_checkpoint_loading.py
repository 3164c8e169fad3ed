"""Best-model checkpoints and load_from_checkpoint, for both constructor styles."""

import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

from flaxlight import TrainerModule


class NamedHparamsTrainer(RegressTrainer):
    """The seed's pattern: model hyperparameters are constructor arguments."""

    def __init__(self, hidden_dims, output_dim, **kwargs):
        super().__init__(model_class=TinyMLP, model_hparams={"hidden_dims": hidden_dims, "output_dim": output_dim},
                         **kwargs)


X0 = np.zeros((1, 4), np.float32)


def test_load_from_checkpoint_with_model_class_constructor(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8, 8]},
                             optimizer_hparams={"lr": 1e-2}, exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    expected = trainer.eval_model(val, log_prefix="val/")

    loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0, enable_progress_bar=False)
    assert loaded.eval_model(val, log_prefix="val/") == pytest.approx(expected, rel=1e-6)
    assert int(loaded.state.step) == int(trainer.state.step)
    assert loaded.state.opt_state is None  # inference only until init_optimizer is called


def test_load_from_checkpoint_flattens_model_hparams_for_the_seed_pattern(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = NamedHparamsTrainer(hidden_dims=[8], output_dim=1, optimizer_hparams={"lr": 1e-2},
                                  exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    loaded = NamedHparamsTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    assert loaded.model_hparams == {"hidden_dims": [8], "output_dim": 1}
    assert loaded.eval_model(val) == pytest.approx(trainer.eval_model(val), rel=1e-6)
    # the loaded trainer can keep training
    loaded.init_optimizer(1, len(train))
    assert loaded.train_epoch(train)["train/loss"] > 0


def test_batch_stats_survive_the_checkpoint(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "batch_norm": True},
                             optimizer_hparams={"lr": 1e-2}, exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    np.testing.assert_array_equal(loaded.state.batch_stats["BatchNorm_0"]["mean"],
                                  trainer.state.batch_stats["BatchNorm_0"]["mean"])


def test_load_from_checkpoint_explains_a_wrong_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="hparams.yaml"):
        RegressTrainer.load_from_checkpoint(tmp_path, exmp_input=X0)
    (tmp_path / "hparams.yaml").write_text("model_class: x.Y\nmodel_hparams: {}\n")
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        TrainerModule.load_from_checkpoint(tmp_path, exmp_input=X0)
