"""``EarlyStopping``: stop when a monitored validation metric stops improving."""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

from flaxlight.callbacks.base import Callback, check_mode, refuse_keras_arguments
from flaxlight.callbacks.nan_guard import weights_damaged
from flaxlight.messages import logger as messages
from flaxlight.options import warn_if_mode_contradicts_name

__all__ = ["EarlyStopping"]

# Keras' EarlyStopping keywords that flaxlight's does not take, and what to write instead.
KERAS_KEYWORDS = {
    "restore_best_weights": "the run's best model is kept in its checkpoints: use trainer.predict(x, "
                            "batch_size=256, which='best'), trainer.test((x, y), batch_size=256) (after "
                            "train_model it tests the best model) or MyTrainer.load_from_checkpoint(log_dir, "
                            "exmp_input=x[:1], which='best'). 'Best' is by the trainer's monitor: for the stopper's "
                            "metric, MyTrainer(..., monitor='val/loss', mode='min')",
    "baseline": "flaxlight has no baseline; stopping_threshold=X stops the run once the metric is better than X "
                "(the goal is met) and divergence_threshold=X once it is worse than X",
    "start_from_epoch": "flaxlight has no start_from_epoch: patience counts the validations without improvement "
                        "from the first one on, so give a patience that covers the epochs to wait",
}
# Lightning's EarlyStopping keywords that flaxlight's does not take (verbose: Keras' too), and what to write instead.
LIGHTNING_KEYWORDS = {
    "verbose": "EarlyStopping always says why it stopped: the reason is printed (the logging logger 'flaxlight') and "
               "kept in trainer.stop_reason; drop it",
    "strict": "flaxlight is always strict (Lightning's default, strict=True): a monitor that is not logged is an "
              "error naming the metrics that are, when train_model starts where nothing of yours could log it, else "
              "at the first validation without it; strict=False, which only warns, has no equivalent: drop it",
    "check_on_train_epoch_end": "EarlyStopping checks after each validation (a val_check_interval one within an epoch "
                                "too), or after each epoch's training when train_model gets no validation data, as "
                                "Lightning's default (None) does: drop it. To check at another moment, write a "
                                "Callback whose on_train_epoch_end(trainer, epoch, metrics) calls trainer.stop(reason)",
    "log_rank_zero_only": "the reason it stopped goes to the logging logger 'flaxlight' of each process and to "
                          "trainer.stop_reason: drop it (to hear it from process 0 only, set that logger's level to "
                          "WARNING where jax.process_index() != 0)",
}


class EarlyStopping(Callback):
    """Stop training once a monitored validation metric stops improving (Lightning's semantics).

    Args:
        monitor: the metric, e.g. ``"val/loss"``.
        mode: whether lower (``"min"``) or higher (``"max"``) is better.
        patience: validations in a row without an improvement of more than ``min_delta`` after
            which training stops (``patience=3``: the third one stops it).
        min_delta: the smallest change that counts as an improvement.
        check_finite: stop at once when the metric is infinite, or NaN while the training's loss
            was NaN/Inf in a step up to this validation's, one within an epoch too (the model
            diverged: :func:`~flaxlight.callbacks.nan_guard.weights_damaged`).
            A NaN of a model whose training is finite is a 0/0 (the validation counted nothing for
            the metric, e.g. a masked ``Mean`` with no labelled example): a validation without an
            improvement, said once; so is every NaN with ``check_finite=False``.
        stopping_threshold: stop at once when the metric is better than this (the goal is met).
        divergence_threshold: stop at once when the metric is worse than this (it diverged).

    The loop finishes the current epoch (its checkpoint included) and stops; the reason is
    printed and kept in ``trainer.stop_reason``. Its state (best score, validations waited) is
    saved in checkpoints under its :attr:`state_key`, which names its monitor and mode (as in
    Lightning), so a resumed run keeps counting, each stopper on its own metric; a state saved
    for another monitor or mode is refused with a warning (the stopper starts fresh). A run without validation data is
    checked after each epoch's training instead (as in Lightning; ``patience`` then counts
    epochs), which suits a ``train/...`` monitor; a ``val/...`` one is an error there. Keras'
    ``restore_best_weights``, ``baseline`` and ``start_from_epoch`` (:data:`KERAS_KEYWORDS`) and
    Lightning's ``strict``, ``check_on_train_epoch_end``, ``log_rank_zero_only`` and ``verbose``
    (Keras' too; :data:`LIGHTNING_KEYWORDS`) are refused with what to write instead.

    Examples:
        >>> stopper = EarlyStopping(monitor="val/loss", mode="min", patience=3, min_delta=1e-4)
    """

    @refuse_keras_arguments(KERAS_KEYWORDS, lightning=LIGHTNING_KEYWORDS, keras_too=("verbose",))
    def __init__(self, monitor: str = "val/loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 check_finite: bool = True, stopping_threshold: float | None = None,
                 divergence_threshold: float | None = None):
        check_mode("EarlyStopping", mode)
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise ValueError(f"EarlyStopping patience must be an int >= 0, got {patience!r}.")
        if not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"EarlyStopping min_delta must be a number >= 0, got {min_delta!r}.")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        warn_if_mode_contradicts_name("EarlyStopping", monitor, mode)
        self.check_finite = check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.wait = 0
        self._after_training = False  # no validation data: checked after each epoch's training
        self._said_nan = False  # a NaN of a finite training (a 0/0) is said once

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return self._better(value, self.best - self.min_delta if self.mode == "min" else self.best + self.min_delta)

    def _best_so_far(self) -> str:
        return "none yet" if self.best is None else f"{self.best:.6g} at epoch {self.best_epoch}"

    def _reason(self, value: float, epoch: int, diverged: bool = False) -> str | None:
        """Record this validation's ``value``; why training must stop now (None: go on).
        ``diverged``: the training's loss was NaN/Inf, so a NaN value is the model's."""
        name = f"EarlyStopping: {self.monitor} = {value:.6g}"
        if self.check_finite and (math.isinf(value) or (math.isnan(value) and diverged)):
            return f"{name} is not finite (best {self._best_so_far()})."
        if math.isnan(value) and not diverged and not self._said_nan:
            self._said_nan = True
            messages.warning(f"{name} at epoch {epoch}, while the training's loss is finite: a 0/0 (the validation "
                             f"counted nothing for it, e.g. a masked Mean of a task with no labelled example in it), "
                             f"counted as a validation without an improvement. (Said once.)")
        improved = self._improved(value)
        if improved:
            self.best, self.best_epoch, self.wait = value, epoch, 0
        else:
            self.wait += 1
        if self.stopping_threshold is not None and self._better(value, self.stopping_threshold):
            return f"{name} reached the stopping threshold {self.stopping_threshold:g}."
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, value):
            return f"{name} passed the divergence threshold {self.divergence_threshold:g}."
        if not improved and self.wait >= self.patience:
            return (f"EarlyStopping: {self.monitor} did not improve by more than {self.min_delta:g} for "
                    f"{self.wait} validations in a row (best {self._best_so_far()}).")
        return None

    def check_run(self, validates: bool) -> None:
        """Whether this callback can work in a run that validates (or not); a clear error if not.

        Examples:
            >>> EarlyStopping(monitor="train/loss").check_run(validates=False)
        """
        if not validates and self.monitor.startswith("val/"):
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, but train_model got no validation data, so it "
                             f"would never stop the run. Pass a val_loader, or monitor a train metric (e.g. "
                             f"'train/loss'), which is checked after each epoch's training.")

    def on_fit_start(self, trainer) -> None:
        self._after_training = trainer.val_loader is None

    def on_train_epoch_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        if self._after_training:
            self._check(trainer, epoch)

    def on_validation_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        self._check(trainer, epoch)

    def _check(self, trainer, epoch: int) -> None:
        reason = self._reason(float(trainer.monitored_value(self.monitor, owner="EarlyStopping")), epoch,
                              diverged=weights_damaged(trainer))
        if reason is not None:
            trainer.stop(reason)

    @property
    def state_key(self) -> str:
        """``EarlyStopping{'monitor': 'val/loss', 'mode': 'min'}``: two stoppers on different
        metrics keep their own states (Lightning's key)."""
        return f"{type(self).__name__}{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait, "monitor": self.monitor,
                "mode": self.mode}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (``{}``: a fresh start). One saved for another monitor or mode
        (a state of an earlier flaxlight, which kept neither, is taken as this stopper's) is
        refused with a warning: its best score is another metric's, so the stopper starts fresh."""
        saved = (state.get("monitor", self.monitor), state.get("mode", self.mode))
        if saved != (self.monitor, self.mode):
            warnings.warn(f"EarlyStopping(monitor={self.monitor!r}, mode={self.mode!r}) was given the state of an "
                          f"EarlyStopping on {saved[0]!r} ({saved[1]}, best {state.get('best')!r}): its best score and "
                          f"patience count do not apply here, so this stopper starts fresh.", RuntimeWarning,
                          stacklevel=2)
            state = {}
        self.best, self.best_epoch, self.wait = state.get("best"), state.get("best_epoch"), int(state.get("wait", 0))
