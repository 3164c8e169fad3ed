"""``TrainerModule``: the training loop of the UvA "Research Projects with JAX" guide, kept fast.

Override :meth:`TrainerModule.loss_fn` (the trainer builds the steps) or ``create_functions``
(the seed's way). The seed's methods are the seams the loop calls (``save_model``, ``load_model``,
``is_new_model_better``, ``init_logger``); the performance machinery is in :mod:`flaxlight.engine`.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax

from flaxlight import distributed as dist
from flaxlight import optim, resume, runfiles
from flaxlight.callbacks import Callback, FitResult, NaNGuard, one_best, start_fresh, with_default_callbacks
from flaxlight.data import (REQUIRED, FirstBatches, as_input_list, checked_loader, fit_loaders, no_batches_error,
                            refuse_unknown_keywords)
from flaxlight.engine import Engine, Span, check_step_pair
from flaxlight.loggers import LoggerCollection
from flaxlight.loop import (BatchLimits, EventSchedule, Interrupted, LoopState, NonfiniteTally, RunPlan, SignalGuard,
                            epoch_stop, epoch_validation_due, safe_len, step_validation_due, warn_if_loader_ran_short)
from flaxlight.messages import logger as messages
from flaxlight.metrics import batch_size, read_means, to_host
from flaxlight.models import make_adapter
from flaxlight.options import TrainerOptions, check_trainer_arguments
from flaxlight.resume import ResumeTarget
from flaxlight.state import TrainState
from flaxlight.step import TrainStep, step_owner
from flaxlight.verbs import TrainerVerbsMixin
from flaxlight.view import TrainerViewMixin

__all__ = ["TrainerModule", "TrainerOptions"]


class TrainerModule(TrainerViewMixin, TrainerVerbsMixin):
    """The trainer: owns the loop, logging, checkpoints and the best model.

    Example (only the loss is written; the trainer builds the steps):

        >>> class Regressor(TrainerModule):
        ...     def loss_fn(self, params, batch, *, train, rng, state):
        ...         x, y = batch
        ...         pred, updates = state.apply_model(params, x, train=train, rng=rng)
        ...         return ((pred - y) ** 2).mean(), ({}, updates)
        >>> trainer = Regressor(model_class=MLP, model_hparams={"hidden_dims": [64]},   # doctest: +SKIP
        ...                     optimizer_hparams={"optimizer": "adam", "lr": 1e-3}, exmp_input=x[:1])
        >>> metrics = trainer.train_model(train_loader, val_loader, num_epochs=10)      # doctest: +SKIP
    """

    def __init__(self, model_class: type, model_hparams: Mapping[str, Any], optimizer_hparams: Mapping[str, Any] | Any,
                 exmp_input: Any, seed: int = 42, logger_params: Mapping[str, Any] | None = None,
                 enable_progress_bar: bool = True, debug: bool = False, check_val_every_n_epoch: int | None = 1,
                 **kwargs: Any):
        mesh, callbacks, loggers = kwargs.pop("mesh", None), kwargs.pop("callbacks", None), kwargs.pop("loggers", None)
        check_trainer_arguments(model_hparams=model_hparams, enable_progress_bar=enable_progress_bar, debug=debug,
                                callbacks=callbacks, loggers=loggers, check_val_every_n_epoch=check_val_every_n_epoch)
        callbacks, self._user_loggers = list(callbacks or []), list(loggers or [])  # loggers: checked by init_logger
        self.options, self.extra_hparams = TrainerOptions.split_kwargs(kwargs, trainer_class=type(self))
        self.model_class, self.model_hparams = model_class, dict(model_hparams or {})
        self.optimizer_hparams, self.seed, self.exmp_input = optim.own_copy(optimizer_hparams), seed, exmp_input
        self.enable_progress_bar, self.debug, self.check_val_every_n_epoch = enable_progress_bar, debug, check_val_every_n_epoch
        self.config = {"model_class": runfiles.class_path(model_class), "model_hparams": self.model_hparams,
                       "optimizer_hparams": optim.recorded_optimizer(optimizer_hparams),
                       "logger_params": dict(logger_params or {}), **dist.mesh_record(mesh),
                       "enable_progress_bar": enable_progress_bar, "debug": debug,
                       "check_val_every_n_epoch": check_val_every_n_epoch, "seed": seed, **kwargs}
        self._start_fresh_run_state()
        self.callbacks: list[Callback] = with_default_callbacks(callbacks, self.options, enable_progress_bar)
        rule = type(self).is_new_model_better  # the one the loop asks: another than ours is a rule of the user's
        self.options, self._checkpoint_callback = one_best(  # one meaning of "best"
            self.options, self.callbacks, own_rule=None if rule is TrainerModule.is_new_model_better else rule.__qualname__)
        runfiles.enable_compilation_cache(self.options.compilation_cache)
        self.mesh = dist.mesh_for(mesh, self.options.distributed)
        self.model_adapter = make_adapter(self.model_class, self.model_hparams, seed=seed)
        if self.options.enable_model_summary:
            self.print_tabulate(exmp_input)
        self._set_up_run_files(logger_params)  # the UvA guide's order: overrides below may use log_dir, logger
        self.engine: Engine | None = None
        self.create_jitted_functions()
        if self.engine is None:  # an override that set only the seed's self.train_step / self.eval_step
            seed_steps = getattr(self, "train_step", None), getattr(self, "eval_step", None)
            self.engine = self._make_engine(*check_step_pair(seed_steps, f"{type(self).__name__}.create_jitted_"
                                                             f"functions() must set self.train_step, self.eval_step:"))
        self.init_model(exmp_input)  # the model called on exmp_input: one that does not fit it fails here
        self._place_state()  # on a mesh from the start: eval_model / test before training use it too

    def _start_fresh_run_state(self) -> None:
        self.global_step, self._hparams_written, self._step_owner = 0, False, None
        self._start_step = 0  # the model's step the run began at (a resume's: its run's): max_steps counts from 0
        self.should_stop, self.stop_reason, self.callback_metrics = False, None, {}
        self.batch_size = self.num_epochs = self.steps_per_epoch = self.optimizer_plan = self.distributed_mode = None
        self._limits = BatchLimits.from_options(self.options)
        self._loop, self._schedule, self._nonfinite = LoopState(), EventSchedule(), NonfiniteTally()
        self._best_eval_metrics, self._is_best, self._val_loader, self._unsaved = None, False, None, None  # _unsaved: why
        self._trained_here, self._wrote_here, self._run_lock, self._loaded = False, False, None, False
        self._loaded_from, self._in_run = None, False  # _loaded_from: the loaded run, when logging to another folder
        self._loader_batch_size = None  # train_epoch's loader's batch_size: a first batch smaller is also its last

    def _set_up_run_files(self, logger_params: Mapping[str, Any] | None) -> None:
        """The run's folder and loggers (``init_logger``); none in ``fast_dev_run``."""
        runfiles.check_shared_log_dir(logger_params, self.options.fast_dev_run)
        if self.options.fast_dev_run:  # a smoke test writes nothing: no log dir, loggers or checkpoints
            self.log_dir, self.logger, self.checkpointer = runfiles.no_run_files()
            self._hparams_written = True
            return
        self.init_logger(logger_params)
        if not dist.is_main_process():  # only process 0 logs and writes files; all take part in checkpoints
            self.logger, self._hparams_written = LoggerCollection([]), True

    # ------------------------------------------------------------------ model and optimizer
    def init_model(self, exmp_input: Any) -> None:
        """Initialise parameters (and batch stats) from ``exmp_input``; no optimizer yet."""
        model_rng, init_rng = jax.random.split(jax.random.PRNGKey(self.seed))
        variables = self._init_variables(as_input_list(exmp_input), init_rng)  # run_model_init; its inputs noted
        params, self.param_annotations = dist.split_annotations(variables["params"], self.model_adapter.annotations)
        self.state = TrainState.create(apply_fn=self.model_adapter.apply, params=params,
                                       batch_stats=variables.get("batch_stats"), rng=model_rng, tx=None)

    def run_model_init(self, exmp_input: Sequence[Any], init_rng) -> dict:
        """Initial variables (``params``, maybe ``batch_stats``) in training mode: Linen's
        ``model.init`` (jitted unless ``debug=True``); NNX: the state the module was built with."""
        init = self.model_adapter.init
        if self.debug or self.model_adapter.kind == "nnx":
            return init(init_rng, exmp_input)
        return jax.jit(init)(init_rng, exmp_input)

    def print_tabulate(self, exmp_input: Any) -> None:
        """Print the model's layers, shapes and parameter counts, and the optimizer in effect."""
        print(f"{self.model_adapter.tabulate(as_input_list(exmp_input))}\nOptimizer: "
              f"{optim.describe_optimizer(self.optimizer_hparams)}")

    def init_optimizer(self, num_epochs: int, num_steps_per_epoch: int) -> None:
        """Build the optimizer for ``num_epochs * num_steps_per_epoch`` train steps (epochs of
        ``self.steps_per_epoch`` batches, where a partial accumulation group is applied); keep params.
        ``self.optimizer_plan`` keeps what was built (schedule, weight decay in effect)."""
        plan = optim.make_optimizer_plan(self.optimizer_hparams, total_steps=num_epochs * num_steps_per_epoch,
                                         first_step=self.global_step, earlier=self._earlier_epochs,  # a resume's
                                         epoch_length=self.steps_per_epoch or num_steps_per_epoch)
        optim.warn_settings_outside_step(type(self).__name__, plan, self._step_owner)
        self.optimizer_plan, self.state = plan, self.state.with_optimizer(plan.tx)  # a TrainState subclass kept

    # ------------------------------------------------------------------ steps
    def loss_fn(self, params, batch, *, train: bool, rng, state: TrainState):
        """Override to return ``(loss, metrics)`` or ``(loss, (metrics, updates))``; ``updates``: the
        changed model collections ``state.apply_model(params, x, train=train, rng=rng)`` returns."""
        raise NotImplementedError(f"{type(self).__name__} must override loss_fn(params, batch, *, train, rng, state) "
                                  f"or create_functions() returning (train_step, eval_step).")

    def create_functions(self) -> tuple[Callable, Callable]:
        """Return ``(train_step, eval_step)``: ``(state, batch) -> (state, metrics)`` and
        ``(state, batch) -> metrics``. The default builds both from :meth:`loss_fn`."""
        if type(self).loss_fn is TrainerModule.loss_fn:
            self.loss_fn(None, None, train=True, rng=None, state=None)  # raises the explanation
        config = optim.as_optimizer_config(self.optimizer_hparams)  # the step's part: L2 term, precision, frozen
        step = TrainStep(self.loss_fn, log_grad_norm=self.options.log_grad_norm, **optim.step_options(config))
        return step.step, step.eval_step

    def create_jitted_functions(self) -> None:
        """Build the loop's :class:`~flaxlight.engine.Engine` from :meth:`create_functions` (jitted
        once, state donated; ``debug=True``: un-jitted). ``self.train_step`` / ``self.eval_step``
        are the jitted single steps. An override may set just those two; the loop then runs them."""
        steps = check_step_pair(self.create_functions(), f"{type(self).__name__}.create_functions() must return")
        if self.options.log_grad_norm and not getattr(step_owner(steps[0]), "log_grad_norm", False):
            raise ValueError(f"log_grad_norm=True needs flaxlight's train step; {type(self).__name__}.create_functions returns"
                             f" another: add optax.tree.norm(grads) as metric 'grad_norm', or wrap super().create_functions().")
        self.engine = self._make_engine(*steps)
        self.train_step, self.eval_step = self.engine.train_step, self.engine.eval_step

    def _make_engine(self, train_step: Callable, eval_step: Callable) -> Engine:
        self._step_owner = step_owner(train_step)  # what its TrainStep applies (the L2 penalty, bf16)
        if self.debug:
            messages.info("debug=True: the train and eval steps run un-jitted (prints and breakpoints work).")
        return Engine(*self._watched_steps(train_step, eval_step), steps_per_execution=self.options.steps_per_execution,
                      nonfinite_guard=self._nonfinite_guard(), prefetch=self.options.prefetch, debug=self.debug, limit_train_batches=self.options.limit_train_batches)

    def _nonfinite_guard(self) -> str | None:
        return next((cb.action for cb in self.callbacks if isinstance(cb, NaNGuard)), None)

    def _place_state(self) -> None:
        """On a mesh: shard (or replicate) the state and re-jit the loop to match."""
        if self.mesh is not None:
            self.state, self.distributed_mode = self.engine.distribute(
                self.state, self.mesh, self.options.distributed, getattr(self, "param_annotations", None),
                self.options.sharding_rules)

    # ------------------------------------------------------------------ the loop
    def train_model(self, train_loader: Iterable = REQUIRED, val_loader: Iterable | None = None, test_loader: Iterable | None = None,
                    num_epochs: int = 500, steps_per_epoch: int | None = None, resume: bool = False,
                    resume_from: str | os.PathLike | None = None, overwrite: bool = False,
                    batch_size: int | None = None, **unknown: Any) -> dict[str, float]:
        """Train ``num_epochs``, validate every ``check_val_every_n_epoch``, keep the best model.

        Returns the best validation metrics merged with the train metrics of the last epoch finished by then (for a
        validation within an epoch: the epoch before; none in the first) and, when a ``test_loader`` is given, the
        best model's ``test/...`` metrics (its checkpoint restored for the test only: the trainer stays as training left
        it, and a next call goes on after this one's last step); its ``.history`` is :attr:`history`. Loaders may be
        arrays instead: ``train_model((x, y), (xv, yv), batch_size=64)`` (training arrays shuffled by the seed, see
        :func:`flaxlight.data.fit_loaders`). ``train_loader`` must be given: without it (Keras' ``x=``, Lightning's ``datamodule=``) a ``TypeError`` says what to write.

        ``resume=True`` continues from the newest readable checkpoint in this run's log dir; ``resume_from`` names a
        run dir, its ``checkpoints`` dir or a ``checkpoints/<step>`` dir (another run's: continued as a copy in a new
        ``log_dir``; an older one of this run's: a rewind, :func:`flaxlight.resume.set_aside_branch`). A resumed run
        ends as an uninterrupted one when the data order is a pure function of the epoch (:class:`ArrayLoader`, or
        ``set_epoch``). SIGTERM/SIGINT finish the step, save and exit (SIGINT in an interactive session: save and raise
        ``KeyboardInterrupt``). A ``log_dir`` holding a run is an error unless that run is resumed or ``overwrite=True``."""
        refuse_unknown_keywords(self, "train_model", unknown, train_loader=train_loader)  # epochs=, x=, datamodule=, none
        train_loader, val_loader, test_loader = fit_loaders(train_loader, val_loader, test_loader, batch_size,
                                                            seed=self.seed)
        target = self._resume_target(resume, resume_from, overwrite)  # the run folder's checkpoints as they are now
        num_epochs = self._prepare_run(train_loader, val_loader, num_epochs, steps_per_epoch, target)
        if (done := self._nothing_to_train(target, num_epochs, test_loader)) is not None:  # as the CLI: nothing written
            return done
        self._check_test_loader(test_loader)  # an empty one, or no way to restore the best model: refused now
        self.engine.compile_eval_ahead(self.state, val_loader, check=self._val_batch_check())  # a bad one writes nothing
        self._claim_run_folder(continuing=target.continuing, overwrite=overwrite, replaces=target.replaces)
        try:  # from here on, the run's folder is locked: every exit releases it
            self._settle_global_step(self._resume(target, train_loader) if target.resumes else None)  # batches
            self._train_loader, self._val_loader = train_loader, val_loader
            self._write_hparams()
            with SignalGuard(self._schedule) as guard:
                self.on_training_start()
                self._call_callbacks("on_fit_start")
                for epoch_idx in range(self._loop.epoch, num_epochs + 1):
                    if self._stopping():
                        break
                    self._run_epoch(epoch_idx, train_loader, val_loader)
                self._announce_stop()
                best_eval_metrics = dict(self._best_eval_metrics or self._loop.train_metrics)
                if test_loader is not None:
                    best_eval_metrics.update(self._test(test_loader))
                self.on_training_end()
                self._call_callbacks("on_fit_end")
        except Interrupted as interrupt:
            self._save_on_interrupt(interrupt)
        except BaseException as exc:
            self._end_failed_run(exc, "failed")
            raise
        self._finish_files("success", best=best_eval_metrics)
        guard.exit_if_received()  # a Ctrl-C during the final test or on_fit_end: the run is complete; stop
        return FitResult(best_eval_metrics, history=self.history)

    def _prepare_run(self, train_loader, val_loader, num_epochs: int, steps_per_epoch: int | None,
                     target: ResumeTarget) -> int:
        """Check the run's length, build the optimizer for it, start a fresh loop state."""
        self._start_step = start = self._run_start(target)  # a call again on a trained trainer: said
        plan = RunPlan.make(train_loader, val_loader, num_epochs=num_epochs, steps_per_epoch=steps_per_epoch,
                            check_val_every_n_epoch=self.check_val_every_n_epoch, limits=self._limits,
                            val_check_interval=self.options.val_check_interval, max_steps=self.options.max_steps,
                            start_step=start, so_far=target.so_far(self.checkpointer))
        self.num_epochs, self.steps_per_epoch, self._earlier_epochs = plan.num_epochs, plan.steps_per_epoch, plan.earlier
        dist.check_loader_divisible(train_loader, self.mesh)  # before the run's folder is claimed
        self._build_optimizer(plan.schedule_epochs, plan.schedule_steps_per_epoch)  # init_optimizer; its state checked
        self._settle_optimizer_plan(start, plan.steps_per_epoch)
        self._place_state()
        self._loop = LoopState.fresh(self.state)  # its data order goes on from state.epoch; the run's best stays its best
        self.should_stop, self.stop_reason = False, None
        start_fresh(self.callbacks, validates=val_loader is not None)  # a resume then restores the run's states
        return plan.num_epochs

    def _run_epoch(self, epoch_idx: int, train_loader, val_loader) -> None:
        """Train one epoch (or its rest, after a resume), validate when due, run the epoch hooks."""
        loop = self._loop
        loop.epoch = epoch_idx
        if loop.phase != "val":  # "val": resumed after this epoch's training, before its validation
            resume.set_loader_epoch(train_loader, loop.model_epoch)  # epochs of earlier calls too
            self._call_callbacks("on_train_epoch_start", epoch_idx)
            if self._stopping() and loop.phase != "train":  # stop() before the epoch's first batch: no epoch
                loop.epoch = epoch_idx - 1
                return
            loop.train_metrics = self.train_epoch(train_loader)
            self.state = self.state.replace(epoch=self.engine.device_scalar(loop.model_epoch))
            if not self._validation_due(val_loader, epoch_idx):  # else the validation starts it, its steps queued
                self.engine.start_epoch_ahead()  # the next epoch's device data, while this one ends
            self._end_train_epoch(epoch_idx, loop.train_metrics)  # what its hooks log joins the history row
        if self._validation_due(val_loader, epoch_idx):
            self._validate(val_loader)
        loop.phase = "epoch_end"
        self._end_epoch(epoch_idx)
        getattr(self.logger, "flush_soon", self.logger.flush)()  # written behind the epoch's records

    def _validation_due(self, val_loader, epoch_idx: int) -> bool:
        """Whether the epoch's validation is still to run (given, due this epoch, not run yet)."""
        return val_loader is not None and not self._loop.validated and epoch_validation_due(
            epoch_idx, self.check_val_every_n_epoch, self._limits)

    def _validate(self, val_loader) -> None:
        """Evaluate, ask ``is_new_model_better`` once, tell hooks and callbacks (once per step)."""
        loop = self._loop
        if loop.validated_step == self.global_step:  # e.g. max_steps ended the epoch on an interval step
            loop.validated = loop.validated or loop.phase == "val"
            return
        loop.validated_step = self.global_step
        self._log_running(loop.running_log.flush())  # the train points before it first, as an interrupt here writes them
        if self._limits.val is not None:
            val_loader = FirstBatches(val_loader, self._limits.val_batches(safe_len(val_loader)))
        eval_metrics = self.eval_model(val_loader, log_prefix="val/")
        self._begin_validation_records()  # what hooks and callbacks log from here on may rank the best model
        self.on_validation_epoch_end(loop.epoch, eval_metrics, val_loader)
        self._log({**eval_metrics, "epoch": loop.epoch})
        self._choose_best(eval_metrics)  # is_new_model_better, now or (a monitor a callback logs) once logged
        loop.validated = loop.phase == "val"  # an epoch's validation: a checkpoint from now on says it ran
        self._end_validation(loop.epoch, eval_metrics,  # its file and history row: with what callbacks log
                             f"eval_epoch_{loop.model_epoch:03d}" if loop.phase != "train" else f"eval_step_{self.global_step}")

    def train_epoch(self, train_loader: Iterable) -> dict[str, float]:
        """One pass over ``train_loader``; returns ``train/...`` means and ``epoch_time``.

        Metrics are summed on the device; the only reads are asynchronous copies at log points and one read
        at the end of the epoch. After a resume mid-epoch, the batches already trained on are skipped (a
        grain / torchdata loader continues from its saved position) and the epoch's sums continue from the
        checkpoint. It ends early at ``limit_train_batches``, ``max_steps`` (exactly) or :meth:`stop`."""
        start, loop = time.time(), self._loop
        if loop.phase != "train":  # a fresh epoch (not the rest of one interrupted mid-way)
            loop.start_epoch()
            self._nonfinite.start_epoch(loop.epoch, self.global_step)
        self._run_owed_events()  # resumed from an interrupt that came before its step's events (they may stop)
        length = self.steps_per_epoch if self.steps_per_epoch is not None else safe_len(train_loader)
        stop = loop.batch_index if self._stopping() else epoch_stop(length, loop.batch_index, self.global_step,
                                                                     self.options.max_steps)
        self._plan_events()
        if stop is not None:
            self.engine.learning_rates.prepare(self.optimizer_plan, self.global_step, stop - loop.batch_index)
        span = Span(self.state, loop.acc, self.global_step, loop.batch_index)
        self._loader_batch_size = getattr(train_loader, "batch_size", None) if length == 1 else None  # its only batch
        try:
            self.engine.train(train_loader, span, stop=stop, schedule=self._schedule, on_event=self._on_event,
                              start_sums=self._start_epoch_sums, epoch_length=length, epoch=loop.model_epoch,
                              more_epochs=lambda: not (loop.epoch == self.num_epochs or self._stopping()),
                              position=loop.take_loader_position(), skip=loop.take_stream_skip())
        except BaseException:
            self._take(span)
            self._log_notes(failing=True)
            raise
        self._take(span)
        self._log_notes()
        if loop.acc is None:
            raise no_batches_error("train_loader", train_loader, self.engine.served_before(train_loader))
        if not (self._stopping() or self._schedule.interrupt_signal is not None or self.options.fast_dev_run):
            warn_if_loader_ran_short(loop, stop, self.global_step, self.options.max_steps, self.num_epochs, train_loader)
        self._log_running(loop.running_log.flush())
        loop.cut = length is not None and loop.batch_index < length and self._stopping()  # a longer run continues it
        loop.phase, (host, updates) = "val", to_host((loop.acc, self.state.step))  # the epoch's one read
        self._end_epoch_count(int(host["totals"].nonfinite), int(updates))  # also: updates per batch
        return {**read_means(host, prefix="train/"), "epoch_time": time.time() - start}

    def _start_epoch_sums(self, batch) -> dict:
        """Check the epoch's first batch and return zeroed metric sums for its structure."""
        self._check_first_batch(batch, "train_loader")
        self.batch_size = batch_size(batch)
        if self.mesh is not None:  # its examples: a leaf that is not per-example may be the first
            dist.check_batch_divisible(dist.example_count(batch)[0] or self.batch_size, self.mesh,
                                       self._loader_batch_size)
        return self.engine.zero_sums("train", self.state, batch)

    def _take(self, span: Span) -> None:
        self.state, self.global_step = span.state, span.step
        self._loop.acc, self._loop.batch_index = span.acc, span.batches

    def _on_event(self, span: Span, steps: int) -> bool:
        """Log points, ``on_step`` callbacks, step validations and interrupts, off the fast path.
        ``steps``: updates since the last event check (a fused block's intervals fire at its
        end). Returns True when the epoch must end now (``max_steps`` or :meth:`stop`)."""
        self._take(span)
        step, loop, schedule = self.global_step, self._loop, self._schedule
        self._log_notes(before=step)  # the points noted since the last stop, before this step's events
        val_due = schedule.due(self.options.val_check_interval, step, steps) and self._val_loader is not None and (
            step_validation_due(loop.epoch, loop.batch_index, self.steps_per_epoch, self.check_val_every_n_epoch,
                                self._limits))
        loop.owed_events, loop.owed_steps = [name for name, due in (
            ("log", schedule.due(self.options.log_every_n_steps, step, steps)), ("val", val_due),
            ("callbacks", any(schedule.due(cb.every_n_steps, step, steps) for cb in self.callbacks))) if due], steps
        schedule.raise_if_interrupted()  # the checkpoint owes this step's events: a resume runs them first
        self._run_owed_events()
        schedule.raise_if_interrupted()  # arrived while the callbacks ran
        self._plan_events()
        span.state = self.state
        return self._stopping()

    def _run_owed_events(self) -> None:
        """Run the current step's events not run yet (each leaves the list as it starts; an
        interrupted validation goes back, so the interrupt's checkpoint owes it)."""
        loop, step = self._loop, self.global_step
        while loop.owed_events:
            event = loop.owed_events.pop(0)
            if event == "log":
                if loop.running_log.would_wait():  # the host's put-off work first: queued steps overlap it
                    self.engine.work_before_waiting()
                self._log_running(loop.running_log.mark(step, loop.acc, at=self._schedule.noted_at(step)))
            elif event == "callbacks":
                for callback in self.callbacks:
                    if self._schedule.due(callback.every_n_steps, step, loop.owed_steps):
                        callback.on_step(self, step)
            else:
                try:
                    self._validate(self._val_loader)
                except Interrupted:
                    loop.owed_events.insert(0, "val")
                    loop.validated_step = None
                    raise

    def eval_model(self, data_loader: Iterable = REQUIRED, log_prefix: str = "", *, batch_size: int | None = None, **unknown: Any) -> dict[str, float]:
        """Evaluate on ``data_loader`` (or arrays with ``batch_size``): per-example means keyed ``log_prefix + name``."""
        data_loader = checked_loader(self, "eval_model", data_loader, batch_size, unknown, name="data_loader")
        acc = self.engine.evaluate(self._live_state(), data_loader, after_batch=self._schedule.raise_if_interrupted,
                                   on_first_batch=lambda batch: self._check_first_batch(batch, "the evaluation loader"))
        if acc is None:
            raise no_batches_error(f"The evaluation loader ({log_prefix or 'eval'})", data_loader,
                                   self.engine.served_before(data_loader))
        return read_means(acc, prefix=log_prefix)

    def is_new_model_better(self, new_metrics: Mapping[str, float], old_metrics: Mapping[str, float] | None) -> bool:
        """True when ``new_metrics`` beat ``old_metrics`` on ``monitor`` (or the seed's priority).
        Asked once per validation; a NaN ranks as the worst; the answer ranks ``ModelCheckpoint(monitor=None)``."""
        self._announce_monitor(new_metrics)  # said once; a NaN monitored value (the worst) warned of once
        return self.options.is_better(new_metrics, old_metrics)

    # ------------------------------------------------------------------ hooks (no-ops)
    def on_training_start(self) -> None:
        """Called once before the first training epoch."""

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        """Called after each training epoch."""

    def on_validation_epoch_end(self, epoch_idx: int, eval_metrics: dict, val_loader: Iterable) -> None:
        """Called after each validation, with its metrics."""

    def on_training_end(self) -> None:
        """Called once after training (and testing) finished."""

    # ------------------------------------------------------------------ logging and files
    def init_logger(self, logger_params: Mapping[str, Any] | None = None) -> None:
        """Pick the log dir (``base_log_dir/<Model>/version_N`` unless ``log_dir``), the loggers and the checkpoint
        folder. Keys: see :class:`flaxlight.runfiles.LoggerParams` and docs/logging.md; ``loggers`` adds logger
        objects (as the trainer's ``loggers=[...]``). A :class:`CSVLogger` (``metrics.csv``) is always kept."""
        self.log_dir, self.logger, self.checkpointer = runfiles.open_run(logger_params, self.model_class.__name__,
                                                                         self._user_loggers)

    def _write_hparams(self) -> None:
        if not self._hparams_written:
            self.logger.log_hyperparams(runfiles.write_hparams(self.log_dir, self.config, self._loop.resumed_from))
            self._hparams_written = True

    # ------------------------------------------------------------------ checkpoints and resume
    def save_model(self, step: int | None = None) -> None:
        """Checkpoint everything needed to continue (state, loop position, callbacks, log history) as step ``step``
        (default: now). :class:`ModelCheckpoint` decides when; the arrays are copied off the device before this
        returns and written in the background; a non-finite state is not saved (a warning says why). An override
        not calling it saves its own way, at new best models only, as the UvA guide's (:attr:`own_checkpoints`)."""
        step, self._saved_by_flaxlight = (self.global_step if step is None else int(step)), True
        snapshot = self.checkpointer.snapshot(self.state)  # one dispatch: the arrays to write, and a NaN/Inf check
        self._unsaved = self._nonfinite.damage(self._loop, self.state, self._nonfinite_guard(), step, snapshot.finite)
        if self._unsaved:  # an interrupt's message says it again
            warnings.warn(f"Not saving checkpoint {step}: {self._unsaved}; the earlier checkpoints are kept.",
                          RuntimeWarning, stacklevel=2)
            return
        self._write_hparams()
        self._log_running(self._loop.running_log.flush())  # the log history up to `step` is on disk first
        records, chosen = self._start_records_flush(), self._checkpoint_callback  # the writer waits for the records
        meta = resume.CheckpointMeta.capture(step, self._loop, callbacks=self.callbacks,
                                             best_step=chosen.best_step if chosen else None,
                                             loader_position=self.engine.loader_position(),
                                             best_eval_metrics=self._best_eval_metrics, num_epochs=self.num_epochs,
                                             steps_per_epoch=self.steps_per_epoch, schedule_steps=self._schedule_steps,
                                             start_step=self._start_step, earlier_epochs=self._earlier_epochs,
                                             block_length=self.engine.chosen_block_length(),
                                             nonfinite=self._nonfinite.state_dict())
        self.checkpointer.save(step, snapshot, meta=meta.to_json(), metrics=chosen.score_of(step) if chosen else None,
                               before_write=records)

    def load_model(self, step: int | None = None) -> None:
        """Restore a checkpoint into ``self.state``: ``step``, else the best, else the newest; outside
        ``train_model``, ``global_step`` too (inside, e.g. from a callback, the run's step count goes on). An
        override may drop ``step`` (the UvA guide's ``load_model(self)``: the best only), see docs/from-uva.md."""
        self._restore_checkpoint(step)

    def _resume(self, target: ResumeTarget, train_loader) -> int | None:
        """Continue from a checkpoint (:func:`flaxlight.resume.restore_run`): state, loop, best, callbacks, loggers.
        Returns the checkpoint's step (None: none to resume from), the batches trained: ``global_step``."""
        restored = resume.restore_run(self.checkpointer, target.resume_from, self.state, load=self._load_for_resume,
                                      train_loader=train_loader, schedule_steps=self._fitted_schedule_steps,
                                      loaded_from=self._loaded_from, steps_per_epoch=self.steps_per_epoch)
        if restored is None:  # no checkpoint yet: a fine-tune goes on from its loaded model's step
            return self._go_on_from_the_loaded_model(target)
        self.state, meta, step = restored
        target.begin(meta, self.checkpointer, self.log_dir)  # a rewind sets the later branch aside
        self._loop, self._best_eval_metrics = meta.loop_state(self.steps_per_epoch, like=self.state), meta.best_eval_metrics
        meta.restore_callbacks(self.callbacks)
        self.engine.adopt_block_length(meta.block_length)
        self._nonfinite.load_state_dict(meta.nonfinite, step)
        self.logger.resume_from_step(step)
        return step

    def _finish_files(self, status: str, best: dict | None = None) -> None:
        self._in_run = False  # every end of train_model comes here
        runfiles.finish_run(status, self.checkpointer, self.logger, self._run_lock, before=self._end_background_work,
                            best=(best, self.global_step) if best else None)
