"""Metric objects: epoch metrics that are not means of batch values, merged on the device.

A loss function returns them next to its scalar metrics; the trainer merges them over the epoch
(``merge``) and reads them once at its end (``compute``), so an epoch's F1 is the F1 of all its
predictions, not a mean of batch F1s. Any object with ``merge(other)`` and ``compute()`` that is
a pytree works the same way: ``clu.metrics`` and metrax classes, or your own
``flax.struct.dataclass``.

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
from flax import struct

__all__ = ["Mean", "Sum", "Max", "Min", "Std", "ConfusionMatrix", "F1"]


def _masked(values: Any, mask: Any, fill: float) -> jax.Array:
    values = jnp.asarray(values, jnp.float32)
    return values if mask is None else jnp.where(jnp.asarray(mask, bool), values, fill)


@struct.dataclass
class Mean:
    """The mean of all the epoch's values, each value counted once (where ``mask`` is true, or
    weighted by ``mask`` when it holds numbers): a per-token loss over padded sequences of
    different lengths, where the plain metrics' per-example means would weight each sequence
    alike whatever its length.

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
        weights = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), values.shape)
        return cls(jnp.sum(jnp.where(weights > 0, values * weights, 0.0)), jnp.sum(weights))  # a left-out NaN stays out

    def merge(self, other: "Mean") -> "Mean":
        return Mean(self.total + other.total, self.count + other.count)

    def compute(self) -> jax.Array:
        return _ratio(self.total, self.count)  # 0 for an epoch with nothing counted


@struct.dataclass
class Sum:
    """The total of the values over the epoch (e.g. a count of errors).

    Examples:
        >>> float(Sum.of(jnp.array([1.0, 2.0])).merge(Sum.of(jnp.array([3.0]))).compute())
        6.0
    """

    total: jax.Array

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Sum":
        """The sum of this batch's ``values`` (where ``mask`` is true, when given)."""
        return cls(jnp.sum(_masked(values, mask, 0.0)))

    def merge(self, other: "Sum") -> "Sum":
        return Sum(self.total + other.total)

    def compute(self) -> jax.Array:
        return self.total


@struct.dataclass
class Max:
    """The largest value over the epoch.

    Examples:
        >>> float(Max.of(jnp.array([1.0, 5.0])).merge(Max.of(jnp.array([3.0]))).compute())
        5.0
    """

    value: jax.Array

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Max":
        return cls(jnp.max(_masked(values, mask, -jnp.inf)))

    def merge(self, other: "Max") -> "Max":
        return Max(jnp.maximum(self.value, other.value))

    def compute(self) -> jax.Array:
        return self.value


@struct.dataclass
class Min:
    """The smallest value over the epoch.

    Examples:
        >>> float(Min.of(jnp.array([1.0, 5.0])).merge(Min.of(jnp.array([3.0]))).compute())
        1.0
    """

    value: jax.Array

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Min":
        return cls(jnp.min(_masked(values, mask, jnp.inf)))

    def merge(self, other: "Min") -> "Min":
        return Min(jnp.minimum(self.value, other.value))

    def compute(self) -> jax.Array:
        return self.value


@struct.dataclass
class Std:
    """The standard deviation of all the epoch's values (population, as ``np.std``), e.g. of
    per-example accuracy or loss.

    It keeps the count, the mean and the sum of squared deviations from the mean, and merges
    batches with Chan's parallel formula, so a large mean does not swamp a small spread (values
    around 10000 with a spread of 1 give 1, where the sums of values and of squares in float32
    would give 4). ``mask`` (when given) weights the values: 0 leaves a value out.

    Examples:
        >>> round(float(Std.of(jnp.array([1.0, 3.0])).merge(Std.of(jnp.array([5.0, 7.0]))).compute()), 4)
        2.2361
    """

    count: jax.Array
    mean: jax.Array
    sum_of_squared_deviations: jax.Array

    @classmethod
    def of(cls, values: Any, mask: Any = None) -> "Std":
        values = jnp.ravel(jnp.asarray(values, jnp.float32))
        weights = jnp.ones_like(values) if mask is None else jnp.ravel(jnp.asarray(mask, jnp.float32))
        values = jnp.where(weights > 0, values, 0.0)  # a left-out NaN / Inf does not reach the sums
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
        return jnp.sqrt(jnp.maximum(_ratio(self.sum_of_squared_deviations, self.count), 0.0))


def _ratio(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator``, 0 where the denominator (a total weight, possibly below 1) is 0."""
    return jnp.where(denominator > 0, numerator / jnp.where(denominator > 0, denominator, 1.0), 0.0)


def _class_ids(predictions: Any, labels: Any) -> jax.Array:
    """Class ids from ids (same shape as ``labels``) or from scores / logits (one more axis: argmax)."""
    predictions = jnp.asarray(predictions)
    if predictions.ndim == jnp.ndim(labels) + 1:
        return jnp.argmax(predictions, axis=-1)
    if predictions.shape != jnp.shape(labels):
        raise ValueError(f"predictions have shape {predictions.shape} and labels {jnp.shape(labels)}: give class ids "
                         f"shaped like the labels, or scores with one more axis (classes last).")
    return predictions.astype(jnp.int32)


def _counts(labels: Any, predictions: Any, num_classes: int, mask: Any) -> jax.Array:
    predicted = jnp.ravel(_class_ids(predictions, labels))
    labels = jnp.ravel(jnp.asarray(labels, jnp.int32))
    weights = jnp.ones(labels.shape, jnp.int32) if mask is None else jnp.ravel(jnp.asarray(mask, jnp.int32))
    return jnp.zeros((num_classes, num_classes), jnp.int32).at[labels, predicted].add(weights)


@struct.dataclass
class ConfusionMatrix:
    """Counts of (true class, predicted class) over the epoch; ``compute()`` is the
    ``num_classes x num_classes`` matrix (rows: true class), as ``sklearn.metrics.confusion_matrix``.
    An array result is returned by ``eval_model`` / ``test`` and kept in the history; loggers
    (scalars only) do not receive it.

    Examples:
        >>> ConfusionMatrix.of(jnp.array([0, 1, 1]), jnp.array([0, 1, 0]), num_classes=2).compute().tolist()
        [[1, 0], [1, 1]]
    """

    matrix: jax.Array

    @classmethod
    def of(cls, labels: Any, predictions: Any, num_classes: int, mask: Any = None) -> "ConfusionMatrix":
        """``predictions``: class ids shaped like ``labels``, or scores / logits with the classes last."""
        return cls(_counts(labels, predictions, num_classes, mask))

    def merge(self, other: "ConfusionMatrix") -> "ConfusionMatrix":
        return ConfusionMatrix(self.matrix + other.matrix)

    def compute(self) -> jax.Array:
        return self.matrix


@struct.dataclass
class F1:
    """The F1 score of all the epoch's predictions (from their confusion matrix), equal to
    ``sklearn.metrics.f1_score`` with the same ``average``: ``"macro"`` (mean over the classes
    that occur in the labels or the predictions), ``"micro"`` or ``"binary"`` (class 1).

    Examples:
        >>> y, p = jnp.array([0, 1, 1, 2]), jnp.array([0, 1, 2, 2])
        >>> round(float(F1.of(y, p, num_classes=3).compute()), 4)
        0.7778
    """

    matrix: jax.Array
    average: str = struct.field(pytree_node=False, default="macro")

    @classmethod
    def of(cls, labels: Any, predictions: Any, num_classes: int, average: str = "macro", mask: Any = None) -> "F1":
        if average not in ("macro", "micro", "binary"):
            raise ValueError(f"F1 average must be 'macro', 'micro' or 'binary'; got {average!r}.")
        return cls(_counts(labels, predictions, num_classes, mask), average)

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
