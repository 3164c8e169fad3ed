"""``Timer``: stop training once a time budget is spent (the trainer's ``max_time``)."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any, Mapping

from flaxlight.callbacks.base import Callback

__all__ = ["Timer", "parse_duration"]


def parse_duration(duration: float | int | str | timedelta) -> float:
    """Seconds from ``3600``, ``timedelta(hours=1)``, ``"01:00:00"`` or ``"00:01:00:00"`` (DD:HH:MM:SS)."""
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, (int, float)) and not isinstance(duration, bool):
        seconds = float(duration)
    elif isinstance(duration, str) and re.fullmatch(r"\d+(:\d+){1,3}", duration.strip()):
        parts = [int(p) for p in duration.strip().split(":")]
        seconds = float(sum(p * u for p, u in zip(reversed(parts), (1, 60, 3600, 86400))))
    else:
        raise ValueError(f"max_time must be seconds, a timedelta or 'HH:MM:SS' / 'DD:HH:MM:SS'; got {duration!r}.")
    if seconds <= 0:
        raise ValueError(f"max_time must be positive, got {duration!r}.")
    return seconds


class Timer(Callback):
    """Stop after ``duration`` of training (checked every ``every_n_steps`` steps and each epoch).

    :attr:`elapsed` counts while ``train_model`` runs and stands still after it (at its end, or
    when it fails or is interrupted). The time already spent is kept in checkpoints, so a resumed
    run continues the budget.

    Examples:
        >>> timer = Timer("00:02:00:00")   # two hours
        >>> timer.elapsed
        0.0
    """

    def __init__(self, duration: float | int | str | timedelta, every_n_steps: int = 10):
        self.duration = parse_duration(duration)
        self.every_n_steps = every_n_steps
        self.elapsed_before = 0.0  # seconds counted before the current train_model (or all, between runs)
        self._start: float | None = None  # when the current train_model started (None: not training)

    @property
    def elapsed(self) -> float:
        """Seconds of training so far (all runs of this training, resumes included); frozen
        between runs, as Lightning's ``Timer.time_elapsed()`` is after training."""
        return self.elapsed_before + (time.monotonic() - self._start if self._start is not None else 0.0)

    def on_fit_start(self, trainer) -> None:
        self._start = time.monotonic()

    def _freeze(self) -> None:
        """Stop the clock: what was counted stays in :attr:`elapsed`."""
        self.elapsed_before, self._start = self.elapsed, None

    def on_fit_end(self, trainer) -> None:
        self._freeze()

    def on_exception(self, trainer, exc: BaseException) -> None:
        self._freeze()

    def _check(self, trainer) -> None:
        if self.elapsed >= self.duration:
            trainer.stop(f"Timer: the time budget of {timedelta(seconds=round(self.duration))} is spent.")

    def on_step(self, trainer, step: int) -> None:
        self._check(trainer)

    def on_epoch_end(self, trainer, epoch: int) -> None:
        self._check(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.elapsed_before = float(state.get("elapsed", 0.0))
        if self._start is not None:  # while training: count on from the restored time
            self._start = time.monotonic()
