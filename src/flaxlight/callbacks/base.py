"""The callback interface: every hook is declared here as a no-op; override what you need."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from flaxlight.trainer import TrainerModule

__all__ = ["Callback"]


class Callback:
    """Side effects at fixed moments of the loop, called in the order the callbacks were listed.

    Hooks, in the order they fire for one epoch::

        on_fit_start(trainer)                         before the first epoch (after a resume)
        on_train_epoch_start(trainer, epoch)          before each epoch's training
        on_step(trainer, step)                        every ``every_n_steps`` optimizer updates
        on_log(trainer, step, metrics)                whenever metrics reach the loggers
        on_train_epoch_end(trainer, epoch, metrics)   after each training epoch
        on_validation_end(trainer, epoch, metrics)    after each validation
        on_epoch_end(trainer, epoch)                  after the epoch's training and validation
        on_test_end(trainer, metrics)                 after testing the best model
        on_fit_end(trainer)                           after training (and testing)
        on_exception(trainer, exc)                    when the loop raises (also on interrupts)

    ``on_step`` is only called at multiples of ``every_n_steps`` (None: never), decided by the
    trainer in one place, so a callback costs nothing on the other steps. Stateful callbacks
    return their state from ``state_dict()``; it is saved in every checkpoint and handed back
    to ``load_state_dict()`` on resume.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_train_epoch_end(self, trainer, epoch, metrics):
        ...         print(epoch, metrics["train/loss"])
    """

    every_n_steps: int | None = None

    def on_fit_start(self, trainer: "TrainerModule") -> None:
        """Before the first epoch (the state is built; after a resume, restored)."""

    def on_train_epoch_start(self, trainer: "TrainerModule", epoch: int) -> None:
        """Before the training part of ``epoch`` (also when it resumes mid-way)."""

    def on_step(self, trainer: "TrainerModule", step: int) -> None:
        """After optimizer update ``step`` when ``step % every_n_steps == 0``."""

    def on_log(self, trainer: "TrainerModule", step: int, metrics: Mapping[str, float]) -> None:
        """After ``metrics`` (host floats) were sent to the loggers."""

    def on_train_epoch_end(self, trainer: "TrainerModule", epoch: int, metrics: Mapping[str, float]) -> None:
        """After the training part of ``epoch`` with its ``train/...`` metrics."""

    def on_validation_end(self, trainer: "TrainerModule", epoch: int, metrics: Mapping[str, float]) -> None:
        """After validating at the end of ``epoch`` with its ``val/...`` metrics."""

    def on_epoch_end(self, trainer: "TrainerModule", epoch: int) -> None:
        """After the whole epoch (training and, when due, validation)."""

    def on_test_end(self, trainer: "TrainerModule", metrics: Mapping[str, float]) -> None:
        """After the test run with its ``test/...`` metrics."""

    def on_fit_end(self, trainer: "TrainerModule") -> None:
        """After training and testing finished."""

    def on_exception(self, trainer: "TrainerModule", exc: BaseException) -> None:
        """When the loop is left by an exception (including a preemption signal)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state to keep in checkpoints (empty for stateless callbacks)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
