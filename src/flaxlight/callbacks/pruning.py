"""``PruningCallback``: report a metric to an Optuna trial at every validation; stop bad trials.

This module does not import Optuna: the trial is used through ``report``/``should_prune``/
``number``, and :class:`optuna.TrialPruned` is imported only when :meth:`raise_if_pruned` raises it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from flaxlight.callbacks.base import Callback
from flaxlight.callbacks.nan_guard import weights_damaged
from flaxlight.loop import nonfinite_parts
from flaxlight.options import MetricNotLoggedError

__all__ = ["MetricNotLoggedError", "PruningCallback"]


class PruningCallback(Callback):
    """Report ``monitor`` to an Optuna ``trial`` after each validation; stop the run when pruned.

    At every validation the latest value of ``monitor`` goes to ``trial.report(value, step)``
    (``step`` is the epoch, or the optimizer step when the trainer validates several times per
    epoch with ``val_check_interval``). When the study's pruner says ``should_prune()``, the
    callback asks the trainer to stop cleanly (``trainer.stop``: the epoch ends, its checkpoint
    is written, loggers are closed) and remembers it; call :meth:`raise_if_pruned` after
    ``train_model`` returns to mark the trial pruned. A NaN/Inf value is not reported: the run is
    stopped and :attr:`nonfinite` says so (``flaxlight.tune`` records such a trial as failed); so
    is a run whose loss was NaN/Inf in a step (its weights are damaged, whatever the metric says),
    unless a ``NaNGuard("skip")`` skipped those steps. A NaN of a model whose training was finite
    is a 0/0 (a validation that counted nothing for the metric, e.g. a masked ``Mean`` of a task
    with no labelled example in it): that validation is not reported, and the run goes on.

    :attr:`reported` holds every value reported to the trial (``{step: value}``): ``flaxlight.tune``
    records the best of them on a trial that SIGINT/SIGTERM stopped (``value_so_far``).

    A metric the trainer never logs raises :class:`MetricNotLoggedError` at the first validation,
    listing the metrics that are logged.

    Examples:
        >>> def objective(trial):                                                   # doctest: +SKIP
        ...     pruning = PruningCallback(trial, monitor="val/acc")
        ...     trainer = MyTrainer(..., callbacks=[pruning], monitor="val/acc", mode="max")
        ...     metrics = trainer.train_model(train_loader, val_loader, num_epochs=20)
        ...     pruning.raise_if_pruned()
        ...     return metrics["val/acc"]
    """

    def __init__(self, trial: Any, monitor: str = "val/loss"):
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"PruningCallback monitor must be a metric name such as 'val/acc', got {monitor!r}.")
        for method in ("report", "should_prune"):
            if not callable(getattr(trial, method, None)):
                raise TypeError(f"PruningCallback needs an optuna trial (with report() and should_prune()); "
                                f"got {type(trial).__name__}.")
        self.trial, self.monitor = trial, monitor
        self.pruned = False
        self.pruned_epoch: int | None = None
        self.nonfinite = False
        self.reason: str | None = None
        self.last_value: float | None = None
        self.reported: dict[int, float] = {}  # step -> the value reported to the trial

    def _step(self, trainer, epoch: int) -> int:
        return int(trainer.global_step) if trainer.options.val_check_interval else int(epoch)

    def on_validation_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        try:
            value = float(trainer.monitored_value(self.monitor, owner="PruningCallback"))
        except KeyError as exc:
            raise MetricNotLoggedError(exc.args[0] if exc.args else str(exc)) from None
        number = getattr(self.trial, "number", "?")
        self.last_value = value
        damaged = self.damaged(trainer)
        if math.isnan(value) and not damaged:  # a 0/0 (nothing counted in this validation): no value to report
            return
        if not math.isfinite(value) or damaged:  # NaN weights give a finite, chance-level accuracy: not a result
            self.nonfinite = True
            self.reason = (f"PruningCallback: {self.monitor} is {value} at epoch {epoch}; trial {number} stopped."
                           if not math.isfinite(value) else
                           f"PruningCallback: by epoch {epoch}, {self.nonfinite_account(trainer, self.monitor)}; "
                           f"trial {number} stopped.")
            trainer.stop(self.reason)
            return
        self.reported[self._step(trainer, epoch)] = value
        self.trial.report(value, self._step(trainer, epoch))
        if self.trial.should_prune():
            self.pruned, self.pruned_epoch = True, epoch
            self.reason = f"PruningCallback: trial {number} pruned at epoch {epoch} ({self.monitor}={value:.6g})."
            trainer.stop(self.reason)

    @staticmethod
    def damaged(trainer) -> bool:
        """Whether the trainer's loss was NaN/Inf in a step that a ``NaNGuard("skip")`` did not
        skip: its weights are damaged, whatever its metrics say (:func:`weights_damaged`)."""
        return weights_damaged(trainer)

    @staticmethod
    def nonfinite_account(trainer, metric: str) -> str:
        """What happened to a trial whose loss was NaN/Inf (:meth:`damaged`), for people: how many
        steps, where the first was seen, and whether the parameters are NaN/Inf (a damaged model) or
        stayed finite (a non-finite loss of a finite model: a bad batch, a data problem), and so why
        its ``metric`` is no result.

        Examples:
            >>> PruningCallback.nonfinite_account(trainer, "val/acc")   # doctest: +SKIP
            'the loss was NaN/Inf in 1 step(s), the first at step 6 (epoch 1, batch 6), but the ...'
        """
        first = trainer.nonfinite_first
        said = f"the loss was NaN/Inf in {trainer.nonfinite_steps} step(s)" + (f", the first {first}" if first else "")
        parts = nonfinite_parts(trainer.state)
        if parts:
            return f"{said}; the {' and the '.join(parts)} hold NaN/Inf, so the model is damaged ({metric} is no result)"
        return (f"{said}, but the parameters and the optimizer state stayed finite: a data problem, not a damaged "
                f"model (check the data for labels out of range, a class index >= num_classes, or NaN/Inf inputs); "
                f"{metric} of a training with NaN/Inf steps is no result (NaNGuard(action='skip') leaves such steps "
                f"out)")

    def raise_if_pruned(self) -> None:
        """Raise :class:`optuna.TrialPruned` when the pruner stopped this run (call after training)."""
        if self.pruned:
            import optuna

            raise optuna.TrialPruned(self.reason)

    def state_dict(self) -> dict[str, Any]:
        return {"pruned": self.pruned, "pruned_epoch": self.pruned_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pruned = bool(state.get("pruned", False))
        self.pruned_epoch = state.get("pruned_epoch")

