"""Trainers that only define a loss (the trainer builds the steps), registered by short name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flaxlight.data import as_input_list
from flaxlight.registry import register_trainer
from flaxlight.trainer import TrainerModule

__all__ = ["ClassificationTrainer", "RegressionTrainer"]


def _one_array(out, trainer: str):
    """The model's output, which these losses need to be one array."""
    if not hasattr(out, "ndim"):
        raise TypeError(f"{trainer}'s loss needs the model to return one array; it returned a {type(out).__name__}. "
                        f"Return one array from the model, or subclass {trainer} and override loss_fn to pick "
                        f"the output the loss is on.")
    return out


def _matched(pred, target, trainer: str, what: str):
    """``(pred, target)`` with a trailing axis of size 1 dropped where only one has it (Keras'
    losses do the same: outputs ``(B, 1)`` against targets ``(B,)``); other shapes must agree,
    since broadcasting ``(B, 1)`` against ``(B,)`` would silently make a ``(B, B)`` loss."""
    if pred.ndim == target.ndim + 1 and pred.shape[-1] == 1:
        pred = pred[..., 0]
    elif target.ndim == pred.ndim + 1 and target.shape[-1] == 1:
        target = target[..., 0]
    if pred.shape != target.shape:
        raise ValueError(f"{trainer}: the model's outputs have shape {tuple(pred.shape)} but the batch's {what} have "
                         f"shape {tuple(target.shape)}; they must match (a trailing axis of size 1 may differ). "
                         f"Check the model's output size and the {what}' layout.")
    return pred, target


def _describe_batch(batch) -> str:
    """``a tuple of 3 parts, of shapes (64, 8), (64,), (64,)``, ``a dict with keys ['x', 'y']``."""
    if isinstance(batch, dict):
        return f"a dict with keys {sorted(map(str, batch))}"
    if isinstance(batch, (tuple, list)):
        shapes = ", ".join(str(tuple(np.shape(part))) if hasattr(part, "shape") else f"a {type(part).__name__}"
                           for part in batch)
        return f"a {type(batch).__name__} of {len(batch)} parts, of shapes {shapes}"
    return f"one array of shape {tuple(np.shape(batch))}" if hasattr(batch, "shape") else f"a {type(batch).__name__}"


@register_trainer("regression")
class RegressionTrainer(TrainerModule):
    """Mean squared error on ``(inputs, targets)`` batches; BatchNorm updates returned if any.

    Outputs and targets must have the same shape, except for a trailing axis of size 1: outputs
    ``(B, 1)`` against targets ``(B,)`` are compared element by element, as in Keras.
    """

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        pred, y = _matched(_one_array(pred, "RegressionTrainer"), jnp.asarray(y), "RegressionTrainer", "targets")
        return jnp.mean((pred - y) ** 2), ({}, updates)


@register_trainer("classification")
class ClassificationTrainer(TrainerModule):
    """Cross-entropy on integer labels, plus accuracy (``acc``); BatchNorm updates returned.

    Labels are one class index per example: shape ``(B,)`` (or ``(B, 1)``) for logits ``(B, C)``.

    The labels of each epoch's first training batch are checked once, on the host: integers in
    ``[0, num_classes)``, ``num_classes`` being the model's number of outputs. (Inside the step
    a label of -1 would silently pick the last class and one >= num_classes would give a NaN
    loss.) Later batches are not checked, so the hot loop does no extra work. The first batch of
    each loader must be a pair ``(inputs, labels)`` while this class's ``loss_fn`` reads it:
    Keras-style ``(x, y, sample_weight)`` batches are refused with a message, as they need a
    ``loss_fn`` of your own (docs/data.md, "Sample and class weights"), which may then read any
    layout.

    Examples:
        >>> trainer = ClassificationTrainer(model_class=MLPClassifier,   # doctest: +SKIP
        ...     model_hparams={"hidden_dims": [32], "num_classes": 10}, optimizer_hparams={"lr": 1e-3},
        ...     exmp_input=x[:1])
        >>> trainer.train_model((x, y), (x_val, y_val), num_epochs=5, batch_size=64)   # doctest: +SKIP
    """

    _num_classes: int | None = None

    def loss_fn(self, params, batch, *, train, rng, state):
        images, labels = batch
        logits, updates = state.apply_model(params, images, train=train, rng=rng)
        logits, labels = _one_array(logits, "ClassificationTrainer"), jnp.asarray(labels)
        if labels.ndim == logits.ndim and labels.shape[-1] == 1:  # (B, 1) labels, as Keras takes them
            labels = labels[..., 0]
        if labels.shape != logits.shape[:-1]:
            raise ValueError(f"ClassificationTrainer: the model's logits have shape {tuple(logits.shape)}, so the "
                             f"labels must have shape {tuple(logits.shape[:-1])} (one class index per example); "
                             f"they have shape {tuple(labels.shape)}. One-hot labels: pass y.argmax(-1).")
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        acc = (logits.argmax(-1) == labels).mean()
        return loss, ({"acc": acc}, updates)

    def _start_epoch_sums(self, batch) -> dict:
        """The trainer's first-batch seam: check the labels, then the trainer's own checks."""
        self.check_labels(batch, "train_loader")
        return super()._start_epoch_sums(batch)

    def _check_first_batch(self, batch, loader_name: str) -> None:
        """An evaluation loader's first batch (a validation's, ``eval_model``'s, ``test``'s): the
        layout this class's ``loss_fn`` reads, then the trainer's own checks."""
        self._check_layout(batch, f"the first batch of {loader_name}")
        super()._check_first_batch(batch, loader_name)

    def _reads_pairs(self) -> bool:
        """Whether this class's own ``loss_fn`` reads the batches (a subclass's may take any layout)."""
        cls = type(self)
        return (cls.loss_fn is ClassificationTrainer.loss_fn and cls.create_functions is TrainerModule.create_functions
                and cls.create_jitted_functions is TrainerModule.create_jitted_functions)

    def _check_layout(self, batch, where: str) -> None:
        """Refuse a batch other than ``(inputs, labels)`` when this class's ``loss_fn`` reads it."""
        if (isinstance(batch, (tuple, list)) and len(batch) == 2) or not self._reads_pairs():
            return
        name = type(self).__name__
        own = (f"a third array of sample or class weights (Keras' sample_weight, class_weight) needs a loss_fn of "
               f"your own: subclass {name} and override loss_fn to read (x, y, w) batches, see docs/data.md, "
               f"\"Sample and class weights\"" if isinstance(batch, (tuple, list)) and len(batch) > 2 else
               f"another layout needs a loss_fn of your own: subclass {name} and override loss_fn")
        raise ValueError(f"{name} takes (inputs, labels) batches, which its loss_fn reads; {where} is "
                         f"{_describe_batch(batch)}. Pass (x, y), e.g. train_model((x, y), (x_val, y_val), "
                         f"batch_size=64); {own}.")

    def _count_classes(self) -> int:
        """The model's number of outputs (the last dimension of its logits), traced once."""
        if self._num_classes is None:
            def logits(variables, inputs):
                return self.model_adapter.apply(variables, *inputs, train=False)

            shape = jax.eval_shape(logits, self.state.variables(), as_input_list(self.exmp_input)).shape
            self._num_classes = int(shape[-1])
        return self._num_classes

    def check_labels(self, batch, where: str) -> None:
        """Fail, naming the offending labels and the fix, unless ``batch = (inputs, labels)`` has
        integer labels in ``[0, num_classes)``; a batch of another layout is refused while this
        class's ``loss_fn`` reads it. A subclass's own ``loss_fn`` (or step) takes any layout and
        labels (a one-logit sigmoid's 0/1, float targets): nothing is checked for it."""
        self._check_layout(batch, f"the first batch of {where}")
        if not self._reads_pairs() or not isinstance(batch, (tuple, list)) or len(batch) != 2 \
                or not hasattr(batch[1], "dtype"):
            return  # another loss reads them
        labels = _this_process_values(batch[1])
        if not np.issubdtype(labels.dtype, np.integer):
            raise TypeError(f"{type(self).__name__} needs integer class labels; the first batch of {where} has labels "
                            f"of dtype {labels.dtype}. Convert them, e.g. y.astype(np.int32) (one-hot labels: "
                            f"y.argmax(-1)).")
        if labels.size == 0:
            return
        low, high, num_classes = int(labels.min()), int(labels.max()), self._count_classes()
        if low < 0 or high >= num_classes:
            raise ValueError(f"Labels in the first batch of {where} range over [{low}, {high}], but the model has "
                             f"num_classes={num_classes} outputs, so labels must be in [0, {num_classes - 1}]. Map "
                             f"the labels to 0..{num_classes - 1} (e.g. y - 1 for labels counted from 1, no -1 for "
                             f"'ignore'), or build the model with more outputs.")


def _this_process_values(array) -> np.ndarray:
    """``array`` on the host; of a batch split over processes (a mesh spanning hosts), the rows
    this process holds (each process checks the part it loaded; the rest cannot be read here).

    Examples:
        >>> _this_process_values(np.arange(3)).tolist()
        [0, 1, 2]
    """
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return np.concatenate([np.asarray(shard.data).reshape(-1) for shard in array.addressable_shards])
    return np.asarray(array)
