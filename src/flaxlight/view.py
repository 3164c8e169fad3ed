"""``TrainerViewMixin``: the trainer's side of :class:`~flaxlight.callbacks.TrainerView`.

What callbacks may read and do, answered from the loop's own objects. :class:`TrainerModule`
inherits it; the members it reads are set up by the trainer: ``_loop`` (a
:class:`~flaxlight.loop.LoopState`), ``_nonfinite`` (a :class:`~flaxlight.loop.NonfiniteTally`),
``_is_best``, ``engine`` (an :class:`~flaxlight.engine.Engine`), ``optimizer_plan``,
``callbacks``, ``logger``, ``callback_metrics``, ``global_step``, ``should_stop``, ``stop_reason``,
``options``, ``_best_eval_metrics``. It also holds the trainer's private logging, stop and
best-model bookkeeping behind these (the best model is chosen once per validation, when its
``monitor`` is known: :meth:`TrainerViewMixin._choose_best`).

Examples:
    >>> class EpochAtLogPoints(flaxlight.Callback):                               # doctest: +SKIP
    ...     def on_log(self, trainer, step, metrics):
    ...         if "train/loss_step" in metrics:  # log_metrics calls on_log again: answer the trainer's records only
    ...             trainer.log_metrics({"epoch_seen": trainer.current_epoch}, step=step)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import inspect
import os
import warnings
from typing import Any, Callable, Iterator, Mapping

import jax

from flaxlight import distributed as dist
from flaxlight import optim, resume, runfiles
from flaxlight.callbacks.base import may_hear_log_points_late
from flaxlight.callbacks.early_stopping import EarlyStopping
from flaxlight.callbacks.history import FitResult, History
from flaxlight.callbacks.model_checkpoint import ModelCheckpoint
from flaxlight.data import check_first_batch
from flaxlight.loggers.base import checked_scalars
from flaxlight.loggers.csv import LoggedStep
from flaxlight.loop import Interrupted, SignalGuard, safe_len
from flaxlight.messages import logger as messages
from flaxlight.metrics import to_host
from flaxlight.options import (MetricNotLoggedError, check_monitors_are_numbers, declared_keywords,
                               foreign_assignment_message, foreign_method_message, written_otherwise)
from flaxlight.progress import progress
from flaxlight.state import TrainState
from flaxlight.step import TrainStep

__all__ = ["TrainerViewMixin"]


def keras_attribute(name: str, doc: str) -> property:
    """A trainer property for Keras' model attribute ``name`` (``stop_training``, ``trainable``):
    reading or assigning it raises, saying what to write, unless the trainer class declares ``name``
    in its ``__init__`` (then it is the class's own attribute).

    Examples:
        >>> class Trainer:
        ...     trainable = keras_attribute("trainable", "Keras' name.")
        >>> Trainer().trainable = False  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        AttributeError: Trainer.trainable = False would change nothing: Keras' model.trainable = False is ...
    """
    def read(self: Any) -> Any:
        if name in self.__dict__:
            return self.__dict__[name]
        raise AttributeError(foreign_method_message(type(self).__name__, name))

    def assign(self: Any, value: Any) -> None:
        if name not in declared_keywords(type(self)):
            raise AttributeError(foreign_assignment_message(type(self).__name__, name, value))
        self.__dict__[name] = value

    return property(read, assign, doc=doc)


class TrainerViewMixin:
    """The read-only loop status, ``stop``, ``log_metrics`` and friends (see the module docstring)."""

    _validation_logged: dict | None = None  # what was logged since the latest validation began
    _row_logged: dict | None = None  # what was logged since the epoch's end records began (its history row's)
    _validation_open = False  # from its evaluation's end until its callbacks' on_validation_end ended
    _best_pending: dict | None = None  # a validation's metrics whose best-model question waits for its monitor
    _chosen_on: dict | None = None  # the metrics the latest best validation was chosen on (is_new_model_better's)
    _earlier_epochs: tuple = ()  # a resumed run's batches in epochs of other lengths (RunPlan.earlier)
    _step_count: tuple = (0, 0)  # (global_step, state.step) when last known together (_settle_global_step)
    _step_updates: float | None = None  # state.step increments per batch, counted at an epoch's end
    _steps_are_flaxlights = False  # the train step is a TrainStep's own: one update per batch

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A ``load_model`` of the subclass's own is wrapped so that the state it sets is taken in as
        ``init_model``'s and ``init_optimizer``'s are (:func:`taking_in_state`)."""
        super().__init_subclass__(**kwargs)
        own = vars(cls).get("load_model")
        if inspect.isfunction(own) and not is_flaxlights_own(own) and not hasattr(own, "flaxlight_takes_in_state"):
            cls.load_model = taking_in_state(own)

    def stop(self, reason: str) -> None:
        """Ask the loop to stop after the current step's work (and the epoch's end routine)."""
        if not self.should_stop:
            self.should_stop, self.stop_reason = True, reason

    stop_training = keras_attribute(
        "stop_training", "Keras' name, refused with what to write (``should_stop``): as a plain attribute, a Keras "
                         "callback's ``trainer.stop_training = True`` would be kept and stop nothing. A trainer class "
                         "that declares ``stop_training`` in its ``__init__`` keeps it as its own attribute.")
    trainable = keras_attribute(
        "trainable", "Keras' name, refused with what to write (``optimizer_hparams`` ``freeze``): as a plain "
                     "attribute, ``trainer.trainable = False`` would be kept and freeze nothing. A trainer class "
                     "that declares ``trainable`` in its ``__init__`` keeps it as its own attribute.")

    @property
    def history(self) -> list[dict[str, Any]]:
        """Each epoch's (and each validation's) metrics, one dict per row (see :class:`~flaxlight.callbacks.History`)."""
        return next(cb for cb in self.callbacks if isinstance(cb, History)).rows

    @property
    def loggers(self) -> list:
        """The run's loggers, as a list (Lightning's ``trainer.loggers``): the CSV logger first, then
        those ``logger_type`` picks, then ``loggers=[...]``. ``trainer.logger`` is not the first of
        them but the fan-out that sends each record to all of them; empty in ``fast_dev_run``."""
        return list(self.logger.loggers)

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The trainer's :class:`ModelCheckpoint` (the user's, or the one added by default), as
        Lightning's ``trainer.checkpoint_callback``; None without one (``enable_checkpointing=False``,
        ``fast_dev_run``). Its ``best_model_path`` is the best checkpoint's folder. Assigning it
        (``self.checkpoint_callback = ...`` in a subclass) sets what it reads from then on; the
        checkpoints are still the ``ModelCheckpoint``'s among the trainer's callbacks.

        Examples:
            >>> trainer.checkpoint_callback.best_model_path   # doctest: +SKIP
            'runs/MLP/version_0/checkpoints/380'
        """
        if "_assigned_checkpoint_callback" in self.__dict__:
            return self.__dict__["_assigned_checkpoint_callback"]
        return getattr(self, "_checkpoint_callback", None)

    @checkpoint_callback.setter
    def checkpoint_callback(self, value: Any) -> None:
        self.__dict__["_assigned_checkpoint_callback"] = value

    @property
    def current_epoch(self) -> int:
        """The epoch being trained (1-based, where Lightning's starts at 0; the next one between
        epochs); after ``train_model``, its last; after ``load_from_checkpoint`` or ``load_model``,
        the loaded checkpoint's. Read while the step is traced (in ``loss_fn``), it warns: jit would compile it in
        as a constant; the step reads ``state.epoch`` instead (:func:`watch_traced_reads`)."""
        _warn_if_traced(self, "current_epoch", self._loop.epoch)
        return self._loop.epoch

    @property
    def global_step(self) -> int:
        """Train steps (batches) completed. Read while the step is traced (in ``loss_fn``), it
        warns: jit would compile it in as a constant; the step reads ``state.step`` instead."""
        value = self.__dict__.get("_global_step", 0)
        _warn_if_traced(self, "global_step", value)
        return value

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.__dict__["_global_step"] = value

    @property
    def one_update_per_batch(self) -> bool | None:
        """Whether the train step makes one optimizer update (one ``state.step`` increment) per
        batch, so that ``state.step`` and the optimizer's schedule count what ``global_step``
        counts: True for the step flaxlight builds from ``loss_fn``; for a ``create_functions`` of
        yours, None until the end of its first epoch, which counts them (a GAN's two
        ``apply_gradients`` per batch: False)."""
        if self._step_updates is None:
            return True if self._steps_are_flaxlights else None
        return self._step_updates == 1.0

    @property
    def batch_in_epoch(self) -> int:
        """Batches of the current epoch already trained on."""
        return self._loop.batch_index if self._loop.phase == "train" else 0

    @property
    def compile_time(self) -> float | None:
        """Seconds of the first train step, compilation included (None before it ran)."""
        return self.engine.compile_time

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose loss was NaN/Inf, as read at the last log point, validation or epoch end."""
        return self._nonfinite.steps

    @property
    def nonfinite_checked_step(self) -> int:
        """The step up to which :attr:`nonfinite_steps` is known."""
        return self._nonfinite.checked_step

    @property
    def nonfinite_first(self) -> str | None:
        """Where the first of :attr:`nonfinite_steps` was seen, for people (``at step 6``, ``between steps
        5 and 6 (epoch 1, batches 5-6)``); None while there is none."""
        return self._nonfinite.where_first() if self._nonfinite.steps else None

    def log_point_time(self, step: int) -> float | None:
        """``time.perf_counter()`` when the train log point at ``step`` was done, for the point
        being delivered to ``on_log`` now (its metrics arrive one log point late, or later: see
        :attr:`Callback.on_log_may_lag`); None for any
        other step or record. Host time, no added device wait: when the loop reached the point,
        or, where the device ran behind, when its values were read or at the pace of the interval
        before (:class:`~flaxlight.loop.RunningLog`)."""
        return self._loop.running_log.finished_at(step)

    @property
    def is_best_validation(self) -> bool:
        """Whether the latest validation is the best so far (``is_new_model_better``'s answer; read
        during a validation whose monitor a callback logs, it is asked now, so that callback must
        come first in the list)."""
        self._settle_best()
        return self._is_best

    @property
    def own_checkpoints(self) -> bool:
        """Whether ``save_model`` writes checkpoints of its own: an override that does not call
        ``super().save_model(step)`` (the UvA guide's way, e.g. with ``flax.training.checkpoints``;
        :func:`writes_own_checkpoints`). As in the guide's loop, such a ``save_model(step)`` is then
        called only when a validation gives a new best model (``ModelCheckpoint``'s periodic,
        last and interrupt saves are not made: they would overwrite the best), and the best model
        is restored through ``load_model()`` for a test, ``predict(which="best")`` and
        ``load_from_checkpoint`` (docs/from-uva.md). False once flaxlight's ``save_model`` ran."""
        return not getattr(self, "_saved_by_flaxlight", False) and writes_own_checkpoints(type(self))

    @property
    def validation_metrics(self) -> dict[str, float]:
        """The latest validation's metrics: the eval step's (``val/...``) and every value logged
        from its start until its callbacks' ``on_validation_end`` ended (by the trainer's
        ``on_validation_epoch_end``, or a callback's ``on_validation_end`` or ``on_log``). The best
        model and :class:`~flaxlight.callbacks.ModelCheckpoint` rank among them."""
        return {key: value for key, value in (self._validation_logged or {}).items() if key != "epoch"}

    @property
    def train_loader(self) -> Any:
        """The loader of the current (or latest) ``train_model`` run (None before one)."""
        return getattr(self, "_train_loader", None)

    @property
    def val_loader(self) -> Any:
        """The validation loader of the current (or latest) ``train_model`` run (None if none)."""
        return getattr(self, "_val_loader", None)

    def learning_rate(self, step: int | None = None) -> float | None:
        """The scheduled learning rate at ``step`` (default: now); None without a known schedule,
        or once the train step was seen making other than one optimizer update per batch
        (:attr:`one_update_per_batch` False: the schedule's count is then not the step; the rate
        used is in the optimizer state, where ``LearningRateMonitor`` reads it). Read from the
        epoch's table, computed at its start (a log point does not wait)."""
        if self.one_update_per_batch is False:
            return None
        return self.engine.learning_rates.rate(self.optimizer_plan, self.global_step if step is None else int(step))

    def monitored_value(self, name: str, owner: str = "monitor") -> float:
        """The latest logged value of ``name``; a clear error naming the logged keys if absent."""
        if name not in self.callback_metrics:
            close = difflib.get_close_matches(name, list(self.callback_metrics), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise MetricNotLoggedError(f"{owner} monitors {name!r}, which was never logged.{hint} "
                                       f"Logged metrics: {sorted(self.callback_metrics)}.")
        return self.callback_metrics[name]

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log numbers the way the trainer logs its own: to the loggers, into
        ``callback_metrics`` and to every callback's ``on_log`` (``step`` default: now). Each value
        must be one number; anything else fails here, naming its key. Called by you outside
        ``train_model``, the run folder's lock is taken while they are written
        (:meth:`_writing_records`); from a callback, the loop running it writes them as its own.

        A ``step`` of your own beyond ``global_step`` (samples seen, say) is the loggers' x value;
        the record still belongs to the training position it was logged at: ``metrics.csv`` keeps
        that ``global_step`` in its ``trainer/global_step`` column, and a resume from a checkpoint
        at step ``s`` keeps the records logged by then, whatever their step. TensorBoard's purge
        goes by step: such scalars are written again after it (from ``metrics.csv``), images are
        not. A step of your own up to ``global_step`` (a log point's, in ``on_log``) is kept or
        dropped by its value; W&B and MLflow keep every record (docs/logging.md, Resume)."""
        metrics = checked_scalars(metrics)
        if step is not None and int(step) > self.global_step:  # the loggers' x; the row's position is now
            step = LoggedStep(step, self.global_step)
        if getattr(self, "_in_callbacks", 0):
            self._log(metrics, step)
            return
        with self._writing_records("logged metrics"):
            self._log(metrics, step)

    def tracker(self, iterator, **kwargs):
        """``iterator`` with a progress bar when enabled (the seed's helper)."""
        return progress(iterator, self.enable_progress_bar, **kwargs)

    def log_image(self, tag: str, image: Any, step: int | None = None) -> None:
        """Send an image (``(H, W)`` or ``(H, W, C)``, uint8 or float in [0, 1]) to every logger
        that shows images (TensorBoard, W&B, MLflow); nothing in ``fast_dev_run``."""
        with self._writing_records("image"):
            self.logger.log_image(tag, image, self.global_step if step is None else int(step))

    def _claim_records(self) -> None:
        """Before this trainer's first run or load: its first record (``test()``, ``log_metrics``
        of a baseline) makes the log folder its own, so a later ``train_model`` continues the same
        records; a folder holding another run's files is refused, as ``train_model`` refuses it.
        A trainer from ``load_from_checkpoint`` adds to the loaded run's records in that run's
        folder; logging to another folder (``logger_params={'log_dir': ...}``), it claims that
        folder as a new trainer does (a fine-tuning run after a baseline test continues its records),
        or, when it holds records alone (``metrics.csv``, ``metrics/``: no ``hparams.yaml``, no
        checkpoints), the tests of other loaded trainers (an eval folder), adds to them without
        making the folder its own (training there then needs ``resume=True`` or ``overwrite=True``)."""
        if self._wrote_here or self._trained_here or self.log_dir is None \
                or not dist.is_main_process():  # the others write no records (and claim no folder)
            return
        if self._loaded and self._loaded_from is None:  # the loaded run's own folder: its records go on
            return
        present = runfiles.run_files_present(self.log_dir)
        if self._loaded and present == ["metrics.csv"]:  # an eval folder: records of tests, no run
            return
        if present == ["metrics.csv"]:
            raise FileExistsError(f"log_dir {self.log_dir} holds earlier records (metrics.csv) and no run: this new "
                                  f"trainer's records would start a run there. Choose another log_dir (a trainer from "
                                  f"load_from_checkpoint adds its tests to such a folder).")
        if present:
            raise FileExistsError(f"log_dir {self.log_dir} already holds a run ({', '.join(present)}): this trainer "
                                  f"would log into it before training. Load that run to add to it "
                                  f"(load_from_checkpoint), or choose another log_dir.")
        self._wrote_here = True

    @contextlib.contextmanager
    def _writing_records(self, what: str) -> Iterator[None]:
        """Records written outside ``train_model`` (``test()``, ``log_metrics``, ``log_image``): the
        run folder's lock is taken first, as a training run takes it, and held while they are
        written (a live process training there is refused: its ``metrics.csv`` would lose rows);
        the folder is claimed (:meth:`_claim_records`); the records are on disk when this ends.
        Inside ``train_model`` (the lock held already) it does nothing."""
        if not self._records_need_lock():
            yield
            return
        lock = self._take_records_lock(what)
        try:
            yield
            self.logger.flush()
        finally:
            lock.release()

    def _check_records_folder(self, what: str) -> None:
        """Refuse now what :meth:`_writing_records` would refuse (a folder in use, another run's),
        e.g. before a long evaluation whose records come at its end; the lock is not kept meanwhile."""
        if self._records_need_lock():
            self._take_records_lock(what).release()

    def _records_need_lock(self) -> bool:
        held = self._run_lock is not None and self._run_lock.held  # inside train_model, or records being written
        return not held and self.log_dir is not None and dist.is_main_process()

    def _take_records_lock(self, what: str) -> "runfiles.RunLock":
        """The run folder's lock, taken for this trainer's ``what``, and the folder claimed."""
        lock = runfiles.RunLock(self.log_dir)
        try:
            lock.acquire()
        except runfiles.RunInUseError as busy:
            raise runfiles.RunInUseError(self._in_use_message(busy, what), busy.log_dir, busy.pid, busy.host) from None
        self._run_lock = lock
        try:
            self._claim_records()
        except BaseException:
            lock.release()
            raise
        return lock

    def _in_use_message(self, busy: "runfiles.RunInUseError", what: str) -> str:
        """Why a record cannot be written into a folder a live process holds, and what to do instead."""
        another_folder = (f"{type(self).__name__}.load_from_checkpoint(run, exmp_input=..., "
                          f"logger_params={{'log_dir': 'runs/eval'}})")
        if busy.in_this_process:  # another trainer object of this process: e.g. a callback's copy of the run
            return (f"The run in {busy.log_dir} is being trained (or written) by another trainer object in this "
                    f"process ({busy.pid}; e.g. the trainer whose train_model runs the callback asking now): this "
                    f"trainer's {what} would be written into its records (metrics.csv, metrics/) beside that "
                    f"trainer's, and rows would be lost. Nothing was written. Log into another folder: "
                    f"{another_folder}; or, in a callback, evaluate with the training trainer itself "
                    f"(trainer.eval_model(data, log_prefix='test/'), then trainer.log_metrics(...)).")
        if self._loaded:
            instead = (f"To test the checkpoint while the run goes on, log into another folder: {another_folder}; "
                       f"or wait for process {busy.pid} to finish.")
        else:
            instead = (f"Log into another folder (logger_params={{'log_dir': ...}}), or wait for process {busy.pid} "
                       f"to finish.")
        return (f"The run in {busy.log_dir} is training in process {busy.pid} on {busy.host} (that process holds its "
                f"lock file {runfiles.RunLock.FILE}): this trainer's {what} would be written into the run's records "
                f"(metrics.csv, metrics/) while it writes them, and rows would be lost. Nothing was written. {instead} "
                f"If that process is gone, delete the lock file.")

    def _log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """The trainer's own records. Outside ``train_model`` (a loop of the user's own calling
        ``train_epoch`` / ``eval_model``) the folder is claimed once; no lock is taken per record
        there (a lock and a flush per log point cost that loop ~15% on a small model)."""
        self._claim_records()
        step = self.global_step if step is None else step
        self.callback_metrics.update(metrics)
        if self._validation_open:
            self._validation_logged.update(metrics)
        if self._row_logged is not None:
            self._row_logged.update(metrics)
        self.logger.log_metrics(metrics, step=step)
        self._call_callbacks("on_log", step, metrics)

    def _settle_optimizer_plan(self, start: int, steps_per_epoch: int | None) -> None:
        """After the run's optimizer was built for a run starting at step ``start``: say what
        ``max_steps`` gives under gradient accumulation, and date a resumed run's schedule from
        the start of the run it continues (its learning rates are that run's)."""
        if note := self.options.max_steps_note(self.optimizer_plan, steps_per_epoch):
            messages.info(note)  # max_steps counts batches, not accumulated updates (Lightning's)
        if isinstance(self.optimizer_plan, optim.OptimizerPlan) and start != self.global_step:
            self.optimizer_plan = dataclasses.replace(self.optimizer_plan, first_step=start)

    def _settle_global_step(self, checkpoint_step: int | None = None) -> None:
        """Set ``global_step``, the batches trained, before a run or after a load: ``checkpoint_step``
        (the step a flaxlight checkpoint was saved at, its meta's) when one was restored; else the
        count kept, unless ``self.state`` was replaced since (a ``load_model`` of yours, an
        assignment): then its ``state.step``. Not ``state.step`` after a restore: it counts the
        optimizer's updates, two per batch for a step that calls ``apply_gradients`` twice."""
        state_step = int(to_host(self.state.step))
        if checkpoint_step is None:
            counted, at = self._step_count
            checkpoint_step = counted if state_step == at else state_step
        self.global_step = int(checkpoint_step)
        self._step_count = (self.global_step, state_step)

    def _settle_loaded_epoch(self, checkpointer: Any = None, step: int | None = None) -> None:
        """After a load outside a run: ``current_epoch`` is the loaded model's epoch, the one its
        checkpoint ``step`` was saved in (from its meta), else the epochs ``state.epoch`` counts."""
        epoch = resume.checkpoint_epoch(checkpointer, step) if checkpointer is not None and step is not None else None
        if epoch is None:
            epoch = int(to_host(getattr(self.state, "epoch", 0) or 0))
        self._loop = dataclasses.replace(self._loop, epoch=max(1, int(epoch)))

    def _end_epoch_count(self, nonfinite: int, state_step: int) -> None:
        """At a training epoch's end, its one read of the sums (which brings ``state.step`` along):
        note its non-finite steps and the optimizer updates per batch of a train step of yours;
        more than one is said once (:meth:`_say_updates_per_batch`)."""
        self._nonfinite.note(self.global_step, nonfinite)
        (counted, at), self._step_count = self._step_count, (self.global_step, state_step)
        batches, updates = self.global_step - counted, state_step - at
        if batches > 0 and not self._steps_are_flaxlights and self._step_updates is None:
            self._step_updates = updates / batches
            if self._step_updates > 1:
                self._say_updates_per_batch(updates, batches)

    def _say_updates_per_batch(self, updates: int, batches: int) -> None:
        """Warn that the train step makes several optimizer updates per batch: ``global_step``,
        ``max_steps`` and the logs count batches, and a schedule flaxlight sized for one update
        per batch (not enlarged by an ``init_optimizer`` of the user's) ends early."""
        name, per = type(self).__name__, updates / batches
        text = f"{per:g}" if per == int(per) else f"{per:.3g} on average"
        plan, asked = self.optimizer_plan, getattr(self, "_schedule_asked", None)
        ends = self._fitted_schedule_steps is not None and asked is not None and plan.total_steps <= asked
        factor = f"{int(per)} * num_steps_per_epoch" if per == int(per) else f"round({per:.3g} * num_steps_per_epoch)"
        (messages.warning if ends else messages.info)(
            f"{name}'s train step made {updates} optimizer updates in {batches} batches ({text} per batch: state.step "
            f"counts updates, global_step, max_steps, log points and checkpoints count batches)."
            + (f" The learning-rate schedule was sized for one update per batch ({plan.total_steps} updates), so it "
               f"ends after about 1/{per:.3g} of the run, which then trains at its final rate. Size it for your "
               f"updates in an init_optimizer override: def init_optimizer(self, num_epochs, num_steps_per_epoch): "
               f"super().init_optimizer(num_epochs, {factor})." if ends else "")
            + " LearningRateMonitor logs the rate the optimizer used (read from its state).")

    def _nothing_to_train(self, target: resume.ResumeTarget, num_epochs: int, test_loader: Any) -> FitResult | None:
        """A resume of the run in place (``resume=True``, or ``resume_from`` its folder; not a rewind
        to an older checkpoint, nor a copy into another folder, which are asked to write) whose
        checkpoint already reached ``num_epochs`` (or ``max_steps``): as the CLI's ``fit --resume``,
        nothing is trained, tested or written (no hparams, records or lock); the trainer holds that
        checkpoint's model, step and best, which are returned, and that is said. None when there
        is something to train (or the checkpoint does not load: the resume says why)."""
        if not target.continuing or target.rewind_step is not None:
            return None
        found = target.checkpoint(self.checkpointer)
        reached = found[1].trained_up_to(num_epochs, self.options.max_steps) if found is not None else None
        if reached is None:
            return None
        source, meta = found
        try:
            self.state = self._load_for_resume(meta.step) if source is self.checkpointer else \
                source.restore(self.state, step=meta.step)
        except Exception as exc:  # noqa: BLE001 - damaged: the resume falls back to an earlier one, saying so
            if getattr(exc, "flaxlight_user_code", False):
                raise
            return None
        self._settle_global_step(meta.step)  # the batches it trained (state.step counts the updates)
        self._best_eval_metrics, self._loop = meta.best_eval_metrics, meta.loop_state(self.steps_per_epoch)
        meta.restore_callbacks(self.callbacks)
        self._trained_here = True  # it continued the run in place (for no epoch): its test() adds to the run's records
        tested = (" The test_loader was not run: trainer.test(test_loader) tests the run's best model again."
                  if test_loader is not None else "")
        messages.warning(f"Nothing to train: the run in {os.path.dirname(source.directory)} has reached {reached}; "
                         f"nothing was run or written, and the trainer holds that checkpoint's model. To train on, "
                         f"resume with a larger {reached.split('=')[0]}.{tested}")
        return FitResult(dict(self._best_eval_metrics or self._loop.train_metrics), history=self.history)

    def _call_callbacks(self, hook: str, *args, before_checkpoint: Callable[[], None] | None = None) -> None:
        """Call ``hook`` of every callback in order; ``before_checkpoint`` first runs before the
        first :class:`ModelCheckpoint` (they come last: :func:`~flaxlight.callbacks.with_default_callbacks`)."""
        self._in_callbacks = getattr(self, "_in_callbacks", 0) + 1  # their log_metrics: the loop's own records
        try:
            for callback in self.callbacks:
                if before_checkpoint is not None and isinstance(callback, ModelCheckpoint):
                    before_checkpoint()
                getattr(callback, hook)(self, *args)
        finally:
            self._in_callbacks -= 1

    def _begin_validation_records(self) -> None:
        """From now until :meth:`_end_validation`, what is logged is the validation's
        (:attr:`validation_metrics`): its eval record, and what hooks and callbacks log then.
        Within an epoch, :attr:`nonfinite_steps` is brought up to this step first (one read of the
        epoch's device count; a validation waits for the device anyway), so a NaN the hooks and
        callbacks see is known to come from a diverged training or not (``weights_damaged``)."""
        self._validation_logged, self._validation_open = {}, True
        if self._loop.phase == "train":  # at an epoch's end the epoch's one read has counted them
            self._nonfinite.note(self.global_step, self._nonfinite.now(self._loop) - self._nonfinite.before_epoch)

    def _choose_best(self, eval_metrics: Mapping[str, float]) -> None:
        """Ask ``is_new_model_better`` once for this validation (:meth:`_settle_best`): now when the
        ``monitor`` is among the eval metrics or was logged since the validation began (by
        ``on_validation_epoch_end``); else once callbacks may have logged it, before
        :class:`ModelCheckpoint` hears of the validation (it comes after the others, as in
        Lightning) or when a callback reads ``is_best_validation``."""
        self._best_pending, self._is_best = dict(eval_metrics), False
        if not self.options.monitor or self.options.monitor in self.validation_metrics:
            self._settle_best()

    def _settle_best(self) -> None:
        """The pending best-model question asked (nothing when none waits) of the eval step's
        metrics and the monitor's value logged during the validation, or an error says why it is
        missing. A best validation is kept (:meth:`_keep_best`) with what was logged so far."""
        if self._best_pending is None:
            return
        metrics, self._best_pending = self._best_pending, None
        monitor, logged = self.options.monitor, self.validation_metrics
        if monitor and monitor not in metrics:
            if monitor not in logged:
                raise MetricNotLoggedError(self.options.missing_monitor_message(
                    metrics, logged_before=[key for key in self.callback_metrics if key not in logged]))
            metrics[monitor] = logged[monitor]
        self._is_best = bool(self.is_new_model_better(metrics, self._best_eval_metrics))
        if self._is_best:
            self._chosen_on = metrics
            self._keep_best(write=False)  # written once the callbacks (before ModelCheckpoint) logged theirs

    def _keep_best(self, write: bool = True) -> None:
        """The latest validation, the best so far, as the run's best (``train_model``'s returned
        metrics, TensorBoard's ``best/*``, the checkpoints' meta, and ``best_eval.json`` when
        ``write``): everything logged during it, as its ``metrics/eval_*.json`` holds
        (:attr:`validation_metrics`), with the epoch's train means; but the values it was chosen on
        (the eval step's, where a callback logs one of their names again) stay, so the next
        validation is compared with values of the same kind."""
        metrics = {**self.validation_metrics, **(self._chosen_on or {})}
        self._best_eval_metrics = {**metrics, **self._loop.train_metrics}
        if write:
            self._record_metrics("best_eval", metrics)

    def save_metrics(self, filename: str, metrics: Mapping[str, float]) -> None:
        """Write ``metrics`` to ``<log_dir>/metrics/<filename>.json`` (nothing in ``fast_dev_run``).

        Examples:
            >>> trainer.save_metrics("my_eval", {"val/acc": 0.91})  # doctest: +SKIP
        """
        if self.log_dir is not None and dist.is_main_process():
            runfiles.write_metrics(self.log_dir, filename, metrics)

    def _record_metrics(self, filename: str, metrics: Mapping[str, float]) -> None:
        """A validation's ``metrics/<filename>.json`` (and ``best_eval.json``), written off the
        training thread in batches (:class:`~flaxlight.runfiles.MetricFiles`): on disk before any
        checkpoint saved after it is written (:meth:`_start_records_flush`) and when ``train_model``
        returns. An override of :meth:`save_metrics` is called instead, as it was."""
        if type(self).save_metrics is not TrainerViewMixin.save_metrics:
            self.save_metrics(filename, metrics)
        elif self.log_dir is not None and dist.is_main_process():
            self._metric_files.write_soon(self.log_dir, filename, metrics)

    @functools.cached_property
    def _metric_files(self) -> runfiles.MetricFiles:
        return runfiles.MetricFiles()

    def _start_records_flush(self) -> Callable[[], None]:
        """What was logged and recorded so far sent to the disk before a checkpoint: the metrics
        files now (a ``kill -9`` right after a new best's save still finds its validation's file),
        the loggers' records queued, with a wait for them returned, which the checkpoint's writer
        runs before the write: no checkpoint goes further than the run's records, and the training
        thread does not wait for the loggers' flush (~1 ms at each new best model's save). A
        logger of its own without ``start_flush`` is flushed now."""
        if "_metric_files" in self.__dict__:
            self._metric_files.flush()
        start = getattr(self.logger, "start_flush", None)
        if start is not None:
            return start()
        self.logger.flush()
        return lambda: None

    def _end_background_work(self) -> None:
        """At the end of ``train_model``: the metrics files written, the engine's threads joined."""
        try:
            if "_metric_files" in self.__dict__:
                self._metric_files.flush()
        finally:
            self.engine.close()

    def _end_validation(self, epoch: int, eval_metrics: Mapping[str, float], file: str) -> None:
        """The callbacks' ``on_validation_end``, the best model chosen before :class:`ModelCheckpoint`
        hears of the validation; what is logged after them is not the validation's. Before it
        (it may save: the checkpoint's history is then whole) or after the last callback, the
        validation's metrics, those logged during it too, join its history row and are written
        to ``metrics/<file>.json``."""
        recorded = False

        def record() -> None:
            nonlocal recorded
            self._settle_best()
            if not recorded:
                recorded = True
                if self._is_best:  # with what the callbacks logged (chosen before them when it could)
                    self._keep_best()
                self._add_to_history(epoch, self.validation_metrics)
                self._record_metrics(file, self.validation_metrics)

        try:
            self._call_callbacks("on_validation_end", epoch, eval_metrics, before_checkpoint=record)
            record()
        except BaseException:
            if not recorded:  # a callback failed: the validation's files are still written (its row: not in a history)
                with contextlib.suppress(Exception):
                    self._record_metrics(file, self.validation_metrics)
                    if self._is_best:
                        self._keep_best()
            raise
        finally:
            self._validation_open, self._best_pending = False, None

    def _end_train_epoch(self, epoch: int, train_metrics: Mapping[str, Any]) -> None:
        """The epoch's train record, the trainer's ``on_training_epoch_end`` and the callbacks'
        ``on_train_epoch_end``; what they log joins the epoch's history row, as in ``metrics.csv``."""
        with self._row_records(epoch):
            self._log({**train_metrics, "epoch": epoch})
            self.on_training_epoch_end(epoch)
            self._call_callbacks("on_train_epoch_end", epoch, train_metrics)

    def _end_epoch(self, epoch: int) -> None:
        """The callbacks' ``on_epoch_end``; what they log joins the epoch's history row before
        :class:`ModelCheckpoint` (which may save then) hears of it."""
        with self._row_records(epoch) as record:
            self._call_callbacks("on_epoch_end", epoch, before_checkpoint=record)

    @contextlib.contextmanager
    def _row_records(self, epoch: int) -> Iterator[Callable[[], None]]:
        """What is logged inside, until the ``record()`` it yields is called (else the block's end),
        joins the history row of ``epoch`` at this step (a save's flush of log points does not)."""
        self._row_logged = {}

        def record() -> None:
            logged, self._row_logged = self._row_logged, None
            if logged is not None:
                self._add_to_history(epoch, logged)

        try:
            yield record
            record()
        finally:
            self._row_logged = None

    def _add_to_history(self, epoch: int, metrics: Mapping[str, Any]) -> None:
        """``metrics`` join the :class:`History` row of ``epoch`` at this step (a new row if none)."""
        history = next((cb for cb in self.callbacks if isinstance(cb, History)), None)
        if history is not None and metrics:
            history.record(epoch, self.global_step, metrics)

    def _save_on_interrupt(self, interrupt: Interrupted) -> None:
        """SIGTERM / SIGINT: save the step trained, end the run's files, say how to resume, exit 128 + signal
        (a SIGINT in an interactive session: ``KeyboardInterrupt``, the session kept, :meth:`Interrupted.stop`)."""
        try:
            if self.own_checkpoints:  # the guide's save_model(step) means "a new best": the state now is not one
                self._unsaved = (f"{type(self).__name__}.save_model writes checkpoints of its own, which flaxlight "
                                 f"asks for at new best models only")
            elif self.log_dir is not None:  # fast_dev_run writes nothing
                with SignalGuard.ignoring():  # a second Ctrl-C waits for the save
                    self.save_model(self.global_step)
                    self.checkpointer.wait()
        finally:  # also when the save failed: callbacks told, files closed, the lock released
            self._end_failed_run(interrupt, "interrupted")
        messages.info(interrupt.explain(self.global_step, self._loop.epoch, self.checkpointer.directory, self.log_dir,
                                        saved=self.checkpointer.all_steps(), unsaved=self._unsaved))
        interrupt.stop()

    def _end_failed_run(self, exc: BaseException, status: str) -> None:
        """Tell every callback ``on_exception`` (one that raises is warned about, and the others are
        still told), then close the run's files with ``status``, whatever happened. The log points
        marked before the failure are logged first (an interrupt's save logged them already)."""
        with contextlib.suppress(Exception):  # the batches trained and the state's updates, for a next train_model
            self._step_count = (self.global_step, int(to_host(self.state.step)))
        try:
            try:
                self._log_running(self._loop.running_log.flush())
            except Exception as failure:  # noqa: BLE001 - the run's own error is what the user must see
                warnings.warn(f"The last log point was not logged ({type(failure).__name__}: {failure}).",
                              RuntimeWarning, stacklevel=2)
            for callback in self.callbacks:
                try:
                    callback.on_exception(self, exc)
                except Exception as failure:  # noqa: BLE001 - the run's own error is what the user must see
                    warnings.warn(f"{type(callback).__name__}.on_exception raised {type(failure).__name__}: {failure} "
                                  f"(while handling {type(exc).__name__}: {exc}).", RuntimeWarning, stacklevel=2)
        finally:
            self._finish_files(status)
        if isinstance(exc, KeyboardInterrupt):
            self._say_what_a_keyboard_interrupt_kept()

    def _say_what_a_keyboard_interrupt_kept(self) -> None:
        """A ``KeyboardInterrupt`` raised inside ``train_model`` (by a callback, a second Ctrl-C, a
        library) saves nothing: it may come in the middle of a step's bookkeeping (the state handed to
        the device, the best model half chosen), where a checkpoint would not resume exactly. Ctrl-C's
        own handler stops at the end of a step and saves there. Say what is kept and how to go on."""
        step, epoch = self.global_step, self._loop.epoch
        said = f"KeyboardInterrupt at step {step} (epoch {epoch}): train_model stopped"
        if self.log_dir is None:
            messages.warning(f"{said}; fast_dev_run saves no checkpoint.")
            return
        try:
            saved = sorted(self.checkpointer.all_steps())
        except Exception as exc:  # noqa: BLE001 - the interrupt is what the user must see
            saved, said = [], f"{said} (its checkpoints could not be listed: {exc})"
        folder = self.checkpointer.directory
        if saved and saved[-1] >= step:
            kept = f"; checkpoint {saved[-1]} in {folder} holds every step trained."
        else:
            newest = (f"The newest checkpoint is step {saved[-1]}: train_model(..., resume=True) continues from there"
                      f" (on this trainer too; it is at step {step} in memory until then)" if saved else
                      f"No checkpoint is in {folder}: resume=True would start from scratch")
            kept = (f", and step {step} is not saved (a KeyboardInterrupt can come in the middle of a step's "
                    f"bookkeeping, so flaxlight saves only where Ctrl-C's own handler stops: at a step's end). "
                    f"{newest}.")
        messages.warning(said + kept)

    def _log_notes(self, before: int | None = None, failing: bool = False) -> None:
        """Log the log points the hot loop noted without stopping (:class:`~flaxlight.loop.EventSchedule`),
        oldest first, as the stops at them would have: each starts its copy and logs the point
        before it. ``before``: the current stop's step, whose own log point its event logs.
        ``failing``: the loop is raising; each point that can be logged is, and an error logging
        one is said in a warning (the loop's own error is the one raised)."""
        running, unlogged = self._loop.running_log, []
        for step, snapshot, noted_at in self._schedule.take_notes(before):
            try:
                if running.would_wait():  # the host's put-off work first: queued steps overlap it
                    self.engine.work_before_waiting()
                self._log_running(running.mark(step, snapshot, at=noted_at))
            except Exception as exc:
                if not failing:
                    raise
                unlogged.append(f"step {step} ({type(exc).__name__}: {exc})")
        if unlogged:
            warnings.warn(f"While the training loop failed, {len(unlogged)} log point(s) noted before it could not "
                          f"be logged: {'; '.join(unlogged[:3])}{'; ...' if len(unlogged) > 3 else ''}.",
                          RuntimeWarning, stacklevel=2)

    def _plan_events(self) -> None:
        """Plan the loop's next look-up (:meth:`~flaxlight.loop.EventSchedule.plan`). Log points
        are noted without a stop when nothing must hear them on time: one process, and every
        callback's ``on_log`` only records or shows values (:func:`~flaxlight.callbacks.base.may_hear_log_points_late`)."""
        log_every = self.options.log_every_n_steps
        noted = log_every if jax.process_count() == 1 and all(may_hear_log_points_late(cb) for cb in self.callbacks) \
            else None
        intervals = [None if noted else log_every, self.options.val_check_interval]
        self._schedule.plan(self.global_step, intervals + [cb.every_n_steps for cb in self.callbacks],
                            self.options.max_steps, notes_every=noted)

    def _log_running(self, points: list[tuple[int, dict, int]]) -> None:
        """Log log points' interval means (:class:`~flaxlight.loop.RunningLog`), oldest first."""
        tally = self._nonfinite
        for step, means, nonfinite in points:
            # A point older than a validation's read of the count knows no more: it leaves the count's step as is.
            if step > tally.checked_step or nonfinite > tally.steps - tally.before_epoch:
                tally.note(step, nonfinite)
            if means:
                self._log(means, step=step)

    def _announce_monitor(self, metrics: Mapping[str, float]) -> None:
        """Say once per trainer which metric picks the best model (an absent one is an error), and
        warn once when its value at a validation is NaN (it ranks as the worst: ``options.is_better``)."""
        said = self.options.describe_monitor(metrics)
        if not getattr(self, "_monitor_announced", False):
            messages.info(said)
            self._monitor_announced = True
        nan_said = self.options.nan_monitor_message(metrics, self._loop.epoch, self.global_step)
        if nan_said and not getattr(self, "_nan_monitor_warned", False):
            messages.warning(nan_said)
            self._nan_monitor_warned = True

    def _check_first_batch(self, batch, loader_name: str) -> None:
        """Check a loader's first batch (:func:`flaxlight.data.check_first_batch`); nothing with
        ``check_batches=False``. A batch shaped unlike ``exmp_input`` is an error when
        flaxlight's own ``loss_fn`` feeds it to the model; with steps of yours (``create_functions``)
        the step that takes it is traced (shapes only), with a ``loss_fn`` of yours the loss, and
        it is accepted if that handles it (a generator fed latent z, a loss that reshapes first)."""
        if not self.options.check_batches:
            return
        try:
            check_first_batch(batch, self.exmp_input, loader_name)
        except ValueError as mismatch:
            if not (is_flaxlights_own(type(self).create_functions) and is_flaxlights_own(type(self).create_jitted_functions)):
                self._step_accepts(batch, "train" if loader_name == "train_loader" else "eval", mismatch)
            elif type(self).loss_fn.__module__.startswith("flaxlight") or not self._loss_accepts(batch, mismatch):
                raise

    def _step_accepts(self, batch, kind: str, mismatch: ValueError) -> None:
        """Trace the ``kind`` step of the user's on ``batch`` (the shapes the loop traces it with
        anyway, kept: :meth:`Engine.zero_sums`); its failure raises ``mismatch`` with the trace's error."""
        try:
            self.engine.zero_sums(kind, self.state, batch)
        except Exception as exc:  # noqa: BLE001 - the step's own error, shown under ours
            raise ValueError(f"{mismatch}\nTracing {type(self).__name__}'s {kind} step (create_functions) on this batch "
                             f"failed too: {type(exc).__name__}: {str(exc)[:300]}\n(A step that feeds the model "
                             f"something else than the batch's first element, a generator fed latent z, is accepted "
                             f"when it traces on the batch; check_batches=False skips this check.)") from exc

    def _resume_target(self, resuming: bool, resume_from: Any, overwrite: bool) -> resume.ResumeTarget:
        """``train_model``'s ``resume`` / ``resume_from`` (:meth:`~flaxlight.resume.ResumeTarget.make`),
        read against the run folder's checkpoints as they are now (:meth:`_refuse_a_stale_trainer`)."""
        self._refuse_a_stale_trainer(continuing=resuming or resume_from is not None, overwrite=overwrite)
        return resume.ResumeTarget.make(resuming, resume_from, own=self.checkpointer, log_dir=self.log_dir,
                                        overwrite=overwrite)

    def _checkpoints_now(self, purpose: str) -> list[int]:
        """List the run folder's checkpoints as they are on disk now (another trainer object, or process,
        may have continued the run and pruned some since this one's last write); returns the steps
        this trainer did not know of, said (info) for ``purpose`` when this trainer wrote into the run."""
        if self.log_dir is None or self._in_run:
            return []
        newer = self.checkpointer.refresh()
        if newer and (self._trained_here or self._wrote_here) and purpose:
            messages.info(f"The run in {self.log_dir} went on after this trainer's last write (step {self.global_step}): "
                          f"another trainer wrote checkpoint{'s' if len(newer) > 1 else ''} {', '.join(map(str, newer))}. "
                          f"{purpose} uses the run's checkpoints as they are now.")
        return newer

    def _refuse_a_stale_trainer(self, continuing: bool, overwrite: bool) -> None:
        """A ``train_model`` that neither resumes nor overwrites, on a trainer whose run folder another
        trainer (object or process) continued after this one's last write, is refused before anything is
        written: it would add a second history to the run (duplicate steps in ``metrics.csv``, another
        best model, checkpoints over that trainer's). A resume continues from the newest checkpoint."""
        newer = self._checkpoints_now("" if not continuing else "resume=True")
        if not newer or continuing or overwrite or not (self._trained_here or self._wrote_here):
            return
        step, newest = self.global_step, max(newer)
        raise FileExistsError(
            f"Another trainer continued the run in {self.log_dir} after this trainer's last write at step {step} (a "
            f"trainer object built again on the same log_dir, or another process): its newest checkpoint is {newest} "
            f"(checkpoints {', '.join(map(str, newer))} are not this trainer's). Training this trainer's model (step {step}) "
            f"on here would write a second history into that run (metrics.csv rows of steps it has, another best "
            f"model). Pass train_model(..., resume=True) to continue the run from its newest checkpoint ({newest}) "
            f"with this trainer; or build a new trainer, or give this one's model another log_dir "
            f"(load_from_checkpoint(..., logger_params={{'log_dir': ...}})); overwrite=True replaces the run (its "
            f"checkpoints and records are deleted).")

    def _claim_run_folder(self, continuing: bool, overwrite: bool, replaces: bool = False) -> None:
        """Refuse to overwrite another run or to share a live one (:func:`flaxlight.runfiles.claim_run`),
        after the last checks that need no folder (a monitor the eval step does not return).
        ``overwrite=True`` replaces the folder's run, also one this trainer wrote when its model was set
        back to an older step of it (``replaces``: a ``resume_from`` another run's checkpoint), and the
        new run writes its own ``hparams.yaml``; a trainer going on from the newest step of its own run
        continues it."""
        self._check_monitor_ahead()
        owned = self._trained_here or self._wrote_here
        if owned and not continuing and (replaces or (overwrite and self._later_checkpoints())):
            self._forget_the_replaced_run()
        elif owned and not (continuing or overwrite):
            self._refuse_a_second_branch()
        elif self._loaded and self._loaded_from is None and self.log_dir is not None and not (
                owned or continuing or overwrite):
            self._refuse_training_over_the_loaded_run()
        if self.log_dir is not None and dist.is_main_process():
            self._run_lock = runfiles.claim_run(self.log_dir, self.checkpointer, continuing=continuing,
                                                overwrite=overwrite, owned=self._trained_here or self._wrote_here)
            self._hparams_written = self._hparams_written and not self._run_lock.replaced  # that run's went with it
            self._trained_here = True
            try:
                self.logger.start_run()  # a loaded trainer's records were late ones; overwrite deleted files
            except BaseException:  # the run never starts: its lock goes (this process would refuse itself)
                self._run_lock.release()
                raise
        self._in_run = True  # until _finish_files: load_model leaves global_step to the loop

    def _later_checkpoints(self) -> list[int]:
        """The steps of this run's checkpoints after the model's (set back by ``load_model``, or
        loaded from an older checkpoint of the run)."""
        return sorted(step for step in self.checkpointer.all_steps() if step > self.global_step)

    def _forget_the_replaced_run(self) -> None:
        """The run this trainer wrote is replaced (``overwrite=True``): its best model, its
        checkpoints' ranking and the ownership of its files go with it."""
        self._trained_here = self._wrote_here = False
        self._best_eval_metrics = None
        if self._checkpoint_callback is not None:
            self._checkpoint_callback.load_state_dict({})

    def _refuse_training_over_the_loaded_run(self) -> None:
        """``train_model`` on a trainer from :meth:`load_from_checkpoint` that logs to the run it was
        loaded from (no ``log_dir`` given: a Lightning user's fine-tune, where Lightning starts a new
        ``version_N``): refused before anything is written, saying what a fine-tune does (a new
        folder), what ``resume=True`` continues, and that ``overwrite=True`` deletes the run loaded from."""
        step, name, steps = self.global_step, type(self).__name__, self.checkpointer.all_steps()
        source = os.path.join(self.checkpointer.directory, str(step)) if step in steps else self.log_dir
        newest = max(steps, default=None)
        resume_text = "" if newest is None else (
            f"To continue that run itself from its newest checkpoint (step {newest}"
            f"{'' if newest == step else f', not the loaded model of step {step}'}), pass train_model(..., "
            f"resume=True). ")
        among = f" (step {step} among them)" if step in steps else ""
        raise FileExistsError(
            f"This trainer was loaded from the run in {self.log_dir}, and logs to that run (load_from_checkpoint "
            f"without logger_params={{'log_dir': ...}} keeps the run's folder), so train_model would train into it, "
            f"over its checkpoints and records. To fine-tune (train on from the loaded model as a new run, as "
            f"Lightning's fit after load_from_checkpoint starts a new version_N), load it with a new folder: "
            f"{name}.load_from_checkpoint({source!r}, exmp_input=..., logger_params={{'log_dir': <a new folder>}}), "
            f"then train_model; the run in {self.log_dir} stays as it is. {resume_text}overwrite=True deletes the "
            f"run being loaded from: its checkpoints{among}, hparams.yaml and records go, and a new run from the "
            f"loaded model (step {step}) is written in its place.")

    def _go_on_from_the_loaded_model(self, target: resume.ResumeTarget) -> None:
        """``resume=True`` of a trainer from :meth:`load_from_checkpoint` logging to a folder of its own
        that holds no checkpoint yet (a fine-tune killed before its first): training goes on from the
        loaded model (:func:`flaxlight.resume.restore_run` said so). What an earlier attempt recorded
        after the loaded model's step is set aside, as for a run killed after its newest checkpoint
        (:meth:`~flaxlight.resume.ResumeTarget.begin_from_loaded_model`), and the loggers go on from
        that step: the run's records end as an uninterrupted run's."""
        if self._loaded_from is None:
            return
        step = int(to_host(self.state.step))
        target.begin_from_loaded_model(step, self._loop.epochs_before, self.checkpointer, self.log_dir,
                                       loaded_from=self._loaded_from.directory)
        self.logger.resume_from_step(step)

    def _refuse_a_second_branch(self) -> None:
        """A next ``train_model`` of a model set back to an older step of its run (``load_model()``,
        the best model loaded by ``load_from_checkpoint`` into its own folder) would write steps the
        run's later checkpoints hold and records of epochs it has: two branches in one run. Refused
        before anything is written, with the rewind (``resume_from``) and a new folder to choose from."""
        later = self._later_checkpoints()
        if not later:
            return
        step, name = self.global_step, type(self).__name__
        here = os.path.join(self.checkpointer.directory, str(step))
        rewind = f"pass train_model(..., resume_from={here!r}) (a rewind: the later checkpoints and records are " \
                 f"set aside in the run's abandoned/ folder, and the run goes on from step {step}); " \
            if step in self.checkpointer.all_steps() else ""
        raise FileExistsError(
            f"This trainer's model is at step {step} (set back by load_model, or loaded from an older checkpoint), "
            f"but its run in {self.log_dir} holds later checkpoints ({', '.join(map(str, sorted(later)))}) from the "
            f"training after it: training on here would write a second branch over the first (its checkpoints and "
            f"epoch records). To go on from step {step} in this run, {rewind}to keep the run as it is, train in "
            f"another folder: {name}.load_from_checkpoint({here!r}, exmp_input=..., logger_params={{'log_dir': "
            f"...}}), then train_model; or pass overwrite=True to replace the run (its checkpoints and records are "
            f"deleted, and a new run from step {step} is written in its place).")

    def _check_monitor_ahead(self) -> None:
        """The trainer's ``monitor`` (the best model is picked among the validation's metrics)
        checked against the names of the eval step traced ahead, so a misspelt one fails before
        training: a name the eval step does not return is refused now when nothing of the user's
        can log it during validation (an ``on_validation_epoch_end`` override, a callback's own
        ``on_validation_end`` or ``on_log``), with "did you mean" for an eval metric's name written
        another way (``val_loss`` for ``val/loss``); else it is looked for at each validation
        (:meth:`_settle_best`), whose message says the same. An ``EarlyStopping`` monitor that is an
        eval metric's name written another way is refused too (it may watch any other logged name)."""
        names, monitor = self.engine.eval_metric_names, self.options.monitor
        if names is None or not is_flaxlights_own(type(self).eval_model):  # it may add metrics
            return
        check_monitors_are_numbers([*((type(cb).__name__, cb.monitor) for cb in self.callbacks if isinstance(
            cb, (EarlyStopping, ModelCheckpoint))), ("The trainer", monitor)], self.engine.eval_result_shapes)
        known = {f"val/{name}": 0.0 for name in names}
        if not is_flaxlights_own(type(self).on_validation_epoch_end) or any(
                not is_flaxlights_own(getattr(type(cb), hook)) for cb in self.callbacks
                for hook in ("on_validation_end", "on_log")):
            return  # a callback or hook of the user's may log it (even as "val_loss") during validation
        for stopper in self.callbacks:  # EarlyStopping may watch any logged name: refused only when misspelt
            close = written_otherwise(stopper.monitor, known) if isinstance(stopper, EarlyStopping) else None
            if close is not None and stopper.monitor not in known:
                raise MetricNotLoggedError(
                    f"EarlyStopping monitors {stopper.monitor!r}, which is not a metric of this run: flaxlight names "
                    f"validation metrics 'val/<name>' (Lightning's 'val_loss' is 'val/loss'). Did you mean {close!r}? "
                    f"Pass EarlyStopping(monitor={close!r}).")
            watched = getattr(stopper, "monitor", None)  # any callback's: a validation metric only the eval step logs
            if isinstance(watched, str) and watched.startswith("val/") and watched.split("/")[1] not in names:
                raise MetricNotLoggedError(_unlogged_monitor(type(stopper).__name__, watched, known))
        if monitor and monitor not in known and not (monitor.startswith("val/") and monitor.split("/")[1] in names):
            raise MetricNotLoggedError(self.options.missing_monitor_message(known, ahead=True))  # not "val/f1/macro"

    def _val_batch_check(self) -> Callable[[Any], None] | None:
        """The check of the validation loader's first batch before training (None with
        ``check_batches=False``: the loader is then not read ahead)."""
        return (lambda batch: self._check_first_batch(batch, "val_loader")) if self.options.check_batches else None

    def _loss_accepts(self, batch, mismatch: ValueError) -> bool:
        """Whether ``loss_fn`` traces on ``batch`` (True), else raise ``mismatch`` with the trace's
        error attached; unknown (True) for a trainer whose steps do not use ``loss_fn``."""
        def loss(params):
            return self.loss_fn(params, batch, train=True, rng=jax.random.PRNGKey(0), state=self.state)

        try:
            jax.eval_shape(loss, self.state.params)
        except NotImplementedError:
            return True
        except Exception as exc:  # noqa: BLE001 - the model's own error, shown under ours
            raise ValueError(f"{mismatch}\nTracing loss_fn on this batch failed too: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from exc
        return True

    @property
    def _schedule_steps(self) -> int | None:
        """The train steps the optimizer's schedule spans (None before ``init_optimizer``)."""
        return getattr(self.optimizer_plan, "total_steps", None)

    @property
    def _fitted_schedule_steps(self) -> int | None:
        """:attr:`_schedule_steps` when the learning rates depend on it (a warmup/decay schedule of
        flaxlight's), else None (a constant rate, an optax transformation of the user's)."""
        config = getattr(self.optimizer_plan, "config", None)
        fitted = config is not None and config.lr is not None and config.schedule in (
            "warmup_cosine", "one_cycle", "linear", "exponential")  # fitted to the run's length
        return self._schedule_steps if fitted else None

    def _stopping(self) -> bool:
        """Whether the loop must end: :meth:`stop` was called or ``max_steps`` reached."""
        return self.should_stop or self.options.reached_max_steps(self.global_step)

    def _announce_stop(self) -> None:
        """Say why training stopped (once, at its end), on the ``flaxlight`` logger; a state no
        epoch end saved (``stop()`` at an epoch's start) is saved now, before a test loads the best."""
        if getattr(self, "_checkpoint_callback", None) is not None:
            self._checkpoint_callback.save_final_state(self)
        if self.stop_reason is None and self.options.reached_max_steps(self.global_step):
            self.stop_reason = f"max_steps={self.options.max_steps} reached."
        if self.stop_reason:
            messages.info(self.stop_reason)

    # ------------------------------------------------------------------ the seed's seams of the user's
    def _run_start(self, target: resume.ResumeTarget) -> int:
        """The model's step this ``train_model`` starts at (:meth:`ResumeTarget.start_step`); a call
        that is not a resume, on a trainer that trained already (a notebook cell run again), is told
        what it keeps and what starts again; edited ``optimizer_hparams`` are taken in
        (:meth:`_take_in_optimizer_edits`), before the optimizer is built from them."""
        if not target.resumes and self._trained_here and self.global_step > 0:
            messages.info(f"train_model again on this trainer: training goes on from its current model (step "
                          f"{self.global_step}) with a new optimizer (its state, e.g. Adam's moments, starts from zero"
                          f" and its learning-rate schedule starts again); epochs, num_epochs and trainer.history count"
                          f" from this call. resume=True instead continues the run from its newest checkpoint with "
                          f"its saved optimizer state.")
        self._take_in_optimizer_edits()  # a notebook cell's trainer.optimizer_hparams["lr"] = ...: recorded
        return target.start_step(self.checkpointer, self.global_step)

    def _take_in_optimizer_edits(self) -> None:
        """``trainer.optimizer_hparams`` edited since the trainer recorded them (a notebook cell between
        ``train_model`` calls): the optimizer this call builds uses them, so they are said and recorded
        in the run's ``hparams.yaml`` at this call's first write (the earlier file kept as
        ``hparams.1.yaml``, as a rebuilt trainer's resume does, :func:`flaxlight.runfiles.write_hparams`).
        A setting the train step applies (built once, by ``__init__``) is refused: it would not apply."""
        record, earlier = optim.recorded_optimizer(self.optimizer_hparams), self.config.get("optimizer_hparams")
        if record == earlier:
            return
        changes, in_step = edited_settings(earlier, record)
        if in_step:
            raise ValueError(f"trainer.optimizer_hparams was edited after the trainer was built ({'; '.join(in_step)}),"
                             f" but the train step applies that setting and was built with the old one by __init__: "
                             f"build a new trainer with the new optimizer_hparams (with its logger_params' log_dir and"
                             f" train_model(..., resume=True) it continues this run), or set it back.")
        messages.info(f"trainer.optimizer_hparams was edited ({'; '.join(changes) or 'its object replaced'}): this "
                      f"train_model's optimizer uses them, and the run's hparams.yaml records them.")
        self.config["optimizer_hparams"] = record
        if self.log_dir is not None and dist.is_main_process():
            self._hparams_written = False  # written again at this call's start: the change said, the old file kept

    def _build_optimizer(self, num_epochs: int, num_steps_per_epoch: int) -> None:
        """``init_optimizer`` (an override of the user's, if any), with ``self.state`` checked before and
        after: a Flax ``TrainState`` (the UvA guide's, built by its ``init_model`` / ``init_optimizer``) is
        taken into a :class:`~flaxlight.TrainState`, anything else is refused now, before training
        (:func:`adopt_state`)."""
        name = type(self).__name__
        self.state = adopt_state(self.state, None, f"{name}.init_model", self._say_once)
        refuse_deleted_arrays(self.state, f"{name}.train_model")  # donated by another trainer's: before any file
        before, self._schedule_asked = self.state, num_epochs * num_steps_per_epoch  # an override may enlarge it
        self.init_optimizer(num_epochs, num_steps_per_epoch)
        self.state = adopt_state(self.state, before, f"{name}.init_optimizer", self._say_once)

    def _watched_steps(self, train_step: Callable, eval_step: Callable) -> tuple[Callable, Callable]:
        """The steps the engine jits, each warning of a trainer attribute read while it is traced
        (:func:`watch_traced_reads`); as they are with ``debug=True`` (un-jitted: read live). A
        ``TrainStep``'s own ``step``, not wrapped, makes one optimizer update per batch (noted)."""
        self._steps_are_flaxlights = isinstance(getattr(train_step, "__self__", None), TrainStep)
        if self.debug:
            return train_step, eval_step
        return watch_traced_reads(train_step, "train"), watch_traced_reads(eval_step, "eval")

    def _take_in_loaded_state(self, before: Any) -> None:
        """After a ``load_model`` of the user's: a Flax ``TrainState`` it set (the UvA guide's
        ``TrainState.create(apply_fn=self.model.apply, ...)``) rebuilt as a :class:`~flaxlight.TrainState`,
        as after ``init_optimizer`` (:func:`adopt_state`: one with fields of its own is refused, naming
        them and the fix); a state it did not change, or that is no Flax ``TrainState`` (None, an
        object of its own), is left as it set it."""
        from flax.training import train_state as flax_train_state

        state = getattr(self, "state", None)
        if state is not before and isinstance(state, flax_train_state.TrainState):
            self.state = adopt_state(state, before, f"{type(self).__name__}.load_model", self._say_once)

    def _live_state(self, verb: str = "eval_model") -> Any:
        """``self.state`` for ``verb``, refused when arrays of it were deleted (:func:`refuse_deleted_arrays`);
        inside ``train_model`` (a validation) unchecked: the loop's own state is live."""
        if not self._in_run:
            refuse_deleted_arrays(self.state, f"{type(self).__name__}.{verb}")
        return self.state

    def _say_once(self, message: str) -> None:
        """Say ``message`` the first time only (each ``train_model`` builds the optimizer again)."""
        if not getattr(self, "_adopted_said", False):
            messages.info(message)
            self._adopted_said = True

    def _restore_checkpoint(self, step: int | None) -> None:
        """flaxlight's ``load_model``: checkpoint ``step`` (None: the best, else the newest) into
        ``self.state``; outside ``train_model``, ``global_step`` too. A failure to read the files is
        marked as one (``flaxlight_checkpoint_read``): called by an override (``super().load_model``),
        it is a damaged checkpoint, as when flaxlight calls it; any other error of an override is the
        user's code (:meth:`_load_for_resume`)."""
        try:
            self.checkpointer.wait()
            step = resume.pick_checkpoint(self.checkpointer, "best") if step is None else step
            self.state = self.checkpointer.restore(self.state, step=step)
        except Exception as exc:
            exc.flaxlight_checkpoint_read = True
            raise
        if not self._in_run:
            self._settle_global_step(step)
            self._settle_loaded_epoch(self.checkpointer, step)

    def _load_for_resume(self, step: int | None = None, purpose: str = "a resume") -> Any:
        """Checkpoint ``step`` (None: the best) restored through ``load_model`` for ``purpose``; returns
        ``self.state``. An override that takes no step (the UvA guide's ``load_model(self)``) is called
        without one for the best model and refused, with what to write, for another. An exception of an
        override's own code propagates as it is, with a note that it came from there, and marked
        ``flaxlight_user_code``: the fallback past damaged checkpoints never takes it for damage, so
        nothing on disk is deleted or moved because of it."""
        if is_flaxlights_own(type(self).load_model):
            self.load_model(step)
            return self.state
        name = f"{type(self).__name__}.load_model"
        args, kwargs = self._load_model_arguments(step, purpose)
        try:
            self.load_model(*args, **kwargs)
        except Exception as exc:
            if not getattr(exc, "flaxlight_checkpoint_read", False):
                exc.flaxlight_user_code = True
                what = "the best model" if step is None else f"checkpoint {step} of {self.checkpointer.directory}"
                exc.add_note(f"Raised by {name} (your code) while flaxlight restored {what} for {purpose}. flaxlight "
                             f"takes it for an error of that code, not for a damaged checkpoint: nothing on disk was "
                             f"deleted or moved.")
            raise
        return self.state

    def _load_model_arguments(self, step: int | None, purpose: str) -> tuple[tuple, dict]:
        """How to call the user's ``load_model`` for ``step`` (None: the best): ``()`` for the best
        when it can be called so (the guide's ``load_model()``), else the step, by position or as
        ``step=``; an override taking no step is called without one for the best checkpoint only."""
        ways = [((), {}), ((None,), {}), ((), {"step": None})] if step is None else \
            [((step,), {}), ((), {"step": step})]
        for args, kwargs in ways:
            if _accepts(self.load_model, *args, **kwargs):
                return args, kwargs
        if step is None or step == resume.pick_checkpoint(self.checkpointer, "best"):  # what load_model() restores
            return (), {}
        refusal = TypeError(f"{type(self).__name__}.load_model(self) takes no step (the UvA guide's signature), so it "
                            f"restores the best model only, and {purpose} needs checkpoint {step}. Give it one, as "
                            f"flaxlight's has: def load_model(self, step=None): super().load_model(step) (None: the "
                            f"best). Nothing on disk was changed.")
        refusal.flaxlight_user_code = True  # the override's signature, not a damaged checkpoint: no fallback
        raise refusal

    def _check_test_loader(self, test_loader: Any) -> None:
        """Before training, what the test after it needs: batches (an empty ``test_loader`` is
        refused now, as an empty ``val_loader`` is, not after the whole run; a loader without
        ``len()`` is not read ahead) and a way to restore the best model (:meth:`_check_load_seam`)."""
        if test_loader is not None and safe_len(test_loader) == 0:
            raise ValueError("test_loader yielded no batches (its len() is 0): check the dataset size, batch_size and "
                             "drop_last, or pass test_loader=None to train without a test.")
        self._check_load_seam("train_model(test_loader=...)" if test_loader is not None else None)

    def _check_load_seam(self, purpose: str | None) -> None:
        """Before training (``purpose``: a test to come; None: none): a ``save_model`` writing its own
        checkpoints needs a ``load_model`` of the user's to restore the best model for the test."""
        if purpose is not None and self.own_checkpoints and is_flaxlights_own(type(self).load_model):
            raise TypeError(self._own_checkpoints_message(purpose))

    def _own_checkpoints_message(self, purpose: str) -> str:
        name = type(self).__name__
        return (f"{name}.save_model writes checkpoints of its own (it does not call super().save_model(step)), which "
                f"flaxlight cannot read, and {purpose} restores the best model: override load_model(self) too, to "
                f"restore self.state from what your save_model wrote (the UvA guide's pair: save_model(step) at each "
                f"new best model, load_model() for it); or call super().save_model(step) in save_model so that "
                f"flaxlight's checkpoints are written as well.")

    def _load_own_best(self, which: str, purpose: str) -> bool:
        """With :attr:`own_checkpoints`, restore the best model through the user's ``load_model()``
        for ``purpose`` (``global_step`` kept); False when this trainer saved none (no validation ran):
        the state stays as it is. ``which="last"`` has no checkpoint then: a ``ValueError`` says so."""
        if which != "best":
            raise ValueError(f"{type(self).__name__}.save_model writes checkpoints of its own, which flaxlight asks "
                             f"for at new best models only, so there is no '{which}' checkpoint for {purpose}: use "
                             f"which='best' (restored by your load_model()) or which='current' (the state now).")
        chosen = getattr(self, "_checkpoint_callback", None)
        if not self._loaded and (chosen is None or chosen.best_step is None):
            messages.info(f"{type(self).__name__}.save_model saved no best model (no validation ran): {purpose} uses "
                          f"the current state.")
            return False
        if is_flaxlights_own(type(self).load_model):
            raise TypeError(self._own_checkpoints_message(purpose))
        step = self.global_step
        self._load_for_resume(None, purpose)
        self.global_step = step
        return True


#: While flaxlight traces a train or eval step (:func:`watch_traced_reads`): ``(kind, names)``, the
#: step's kind and the trainer attributes already warned of in this trace; None otherwise.
_TRACING: contextvars.ContextVar[tuple[str, set] | None] = contextvars.ContextVar("flaxlight_tracing", default=None)

#: What the step reads instead of a trainer attribute that changes during a run.
_IN_THE_STEP = {
    "current_epoch": "state.epoch, the epochs completed (an int32 traced with the step: 0 in the first epoch, as "
                     "Lightning's current_epoch, i.e. current_epoch - 1 while training), e.g. "
                     "beta = jnp.minimum(1.0, state.epoch / warmup_epochs)",
    "global_step": "state.step, the steps completed before this one (global_step's value, traced with the step; it "
                   "counts apply_gradients calls: two per batch for a step updating twice), "
                   "e.g. beta = jnp.minimum(1.0, state.step / warmup_steps)",
}


_STEP_SETTINGS = ("precision", "freeze", "weight_decay_mode", "weight_decay_exclude", "weight_decay_mask")


def edited_settings(earlier: Any, now: Any) -> tuple[list[str], list[str]]:
    """The settings of two optimizer records (:func:`flaxlight.optim.recorded_optimizer`) that differ,
    each as ``key: old -> new``: all of them, and those a :class:`~flaxlight.step.TrainStep` applies
    (:data:`_STEP_SETTINGS`, and ``weight_decay`` where either record adds it to the loss as an L2 term).

    Examples:
        >>> edited_settings({"lr": 0.01, "optimizer": "sgd"}, {"lr": 0.5, "optimizer": "sgd"})
        (['lr: 0.01 -> 0.5'], [])
        >>> edited_settings({"weight_decay": 0.1, "weight_decay_mode": "l2"}, {"weight_decay": 0.2, "weight_decay_mode": "l2"})[1]
        ['weight_decay: 0.1 -> 0.2']
    """
    if not (isinstance(earlier, Mapping) and isinstance(now, Mapping)):
        return [], []
    l2, missing = "l2" in (earlier.get("weight_decay_mode"), now.get("weight_decay_mode")), object()
    keys = [key for key in dict.fromkeys([*earlier, *now]) if earlier.get(key, missing) != now.get(key, missing)]
    said = {key: f"{key}: {earlier.get(key, '(unset)')!r} -> {now.get(key, '(unset)')!r}" for key in keys}
    in_step = [said[key] for key in keys if key in _STEP_SETTINGS or (l2 and key == "weight_decay")]
    return list(said.values()), in_step


def watch_traced_reads(step: Callable, kind: str) -> Callable:
    """``step`` (a train or eval step, ``kind`` ``"train"`` / ``"eval"``) marking the time it runs:
    the trainer jits it, so it runs only while traced, and a trainer attribute that changes during
    a run (``current_epoch``, ``global_step``) read meanwhile, in ``loss_fn``, would be compiled
    into the step as a constant: it warns (once per attribute and trace), saying what to read
    instead. With ``debug=True`` (steps run un-jitted, attributes read live) the steps are not
    wrapped. ``step_owner`` sees through the wrapper (``__wrapped__``).

    Examples:
        >>> train_step = watch_traced_reads(step.step, "train")   # doctest: +SKIP
    """
    @functools.wraps(step)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if jax.config.jax_disable_jit:  # run as Python, as with debug=True: attributes are read live
            return step(*args, **kwargs)
        token = _TRACING.set((kind, set()))
        try:
            return step(*args, **kwargs)
        finally:
            _TRACING.reset(token)

    return traced


def _warn_if_traced(trainer: Any, name: str, value: Any) -> None:
    """Warn (at the reader's line: ``loss_fn``'s) when ``name`` is read while a step is traced."""
    tracing = _TRACING.get()
    if tracing is None or name in tracing[1]:
        return
    kind, said = tracing
    said.add(name)
    warnings.warn(f"{type(trainer).__name__}.{name} was read while flaxlight traced the {kind} step (in loss_fn, or "
                  f"a step function of yours): jit compiles the value it has now, {value!r}, into the step as a "
                  f"constant, so the step goes on using {value!r} however far training goes (with debug=True, which "
                  f"runs the steps un-jitted, it would change, and a resumed run compiles the value it resumes at). "
                  f"Inside the step, read the state instead: {_IN_THE_STEP[name]}; or a field of a TrainState "
                  f"subclass that a callback sets (trainer.state = trainer.state.replace(beta=...) in "
                  f"on_train_epoch_start). See docs/models.md, 'Values that change during training'.",
                  UserWarning, stacklevel=3)


def writes_own_checkpoints(cls: type) -> bool:
    """Whether ``cls.save_model`` writes checkpoints of its own rather than flaxlight's: the
    nearest override (up to flaxlight's) that never refers to ``save_model`` (no
    ``super().save_model(step)``), as the UvA guide's ``save_model`` with
    ``flax.training.checkpoints``. An override that calls flaxlight's adds to its checkpoints.

    Examples:
        >>> class Guide(flaxlight.TrainerModule):                         # doctest: +SKIP
        ...     def save_model(self, step=0):
        ...         checkpoints.save_checkpoint(self.log_dir, {"params": self.state.params}, step, overwrite=True)
        >>> writes_own_checkpoints(Guide)                                  # doctest: +SKIP
        True
    """
    for klass in cls.__mro__:
        method = vars(klass).get("save_model")
        if method is None:
            continue
        method = getattr(method, "__func__", method)
        if is_flaxlights_own(method):
            return False
        if not _refers_to(method, "save_model", cls):
            return True
    return False


def _refers_to(function: Callable, name: str, cls: type | None = None, depth: int = 4) -> bool:
    """Whether ``function``'s code looks up an attribute or global ``name``, in its nested
    functions, the functions it closes over (a decorator's wrapper without ``functools.wraps``),
    the module-level functions it names and ``cls``'s own (not flaxlight's) methods it names (a
    helper reaching ``super().save_model(step)``), ``depth`` calls deep; True when it has no Python
    code to read (it cannot be told)."""
    if getattr(inspect.unwrap(function), "__code__", None) is None:
        return True
    seen, todo = set(), [(inspect.unwrap(function), 0)]
    while todo:
        function, level = todo.pop()
        if id(function) in seen or level > depth:
            continue
        seen.add(id(function))
        codes, names = [function.__code__], set()
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            codes.extend(const for const in code.co_consts if inspect.iscode(const))
        if name in names:
            return True
        found = [cell.cell_contents for cell in (function.__closure__ or ()) if _has_cell(cell)]
        found += [function.__globals__.get(other) for other in names]
        found += [getattr(cls, other, None) for other in names] if cls is not None else []
        for callee in found:
            callee = inspect.unwrap(getattr(callee, "__func__", callee)) if callable(callee) else None
            if callee is not None and inspect.isfunction(callee) and not is_flaxlights_own(callee):
                todo.append((callee, level + 1))
    return False


def _has_cell(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _accepts(method: Callable, *args: Any, **kwargs: Any) -> bool:
    """Whether ``method`` (bound) can be called with these arguments (True when its signature
    cannot be read)."""
    try:
        inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def taking_in_state(load_model: Callable) -> Callable:
    """``load_model`` (a trainer subclass's own) followed by taking in the state it set: the UvA
    guide's ``load_model`` builds its Flax ``TrainState``, which ``bind_model``, ``predict`` and the
    loop cannot use, and it is called by flaxlight (a test, ``load_from_checkpoint``, a resume) and
    by the user alike, so the method itself does it. Its name, signature and module stay the
    override's (``functools.wraps``: flaxlight still calls it as the user's).

    Examples:
        >>> class Guide(flaxlight.TrainerModule):           # doctest: +SKIP
        ...     def load_model(self):
        ...         self.state = GuideTrainState.create(apply_fn=self.model.apply, params=..., tx=...)
        >>> Guide.load_model.flaxlight_takes_in_state       # doctest: +SKIP
        True
    """
    @functools.wraps(load_model)
    def load_model_taking_in_state(self, *args: Any, **kwargs: Any) -> Any:
        before = getattr(self, "state", None)
        result = load_model(self, *args, **kwargs)
        self._take_in_loaded_state(before)
        return result

    load_model_taking_in_state.flaxlight_takes_in_state = True
    return load_model_taking_in_state


def adopt_state(state: Any, before: Any, where: str, say: Callable[[str], None]) -> Any:
    """``state`` (set by ``where``) as a :class:`~flaxlight.TrainState`: one already, as it is; a Flax
    ``flax.training.train_state.TrainState`` whose fields flaxlight's has too (the UvA guide's, with
    ``batch_stats`` and ``rng``), rebuilt as one by ``TrainState.create`` (its optimizer state kept
    when it fits the rebuilt one's; the fields it lacks, ``epoch`` and ``metrics``, from ``before``), which ``say``
    tells; anything else is a ``TypeError`` saying what to build.

    Examples:
        >>> state = flaxlight.TrainState.create(apply_fn=f, params=p, tx=tx)   # doctest: +SKIP
        >>> adopt_state(state, None, "MyTrainer.init_optimizer", print) is state   # doctest: +SKIP
        True
    """
    if isinstance(state, TrainState):
        return state
    from flax.training import train_state as flax_train_state

    kind = f"{type(state).__module__}.{type(state).__qualname__}"
    known = {field.name for field in dataclasses.fields(TrainState)}
    extra = sorted({field.name for field in dataclasses.fields(state)} - known) \
        if isinstance(state, flax_train_state.TrainState) else None
    if extra == []:
        names = ("batch_stats", "rng", "epoch", "metrics")  # a Flax TrainState may lack them
        fields = {name: getattr(state, name) for name in names if hasattr(state, name)}
        kept = {name: getattr(before, name) for name in names if before is not None and name not in fields}
        say(f"{where} set self.state to a {kind} (a Flax TrainState): it is rebuilt as a flaxlight.TrainState with "
            f"its fields and its optimizer state ({', '.join(sorted(kept)) or 'nothing'} kept from the "
            f"state before), as flaxlight's loop keeps the epoch in the state. Build flaxlight.TrainState.create(...) "
            f"there to skip this.")
        adopted = TrainState.create(apply_fn=state.apply_fn, params=state.params, tx=state.tx, step=state.step,
                                    **{**kept, **fields})
        if state.opt_state is not None and \
                jax.tree.structure(state.opt_state) == jax.tree.structure(adopted.opt_state):  # a restored one: kept
            adopted = adopted.replace(opt_state=state.opt_state)
        return adopted
    why = (f"its fields {extra} are not a flaxlight.TrainState's, and would be lost" if extra else
           "it is not a Flax TrainState")
    raise TypeError(f"{where} set self.state to a {kind}: flaxlight's loop needs a flaxlight.TrainState (or a "
                    f"subclass), which keeps the epoch, batch_stats and rng in the state, and {why}. Build it with "
                    f"flaxlight.TrainState.create(apply_fn=self.state.apply_fn, params=self.state.params, "
                    f"tx=optimizer, batch_stats=self.state.batch_stats, rng=self.state.rng), or "
                    f"self.state.with_optimizer(optimizer) "
                    f"(every field kept); for fields of your own, subclass it: class MyState(flaxlight.TrainState): "
                    f"ema: Any = None.")


def refuse_deleted_arrays(state: Any, where: str) -> None:
    """A clear error when ``state`` holds JAX arrays that were deleted, naming them: ``train_model``
    donates its trainer's state to the jitted step, so arrays one trainer's state shares with
    another's (layers put into a new trainer's state, docs/models.md "A new head") are gone once
    either trains. Cheap (``is_deleted()`` per leaf); paths are found only when one is deleted.

    Examples:
        >>> refuse_deleted_arrays(trainer.state, "MyTrainer.predict")   # doctest: +SKIP
    """
    if not any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(state)):
        return
    paths = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)
             if isinstance(leaf, jax.Array) and leaf.is_deleted()]
    named = ", ".join(f"state{jax.tree_util.keystr(path)} ({leaf.dtype}{list(leaf.shape)})" for path, leaf in paths[:4])
    more = f" and {len(paths) - 4} more" if len(paths) > 4 else ""
    layer = f"source.state{jax.tree_util.keystr(paths[0][0][:2])}"  # e.g. source.state.params['Dense_0']
    raise RuntimeError(
        f"{where}: {len(paths)} array(s) of the trainer's state were deleted: {named}{more}. JAX deletes an array "
        f"that a jitted step was given to reuse (donated): train_model donates its trainer's state, so arrays that two "
        f"trainers' states share (layers put into a new trainer's state from another's, as in docs/models.md \"A new "
        f"head\") are gone once either of them trains. Load the run they came from again (load_from_checkpoint), and "
        f"copy them when putting them into another trainer's state, jax.tree.map(jnp.copy, {layer}), so that "
        f"training one leaves the other intact.")


def is_flaxlights_own(method: Callable) -> bool:
    """Whether ``method`` is flaxlight's own (inherited, not the user's override).

    Examples:
        >>> import flaxlight
        >>> is_flaxlights_own(flaxlight.TrainerModule.loss_fn), is_flaxlights_own(print)
        (True, False)
    """
    module = getattr(method, "__module__", "") or ""
    return module == "flaxlight" or module.startswith("flaxlight.")


def _unlogged_monitor(owner: str, monitor: str, known: Mapping[str, float]) -> str:
    """The refusal, before training, of a callback's ``monitor`` that no validation logs."""
    close = difflib.get_close_matches(monitor, list(known), n=1, cutoff=0.6)
    fix = f"Did you mean {close[0]!r}? Pass {owner}(monitor={close[0]!r})." if close else \
        f"Pass {owner}(monitor='val/<name>') with one of them."
    return (f"{owner} monitors {monitor!r}, which no validation of this run logs: it is not among the eval step's "
            f"metrics {sorted(known)}, and nothing of yours runs during a validation to log it. {fix}")
