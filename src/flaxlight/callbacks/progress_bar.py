"""``ProgressBar``: tqdm bars on a terminal, one plain line per epoch in a log file or under ``CI``."""

from __future__ import annotations

import sys
import time
from typing import Mapping

from flaxlight.callbacks.base import Callback
from flaxlight.callbacks.throughput import TrainClock
from flaxlight.progress import bars_wanted, format_metrics

__all__ = ["ProgressBar"]

REFRESH_SECONDS = 0.1  # tqdm draws at most this often (its mininterval): closer refreshes are not seen


class ProgressBar(Callback):
    """Epoch and step bars showing loss, learning rate and samples/s (one step bar for the run, reset
    at each epoch, as Lightning's).

    Everything shown is already on the host (values from the last log point), so the bars never
    wait for the device; samples/s is over the interval between log points, each timed when the
    loop reached it (``trainer.log_point_time``). The step bar moves every
    ``refresh_every_n_steps`` steps, or, while those come faster than tqdm draws (ten times a
    second), every power-of-two multiple of them that keeps it near that pace: each move stops the
    training loop, which costs a small model's loop more than its steps. For the same reason, an
    epoch's start is not drawn when the bar was drawn less than a tenth of a second before (its end
    is: a validation may follow).

    ``style="auto"`` (default) shows bars when stderr is a terminal or in a notebook, and prints
    one plain line per epoch otherwise (a log file, a pipe, ``CI`` set), as Keras'
    ``verbose="auto"`` does; ``"bars"`` or ``"lines"`` choose one. Added by default when
    ``enable_progress_bar=True``.

    Examples:
        >>> trainer = MyTrainer(..., callbacks=[ProgressBar(refresh_every_n_steps=50)])  # doctest: +SKIP
    """

    on_log_may_lag = True  # it shows / logs the values: the loop need not stop for it

    def __init__(self, refresh_every_n_steps: int = 10, style: str = "auto"):
        if not isinstance(refresh_every_n_steps, int) or refresh_every_n_steps < 1:
            raise ValueError(f"refresh_every_n_steps must be a positive int, got {refresh_every_n_steps!r}.")
        if style not in ("auto", "bars", "lines"):
            raise ValueError(f"ProgressBar style must be 'auto', 'bars' or 'lines', got {style!r}.")
        self.refresh_every_n_steps, self.style = refresh_every_n_steps, style
        self._lines = style == "lines"
        self.every_n_steps = None if self._lines else refresh_every_n_steps  # lines: nothing to do per step
        self._epoch_bar = self._step_bar = None
        self._shown: dict[str, str] = {}
        self._epoch_metrics: dict[str, float] = {}
        self._last_step = 0
        self._moved_at: float | None = None  # time.perf_counter() of the step bar's last move
        self._clock = TrainClock()

    def _tqdm(self, **kwargs):
        from tqdm.auto import tqdm

        return tqdm(dynamic_ncols=True, file=sys.stderr, **kwargs)

    def on_fit_start(self, trainer) -> None:
        self._lines = self.style == "lines" or (self.style == "auto" and not bars_wanted())
        self.every_n_steps = None if self._lines else self.refresh_every_n_steps  # no stop in the loop for lines
        if not self._lines:
            self._epoch_bar = self._tqdm(total=trainer.num_epochs, initial=trainer.current_epoch - 1, desc="Epochs")

    def on_train_epoch_start(self, trainer, epoch: int) -> None:
        self._epoch_metrics = {}
        self._last_step = trainer.global_step
        self._moved_at = time.perf_counter()
        self._clock.start_epoch(trainer.global_step)
        if self._lines:
            return
        if self._step_bar is None:  # one bar for the run, reset at each epoch (as Lightning's)
            self._step_bar = self._tqdm(total=trainer.steps_per_epoch, initial=trainer.batch_in_epoch,
                                        desc=f"Epoch {epoch}", leave=False)
        else:  # named first: reset() draws the bar
            self._step_bar.set_description(f"Epoch {epoch}", refresh=False)
            self._reset_step_bar(trainer.steps_per_epoch)
            if trainer.batch_in_epoch:
                self._step_bar.update(trainer.batch_in_epoch)

    def _drawn_lately(self) -> bool:
        """Whether the step bar was drawn less than ``REFRESH_SECONDS`` ago (tqdm's clock)."""
        return time.time() - getattr(self._step_bar, "last_print_t", 0.0) < REFRESH_SECONDS

    def _reset_step_bar(self, total: int | None) -> None:
        """Back to 0 of ``total`` for a new epoch; drawn now unless it was drawn lately (then
        tqdm's next move draws it). Epochs of a small model take milliseconds: a draw at each
        epoch's start would cost them more than the bar shows (~0.15 ms in a training run)."""
        bar = self._step_bar
        if self._drawn_lately() and total == bar.total:
            bar.n = bar.last_print_n = 0
            bar.start_t = bar.last_print_t = time.time()
        else:
            bar.reset(total=total)

    def on_step(self, trainer, step: int) -> None:
        if self._step_bar is not None:
            self._step_bar.update(step - self._last_step)
        self._last_step = step
        self._space_moves(time.perf_counter())

    def _space_moves(self, now: float) -> None:
        """Twice the steps between moves while they come in under half of ``REFRESH_SECONDS``,
        half as many (down to ``refresh_every_n_steps``) when they take over twice as long."""
        if self._moved_at is not None and self.every_n_steps is not None:
            elapsed, every = now - self._moved_at, self.every_n_steps
            if elapsed < REFRESH_SECONDS / 2 and every < 1024 * self.refresh_every_n_steps:
                self.every_n_steps = 2 * every
            elif elapsed > 2 * REFRESH_SECONDS and every > self.refresh_every_n_steps:
                self.every_n_steps = every // 2
        self._moved_at = now

    def on_log(self, trainer, step: int, metrics: Mapping[str, float]) -> None:
        loss = metrics.get("train/loss_step")
        if loss is None:
            return
        self._shown["loss"] = f"{loss:.4g}"
        lr = trainer.learning_rate()
        if lr is not None:
            self._shown["lr"] = f"{lr:.3g}"
        else:  # none known (any more: a step of yours updating twice per batch), none shown
            self._shown.pop("lr", None)
        done = trainer.log_point_time(step)  # when this point's step was done (its values come a point late)
        seconds = None if done is None else self._clock.seconds_per_step(step, done)
        if seconds is not None and trainer.batch_size:
            self._shown["samples/s"] = f"{trainer.batch_size / seconds:.4g}"
        if self._step_bar is not None:  # new values only arrive here: format them once per log point
            self._step_bar.set_postfix(self._shown, refresh=False)

    def on_train_epoch_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        self._clock.end_epoch(trainer.global_step)
        self._epoch_metrics.update(metrics)
        if self._step_bar is not None:  # the epoch's last steps shown while it validates
            self._step_bar.update(trainer.global_step - self._last_step)
            self._last_step = trainer.global_step
            self._step_bar.refresh()

    def on_validation_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        self._epoch_metrics.update(metrics)

    def on_epoch_end(self, trainer, epoch: int) -> None:
        summary = format_metrics(self._epoch_metrics)
        if self._lines:
            if not self._epoch_metrics:  # the end of a resumed run's restored epoch, repeated: nothing new to say
                return
            seconds = self._epoch_metrics.get("epoch_time", 0.0)
            print(f"Epoch {epoch}/{trainer.num_epochs} ({seconds:.2f}s): {summary}", flush=True)
        elif self._epoch_bar is not None:
            self._epoch_bar.set_postfix_str(summary, refresh=False)
            self._epoch_bar.update(1)  # drawn when tqdm's mininterval has passed, and at the end

    def _close_step_bar(self) -> None:
        if self._step_bar is not None:
            self._step_bar.close()
            self._step_bar = None

    def on_fit_end(self, trainer) -> None:
        self._close_step_bar()
        if self._epoch_bar is not None:
            self._epoch_bar.close()
            self._epoch_bar = None

    on_exception = lambda self, trainer, exc: self.on_fit_end(trainer)  # noqa: E731
