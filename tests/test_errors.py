"""Bad input gets a message that says what was wrong and how to fix it."""

import os
import re
import shutil
import traceback

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
    with pytest.raises(ValueError, match=r"shape \(8, 5\).*exmp_input of shape \(1, 4\)"):
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


class _Batches:
    """A loader of the user's own: no len(), a new pass at each iter()."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _fails_before_training(tmp_path, trainer, val, error, match):
    with pytest.raises(error, match=match):
        trainer.train_model(_loader(), val, num_epochs=2)
    assert int(trainer.state.step) == 0 and not (tmp_path / "run" / "hparams.yaml").exists()  # nothing trained or written


def test_a_validation_loader_that_cannot_work_fails_before_the_first_epoch(tmp_path):
    """Found after a whole training epoch, with no checkpoint saved (Lightning's sanity check finds these first)."""
    torch_like = _Batches([(np.zeros((8, 4), np.float32).tolist(), np.zeros((8, 1), np.float32))])  # a collate slip
    _fails_before_training(tmp_path, _trainer(tmp_path), torch_like, TypeError,
                           r"The first batch of val_loader must be an array .* the leaf at \[0\]\[0\]\[0\] is a float")
    _fails_before_training(tmp_path, _trainer(tmp_path), _Batches([]), ValueError, "val_loader yielded no batches")
    wrong_width = _Batches([(np.zeros((8, 5), np.float32), np.zeros((8, 1), np.float32))])
    _fails_before_training(tmp_path, _trainer(tmp_path), wrong_width, ValueError, r"shape \(8, 5\)")
    _fails_before_training(tmp_path, _trainer(tmp_path, limit_val_batches=0.5), _Batches(list(_loader())), TypeError,
                           r"limit_val_batches=0.5 is a fraction, but val_loader has no len\(\)")

    class EvalOnlyBug(RegressTrainer):
        def loss_fn(self, params, batch, *, train, rng, state):
            if not train:
                raise RuntimeError("a bug in the evaluation branch")
            return super().loss_fn(params, batch, train=train, rng=rng, state=state)

    trainer = EvalOnlyBug(model_class=TinyMLP, model_hparams={}, exmp_input=X0, optimizer_hparams={"lr": 1e-2},
                          **quiet(tmp_path))
    _fails_before_training(tmp_path, trainer, _Batches(list(_loader())), RuntimeError, "evaluation branch")
    assert _trainer(tmp_path).train_model(_loader(), _Batches(list(_loader())), num_epochs=2)["val/loss"] >= 0


def test_a_batch_of_zero_rows_is_passed_over_not_a_nan_in_the_metrics(tmp_path):
    """mean([]) is NaN, and NaN * weight 0 is NaN: one empty batch made the epoch's train/loss and
    val/loss NaN and counted as a non-finite step (a NaNGuard would have stopped a healthy run)."""
    batches = list(_loader(num=48))
    empty = (batches[0][0][:0], batches[0][1][:0])
    with pytest.warns(RuntimeWarning) as said:
        trainer = _trainer(tmp_path)
        metrics = trainer.train_model(batches[:2] + [empty] + batches[2:], batches + [empty], num_epochs=2)
    messages = [str(w.message) for w in said]
    training = next(m for m in messages if m.startswith("A training batch has 0 rows"))
    evaluation = next(m for m in messages if m.startswith("An evaluation batch has 0 rows"))
    assert "counts as a step" in training and "step" not in evaluation  # an evaluation batch is no training step
    assert trainer.global_step == int(trainer.state.step) == 2 * 7  # the empty batch still counts as a step
    assert np.isfinite(metrics["train/loss"]) and trainer.nonfinite_steps == 0
    assert trainer.eval_model(batches[:1] + [empty] + batches[1:]) == trainer.eval_model(batches)
    with pytest.raises(ValueError, match=r"The first batch of train_loader has 0 rows .* drop empty batches"):
        _trainer(tmp_path / "again").train_model([empty] + batches, None, num_epochs=1)


def test_the_check_before_training_never_takes_a_batch_from_a_shared_stream(tmp_path):
    """A validation loader whose iter() hands out one shared stream lost its first batch to the look ahead."""
    val_batches = [(np.full((8, 4), i, np.float32), np.full((8, 1), i, np.float32)) for i in range(4)]

    class SharedStream:
        def __init__(self):
            self.stream = iter(val_batches)

        def __iter__(self):
            return self.stream

    trainer = _trainer(tmp_path)
    metrics = trainer.train_model(_loader(), SharedStream(), num_epochs=1)
    assert metrics["val/loss"] == pytest.approx(trainer.eval_model(val_batches, log_prefix="val/")["val/loss"])
    from flaxlight.data import FirstBatches

    metrics = _trainer(tmp_path / "b").train_model(_loader(), FirstBatches(iter(val_batches), 4), num_epochs=1)
    assert metrics["val/loss"] == pytest.approx(trainer.eval_model(val_batches, log_prefix="val/")["val/loss"])


def test_a_compilation_cache_that_is_a_file_is_refused_at_construction(tmp_path):
    """JAX only warned, at each compile, 'Error reading persistent compilation cache entry ... FileExistsError'."""
    (tmp_path / "config.yaml").write_text("x: 1\n")
    with pytest.raises(ValueError, match=r"compilation_cache='.*config.yaml' is a file, not a folder: JAX's persistent "
                                         r"compilation cache is a folder.*Name a folder instead"):
        _trainer(tmp_path, compilation_cache=str(tmp_path / "config.yaml"))
    with pytest.raises(ValueError, match=r"compilation_cache='.*config.yaml/jax' lies under the file .*config.yaml"):
        _trainer(tmp_path, compilation_cache=str(tmp_path / "config.yaml" / "jax"))
    assert not (tmp_path / "run").exists()  # refused before the run's folder is made


def test_a_cache_folder_from_the_environment_that_is_a_file_is_refused(tmp_path, monkeypatch):
    import jax

    from flaxlight.runfiles import enable_compilation_cache

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FLAXLIGHT_CACHE_DIR", str(tmp_path / "file"))
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)  # as in a fresh process
    try:
        with pytest.raises(ValueError, match=r"\$FLAXLIGHT_CACHE_DIR='.*file' is a file, not a folder.*Set it to a "
                                             r"folder, or set compilation_cache"):
            enable_compilation_cache(True)
        assert jax.config.jax_compilation_cache_dir is None  # not taken
        assert enable_compilation_cache(False) is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


class _ThirdBatchWrong:
    """Six batches of 16 whose third is wrong: ``"short_y"`` (3 labels cut off), ``"wide_x"`` (a
    5th feature), or ``"raises"`` (the loader's own error while making it)."""

    def __init__(self, fault):
        self.fault = fault

    def __len__(self):
        return 6

    def __iter__(self):
        for i in range(6):
            x, y = np.full((16, 4), i, np.float32), np.full((16, 1), i, np.float32)
            if i == 2 and self.fault == "short_y":
                y = y[:-3]
            elif i == 2 and self.fault == "wide_x":
                x = np.concatenate([x, x[:, :1]], axis=1)
            elif i == 2:
                raise KeyError("record 32 is missing")
            yield x, y


def _printed(excinfo) -> str:
    """The error as Python prints it (its notes included)."""
    return "".join(traceback.format_exception(excinfo.value))


@pytest.mark.parametrize("fault, said", [
    ("short_y", r"flaxlight: The arrays of the 3rd batch of this epoch of train_loader have different leading "
                r"\(batch\) dimensions: \[0\] 16, \[1\] 13; every array needs one row per example"),
    ("wide_x", r"flaxlight: the step failed on the 3rd batch of this epoch of train_loader, whose arrays differ from "
               r"the first batch's beyond the batch dimension: \[0\] \(16, 5\) float32 \(first batch: \(16, 4\) float32\)"),
])
def test_a_bad_batch_after_the_first_is_named_when_the_step_fails_on_it(tmp_path, fault, said):
    """Only an epoch's first batch is checked; a later bad one gave a bare JAX / Flax error (broadcasting,
    ScopeParamShapeError) that named neither the loader nor the batch."""
    with pytest.raises(Exception) as raised:
        _trainer(tmp_path).train_model(_ThirdBatchWrong(fault), None, num_epochs=1)
    assert len([note for note in raised.value.__notes__ if note.startswith("flaxlight:")]) == 1
    assert re.search(said, _printed(raised))


def test_a_later_evaluation_batch_that_fails_is_named_and_a_loaders_own_error_gets_the_loaders_note(tmp_path):
    """A loader that raised mid-epoch (a corrupt shard) came out bare: now one note names the loader,
    the batch it was producing and how to go on (resume=True, a callback that saves on_exception)."""
    trainer = _trainer(tmp_path)
    trainer.train_model(_loader(), None, num_epochs=1)
    with pytest.raises(Exception) as raised:
        trainer.eval_model(list(_ThirdBatchWrong("wide_x")))
    assert "flaxlight: the step failed on the 3rd batch of the evaluation loader" in _printed(raised)
    with pytest.raises(KeyError, match="record 32 is missing") as raised:
        _trainer(tmp_path / "again").train_model(_ThirdBatchWrong("raises"), None, num_epochs=1)
    notes = [note for note in getattr(raised.value, "__notes__", []) if note.startswith("flaxlight:")]
    assert len(notes) == 1 and "train_loader raised this while producing the 3rd batch of epoch 1" in notes[0]
    assert "resume=True" in notes[0] and "on_exception" in notes[0]


def test_a_list_of_per_example_arrays_is_said_briefly_with_the_fix(tmp_path):
    """A collate that forgot to pad: the message listed all 512 arrays (6,897 characters)."""
    rows = [np.zeros((40 + i % 24,), np.float32) for i in range(512)]
    with pytest.raises(ValueError) as raised:
        _trainer(tmp_path).train_model([(rows, np.zeros((512, 1), np.float32))], None, num_epochs=1)
    message = str(raised.value)
    assert len(message) < 800, message
    assert "[0][0] 40, [0][1] 41" in message and "... (513 arrays in all)" in message
    assert "batch[0] is a list of 512 arrays of lengths 40 to 63: one array per example" in message
    assert "(np.stack)" in message and "pad them to one length" in message


def test_a_log_dir_removed_after_the_trainer_was_built_is_made_again(tmp_path, caplog):
    """A notebook's `rm -rf runs/` between cells: train_model failed with a raw FileNotFoundError on
    <log_dir>/.flaxlight.lock."""
    trainer = _trainer(tmp_path)
    shutil.rmtree(tmp_path / "run")
    with caplog.at_level("INFO", logger="flaxlight"):
        trainer.train_model(_loader(), None, num_epochs=1)
    assert "is gone (removed after the trainer was built): it is made again for this run" in caplog.text
    assert (tmp_path / "run" / "metrics.csv").is_file() and (tmp_path / "run" / "hparams.yaml").is_file()
    assert trainer.global_step == 2 and os.listdir(tmp_path / "run" / "checkpoints")  # its checkpoint too


def test_a_resume_into_a_log_dir_removed_since_is_refused(tmp_path):
    """Made again, it started the run over from step 0 under resume=True (review)."""
    trainer = _trainer(tmp_path)
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=r"resume: the run's folder .* is gone .* nothing to continue"):
        trainer.train_model(_loader(), None, num_epochs=1, resume=True)
    assert not os.path.exists(tmp_path / "run")
