"""Metric objects: epoch metrics that are not means of batch values, merged on the device.

A loss function returns them next to its scalar metrics; the trainer merges them over the epoch
(``merge``) and reads them once at its end (``compute``), so an epoch's F1 is the F1 of all its
predictions, not a mean of batch F1s. Any object with ``merge(other)`` and ``compute()`` that is
a pytree works the same way: ``clu.metrics`` and metrax classes, or your own
``flax.struct.dataclass``.

``mask`` means the same in every class: one weight per value (per example for ``ConfusionMatrix``
and ``F1``), broadcast to the values' shape, as scikit-learn's ``sample_weight``. A weight of 0
leaves a value out (a NaN there included); a boolean mask is weights of 0 and 1. ``Mean``, ``Std``,
``Sum``, ``ConfusionMatrix`` and ``F1`` count a value ``weight`` times (weighted means and sums,
weighted counts); ``Max`` and ``Min`` take the values whose weight is not 0.

Examples:
    >>> def loss_fn(params, batch, *, train, rng, state):
    ...     x, y = batch
    ...     logits, _ = state.apply_model(params, x, train=train, rng=rng)
    ...     loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    ...     return loss, {"acc": (logits.argmax(-1) == y).mean(),
    ...                   "f1": F1.of(y, logits, num_classes=10),
    ...                   "confusion": ConfusionMatrix.of(y, logits, num_classes=10)}   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = ["Mean", "Sum", "Max", "Min", "Std", "ConfusionMatrix", "F1"]


def _weights(mask: Any, shape: tuple[int, ...], metric: str, dtype: Any = jnp.float32) -> jax.Array:
    """``mask`` as weights of ``dtype`` broadcast to ``shape`` (checked at trace time, naming ``metric``)."""
    mask = jnp.asarray(mask)
    try:
        return jnp.broadcast_to(mask.astype(dtype), shape)
    except ValueError:
        raise ValueError(
            f"{metric}.of got a mask of shape {mask.shape} for values of shape {shape}: the mask holds one weight per "
            f"value (0 leaves it out) and must have their shape or broadcast to it, e.g. one weight per example of a "
            f"(batch, tokens) array as mask[:, None].") from None


def _masked(values: Any, mask: Any, fill: float, metric: str) -> jax.Array:
    """``values`` as float32, ``fill`` where ``mask``'s weight is 0."""
    values = jnp.asarray(values, jnp.float32)
    return values if mask is None else jnp.where(_weights(mask, values.shape, metric) != 0, values, fill)


@struct.dataclass
class Mean:
    """The mean of all the epoch's values, each value counted once, or ``mask`` times (weights, as
    ``np.average(values, weights=mask)``; 0 or False leaves a value out): a per-token loss over
    padded sequences of different lengths, where the plain metrics' per-example means would weight
    each sequence alike whatever its length. With nothing counted (every weight 0: a task with no
    labelled example in an evaluation) it is NaN, as torchmetrics' ``MeanMetric``, not a perfect 0:
    a NaN ranks below every number, and a 0/0 does not stop ``EarlyStopping``.

    Examples:
        >>> tokens = Mean.of(jnp.array([[1.0, 2.0], [3.0, 0.0]]), mask=jnp.array([[1, 1], [1, 0]]))
        >>> float(tokens.merge(Mean.of(jnp.array([6.0]))).compute())
        3.0
    """

    total: jax.Array
    count: jax.Array

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Mean":
        """This batch's sum of ``values`` and their count (the sum of ``mask``'s weights, when given)."""
        values = jnp.asarray(values, jnp.float32)
        if mask is None:
            return cls(jnp.sum(values), jnp.asarray(values.size, jnp.float32))
        weights = _weights(mask, values.shape, "Mean")
        return cls(jnp.sum(jnp.where(weights != 0, values * weights, 0.0)), jnp.sum(weights))  # a left-out NaN stays out

    def merge(self, other: "Mean") -> "Mean":
        return Mean(self.total + other.total, self.count + other.count)

    def compute(self) -> jax.Array:
        return _ratio(self.total, self.count, empty=jnp.nan)  # NaN for an epoch with nothing counted


@struct.dataclass
class Sum:
    """The total of the values over the epoch (e.g. a count of errors); with ``mask``, the
    weighted total ``sum(values * mask)`` (0 or False leaves a value out).

    Examples:
        >>> float(Sum.of(jnp.array([1.0, 2.0])).merge(Sum.of(jnp.array([3.0]))).compute())
        6.0
        >>> float(Sum.of(jnp.array([1.0, 2.0, jnp.nan]), mask=jnp.array([2.0, 0.5, 0.0])).compute())
        3.0
    """

    total: jax.Array

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Sum":
        """The sum of this batch's ``values``, each times its weight in ``mask`` (when given)."""
        values = jnp.asarray(values, jnp.float32)
        if mask is None:
            return cls(jnp.sum(values))
        weights = _weights(mask, values.shape, "Sum")
        return cls(jnp.sum(jnp.where(weights != 0, values * weights, 0.0)))  # a left-out NaN stays out

    def merge(self, other: "Sum") -> "Sum":
        return Sum(self.total + other.total)

    def compute(self) -> jax.Array:
        return self.total


@struct.dataclass
class Max:
    """The largest value over the epoch (among those whose ``mask`` weight is not 0, when given).
    With nothing counted (every weight 0: a task with no labelled example in an evaluation) it is
    NaN, as :class:`Mean`'s, not -inf, which ``EarlyStopping(check_finite=True)`` would stop on.

    Examples:
        >>> float(Max.of(jnp.array([1.0, 5.0])).merge(Max.of(jnp.array([3.0]))).compute())
        5.0
    """

    value: jax.Array
    count: jax.Array  # the values counted: none, and the result is NaN

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Max":
        values = jnp.asarray(values, jnp.float32)
        counted = values.size if mask is None else jnp.sum(_weights(mask, values.shape, "Max") != 0)
        return cls(jnp.max(_masked(values, mask, -jnp.inf, "Max"), initial=-jnp.inf), jnp.asarray(counted, jnp.float32))

    def merge(self, other: "Max") -> "Max":
        return Max(jnp.maximum(self.value, other.value), self.count + other.count)

    def compute(self) -> jax.Array:
        return jnp.where(self.count > 0, self.value, jnp.nan)


@struct.dataclass
class Min:
    """The smallest value over the epoch (among those whose ``mask`` weight is not 0, when given).
    With nothing counted (every weight 0: a task with no labelled example in an evaluation) it is
    NaN, as :class:`Mean`'s, not +inf, which ``EarlyStopping(check_finite=True)`` would stop on.

    Examples:
        >>> float(Min.of(jnp.array([1.0, 5.0])).merge(Min.of(jnp.array([3.0]))).compute())
        1.0
    """

    value: jax.Array
    count: jax.Array  # the values counted: none, and the result is NaN

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Min":
        values = jnp.asarray(values, jnp.float32)
        counted = values.size if mask is None else jnp.sum(_weights(mask, values.shape, "Min") != 0)
        return cls(jnp.min(_masked(values, mask, jnp.inf, "Min"), initial=jnp.inf), jnp.asarray(counted, jnp.float32))

    def merge(self, other: "Min") -> "Min":
        return Min(jnp.minimum(self.value, other.value), self.count + other.count)

    def compute(self) -> jax.Array:
        return jnp.where(self.count > 0, self.value, jnp.nan)


@struct.dataclass
class Std:
    """The standard deviation of all the epoch's values (population, as ``np.std``), e.g. of
    per-example accuracy or loss.

    It keeps the count, the mean and the sum of squared deviations from the mean, and merges
    batches with Chan's parallel formula, so a large mean does not swamp a small spread (values
    around 10000 with a spread of 1 give 1, where the sums of values and of squares in float32
    would give 4). ``mask`` (when given) weights the values: 0 leaves a value out; with nothing
    counted it is NaN (as ``np.std`` of no values).

    Examples:
        >>> round(float(Std.of(jnp.array([1.0, 3.0])).merge(Std.of(jnp.array([5.0, 7.0]))).compute()), 4)
        2.2361
    """

    count: jax.Array
    mean: jax.Array
    sum_of_squared_deviations: jax.Array

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Std":
        values = jnp.asarray(values, jnp.float32)
        weights = jnp.ones_like(values) if mask is None else _weights(mask, values.shape, "Std")
        values, weights = jnp.ravel(values), jnp.ravel(weights)
        values = jnp.where(weights != 0, values, 0.0)  # a left-out NaN / Inf does not reach the sums
        count = jnp.sum(weights)
        mean = _ratio(jnp.sum(weights * values), count)
        return cls(count, mean, jnp.sum(weights * (values - mean) ** 2))

    def merge(self, other: "Std") -> "Std":
        count = self.count + other.count
        delta = other.mean - self.mean
        share = _ratio(other.count, count)  # 0 when both are empty
        return Std(count, self.mean + delta * share,
                   self.sum_of_squared_deviations + other.sum_of_squared_deviations + delta ** 2 * self.count * share)

    def compute(self) -> jax.Array:
        return jnp.sqrt(jnp.maximum(_ratio(self.sum_of_squared_deviations, self.count, empty=jnp.nan), 0.0))


def _ratio(numerator: jax.Array, denominator: jax.Array, empty: float = 0.0) -> jax.Array:
    """``numerator / denominator``, ``empty`` where the denominator (a total weight, possibly below 1)
    is 0: 0 inside the sums, NaN for a result of nothing counted (as ``np.average`` has none)."""
    return jnp.where(denominator > 0, numerator / jnp.where(denominator > 0, denominator, 1.0), empty)


def _class_ids(metric: str, predictions: jax.Array, labels: jax.Array, num_classes: int) -> jax.Array:
    """Class ids from ids (integers shaped like ``labels``) or from scores / logits with one more
    axis, of ``num_classes`` (argmax). Anything else is refused at trace time, naming ``metric``."""
    seen = f"{metric}.of got labels of shape {labels.shape} ({labels.dtype}) and predictions of shape " \
           f"{predictions.shape} ({predictions.dtype})"
    binary = "threshold the scores into class ids shaped like the labels: (logits > 0) for logits, (probs > 0.5) " \
             "for probabilities"
    if predictions.ndim == labels.ndim + 1 and predictions.shape[:-1] == labels.shape:
        if predictions.shape[-1] == 1 and not jnp.issubdtype(predictions.dtype, jnp.inexact):
            raise ValueError(f"{seen}: class ids must be shaped like the labels; pass predictions[..., 0].")
        if predictions.shape[-1] == 1:  # argmax over one column would call every example class 0
            raise ValueError(f"{seen}: one score per example (a sigmoid head) is no axis of class scores. For a binary "
                             f"model, {binary}, e.g. {metric}.of(y, logits[..., 0] > 0, num_classes=2"
                             f"{', average=' + repr('binary') if metric == 'F1' else ''}).")
        if predictions.shape[-1] != num_classes:
            raise ValueError(f"{seen}: the last axis holds {predictions.shape[-1]} class scores, but num_classes is "
                             f"{num_classes}. Pass num_classes={predictions.shape[-1]}, or scores of {num_classes} classes.")
        return jnp.argmax(predictions, axis=-1)
    if predictions.shape != labels.shape:
        raise ValueError(f"{seen}: give class ids shaped like the labels, or scores / logits with one more axis "
                         f"(classes last: shape {labels.shape + (num_classes,)}).")
    if not (jnp.issubdtype(predictions.dtype, jnp.integer) or predictions.dtype == jnp.bool_):
        raise ValueError(f"{seen}: predictions shaped like the labels are taken as class ids, which are integers; these "
                         f"are {predictions.dtype} scores. For a binary model, {binary}; for several classes, give "
                         f"scores with the classes last (shape {labels.shape + (num_classes,)}) or their argmax(-1).")
    return predictions.astype(jnp.int32)


def _counts(metric: str, labels: Any, predictions: Any, num_classes: int, mask: Any) -> jax.Array:
    """The ``num_classes x num_classes`` (true, predicted) counts, weighted by ``mask``: int32
    without weights or with integer / boolean ones, float32 with fractional weights (as
    scikit-learn's ``confusion_matrix(..., sample_weight=...)``). An example whose label or
    prediction is not a class id in ``0 .. num_classes - 1`` (an ignore label such as -1 or -100)
    is left out, as ``confusion_matrix(..., labels=range(num_classes))`` leaves it out."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
        raise ValueError(f"{metric}.of needs num_classes, the number of classes, as a Python int of at least 2 (2 for "
                         f"a binary model); got {num_classes!r}.")
    labels, predictions = jnp.asarray(labels), jnp.asarray(predictions)
    if not (jnp.issubdtype(labels.dtype, jnp.integer) or labels.dtype == jnp.bool_):
        raise ValueError(f"{metric}.of got labels of dtype {labels.dtype} (shape {labels.shape}): labels are class ids, "
                         f"integers in 0 .. {num_classes - 1}. Pass y.astype(jnp.int32) (float labels of a binary "
                         f"model included; soft labels have no confusion matrix).")
    predicted = _class_ids(metric, predictions, labels, num_classes)
    labels = labels.astype(jnp.int32)
    counted = (labels >= 0) & (labels < num_classes) & (predicted >= 0) & (predicted < num_classes)
    if mask is None:
        weights = counted.astype(jnp.int32)
    else:
        dtype = jnp.float32 if jnp.issubdtype(jnp.asarray(mask).dtype, jnp.inexact) else jnp.int32
        weights = jnp.where(counted, _weights(mask, labels.shape, metric, dtype), 0)
    rows, columns = jnp.where(counted, labels, 0), jnp.where(counted, predicted, 0)  # no index wraps around
    matrix = jnp.zeros((num_classes, num_classes), weights.dtype)
    return matrix.at[jnp.ravel(rows), jnp.ravel(columns)].add(jnp.ravel(weights))


@struct.dataclass
class ConfusionMatrix:
    """Counts of (true class, predicted class) over the epoch; ``compute()`` is the
    ``num_classes x num_classes`` matrix (rows: true class), as ``sklearn.metrics.confusion_matrix``
    with ``labels=range(num_classes)`` (and ``sample_weight=mask``). An array result is returned by
    ``eval_model`` / ``test`` and kept in the history; loggers (scalars only) do not receive it.

    ``labels``: integer class ids. ``predictions``: integer (or boolean) class ids shaped like
    ``labels``, or scores / logits with one more axis, of ``num_classes`` (argmax). Anything else
    is an error when the step is traced: a binary model's one score per example (shape ``(B, 1)``)
    or float scores shaped like the labels are thresholded first (``logits[:, 0] > 0``), float
    labels cast (``y.astype(jnp.int32)``). An example whose label or prediction is outside
    ``0 .. num_classes - 1`` (an ignore label, -1 or -100) is left out, as with a weight of 0.
    ``mask``: one weight per example (0 leaves it out); fractional weights give a float32 matrix,
    as in scikit-learn, none or integer ones int32 counts.

    Examples:
        >>> ConfusionMatrix.of(jnp.array([0, 1, 1]), jnp.array([0, 1, 0]), num_classes=2).compute().tolist()
        [[1, 0], [1, 1]]
    """

    matrix: jax.Array

    @classmethod
    def of(cls, labels: Any, predictions: Any, num_classes: int, mask: Any = None) -> "ConfusionMatrix":
        """This batch's counts: ``predictions`` are class ids shaped like ``labels``, or scores /
        logits with the classes last; ``mask``, weights (see the class)."""
        return cls(_counts("ConfusionMatrix", labels, predictions, num_classes, mask))

    def merge(self, other: "ConfusionMatrix") -> "ConfusionMatrix":
        return ConfusionMatrix(self.matrix + other.matrix)

    def compute(self) -> jax.Array:
        return self.matrix


@struct.dataclass
class F1:
    """The F1 score of all the epoch's predictions (from their confusion matrix), equal to
    ``sklearn.metrics.f1_score`` with the same ``average``: ``"macro"`` (mean over the classes
    that occur in the labels or the predictions), ``"micro"`` or ``"binary"`` (class 1 of
    ``num_classes=2``). ``labels``, ``predictions`` and ``mask`` are those of
    :class:`ConfusionMatrix` (``mask``: weights, as ``f1_score(..., sample_weight=mask)``); a binary
    model's scores are thresholded first: ``F1.of(y, logits[:, 0] > 0, num_classes=2, average="binary")``.

    Examples:
        >>> y, p = jnp.array([0, 1, 1, 2]), jnp.array([0, 1, 2, 2])
        >>> round(float(F1.of(y, p, num_classes=3).compute()), 4)
        0.7778
    """

    matrix: jax.Array
    average: str = struct.field(pytree_node=False, default="macro")

    @classmethod
    def of(cls, labels: Any, predictions: Any, num_classes: int, average: str = "macro", mask: Any = None) -> "F1":
        """This batch's counts (see the class for the arguments)."""
        if average not in ("macro", "micro", "binary"):
            raise ValueError(f"F1 average must be 'macro', 'micro' or 'binary'; got {average!r}.")
        if average == "binary" and num_classes != 2:
            raise ValueError(f"F1.of(..., average='binary') scores class 1 of a binary model, num_classes=2; got "
                             f"num_classes={num_classes!r}. For several classes use average='macro' or 'micro'.")
        return cls(_counts("F1", labels, predictions, num_classes, mask), average)

    def merge(self, other: "F1") -> "F1":
        return F1(self.matrix + other.matrix, self.average)

    def compute(self) -> jax.Array:
        matrix = jnp.asarray(self.matrix, jnp.float32)
        true_positives = jnp.diag(matrix)
        wrong = matrix.sum(0) + matrix.sum(1) - 2 * true_positives  # false positives + false negatives
        if self.average == "micro":
            return 2 * true_positives.sum() / jnp.maximum(2 * true_positives.sum() + wrong.sum(), 1.0)
        per_class = 2 * true_positives / jnp.maximum(2 * true_positives + wrong, 1.0)
        if self.average == "binary":
            return per_class[1]
        present = (matrix.sum(0) + matrix.sum(1)) > 0
        return jnp.sum(jnp.where(present, per_class, 0.0)) / jnp.maximum(present.sum(), 1)
