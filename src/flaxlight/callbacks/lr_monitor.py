"""``LearningRateMonitor``: log the learning rate at every train log point."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from flaxlight.callbacks.base import Callback
from flaxlight.metrics import deliberate_reads
from flaxlight.optim import RATE_NAMES, current_learning_rate

__all__ = ["LearningRateMonitor", "rate_in_optimizer_state"]


def _nodes(tree: Any):
    """Every node of an optax state tree (NamedTuples, tuples, lists, dicts), depth first."""
    yield tree
    children = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (tuple, list)) else ()
    for child in children:
        yield from _nodes(child)


def rate_in_optimizer_state(opt_state: Any) -> dict[str, Any]:
    """The rates an optax state exposes, as stored there: ``{"train/lr": ...}`` from
    ``optax.inject_hyperparams`` (its ``learning_rate``: for a schedule, the rate of the last
    update; :func:`flaxlight.current_learning_rate` of the TrainState gives the next one's),
    ``{"train/lr_scale": ...}`` from ``optax.contrib.reduce_on_plateau`` (the factor it applies);
    empty when it exposes none. Values stay on the device.

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
            name = next((n for n in RATE_NAMES if n in hyperparams), None)
            if name is not None:
                found["train/lr"] = hyperparams[name]
        if type(node).__name__ == "ReduceLROnPlateauState" and "train/lr_scale" not in found:
            found["train/lr_scale"] = node.scale
    return found


class LearningRateMonitor(Callback):
    """Logs ``train/lr`` next to the running train metrics: at step ``s``, the rate of the next
    update (the one after the ``s`` steps made), as Lightning's monitor does.

    For the optimizers flaxlight builds, the rate comes from their schedule evaluated on the
    host at that step (no device read); with ``reduce_on_plateau`` it is multiplied by the
    factor the plateau reached by step ``s`` (``train/lr_scale`` is logged too). For a ready-made
    optax transformation, it is read from the optimizer state where the transformation exposes
    it: built with ``optax.inject_hyperparams`` (``train/lr``, the same rate as
    :func:`flaxlight.current_learning_rate` of the state) or containing
    ``optax.contrib.reduce_on_plateau`` (``train/lr_scale``, the factor applied to the rate).
    Values read from the device are taken at step ``s`` itself (``on_step``, every
    ``log_every_n_steps``) and copied to the host in the background, to be logged when the
    running metrics of ``s`` arrive, a log point later: the loop never waits for them. When
    neither is known, it says so once and logs nothing.

    Examples:
        >>> trainer = MyTrainer(..., callbacks=[LearningRateMonitor()])  # doctest: +SKIP
    """

    def __init__(self):
        self._warned = False
        self._source: str | None = None  # "schedule", "schedule+scale", "state" or "none" (set per run)
        self._taken: dict[int, dict[str, Any]] = {}  # step -> device values on their way to the host

    def on_fit_start(self, trainer) -> None:
        """Decide where the rate comes from; read the device only at log points, when it must."""
        self._taken.clear()
        plan = getattr(trainer, "optimizer_plan", None)
        config = getattr(plan, "config", None)
        if getattr(plan, "schedule", None) is not None:  # the rates trainer.learning_rate(step) gives
            self._source = "schedule" if getattr(config, "reduce_on_plateau", None) is None else "schedule+scale"
        else:
            self._source = "state" if rate_in_optimizer_state(getattr(trainer.state, "opt_state", None)) else "none"
        self.every_n_steps = trainer.options.log_every_n_steps if self._source in ("schedule+scale", "state") \
            else None

    def on_step(self, trainer, step: int) -> None:
        """At a log point: start copying this step's rate (or plateau scale) to the host."""
        # Copies on the device first: the next step donates the state's buffers (and so would free them).
        taken = {key: jnp.copy(value) for key, value in self._device_values(trainer).items()}
        with deliberate_reads():
            for value in taken.values():
                value.copy_to_host_async()
        self._taken[step] = taken

    def _device_values(self, trainer) -> dict[str, Any]:
        """The rate and the plateau scale in the state now (device arrays; nothing waits)."""
        state = trainer.state
        values = {key: value for key, value in rate_in_optimizer_state(state.opt_state).items()
                  if key == "train/lr_scale"}
        if self._source == "state":
            rate = current_learning_rate(state)  # the rate of the next update (an inject schedule asked)
            if rate is not None:
                values["train/lr"] = rate
        return values

    def on_log(self, trainer, step: int, metrics: Mapping[str, float]) -> None:
        if not any(key.endswith("_step") for key in metrics):
            return
        if self._source is None:  # logged outside train_model's loop (no on_fit_start)
            self.on_fit_start(trainer)
        if self._source == "schedule":
            trainer.log_metrics({"train/lr": trainer.learning_rate(step)}, step=step)
            return
        if self._source == "none":
            self._warn_once()
            return
        values = self._values_at(trainer, step)
        if values is None:
            return
        if self._source == "schedule+scale":
            scale = values.get("train/lr_scale", 1.0)
            values = {"train/lr": trainer.learning_rate(step) * scale, "train/lr_scale": scale}
        if values:
            trainer.log_metrics(values, step=step)

    def _values_at(self, trainer, step: int) -> dict[str, float] | None:
        """The values taken at ``step``, on the host; None when none were (never a later step's)."""
        taken = self._taken.pop(step, None)
        for old in [s for s in self._taken if s < step]:
            del self._taken[old]
        if taken is None and step == trainer.global_step:  # delivered before this step's on_step ran (a
            taken = self._device_values(trainer)  # checkpoint flushed the log): the state is still step's
        if taken is None:
            return None
        return {key: float(np.mean(value)) for key, value in jax.device_get(taken).items()}

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn("LearningRateMonitor: the optimizer is a ready optax transformation whose learning rate "
                          "flaxlight cannot read; build it with optax.inject_hyperparams(optax.adam)(learning_rate=...) "
                          "to have train/lr logged, or give optimizer_hparams instead.", RuntimeWarning, stacklevel=3)
