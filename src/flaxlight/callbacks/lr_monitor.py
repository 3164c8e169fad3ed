"""``LearningRateMonitor``: log the learning rate at every train log point."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import jax
import numpy as np

from flaxlight.callbacks.base import Callback

__all__ = ["LearningRateMonitor", "rate_in_optimizer_state"]

_RATE_NAMES = ("learning_rate", "lr", "step_size")


def _nodes(tree: Any):
    """Every node of an optax state tree (NamedTuples, tuples, lists, dicts), depth first."""
    yield tree
    children = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (tuple, list)) else ()
    for child in children:
        yield from _nodes(child)


def rate_in_optimizer_state(opt_state: Any) -> dict[str, Any]:
    """The rates an optax state exposes: ``{"train/lr": ...}`` from ``optax.inject_hyperparams``
    (its ``learning_rate``), ``{"train/lr_scale": ...}`` from ``optax.contrib.reduce_on_plateau``
    (the factor it applies); empty when it exposes none. Values stay on the device.

    Examples:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.125)
        >>> float(rate_in_optimizer_state(tx.init(jnp.zeros(2)))["train/lr"])
        0.125
    """
    found: dict[str, Any] = {}
    for node in _nodes(opt_state):
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, Mapping) and "train/lr" not in found:
            name = next((n for n in _RATE_NAMES if n in hyperparams), None)
            if name is not None:
                found["train/lr"] = hyperparams[name]
        if type(node).__name__ == "ReduceLROnPlateauState" and "train/lr_scale" not in found:
            found["train/lr_scale"] = node.scale
    return found


class LearningRateMonitor(Callback):
    """Logs ``train/lr`` next to the running train metrics.

    For the optimizers flaxlight builds, the rate comes from their schedule evaluated on the
    host at the current step (no device read); with ``reduce_on_plateau`` it is multiplied by the
    factor the plateau applies, read from the device (``train/lr_scale`` is logged too). For a
    ready-made optax transformation, it is read from the optimizer state where the
    transformation exposes it: built with ``optax.inject_hyperparams`` (``train/lr``) or containing
    ``optax.contrib.reduce_on_plateau`` (``train/lr_scale``, the factor applied to the rate);
    that reads one scalar from the device per log point. When neither is known, it says so
    once and logs nothing.

    Examples:
        >>> trainer = MyTrainer(..., callbacks=[LearningRateMonitor()])  # doctest: +SKIP
    """

    def __init__(self):
        self._warned = False

    def on_log(self, trainer, step: int, metrics: Mapping[str, float]) -> None:
        if not any(key.endswith("_step") for key in metrics):
            return
        lr = trainer.learning_rate(step)
        if lr is not None:
            config = getattr(getattr(trainer, "optimizer_plan", None), "config", None)
            if getattr(config, "reduce_on_plateau", None) is None:
                trainer.log_metrics({"train/lr": lr}, step=step)
                return
            scale = rate_in_optimizer_state(trainer.state.opt_state).get("train/lr_scale")  # one device read
            scale = 1.0 if scale is None else float(np.mean(jax.device_get(scale)))
            trainer.log_metrics({"train/lr": lr * scale, "train/lr_scale": scale}, step=step)
            return
        exposed = rate_in_optimizer_state(getattr(trainer.state, "opt_state", None))
        if exposed:
            host = jax.device_get(exposed)
            trainer.log_metrics({key: float(np.mean(value)) for key, value in host.items()}, step=step)
        elif not self._warned:
            self._warned = True
            warnings.warn("LearningRateMonitor: the optimizer is a ready optax transformation whose learning rate "
                          "flaxlight cannot read; build it with optax.inject_hyperparams(optax.adam)(learning_rate=...) "
                          "to have train/lr logged, or give optimizer_hparams instead.", RuntimeWarning, stacklevel=2)
