"""Bad input gets a message that says what was wrong and how to fix it."""

import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

from flaxlight import ArrayLoader, TrainerModule

X0 = np.zeros((1, 4), np.float32)


def _trainer(tmp_path, **kwargs):
    kwargs.setdefault("optimizer_hparams", {"lr": 1e-2})
    return RegressTrainer(model_class=TinyMLP, model_hparams={}, exmp_input=X0, **quiet(tmp_path, **kwargs))


def _loader(dim=4, num=16):
    return ArrayLoader(np.zeros((num, dim), np.float32), np.zeros((num, 1), np.float32), batch_size=8)


def test_exmp_input_shape_that_does_not_match_the_batches(tmp_path):
    with pytest.raises(ValueError, match=r"shape \(8, 5\).*exmp_input\[0\] of shape \(1, 4\)"):
        _trainer(tmp_path).train_model(_loader(dim=5), None, num_epochs=1)


def test_empty_loader(tmp_path):
    with pytest.raises(ValueError, match="yielded no batches"):
        _trainer(tmp_path).train_model([], None, num_epochs=1)


def test_batch_that_is_not_an_array_pytree(tmp_path):
    batches = [("not", "arrays")]
    with pytest.raises(TypeError, match=r"pytree of numpy/JAX arrays.*str"):
        _trainer(tmp_path).train_model(batches, None, num_epochs=1)


def test_unknown_optimizer_lists_the_valid_names(tmp_path):
    with pytest.raises(ValueError, match=r"'adamm'.*Did you mean 'adam'.*sgd"):
        _trainer(tmp_path, optimizer_hparams={"optimizer": "adamm"}).train_model(_loader(), None, num_epochs=1)


def test_create_functions_with_the_wrong_arity(tmp_path):
    class OneFunction(TrainerModule):
        def create_functions(self):
            return (lambda state, batch: (state, {}),)

    with pytest.raises(TypeError, match=r"pair \(train_step, eval_step\).*length 1"):
        OneFunction(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0, **quiet(tmp_path))


def test_no_loss_fn_and_no_create_functions(tmp_path):
    with pytest.raises(NotImplementedError, match="loss_fn.*create_functions"):
        TrainerModule(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0, **quiet(tmp_path))


def test_validation_interval_longer_than_the_run_fails_up_front(tmp_path):
    trainer = _trainer(tmp_path, check_val_every_n_epoch=5)
    with pytest.raises(ValueError, match="check_val_every_n_epoch=5 > num_epochs=3"):
        trainer.train_model(_loader(), _loader(), num_epochs=3)
    assert int(trainer.state.step) == 0  # nothing ran


def test_loader_without_len_needs_steps_per_epoch(tmp_path):
    def batches():
        yield from _loader()

    with pytest.raises(TypeError, match="steps_per_epoch"):
        _trainer(tmp_path).train_model(batches(), None, num_epochs=1)
    assert _trainer(tmp_path).train_model(batches(), None, num_epochs=1, steps_per_epoch=2)["train/loss"] >= 0
