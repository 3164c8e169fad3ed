"""docs/from-keras.md stays true: every Keras keyword refused with a hint has a row, the
ReduceLROnPlateau row's patience in epochs holds, and the zoo classifier's answer to Keras-style
``(x, y, sample_weight)`` batches points at a docs section that exists."""

import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

import flaxlight
from flaxlight.callbacks import ModelCheckpoint, early_stopping, model_checkpoint
from flaxlight.data import KERAS_KEYWORDS
from flaxlight.zoo import ClassificationTrainer

DOCS = Path(__file__).resolve().parents[1] / "docs"
FROM_KERAS = (DOCS / "from-keras.md").read_text()


def _row(keras: str) -> str:
    """The table row of from-keras.md whose Keras cell mentions ``keras``."""
    rows = [line for line in FROM_KERAS.splitlines() if line.startswith("| ") and keras in line.split(" | ")[0]]
    assert rows, f"docs/from-keras.md has no row for {keras}"
    return rows[0]


@pytest.mark.parametrize("keyword", [*KERAS_KEYWORDS, *early_stopping.KERAS_KEYWORDS,
                                     *model_checkpoint.KERAS_ARGUMENTS])
def test_every_keras_keyword_refused_with_a_hint_has_a_row(keyword):
    assert re.search(rf"`[^`|]*\b{keyword}\b[^`|]*`", FROM_KERAS), keyword


def test_the_keras_rows_say_what_to_write():
    assert "loss_fn` that reads `(x, y, w)` batches ([data](data.md#sample-and-class-weights))" in _row("class_weight")
    assert "`MyTrainer(..., limit_val_batches=10)`" in _row("validation_steps")
    assert "`train_model(..., num_epochs=10, resume=True)`" in _row("initial_epoch")
    assert 'which="best"' in _row("restore_best_weights") and "`monitor`" in _row("restore_best_weights")
    assert "`stopping_threshold=`" in _row("baseline")
    plateau = _row("ReduceLROnPlateau")
    assert "**training** loss of each step" in plateau and '"accumulation_size": steps_per_epoch' in plateau
    assert "so that `patience` counts epochs" in plateau
    assert "No built-in option lowers the rate from a validation metric" in plateau


WHERE = (r"checkpoints are written to <log_dir>/checkpoints/<step>/, with no file name: choose the run's folder with "
         r"the trainer's logger_params=\{'log_dir': \.\.\.\}\. Keras' ModelCheckpoint\(filepath, monitor='val_loss', "
         r"save_best_only=True\) is ModelCheckpoint\(monitor='val/loss', mode='min'\), or no callback at all: the "
         r"default one keeps the best by the trainer's monitor .* and the last, which resume=True goes on from\. Load "
         r"the best with MyTrainer\.load_from_checkpoint\(log_dir, exmp_input=x\[:1\], which='best'\)\.$")


@pytest.mark.parametrize("args, kwargs, error, message", [
    (("best.keras",), dict(monitor="val/loss", save_best_only=True), TypeError,
     r"^ModelCheckpoint\(\) got 'best.keras' as its first argument, which is monitor \(the metric that ranks "
     r"checkpoints, e\.g\. 'val/loss'\), not Keras' filepath: " + WHERE),
    (("best.keras",), {}, TypeError, r"got 'best.keras' as its first argument, which is monitor .*" + WHERE),
    (("ckpts",), dict(monitor="val/loss"), TypeError, r"got 'ckpts' as its first argument, which is monitor"),
    ((), dict(monitor="runs/best.weights.h5"), TypeError,
     r"^ModelCheckpoint\(\) got monitor='runs/best.weights.h5', a file path \(Keras' filepath\?\), not a metric "
     r"such as 'val/loss': " + WHERE),
    ((), dict(monitor="/tmp/ckpt/"), TypeError, r"got monitor='/tmp/ckpt/', a file path"),
    ((), dict(monitor="weights.{epoch:02d}-{val_loss:.2f}"), TypeError, r"a file path \(Keras' filepath\?\)"),
    ((), dict(filepath="best.keras", monitor="val/loss"), TypeError,
     r"^ModelCheckpoint\(\) got an unexpected keyword argument 'filepath' \(a Keras one\): " + WHERE),
    ((), dict(monitor="val/loss", save_best_only=True), TypeError,
     r"^ModelCheckpoint\(\) got an unexpected keyword argument 'save_best_only' \(a Keras one\): the default "
     r"save_top_k=1 keeps the best checkpoint \(by monitor\) and save_last=True the last, which resume=True goes on "
     r"from: leave both as they are\. save_last=False would keep only the best, and a resume would then go on from "
     r"the best epoch, not from where the run ended\. Load the best with which='best'"),
    ((), dict(monitor="val/loss", save_freq="epoch"), TypeError,
     r"'save_freq' \(a Keras one\): checkpoints are written after validations \(the best\) and at epoch ends \(the "
     r"last\), as with Keras' save_freq='epoch' \(drop it\); for one every N batches, every_n_steps=N"),
    ((), dict(monitor="val/loss", initial_value_threshold=0.5), TypeError,
     r"'initial_value_threshold' \(a Keras one\)"),
    ((), dict(monitor="val/acc", mode="auto"), ValueError,
     r"^ModelCheckpoint mode must be 'min' or 'max', got 'auto' \(Keras' 'auto' is not taken: 'max' for a score such "
     r"as 'val/acc', 'min' for a loss\)\.$"),
], ids=["path-first-save_best_only", "path-first", "first-and-monitor", "monitor-path", "monitor-folder",
        "monitor-template", "filepath", "save_best_only", "save_freq", "initial_value_threshold", "mode-auto"])
def test_keras_model_checkpoint_spellings_say_what_to_write(args, kwargs, error, message):
    """Keras' ModelCheckpoint("best.keras", monitor=...) was "got multiple values for argument 'monitor'",
    ModelCheckpoint("best.keras") took the path as its monitor, save_best_only was "Did you mean
    'save_last'?" and filepath / save_freq / mode="auto" got no advice (Keras user's report)."""
    with pytest.raises(error, match=message):
        ModelCheckpoint(*args, **kwargs)


def test_a_metric_named_with_slashes_is_still_a_monitor_first_or_by_keyword():
    assert ModelCheckpoint("val/loss").monitor == "val/loss"
    assert ModelCheckpoint(monitor="val/head_1/acc", mode="max").monitor == "val/head_1/acc"
    from flaxlight.config import ConfigError, _check_kwargs  # configs still check keys against its own arguments
    with pytest.raises(ConfigError, match="Did you mean 'callbacks\\[0\\].save_top_k'"):
        _check_kwargs(ModelCheckpoint, {"save_topk": 3}, "callbacks[0]", "ModelCheckpoint")


@pytest.mark.parametrize("name", ["val/f1_{macro}", "val/nll.pt", "val/acc.h5", "val/bleu.ckpt", "val/x/", "val/a\\b",
                                  "~val/x", "test/map@[.5:.95]", "f1_{macro}", "loss.total"])
def test_a_metric_name_with_a_brace_suffix_or_tilde_is_a_monitor(name):
    """Any name with "{", starting with "~" or ending in "/", ".pt", ".h5" or ".ckpt" was refused as a
    file path, with no way around it: only a name that cannot be a logged metric is one now."""
    assert ModelCheckpoint(monitor=name).monitor == name
    assert ModelCheckpoint(name).monitor == name


@pytest.mark.parametrize("path", ["ckpt/{epoch:02d}.h5", "model-{val_acc:.3f}", "~/models/best", "../runs/best",
                                  "C:\\runs\\best", "best.hdf5"])
def test_a_keras_file_path_is_still_refused_with_the_port_advice(path):
    with pytest.raises(TypeError, match=r"^ModelCheckpoint\(\) got .*, which is monitor .*" + WHERE):
        ModelCheckpoint(path)
    with pytest.raises(TypeError, match=r"a file path \(Keras' filepath\?\), not a metric such as 'val/loss': "):
        ModelCheckpoint(monitor=path)


def test_the_keras_checkpoint_row_says_how_to_port_save_best_only():
    row = _row("save_best_only")
    assert "the default `ModelCheckpoint` keeps the best (`save_top_k=1`) and the last" in row
    assert "`save_last=False` keeps only the best" in row and "a resume then goes on from the best" in row
    assert "goes on from the best one" in _row("initial_epoch")


def test_reduce_on_plateau_with_accumulation_size_counts_patience_in_epochs(tmp_path):
    """What the ReduceLROnPlateau row promises: with ``accumulation_size`` = the steps of an epoch,
    ``patience=1`` halves the rate once per epoch without improvement (lr ~ 0: the epoch's mean
    loss stays the same); per step, it is halved within the first epoch already."""
    assert '"accumulation_size": steps_per_epoch' in _row("ReduceLROnPlateau")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    scales = {}
    for accumulation_size in (1, 4):  # 32 examples in batches of 8: 4 steps per epoch
        seen = scales.setdefault(accumulation_size, [])

        class Record(flaxlight.Callback):
            def on_train_epoch_end(self, trainer, epoch, metrics):
                seen.append(float(flaxlight.current_learning_rate(trainer.state)) / 1e-9)

        trainer = RegressTrainer(
            model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 1}, exmp_input=x[:1],
            optimizer_hparams={"optimizer": "sgd", "lr": 1e-9, "schedule": "constant", "gradient_clip": None,
                               "reduce_on_plateau": {"patience": 1, "factor": 0.5,
                                                     "accumulation_size": accumulation_size}},
            callbacks=[Record()], **quiet(tmp_path / str(accumulation_size)))
        trainer.train_model((x, y), None, num_epochs=3, batch_size=8)
    assert scales[4] == pytest.approx([1.0, 0.5, 0.25])
    assert scales[1][0] < 1.0


class _Weighted(ClassificationTrainer):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y, *w = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return (losses * w[0]).mean() if w else losses.mean(), ({}, updates)


def test_the_classifier_points_weights_at_the_docs_and_a_subclass_with_its_own_loss_takes_them(tmp_path):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y, w = (x[:, 0] > 0).astype(np.int32), np.full(16, 2.0, np.float32)
    kwargs = dict(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 2},
                  optimizer_hparams={"lr": 1e-2}, exmp_input=x[:1])
    with pytest.raises(ValueError, match=r"see docs/data.md, \"Sample and class weights\"") as refused:
        ClassificationTrainer(**kwargs, **quiet(tmp_path / "zoo")).train_model((x, y, w), None, num_epochs=1,
                                                                               batch_size=8)
    section = re.search(r'docs/data.md, "([^"]+)"', str(refused.value)).group(1)
    assert f"\n## {section}\n" in (DOCS / "data.md").read_text()
    weighted = _Weighted(**kwargs, **quiet(tmp_path / "own"))  # its own loss_fn: any layout
    result = weighted.train_model((x, y, w), (x, y), num_epochs=1, batch_size=8)
    plain = weighted.eval_model((x, y), batch_size=8)["loss"]
    assert weighted.eval_model((x, y, w), batch_size=8)["loss"] == pytest.approx(2 * plain, rel=1e-5)
    assert result.history[-1]["val/loss"] == pytest.approx(plain, rel=1e-5)


def test_a_classifier_whose_steps_come_from_create_jitted_functions_takes_any_layout(tmp_path):
    """The layout check looked at loss_fn and create_functions only: a subclass setting its own
    train_step / eval_step in create_jitted_functions (a documented seam) was refused."""
    from flaxlight import make_eval_step, make_train_step

    def weighted_loss(params, batch, *, train, rng, state):
        x, y, w = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, y) * w).mean(), ({}, updates)

    class OwnSteps(ClassificationTrainer):
        def create_jitted_functions(self):
            self.train_step = jax.jit(make_train_step(weighted_loss))
            self.eval_step = jax.jit(make_eval_step(weighted_loss))

    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y, w = (x[:, 0] > 0).astype(np.int32), np.full(16, 2.0, np.float32)
    trainer = OwnSteps(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 2},
                       optimizer_hparams={"lr": 1e-2}, exmp_input=x[:1], **quiet(tmp_path))
    assert np.isfinite(trainer.train_model((x, y, w), (x, y, w), num_epochs=1, batch_size=8)["val/loss"])


class _BinarySigmoid(ClassificationTrainer):
    """Keras' binary classifier: one logit, sigmoid cross-entropy, 0/1 labels (int or float)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logit, updates = state.apply_model(params, x, train=train, rng=rng)
        loss = optax.sigmoid_binary_cross_entropy(logit[:, 0], y.astype(logit.dtype)).mean()
        return loss, ({"acc": ((logit[:, 0] > 0) == (y > 0.5)).mean()}, updates)


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_a_classifier_subclass_with_its_own_loss_takes_a_one_logit_sigmoids_labels(tmp_path, dtype):
    """Its (x, y) batches were refused by the zoo's softmax label check: 'labels must be in [0, 0]. Map
    the labels to 0..0', or float labels outright; (x, y, w) batches of the same data trained."""
    x = np.random.default_rng(0).normal(size=(128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(dtype)
    trainer = _BinarySigmoid(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 1},
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1],
                             **quiet(tmp_path))
    metrics = trainer.train_model((x, y), (x, y), num_epochs=20, batch_size=32)
    assert metrics["val/acc"] > 0.85


def test_keras_stop_training_and_trainable_are_refused_with_what_to_write(tmp_path):
    """A Keras callback's ``model.stop_training = True`` and ``model.trainable = False`` were kept
    as plain attributes on the trainer and did nothing: the run trained on, nothing was frozen."""
    class KerasStyleStop(flaxlight.Callback):
        def on_train_epoch_end(self, trainer, epoch, metrics):
            trainer.stop_training = True

    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, callbacks=[KerasStyleStop()],
                             **quiet(tmp_path))
    with pytest.raises(AttributeError, match=r"RegressTrainer.stop_training = True would change nothing: .*"
                                             r"trainer.should_stop = True"):
        trainer.train_model((x, x.sum(1, keepdims=True)), num_epochs=3, batch_size=8)
    with pytest.raises(AttributeError, match=r"trainable = False would change nothing: .*'freeze': \['Dense_0'\]"):
        trainer.trainable = False
    with pytest.raises(AttributeError, match="has no attribute 'stop_training': Keras'"):
        trainer.stop_training
    assert not hasattr(trainer, "trainable")

    class OwnTrainable(RegressTrainer):  # a class's own argument of that name stays its own attribute
        def __init__(self, *args, trainable=("Dense_0",), **kwargs):
            super().__init__(*args, **kwargs)
            self.trainable = trainable

    own = OwnTrainable(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1], optimizer_hparams={},
                       **quiet(tmp_path / "own"))
    assert own.trainable == ("Dense_0",)
