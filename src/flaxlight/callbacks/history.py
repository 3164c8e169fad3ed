"""``History``: every epoch's and every validation's metrics, kept in memory and in checkpoints."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from flaxlight.callbacks.base import Callback, TrainerView

__all__ = ["FitResult", "History"]


class History(Callback):
    """The run's metrics as a list of rows, one per epoch (and one per validation between epoch
    ends): ``{"epoch": 3, "step": 96, "train/loss": ..., "val/loss": ..., "val/acc": ...}``.

    A validation at an epoch's end joins that epoch's row; a validation every ``val_check_interval``
    steps gets its own row (same ``step``: never two rows). A row also holds what was logged
    (``trainer.log_metrics``) at its moment, the values ``metrics.csv`` got there: a validation's
    row everything logged during it (``trainer.validation_metrics``: by the trainer's
    ``on_validation_epoch_end``, callbacks' ``on_validation_end``), an epoch's row what the
    trainer's ``on_training_epoch_end`` and callbacks' ``on_train_epoch_end`` and ``on_epoch_end``
    logged. Each moment's row is whole once its callbacks ran, and before :class:`ModelCheckpoint`
    saves at it (a callback listed after this one reads, in ``on_validation_end``, the values
    logged before it). The rows are kept in every checkpoint,
    so a resumed run's history is the uninterrupted run's; each new ``train_model`` call starts
    an empty one. Every trainer has one: ``trainer.history``, also ``train_model(...).history``.

    Examples:
        >>> result = trainer.train_model((x, y), (xv, yv), num_epochs=5, batch_size=64)   # doctest: +SKIP
        >>> [round(row["val/acc"], 2) for row in result.history]                           # doctest: +SKIP
        [0.81, 0.9, 0.93, 0.94, 0.95]
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def clear(self) -> None:
        """Start an empty history (a new run)."""
        self.rows = []

    def record(self, epoch: int, step: int, metrics: Mapping[str, Any]) -> None:
        """Add ``metrics`` to the row of ``epoch`` at ``step`` (the latest row, if it is that one;
        else a new row); arrays are kept as nested lists, ``"epoch"`` is the row's own.

        Examples:
            >>> history = History()
            >>> history.record(1, 8, {"train/loss": 0.5}); history.record(1, 8, {"val/loss": 0.6})
            >>> history.rows
            [{'epoch': 1, 'step': 8, 'train/loss': 0.5, 'val/loss': 0.6}]
        """
        values = {key: value if np.ndim(value) == 0 else np.asarray(value).tolist()  # JSON, for checkpoints
                  for key, value in metrics.items() if key != "epoch"}
        last = self.rows[-1] if self.rows else None
        if last is not None and last["epoch"] == epoch and last["step"] == step:
            last.update(values)
        else:
            self.rows.append({"epoch": int(epoch), "step": int(step), **values})

    def on_train_epoch_end(self, trainer: TrainerView, epoch: int, metrics: Mapping[str, float]) -> None:
        self.record(epoch, trainer.global_step, metrics)

    def on_validation_end(self, trainer: TrainerView, epoch: int, metrics: Mapping[str, float]) -> None:
        self.record(epoch, trainer.global_step, {**metrics, **trainer.validation_metrics})

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [dict(row) for row in self.rows]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rows = [dict(row) for row in state.get("rows", [])]


class FitResult(dict):
    """What ``train_model`` returns: the best metrics as a dict (the seed's return value), with
    the run's :class:`History` rows as ``.history``.

    Examples:
        >>> result = FitResult({"val/acc": 0.9}, history=[{"epoch": 1, "step": 8, "val/acc": 0.9}])
        >>> (result["val/acc"], len(result.history))
        (0.9, 1)
    """

    def __init__(self, metrics: Mapping[str, float], history: list[dict[str, Any]]):
        super().__init__(metrics)
        self.history = history
