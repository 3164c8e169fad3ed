"""``EarlyStopping``: stop when a monitored validation metric stops improving."""

from __future__ import annotations

import math
from typing import Any, Mapping

from flaxlight.callbacks.base import Callback

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Stop training after ``patience`` validations without an improvement of ``min_delta``.

    The loop finishes the current epoch (its checkpoint included) and stops; the reason is
    printed and kept in ``trainer.stop_reason``. Its state (best score, validations waited) is
    saved in checkpoints, so a resumed run keeps counting.

    Example:
        >>> stopper = EarlyStopping(monitor="val/loss", mode="min", patience=3, min_delta=1e-4)
    """

    def __init__(self, monitor: str = "val/loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}.")
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping patience must be an int >= 0, got {patience!r}.")
        if min_delta < 0:
            raise ValueError(f"EarlyStopping min_delta must be >= 0, got {min_delta!r}.")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.wait = 0

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return not math.isnan(value)
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_validation_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        value = float(trainer.monitored_value(self.monitor, owner="EarlyStopping"))
        if self._improved(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            trainer.stop(
                f"EarlyStopping: {self.monitor} did not improve by more than {self.min_delta:g} for "
                f"{self.wait} validations (best {self.best:.6g} at epoch {self.best_epoch})."
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_epoch, self.wait = state.get("best"), state.get("best_epoch"), int(state.get("wait", 0))
