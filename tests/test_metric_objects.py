"""Metric objects returned by a loss (F1, confusion matrix, sum, max, min, std): epoch values
computed from all the epoch's predictions, equal to scikit-learn / numpy on the same predictions."""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits
from sklearn.metrics import confusion_matrix, f1_score

import flaxlight
from flaxlight.callbacks import EarlyStopping, ModelCheckpoint
from flaxlight.metric_objects import F1, ConfusionMatrix, Max, Min, Std, Sum
from conftest import TinyMLP, linear_data, quiet


class DigitsTrainer(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        wrong = logits.argmax(-1) != y
        return losses.mean(), ({"acc": 1.0 - wrong.mean(), "f1": F1.of(y, logits, num_classes=10),
                                "f1_micro": F1.of(y, logits, num_classes=10, average="micro"),
                                "confusion": ConfusionMatrix.of(y, logits, num_classes=10),
                                "errors": Sum.of(wrong), "loss_max": Max.of(losses), "loss_min": Min.of(losses),
                                "loss_std": Std.of(losses)}, updates)


def _digits():
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int32)


def _trainer(tmp_path, **kwargs):
    return DigitsTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [32], "output_dim": 10},
                         optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=np.zeros((1, 64), np.float32),
                         **quiet(tmp_path, **kwargs))


def test_epoch_metric_objects_equal_sklearn_and_numpy_on_the_same_predictions(tmp_path, capsys):
    x, y = _digits()
    train, val = (x[:1200], y[:1200]), (x[1200:1500], y[1200:1500])
    trainer = _trainer(tmp_path)
    trainer.train_model(train, val, num_epochs=2, batch_size=64)
    said = [line for line in capsys.readouterr().err.splitlines() if "the default among" in line]
    assert said and "val/f1" in said[0] and "confusion" not in said[0]  # a matrix is no choice of monitor

    metrics = trainer.eval_model(val, log_prefix="val/", batch_size=64)  # 300 = 4 * 64 + 44: a short last batch
    logits = trainer.predict(val[0], batch_size=64)
    predicted, losses = logits.argmax(-1), np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, val[1]))
    assert metrics["val/f1"] == pytest.approx(f1_score(val[1], predicted, average="macro"), abs=1e-6)
    assert metrics["val/f1_micro"] == pytest.approx(f1_score(val[1], predicted, average="micro"), abs=1e-6)
    np.testing.assert_array_equal(metrics["val/confusion"], confusion_matrix(val[1], predicted, labels=range(10)))
    assert metrics["val/errors"] == int((predicted != val[1]).sum())
    assert metrics["val/loss_max"] == pytest.approx(losses.max(), rel=1e-5)
    assert metrics["val/loss_min"] == pytest.approx(losses.min(), rel=1e-4, abs=1e-6)
    assert metrics["val/loss_std"] == pytest.approx(losses.std(), rel=1e-4)
    assert metrics["val/f1"] > 0.8  # it learned

    # loggers get the scalars; the matrix is in the history and the metrics JSON, not in metrics.csv
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        header = next(csv.reader(f))
    assert {"train/f1", "val/f1", "val/errors"} <= set(header) and not any("confusion" in k for k in header)
    last = trainer.history[-1]
    assert np.asarray(last["val/confusion"]).shape == (10, 10) and np.sum(last["val/confusion"]) == 300
    assert np.sum(last["train/confusion"]) == 1200  # the whole epoch, every batch merged


def test_resume_mid_epoch_keeps_the_epochs_metric_objects(tmp_path):
    x, y = _digits()
    train = (x[:640], y[:640])  # 10 batches of 64 per epoch

    class Crash(flaxlight.Callback):
        every_n_steps = 14

        def on_step(self, trainer, step):
            raise RuntimeError("crash")

    def run(log_dir, callbacks=(), resume=False):
        trainer = _trainer(log_dir, callbacks=[flaxlight.ModelCheckpoint(every_n_steps=4), *callbacks])
        trainer.train_model(train, None, num_epochs=2, batch_size=64, resume=resume)
        return trainer

    reference = run(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "cut", callbacks=[Crash()])  # the step-12 checkpoint is mid-epoch 2
    resumed = run(tmp_path / "cut", resume=True)
    assert resumed.history[-1]["train/confusion"] == reference.history[-1]["train/confusion"]
    assert resumed.history[-1]["train/f1"] == reference.history[-1]["train/f1"]
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


def test_a_non_scalar_metric_that_is_not_an_object_says_what_to_return(tmp_path):
    class VectorTrainer(DigitsTrainer):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y = batch
            logits, _ = state.apply_model(params, x, train=train, rng=rng)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), {"per_class": logits.mean(0)}

    x, y = _digits()
    trainer = VectorTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 10},
                            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1], **quiet(tmp_path))
    with pytest.raises(ValueError, match=r"'per_class' has shape \(10,\).*metric objects.*ConfusionMatrix"):
        trainer.train_model((x[:128], y[:128]), None, num_epochs=1, batch_size=64)


def test_metric_objects_merge_like_one_big_batch():
    values = np.array([0.5, 2.0, -1.0, 4.0, 3.0], np.float32)
    halves = [(Cls.of(values[:2]), Cls.of(values[2:])) for Cls in (Sum, Max, Min, Std)]
    merged = [float(a.merge(b).compute()) for a, b in halves]
    assert merged == pytest.approx([values.sum(), values.max(), values.min(), values.std()], rel=1e-6)
    labels, predictions = np.array([0, 1, 1, 2, 2, 2]), np.array([0, 2, 1, 2, 0, 2])
    f1 = F1.of(labels[:3], predictions[:3], 3).merge(F1.of(labels[3:], predictions[3:], 3))
    assert float(f1.compute()) == pytest.approx(f1_score(labels, predictions, average="macro"))
    binary = F1.of(np.array([0, 1, 1, 0]), np.array([0, 1, 0, 1]), 2, average="binary")
    assert float(binary.compute()) == pytest.approx(f1_score([0, 1, 1, 0], [0, 1, 0, 1]))
    with pytest.raises(ValueError, match="average must be"):
        F1.of(labels, predictions, 3, average="weighted")
    with pytest.raises(ValueError, match="shaped like the labels"):
        ConfusionMatrix.of(labels, predictions[:4], 3)


@pytest.mark.parametrize("mean, spread", [(0.0, 1.0), (1000.0, 0.1), (1e4, 1.0), (300.0, 0.05)])
def test_std_of_values_with_a_large_mean_and_a_small_spread_equals_numpy(mean, spread):
    values = (mean + spread * np.random.default_rng(0).standard_normal(1280)).astype(np.float32)
    merge = jax.jit(lambda a, b: a.merge(b))  # as the trainer merges: inside jit
    total = Std.of(jnp.zeros(3), mask=jnp.zeros(3))  # an empty batch (everything masked out) changes nothing
    for batch in np.split(values, 10):
        total = merge(total, jax.jit(Std.of)(batch))
    assert float(total.compute()) == pytest.approx(values.std(dtype=np.float64), rel=1e-3)


def test_std_leaves_masked_out_values_out_even_when_they_are_nan():
    values = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    masked = Std.of(np.append(values, [np.nan, 1e9]).astype(np.float32), mask=np.arange(130) < 128)
    assert float(masked.compute()) == pytest.approx(values.std(dtype=np.float64), rel=1e-5)


def test_std_in_a_run_with_fused_steps_equals_numpy_over_the_epoch(tmp_path):
    class OffsetTrainer(flaxlight.TrainerModule):  # targets around 10000 (a price, a temperature in K)
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y = batch
            pred, _ = state.apply_model(params, x, train=train, rng=rng)
            return ((pred - y) ** 2).mean(), {"target_std": Std.of(y + 10000.0)}

    (x, y), (xv, yv) = linear_data(256, 0), linear_data(70, 1)
    trainer = OffsetTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                            exmp_input=x[:1], **quiet(tmp_path, steps_per_execution=4))
    trainer.train_model((x, y), (xv, yv), num_epochs=2, batch_size=32)
    expected, expected_val = (y + np.float32(10000.0)).std(dtype=np.float64), (yv + np.float32(10000.0)).std(dtype=np.float64)
    assert [row["train/target_std"] for row in trainer.history] == pytest.approx([expected] * 2, rel=1e-3)
    assert trainer.history[-1]["val/target_std"] == pytest.approx(expected_val, rel=1e-3)  # 32 + 32 + 6 rows


def test_std_with_weights_that_add_up_to_less_than_one_equals_the_weighted_numpy_std():
    values, weights = np.array([1.0, 2.0, 3.0]), np.full(3, 0.1)
    merged = Std.of(jnp.asarray(values[:1]), jnp.asarray(weights[:1])).merge(
        Std.of(jnp.asarray(values[1:]), jnp.asarray(weights[1:])))
    expected = np.sqrt(np.average((values - np.average(values, weights=weights)) ** 2, weights=weights))
    assert float(merged.compute()) == pytest.approx(expected, rel=1e-5)


def test_a_masked_per_token_mean_over_padded_sequences_equals_the_hand_per_token_mean(tmp_path):
    """A per-token loss over padded sequences of different lengths: the plain metrics weight each
    sequence alike (a mean of per-sequence means); Mean counts each real token once."""
    from flaxlight.metric_objects import Mean

    class TokenTrainer(flaxlight.TrainerModule):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y, mask = batch
            pred, _ = state.apply_model(params, x, train=train, rng=rng)  # [B, T] per-token predictions
            errors = (pred - y) ** 2
            loss = (errors * mask).sum() / mask.sum()
            return loss, {"token_error": Mean.of(errors, mask=mask), "ignored": Mean.of(errors, mask=mask > 2)}

    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 6)).astype(np.float32)
    y = rng.standard_normal((48, 6)).astype(np.float32)
    mask = (np.arange(6) < rng.integers(1, 7, size=(48, 1))).astype(np.float32)  # lengths 1..6
    trainer = TokenTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 6},
                           optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1], **quiet(tmp_path))
    trainer.train_model((x, y, mask), None, num_epochs=1, batch_size=16)
    pred = np.asarray(trainer.predict(x, batch_size=16))
    errors = (pred - y) ** 2
    metrics = trainer.eval_model(flaxlight.ArrayLoader(x, y, mask, batch_size=16), log_prefix="val/")
    assert metrics["val/token_error"] == pytest.approx(errors[mask > 0].mean(), rel=1e-5)
    assert metrics["val/token_error"] != pytest.approx((errors * mask).sum(1).__truediv__(mask.sum(1)).mean(), rel=1e-3)
    assert np.isnan(metrics["val/ignored"]) and np.isnan(trainer.history[-1]["train/ignored"])  # nothing counted


# ---------------------------------------------------------------- a binary model's scores, ignore labels
class BinaryTrainer(flaxlight.TrainerModule):
    """One logit per example (a (B, 1) sigmoid head); ``f1`` is given the scores as they come."""

    threshold_first = False

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        z, updates = state.apply_model(params, x, train=train, rng=rng)
        loss = optax.sigmoid_binary_cross_entropy(z[:, 0], y.astype(jnp.float32)).mean()
        predictions = z[:, 0] > 0 if self.threshold_first else z
        return loss, ({"f1": F1.of(y, predictions, num_classes=2, average="binary")}, updates)


def test_a_binary_heads_scores_are_refused_before_training_and_thresholded_ids_give_sklearns_f1(tmp_path):
    """F1 of a (B, 1) sigmoid head's logits was argmax over one column: class 0 for all, F1 0.0
    every epoch, and the epoch-1 model stayed the "best" for monitor='val/f1'."""
    x, y = _digits()
    y = (y >= 5).astype(np.int32)
    train, val = (x[:640], y[:640]), (x[640:900], y[640:900])
    kwargs = dict(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 1},
                  optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1])
    refused = BinaryTrainer(**kwargs, **quiet(tmp_path / "scores", monitor="val/f1", mode="max"))
    with pytest.raises(ValueError, match=r"F1\.of got labels of shape \(64,\) \(int32\) and predictions of shape "
                                         r"\(64, 1\) \(float32\): one score per example .* threshold the scores .*"
                                         r"F1\.of\(y, logits\[\.\.\., 0\] > 0, num_classes=2, average='binary'\)"):
        refused.train_model(train, val, num_epochs=2, batch_size=64)
    assert refused.global_step == 0 and not (tmp_path / "scores" / "run" / "checkpoints").exists()

    class Thresholded(BinaryTrainer):
        threshold_first = True

    trainer = Thresholded(**kwargs, **quiet(tmp_path / "ids", monitor="val/f1", mode="max"))
    trainer.train_model(train, val, num_epochs=2, batch_size=64)
    predicted = (trainer.predict(val[0], batch_size=64)[:, 0] > 0).astype(int)
    assert trainer.history[-1]["val/f1"] == pytest.approx(f1_score(val[1], predicted), abs=1e-6)
    assert trainer.history[-1]["val/f1"] > 0.7


@pytest.mark.parametrize("labels, predictions, expected", [
    (np.array([0, 1, 1]), np.array([0.2, 0.9, 0.6], np.float32),
     r"predictions of shape \(3,\) \(float32\): predictions shaped like the labels are taken as class ids, which are "
     r"integers; these are float32 scores\. For a binary model, threshold .*\(probs > 0\.5\)"),
    (np.array([0.0, 1.0, 1.0], np.float32), np.array([0, 1, 1]),
     r"labels of dtype float32 \(shape \(3,\)\): labels are class ids, integers in 0 \.\. 1\. Pass y\.astype\(jnp\.int32\)"),
    (np.array([0, 1, 1]), np.zeros((3, 3), np.float32),
     r"the last axis holds 3 class scores, but num_classes is 2\. Pass num_classes=3"),
    (np.array([0, 1, 1]), np.zeros((4, 2), np.float32), r"classes last: shape \(3, 2\)"),
    (np.array([0, 1, 1]), np.array([[0], [1], [1]]), r"class ids must be shaped like the labels; pass predictions\[\.\.\., 0\]"),
])
@pytest.mark.parametrize("metric", [F1, ConfusionMatrix])
def test_scores_or_labels_that_are_no_class_ids_are_refused_naming_the_metric_and_the_fix(metric, labels, predictions,
                                                                                          expected):
    with pytest.raises(ValueError, match=rf"{metric.__name__}\.of .*{expected}"):
        metric.of(labels, predictions, num_classes=2)
    with pytest.raises(ValueError, match=rf"{metric.__name__}\.of .*{expected}"):  # at trace time, in a jitted step
        jax.jit(lambda y, p: metric.of(y, p, num_classes=2)).lower(labels, predictions)


def test_f1_binary_needs_two_classes_and_num_classes_is_a_number():
    with pytest.raises(ValueError, match=r"F1\.of\(\.\.\., average='binary'\) scores class 1 of a binary model, num_classes=2; got "
                                         r"num_classes=3\. For several classes use average='macro' or 'micro'"):
        F1.of(np.array([0, 1]), np.array([0, 1]), num_classes=3, average="binary")
    with pytest.raises(ValueError, match=r"ConfusionMatrix\.of needs num_classes, .* at least 2 .*; got 1"):
        ConfusionMatrix.of(np.array([0, 0]), np.array([0, 0]), num_classes=1)


def test_ignore_labels_and_out_of_range_ids_are_left_out_as_sklearn_with_labels_range():
    """A label of -1 counted as the last class (index wrap-around); -100 and ids >= num_classes
    were dropped: now every id outside 0..num_classes-1 is left out, as a weight of 0 leaves it."""
    labels = np.array([0, 1, 2, -1, -1, -100, 2, 1, 3])
    predicted = np.array([0, 1, 2, 2, 0, 1, 1, 5, 2])
    matrix = ConfusionMatrix.of(labels, predicted, num_classes=3).compute()
    np.testing.assert_array_equal(matrix, confusion_matrix(labels, predicted, labels=range(3)))
    assert matrix.dtype == np.int32 and int(matrix.sum()) == 4
    kept = (labels >= 0) & (labels < 3) & (predicted < 3)
    f1 = F1.of(labels, predicted, num_classes=3)
    assert float(f1.compute()) == pytest.approx(f1_score(labels[kept], predicted[kept], average="macro"))
    masked = F1.of(labels, predicted, num_classes=3, mask=kept)
    np.testing.assert_array_equal(masked.matrix, f1.matrix)


# ---------------------------------------------------------------- mask: one meaning, weights
def test_mask_is_a_weight_in_every_metric_object_as_sklearns_sample_weight():
    """Mean and Std weighted by mask; Sum took it as on/off, ConfusionMatrix and F1 truncated it
    to an int (0.5 dropped the example, 2.5 counted it twice)."""
    from flaxlight.metric_objects import Mean

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 200)
    predicted = np.where(rng.random(200) < 0.7, labels, rng.integers(0, 3, 200))
    weights = rng.choice([0.0, 0.5, 1.0, 2.5], 200).astype(np.float32)
    values = rng.normal(size=200).astype(np.float32)
    values[weights == 0] = np.nan  # left out, not summed as NaN * 0
    kept = values[weights > 0]

    def merged(cls, *args, **kwargs):  # two batches, merged as the trainer merges them
        def part(cut):
            return lambda a: a[cut] if isinstance(a, np.ndarray) else a

        first, second = part(slice(None, 120)), part(slice(120, None))
        one = cls.of(*map(first, args), **{k: first(v) for k, v in kwargs.items()})
        return one.merge(cls.of(*map(second, args), **{k: second(v) for k, v in kwargs.items()})).compute()

    average = np.average(kept, weights=weights[weights > 0])
    assert float(merged(Mean, values, mask=weights)) == pytest.approx(average, rel=1e-5)
    assert float(merged(Sum, values, mask=weights)) == pytest.approx((kept * weights[weights > 0]).sum(), rel=1e-5)
    spread = np.sqrt(np.average((kept - average) ** 2, weights=weights[weights > 0]))
    assert float(merged(Std, values, mask=weights)) == pytest.approx(spread, rel=1e-5)
    assert float(merged(Max, values, mask=weights)) == kept.max()
    assert float(merged(Min, values, mask=weights)) == kept.min()
    matrix = merged(ConfusionMatrix, labels, predicted, num_classes=3, mask=weights)
    np.testing.assert_allclose(matrix, confusion_matrix(labels, predicted, sample_weight=weights), rtol=1e-6)
    for average_kind in ("macro", "micro"):
        f1 = merged(F1, labels, predicted, num_classes=3, average=average_kind, mask=weights)
        assert float(f1) == pytest.approx(f1_score(labels, predicted, average=average_kind, sample_weight=weights))
    binary_labels, binary_predicted = labels % 2, predicted % 2
    f1 = merged(F1, binary_labels, binary_predicted, num_classes=2, average="binary", mask=weights)
    assert float(f1) == pytest.approx(f1_score(binary_labels, binary_predicted, sample_weight=weights))
    boolean = ConfusionMatrix.of(labels, predicted, num_classes=3, mask=weights > 0).compute()  # on/off: int counts
    assert boolean.dtype == np.int32
    np.testing.assert_array_equal(boolean, confusion_matrix(labels[weights > 0], predicted[weights > 0]))


def test_a_mask_that_does_not_fit_the_values_is_refused_naming_the_metric():
    with pytest.raises(ValueError, match=r"Sum\.of got a mask of shape \(4,\) for values of shape \(4, 3\): the mask "
                                         r"holds one weight per value .* as mask\[:, None\]"):
        Sum.of(np.ones((4, 3)), mask=np.ones(4))
    per_example = Sum.of(np.ones((4, 3)), mask=np.array([[1.0], [0.0], [2.0], [0.5]]))
    assert float(per_example.compute()) == 3 * 3.5
    with pytest.raises(ValueError, match=r"F1\.of got a mask of shape \(3,\) for values of shape \(4,\)"):
        F1.of(np.array([0, 1, 1, 0]), np.array([0, 1, 1, 0]), num_classes=2, mask=np.ones(3))


@pytest.mark.parametrize("given", ["trainer", "EarlyStopping", "ModelCheckpoint"])
def test_a_monitor_on_an_array_result_is_refused_before_training_naming_it(tmp_path, given):
    """A monitor on a confusion matrix crashed at the first validation, after an epoch of training,
    with numpy's "only 0-dimensional arrays can be converted to Python scalars"."""
    x, y = _digits()
    monitor = dict(monitor="val/confusion", mode="max")
    kwargs = {"trainer": monitor, "EarlyStopping": {"callbacks": [EarlyStopping(**monitor)]},
              "ModelCheckpoint": {"callbacks": [ModelCheckpoint(**monitor)]}}[given]
    trainer = _trainer(tmp_path, **kwargs)
    who = "The trainer" if given == "trainer" else given
    with pytest.raises(ValueError, match=rf"{who} monitors 'val/confusion', a metric object's result of shape "
                                         rf"\(10, 10\): a monitor must be one number .* e\.g\. an F1 object's 'val/f1'"):
        trainer.train_model((x[:256], y[:256]), (x[256:320], y[256:320]), num_epochs=1, batch_size=64)
    assert trainer.global_step == 0


# ---------------------------------------------------------------- nothing counted
def test_a_mean_or_std_of_nothing_counted_is_nan_as_np_average_has_none_and_f1_stays_0():
    """A masked Mean (and Std) with every weight 0 read 0.0: a task with no labelled example in an
    evaluation read a perfect loss."""
    from flaxlight.metric_objects import Mean

    nothing = jnp.zeros(3, bool)
    assert np.isnan(float(Mean.of(jnp.array([2.3, 1.7, 0.4]), mask=nothing).compute()))
    assert np.isnan(float(Std.of(jnp.array([2.3, 1.7, 0.4]), mask=nothing).compute()))
    empty = Mean.of(jnp.ones(2), mask=jnp.zeros(2))
    assert np.isnan(float(empty.merge(empty).compute()))
    assert float(empty.merge(Mean.of(jnp.array([4.0]))).compute()) == 4.0  # an empty batch changes nothing
    assert float(F1.of(jnp.array([-1, -1]), jnp.array([1, 2]), num_classes=3).compute()) == 0.0  # as documented
    from flaxlight.metric_objects import Max, Min  # read -inf / +inf, which EarlyStopping(check_finite) stops on

    for metric in (Max, Min):
        empty = metric.of(jnp.array([2.3, 1.7]), mask=jnp.zeros(2, bool))
        assert np.isnan(float(empty.merge(empty).compute())) and np.isnan(float(metric.of(jnp.zeros(0)).compute()))
        assert float(empty.merge(metric.of(jnp.array([-4.0]))).compute()) == -4.0
        assert float(metric.of(jnp.array([-jnp.inf])).compute()) == -np.inf  # a value counted stays what it is


class TaskTrainer(flaxlight.TrainerModule):
    """A second task whose labels are missing at the validation of epoch 2 (and in epoch 3's training)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        from flaxlight.metric_objects import Max, Mean

        x, y = batch
        pred, _ = state.apply_model(params, x, train=train, rng=rng)
        errors = ((pred - y) ** 2)[:, 0]
        labelled = jnp.broadcast_to(state.epoch != 2, errors.shape)  # state.epoch: 2 there
        return errors.mean(), {"task": Mean.of(errors, mask=labelled), "worst": Max.of(errors, mask=labelled)}


def test_an_evaluation_with_nothing_counted_reads_nan_ranks_last_and_stops_nothing(tmp_path, caplog):
    """The empty validation's masked mean read 0.0, a perfect loss: the epoch-2 model was kept as the
    best. NaN ranks below every number; EarlyStopping (check_finite) goes on, the model being finite;
    the progress bar, metrics.csv and the files show it."""
    x, y = linear_data(128, 0)
    stopper = EarlyStopping("val/task", patience=2)
    trainer = TaskTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                          optimizer_hparams={"optimizer": "sgd", "lr": 1e-3}, exmp_input=x[:1],
                          callbacks=[stopper], **quiet(tmp_path, monitor="val/task", enable_progress_bar=True))
    with caplog.at_level("WARNING", logger="flaxlight"):
        best = trainer.train_model((x, y), linear_data(64, 1), num_epochs=4, batch_size=32)
    assert trainer.current_epoch == 4 and trainer.stop_reason is None
    curve = [row["val/task"] for row in trainer.history if "val/task" in row]
    assert np.isnan(curve[1]) and not np.isnan([curve[0], *curve[2:]]).any()
    assert np.isnan(trainer.history[2]["train/task"])  # epoch 3's training counted nothing either
    assert np.isnan(trainer.history[1]["val/worst"]) and trainer.history[2]["val/worst"] > 0  # not -inf
    assert best["val/task"] == min(curve[0], *curve[2:]) and stopper.best == best["val/task"]
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        logged = [row["val/task"] for row in csv.DictReader(f) if row.get("val/task")]
    assert logged[1] == "nan" and len(logged) == 4
    assert "EarlyStopping: val/task = nan at epoch 2, while the training's loss is finite: a 0/0" in caplog.text
