"""Trainers that only define a loss (the trainer builds the steps), registered by short name."""

from __future__ import annotations

import jax.numpy as jnp
import optax

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
    """Cross-entropy on integer labels, plus accuracy (``acc``); BatchNorm updates returned."""

    def loss_fn(self, params, batch, *, train, rng, state):
        images, labels = batch
        logits, updates = state.apply_model(params, images, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        acc = (logits.argmax(-1) == labels).mean()
        return loss, ({"acc": acc}, updates)
