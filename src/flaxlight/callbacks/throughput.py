"""``ThroughputMonitor``: samples/s, step time and the first step's compile time, logged."""

from __future__ import annotations

import time
from typing import Mapping

from flaxlight.callbacks.base import Callback

__all__ = ["ThroughputMonitor", "TrainClock"]


class TrainClock:
    """Seconds per step between train log points, from the times the loop gives each point
    (``trainer.log_point_time``): the time of training only. What an epoch spends after its last
    log point (the last steps, their ``on_step`` callbacks) counts towards the next epoch's first
    interval; its validation and epoch-end work count nowhere.

    Examples:
        >>> clock = TrainClock()
        >>> clock.start_epoch(step=0, now=10.0)
        >>> clock.seconds_per_step(step=4, done=12.0)
        0.5
        >>> clock.end_epoch(step=5, now=13.0); clock.start_epoch(step=5, now=20.0)
        >>> clock.seconds_per_step(step=8, done=21.0)   # steps 5-8 (4 of them) in 1 s + 1 s
        0.5
    """

    def __init__(self):
        self._mark: tuple[int, float] | None = None  # (step, time) of the previous point
        self._carry: tuple[int, float] = (0, 0.0)  # steps and seconds after the last epoch's last point

    def start_epoch(self, step: int, now: float | None = None) -> None:
        """An epoch's training starts at ``step`` (``now``: default the current time)."""
        now = time.perf_counter() if now is None else now
        steps, seconds = self._carry
        self._mark, self._carry = (step - steps, now - seconds), (0, 0.0)

    def end_epoch(self, step: int, now: float | None = None) -> None:
        """An epoch's training ended at ``step``: the time since its last point carries over."""
        now = time.perf_counter() if now is None else now
        if self._mark is not None:
            self._carry = (step - self._mark[0], now - self._mark[1])
        self._mark = None

    def seconds_per_step(self, step: int, done: float) -> float | None:
        """The interval's seconds per step, up to the point ``step`` done at ``done`` (None when
        there is no interval: the first point, or no step since the previous one)."""
        mark, self._mark = self._mark, (step, done)
        if mark is None or step <= mark[0] or done <= mark[1]:
            return None
        return (done - mark[1]) / (step - mark[0])


class ThroughputMonitor(Callback):
    """Logs ``perf/samples_per_sec`` and ``perf/step_time_ms`` at each train log point, and
    ``perf/compile_time_s`` (the first step, compilation included) once.

    Rates are wall-clock over the interval between log points (see :class:`TrainClock`), each
    point timed when its step was done (``trainer.log_point_time``), not when its metrics
    arrive one log point later; measured on the host: no device sync is added (the first step
    is timed to completion once, by the trainer). The run's first interval includes compilation.

    Examples:
        >>> trainer = MyTrainer(..., callbacks=[ThroughputMonitor()])  # doctest: +SKIP
    """

    on_log_may_lag = True  # it shows / logs the values: the loop need not stop for it

    def __init__(self):
        self._clock = TrainClock()
        self._compile_logged = False
        self.last: dict[str, float] = {}

    def on_train_epoch_start(self, trainer, epoch: int) -> None:
        self._clock.start_epoch(trainer.global_step)

    def on_train_epoch_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        self._clock.end_epoch(trainer.global_step)

    def on_log(self, trainer, step: int, metrics: Mapping[str, float]) -> None:
        if not any(key.endswith("_step") for key in metrics):
            return
        out: dict[str, float] = {}
        done = trainer.log_point_time(step)  # None: not a train log point (a record of the user's)
        seconds = None if done is None else self._clock.seconds_per_step(step, done)
        if seconds is not None:
            out["perf/step_time_ms"] = seconds * 1e3
            if trainer.batch_size:
                out["perf/samples_per_sec"] = trainer.batch_size / seconds
        if not self._compile_logged and trainer.compile_time is not None:
            out["perf/compile_time_s"] = trainer.compile_time
            self._compile_logged = True
        if out:
            self.last = out
            trainer.log_metrics(out, step=step)
