"""``ModelCheckpoint``: which checkpoints to write and which to keep (best k + last)."""

from __future__ import annotations

import math
from typing import Any, Mapping

from flaxlight.callbacks.base import Callback

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(Callback):
    """Save the full train state at validations, epochs or steps; keep the best k and the last.

    Args:
        monitor: metric that ranks checkpoints (e.g. ``"val/acc"``); None follows the trainer's
            ``is_new_model_better`` (the seed's rule, asked once per validation by the trainer)
            and keeps only the single best.
        mode: ``"min"`` or ``"max"`` for ``monitor``.
        save_top_k: how many best checkpoints to keep (0: none kept for being best).
        save_last: always keep the most recent checkpoint, so a run can resume from it.
        every_n_epochs: write a checkpoint every N epochs (after validation when it runs).
        every_n_steps: also write one every N optimizer steps, mid-epoch included.

    This callback decides *when* to save and what to keep; the trainer's ``save_model(step)``
    decides *how* (override it to save differently). Checkpoints land in
    ``<log_dir>/checkpoints/<step>/`` (asynchronously; atomically).

    Example:
        >>> trainer = MyTrainer(..., callbacks=[ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=3)])  # doctest: +SKIP
    """

    def __init__(self, monitor: str | None = None, mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 every_n_epochs: int | None = 1, every_n_steps: int | None = None):
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint mode must be 'min' or 'max', got {mode!r}.")
        if save_top_k < 0:
            raise ValueError(f"save_top_k must be >= 0, got {save_top_k}.")
        if monitor is None and save_top_k > 1:
            raise ValueError("save_top_k > 1 needs a monitor='val/<metric>' to rank checkpoints by.")
        for name, value in (("every_n_epochs", every_n_epochs), ("every_n_steps", every_n_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelCheckpoint {name} must be a positive int or None, got {value!r}.")
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.best: list[tuple[float, int]] = []  # (score, step), best first
        self.best_metrics: dict[str, float] | None = None
        self.last_step: int | None = None

    # ---------------------------------------------------------------- decisions
    @property
    def best_step(self) -> int | None:
        """Step of the best checkpoint kept so far (None before the first validation)."""
        return self.best[0][1] if self.best else None

    def _score(self, metrics: Mapping[str, float]) -> float | None:
        if self.monitor is None:
            return None
        if self.monitor not in metrics:
            raise KeyError(
                f"ModelCheckpoint monitor {self.monitor!r} is not among the validation metrics {sorted(metrics)}."
            )
        value = float(metrics[self.monitor])
        return -value if self.mode == "max" else value  # lower is better internally

    def _is_top_k(self, trainer, metrics: Mapping[str, float]) -> bool:
        if self.save_top_k == 0:
            return False
        if self.monitor is None:
            return trainer.is_best_validation
        score = self._score(metrics)
        if math.isnan(score):
            return False
        return len(self.best) < self.save_top_k or score < self.best[-1][0]

    # ---------------------------------------------------------------- hooks
    def on_step(self, trainer, step: int) -> None:
        if self.save_last:
            self._save(trainer, step, best_metrics=None)

    def on_validation_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        if self._is_top_k(trainer, metrics):
            self._save(trainer, trainer.global_step, best_metrics=metrics)

    def on_epoch_end(self, trainer, epoch: int) -> None:
        due = self.every_n_epochs is not None and epoch % self.every_n_epochs == 0
        if due and self.save_last and self.last_step != trainer.global_step:
            self._save(trainer, trainer.global_step, best_metrics=None)

    def on_fit_end(self, trainer) -> None:
        trainer.checkpointer.wait()
        self._prune(trainer)

    # ---------------------------------------------------------------- saving and pruning
    def _save(self, trainer, step: int, best_metrics: Mapping[str, float] | None) -> None:
        # Deletions queue behind the saves before them on the checkpointer's writer, and none runs
        # after a failed write: a failed or killed save never leaves the run without a checkpoint.
        self._prune(trainer, also_keep=step)  # `step` itself may be saved again right below
        if best_metrics is not None:
            self.best_metrics = dict(best_metrics)
            if self.monitor is None:
                self.best = [(0.0, step)]
            else:
                entry = (self._score(best_metrics), step)
                self.best = sorted([b for b in self.best if b[1] != step] + [entry])[: self.save_top_k]
        self.last_step = step
        trainer.save_model(step)

    def _keep(self) -> set[int]:
        keep = {step for _, step in self.best}
        if self.save_last and self.last_step is not None:
            keep.add(self.last_step)
        return keep

    def _prune(self, trainer, also_keep: int | None = None) -> None:
        """Delete (in the background) the checkpoints neither best, last nor ``also_keep``."""
        keep, steps = self._keep() | {also_keep}, trainer.checkpointer.all_steps()
        if self.save_last and steps and self.last_step not in steps and also_keep not in steps:
            keep.add(max(steps))  # the last save was refused (NaN params): the newest on disk stands in
        for step in steps:
            if step not in keep:
                trainer.checkpointer.delete(step)

    def state_dict(self) -> dict[str, Any]:
        return {"best": [[score, step] for score, step in self.best], "best_metrics": self.best_metrics,
                "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = [(float(score), int(step)) for score, step in state.get("best", [])]
        self.best_metrics = state.get("best_metrics")
        self.last_step = state.get("last_step")
