"""``NaNGuard``: stop (or skip the updates) when the loss stops being finite."""

from __future__ import annotations

from flaxlight.callbacks.base import Callback, TrainerView
from flaxlight.loop import nonfinite_parts
from flaxlight.messages import logger as messages

__all__ = ["NaNGuard", "weights_damaged"]


class NaNGuard(Callback):
    """React to non-finite steps, counted on the device inside the step: a step is non-finite
    when its loss is, or when its update makes a parameter NaN/Inf (a NaN gradient with a finite
    loss counts). Another metric that is NaN on a batch (a recall on a batch without the class)
    only makes its own mean NaN (that step is applied).

    ``action="stop"`` (default): at the next log point (or epoch end) training stops with the
    step range; no checkpoint is written from a state whose parameters (or optimizer state, batch
    statistics) hold NaN/Inf. When they are still finite (a NaN loss of one bad batch: a label
    out of range), the message says to check the data, and that state may be saved.
    ``action="skip"``: non-finite updates are not applied (params and optimizer state stay as
    they were; the step counter advances); ``trainer.nonfinite_steps`` counts them, and a
    warning says how many were skipped, once per epoch that had any. A skipped step changed nothing, so its
    metrics are left out of the running (``train/<name>_step``) and epoch (``train/<name>``)
    means: they are the means of the applied steps (an epoch whose every step was skipped
    shows NaN). Without a NaNGuard (or with ``"stop"``) a NaN step is applied, and its NaN
    shows in the means. Without a NaNGuard, a checkpoint is still never written from
    non-finite params; a NaN loss with a finite state is saved, and a warning says once how many
    steps had one and where the first was seen.

    Examples:
        >>> guard = NaNGuard(action="skip")
    """

    def __init__(self, action: str = "stop"):
        if action not in ("stop", "skip"):
            raise ValueError(f"NaNGuard action must be 'stop' or 'skip', got {action!r}.")
        self.action = action
        self.on_log_may_lag = action == "skip"  # "skip" only says at epoch ends; "stop" stops at the next log point
        self._said = 0  # the non-finite steps already said (skip)

    @property
    def skips_updates(self) -> bool:
        return self.action == "skip"

    def on_fit_start(self, trainer) -> None:
        self._said = trainer.nonfinite_steps  # a resumed run's earlier ones were said before

    def on_log(self, trainer, step: int, metrics) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer, epoch: int, metrics) -> None:
        self._check(trainer)
        if self.action == "skip":
            self._say_skipped(trainer, f"in epoch {epoch}")

    def on_fit_end(self, trainer) -> None:
        if self.action == "skip":
            self._say_skipped(trainer, "since the last epoch end")

    def _check(self, trainer) -> None:
        if self.action == "stop" and trainer.nonfinite_steps > 0:
            parts = nonfinite_parts(trainer.state)  # once: the run stops
            said = (f"NaNGuard: the loss was NaN/Inf (or the update made the params NaN/Inf) in "
                    f"{trainer.nonfinite_steps} step(s) up to step {trainer.nonfinite_checked_step}; ")
            if parts:
                said += (f"the {' and the '.join(parts)} hold NaN/Inf, so no checkpoint is written from this state. "
                         f"Lower the learning rate, clip gradients, check the data (NaN/Inf inputs), or use "
                         f"NaNGuard(action='skip').")
            else:
                said += (f"the parameters and the optimizer state are still finite (a checkpoint of this state may be "
                         f"saved), which usually means a bad batch: check the data for labels out of range (a class "
                         f"index >= num_classes) or NaN/Inf inputs; else lower the learning rate or clip gradients. "
                         f"NaNGuard(action='skip') leaves such steps out.")
            trainer.stop(said)

    def _say_skipped(self, trainer, when: str) -> None:
        new, self._said = trainer.nonfinite_steps - self._said, trainer.nonfinite_steps
        if new > 0:
            messages.warning(
                f"NaNGuard(action='skip') skipped {new} step(s) {when} ({trainer.nonfinite_steps} in all, up to "
                f"step {trainer.nonfinite_checked_step}): their loss or update was NaN/Inf, and their updates were not "
                f"applied. A few such steps usually mean bad batches: check the data for labels out of range (a "
                f"class index >= num_classes) or NaN/Inf inputs; many mean a diverging training: lower the learning "
                f"rate or clip gradients.")


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
