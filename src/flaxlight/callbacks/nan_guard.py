"""``NaNGuard``: stop (or skip the updates) when the loss stops being finite."""

from __future__ import annotations

from flaxlight.callbacks.base import Callback, TrainerView

__all__ = ["NaNGuard", "weights_damaged"]


class NaNGuard(Callback):
    """React to non-finite steps, counted on the device inside the step: a step is non-finite
    when its loss is, or when its update makes a parameter NaN/Inf (a NaN gradient with a finite
    loss counts). Another metric that is NaN on a batch (a recall on a batch without the class)
    only makes its own mean NaN (that step is applied).

    ``action="stop"`` (default): at the next log point (or epoch end) training stops with the
    step range, and no checkpoint is written from the bad state. ``action="skip"``: non-finite
    updates are not applied (params and optimizer state stay as they were; the step counter
    advances); ``trainer.nonfinite_steps`` counts them. A skipped step changed nothing, so its
    metrics are left out of the running (``train/<name>_step``) and epoch (``train/<name>``)
    means: they are the means of the applied steps (an epoch whose every step was skipped
    shows NaN). Without a NaNGuard (or with ``"stop"``) a NaN step is applied, and its NaN
    shows in the means. Without a NaNGuard, a checkpoint is still never written from
    non-finite params.

    Examples:
        >>> guard = NaNGuard(action="skip")
    """

    def __init__(self, action: str = "stop"):
        if action not in ("stop", "skip"):
            raise ValueError(f"NaNGuard action must be 'stop' or 'skip', got {action!r}.")
        self.action = action

    @property
    def skips_updates(self) -> bool:
        return self.action == "skip"

    def on_log(self, trainer, step: int, metrics) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer, epoch: int, metrics) -> None:
        self._check(trainer)

    def _check(self, trainer) -> None:
        if self.action == "stop" and trainer.nonfinite_steps > 0:
            trainer.stop(
                f"NaNGuard: the loss was NaN/Inf (or the update made the params NaN/Inf) in {trainer.nonfinite_steps} "
                f"step(s) up to step "
                f"{trainer.nonfinite_checked_step}; no checkpoint was written from those steps. Lower the "
                f"learning rate, clip gradients, or use NaNGuard(action='skip')."
            )


def weights_damaged(trainer: TrainerView) -> bool:
    """Whether the trainer's loss was NaN/Inf (or an update made the params NaN/Inf) in a step that
    a ``NaNGuard("skip")`` did not skip: its weights are damaged, whatever its metrics say. A NaN
    metric of an undamaged model is a 0/0 instead (a masked ``Mean`` with nothing counted, the
    precision of a class never predicted): the validation did not measure it.

    Examples:
        >>> weights_damaged(trainer)   # doctest: +SKIP
        False
    """
    return bool(getattr(trainer, "nonfinite_steps", 0)) and not any(
        isinstance(cb, NaNGuard) and cb.action == "skip" for cb in getattr(trainer, "callbacks", ()))
