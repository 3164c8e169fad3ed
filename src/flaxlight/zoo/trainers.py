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


@register_trainer("regression")
class RegressionTrainer(TrainerModule):
    """Mean squared error on ``(inputs, targets)`` batches; BatchNorm updates returned if any."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        return jnp.mean((pred - y) ** 2), ({}, updates)


@register_trainer("classification")
class ClassificationTrainer(TrainerModule):
    """Cross-entropy on integer labels, plus accuracy (``acc``); BatchNorm updates returned.

    The labels of each epoch's first training batch are checked once, on the host: integers in
    ``[0, num_classes)``, ``num_classes`` being the model's number of outputs. (Inside the step
    a label of -1 would silently pick the last class and one >= num_classes would give a NaN
    loss.) Later batches are not checked, so the hot loop does no extra work.
    """

    _num_classes: int | None = None

    def loss_fn(self, params, batch, *, train, rng, state):
        images, labels = batch
        logits, updates = state.apply_model(params, images, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        acc = (logits.argmax(-1) == labels).mean()
        return loss, ({"acc": acc}, updates)

    def _start_epoch_sums(self, batch) -> dict:
        """The trainer's first-batch seam: check the labels, then the trainer's own checks."""
        self.check_labels(batch, "train_loader")
        return super()._start_epoch_sums(batch)

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
        integer labels in ``[0, num_classes)``."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2 or not hasattr(batch[1], "dtype"):
            return  # another layout: a subclass's loss_fn reads it
        labels = np.asarray(batch[1])
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
