"""``LearningRateMonitor``: log the learning rate at every train log point."""

from __future__ import annotations

from typing import Mapping

from flaxlight.callbacks.base import Callback

__all__ = ["LearningRateMonitor"]


class LearningRateMonitor(Callback):
    """Logs ``train/lr`` next to the running train metrics.

    The rate comes from the optimizer's schedule evaluated on the host at the current step, so
    it costs no device read. Nothing is logged for a ready-made optax transformation whose
    schedule flaxlight does not know.

    Example:
        >>> trainer = MyTrainer(..., callbacks=[LearningRateMonitor()])  # doctest: +SKIP
    """

    def on_log(self, trainer, step: int, metrics: Mapping[str, float]) -> None:
        if not any(key.endswith("_step") for key in metrics):
            return
        lr = trainer.learning_rate(step)
        if lr is not None:
            trainer.log_metrics({"train/lr": lr}, step=step)
