"""``ThroughputMonitor``: samples/s, step time and the first step's compile time, logged."""

from __future__ import annotations

import time
from typing import Mapping

from flaxlight.callbacks.base import Callback

__all__ = ["ThroughputMonitor"]


class ThroughputMonitor(Callback):
    """Logs ``perf/samples_per_sec`` and ``perf/step_time_ms`` at each train log point, and
    ``perf/compile_time_s`` (the first step, compilation included) once.

    Rates are wall-clock over the interval between log points, measured on the host: no device
    sync is added (the first step is timed to completion once, by the trainer).

    Examples:
        >>> trainer = MyTrainer(..., callbacks=[ThroughputMonitor()])  # doctest: +SKIP
    """

    def __init__(self):
        self._mark: tuple[int, float] | None = None
        self._compile_logged = False
        self.last: dict[str, float] = {}

    def on_train_epoch_start(self, trainer, epoch: int) -> None:
        self._mark = (trainer.global_step, time.perf_counter())

    def on_log(self, trainer, step: int, metrics: Mapping[str, float]) -> None:
        if not any(key.endswith("_step") for key in metrics):
            return
        now = time.perf_counter()
        out: dict[str, float] = {}
        if self._mark is not None and step > self._mark[0]:
            seconds = (now - self._mark[1]) / (step - self._mark[0])
            out["perf/step_time_ms"] = seconds * 1e3
            if trainer.batch_size:
                out["perf/samples_per_sec"] = trainer.batch_size / seconds
        if not self._compile_logged and trainer.compile_time is not None:
            out["perf/compile_time_s"] = trainer.compile_time
            self._compile_logged = True
        self._mark = (step, now)
        if out:
            self.last = out
            trainer.log_metrics(out, step=step)
