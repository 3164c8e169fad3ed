"""``TrainerModule``: the training loop of the UvA "Research Projects with JAX" guide, kept fast.

Subclass it and either override :meth:`TrainerModule.loss_fn` (the common way: the trainer builds
the train and eval steps) or :meth:`TrainerModule.create_functions` (full control, the seed's way).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import importlib
import inspect
import itertools
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import NamedSharding, PartitionSpec

from flaxlight import distributed as dist
from flaxlight.callbacks import Callback, ModelCheckpoint, NaNGuard, ProgressBar, Timer
from flaxlight.checkpoint import Checkpointer
from flaxlight.data import (ArrayLoader, DeviceEpoch, Prefetcher, check_batch, check_input_shapes, group_batches,
                            same_shapes, take_batches)
from flaxlight.lean import LeanLoop
from flaxlight.loggers import CSVLogger, Logger, LoggerCollection, TensorBoardLogger, tensorboard_available
from flaxlight.models import make_adapter
from flaxlight.metrics import (HostSnapshot, accumulate, all_finite, batch_size, fresh_zeros, init_accumulator,
                               read_means, to_host)
from flaxlight.optim import as_optimizer_config, logger as optim_logger, make_optimizer_plan
from flaxlight.progress import progress
from flaxlight.state import TrainState
from flaxlight.step import TrainStep

__all__ = ["TrainerModule", "TrainerOptions"]

_log = logging.getLogger("flaxlight")

HPARAMS_FILE = "hparams.yaml"
CHECKPOINT_DIR = "checkpoints"
LOGGER_TYPES = ("csv", "tensorboard", "wandb", "mlflow")
# The seed's priority for choosing the best model: (metric, higher is better).
DEFAULT_MONITORS = (("val/val_metric", False), ("val/acc", True), ("val/loss", False))


@dataclasses.dataclass
class TrainerOptions:
    """Trainer settings beyond the seed's constructor arguments (pass them as keyword arguments).

    Attributes:
        monitor: metric that picks the best model, e.g. ``"val/acc"``; None uses the seed's
            priority (``val/val_metric`` lower, ``val/acc`` higher, ``val/loss`` lower).
        mode: ``"min"`` or ``"max"`` for ``monitor`` (default ``"min"``, as in Lightning).
        log_every_n_steps: how often running train metrics are logged (values are copied off the
            device asynchronously and logged one log point later, so the loop never waits).
        enable_model_summary: print the model table (``print_tabulate``) at construction.
        enable_checkpointing: add a default :class:`ModelCheckpoint` (``monitor``/``mode`` as
            above, best and last kept) unless one is among the callbacks.
        max_steps: stop after this many optimizer steps (the schedule is fitted to it).
        max_time: stop after this much training time (seconds, ``timedelta`` or
            ``"DD:HH:MM:SS"``), via a :class:`Timer` callback.
        val_check_interval: also validate every N steps, not only at epoch ends.
        limit_train_batches / limit_val_batches: batches per epoch / per validation (an int)
            or a fraction of the loader (a float in (0, 1]).
        fast_dev_run: one train batch and one validation batch, one epoch, nothing written:
            a smoke test of the whole loop.
        steps_per_execution: train steps fused into one dispatch (``lax.scan`` over a stacked
            block of batches); same results as single steps. Log points and ``on_step``
            callbacks fire at block ends (intervals that are multiples of it stay exact).
        prefetch: batches (or blocks) loaded, stacked and put on the device ahead of use by a
            background thread (for loaders whose host work is slow); 0, the default, loads them
            in the training thread, which is faster when a batch is cheap to make (the thread's
            hand-over halved the steps/s of a tiny MLP on a 2-core CPU). An :class:`ArrayLoader`
            on one device needs none: its data live on the device and each epoch is gathered
            there (see :class:`flaxlight.data.DeviceEpoch`).
        compilation_cache: JAX's persistent compilation cache, so a second start-up skips
            compiling: True uses ``$FLAXLIGHT_CACHE_DIR`` or ``~/.cache/flaxlight/jax``, a string
            names the folder, False leaves JAX's settings alone. A cache folder the user already
            configured in JAX is kept.
        distributed: ``"data_parallel"``, ``"fsdp"`` or ``"auto"`` trains on all devices (all
            processes) over a ``jax.sharding.Mesh``; ``mesh=`` gives one explicitly. See
            :mod:`flaxlight.distributed`.
    """

    monitor: str | None = None
    mode: str = "min"
    log_every_n_steps: int = 50
    enable_model_summary: bool = True
    enable_checkpointing: bool = True
    max_steps: int | None = None
    max_time: Any = None
    val_check_interval: int | None = None
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    fast_dev_run: bool = False
    steps_per_execution: int = 1
    prefetch: int = 0
    compilation_cache: bool | str = True
    distributed: str | None = None

    def __post_init__(self):
        if isinstance(self.steps_per_execution, bool) or not isinstance(self.steps_per_execution, int) \
                or self.steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be a positive int, got {self.steps_per_execution!r}.")
        if self.distributed is not None and self.distributed not in dist.MODES:
            raise ValueError(f"distributed must be one of {dist.MODES} or None; got {self.distributed!r}.")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (0: no background loading), got {self.prefetch!r}.")
        for name in ("max_steps", "val_check_interval"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int (or None), got {value!r}.")
        for name in ("limit_train_batches", "limit_val_batches"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                    isinstance(value, float) and value > 1):
                raise ValueError(f"{name} must be a number of batches (int >= 1) or a fraction in (0, 1]; got {value!r}.")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}.")
        if not isinstance(self.log_every_n_steps, int) or self.log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be a positive int, got {self.log_every_n_steps!r}.")


def _as_input_list(exmp_input) -> list:
    return list(exmp_input) if isinstance(exmp_input, (list, tuple)) else [exmp_input]


def _class_path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_class(path: str):
    module_name, _, qualname = path.rpartition(".")
    try:
        obj = sys.modules[module_name] if module_name in sys.modules else importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"Cannot import model class {path!r} named in {HPARAMS_FILE}: {exc}. "
            f"Pass it explicitly: load_from_checkpoint(..., model_class=MyModel)."
        ) from exc
    return obj


def _to_yaml_safe(value):
    """Plain YAML data: tuples become lists, numpy scalars floats/ints, classes their path."""
    if isinstance(value, Mapping):
        return {str(k): _to_yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_yaml_safe(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, type):
        return _class_path(value)
    return repr(value)


def _next_version_dir(base: str) -> str:
    os.makedirs(base, exist_ok=True)
    versions = [
        int(name.split("_", 1)[1])
        for name in os.listdir(base)
        if name.startswith("version_") and name.split("_", 1)[1].isdigit()
    ]
    return os.path.join(base, f"version_{max(versions, default=-1) + 1}")


def _loader_length(loader, name: str) -> int:
    try:
        return len(loader)
    except TypeError:
        raise TypeError(
            f"{name} has no len(), which the learning-rate schedule needs to know the run's length. "
            f"Give it a __len__, or pass steps_per_epoch=N to train_model."
        ) from None


class TrainerModule:
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

    def __init__(
        self,
        model_class: type,
        model_hparams: Mapping[str, Any],
        optimizer_hparams: Mapping[str, Any] | Any,
        exmp_input: Any,
        seed: int = 42,
        logger_params: Mapping[str, Any] | None = None,
        enable_progress_bar: bool = True,
        debug: bool = False,
        check_val_every_n_epoch: int = 1,
        **kwargs: Any,
    ):
        mesh = kwargs.pop("mesh", None)
        callbacks = list(kwargs.pop("callbacks", None) or [])
        for callback in callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks must be flaxlight.Callback instances; got {type(callback).__name__}.")
        self._user_loggers = list(kwargs.pop("loggers", None) or [])
        for user_logger in self._user_loggers:
            if not isinstance(user_logger, Logger):
                raise TypeError(f"loggers must be flaxlight.loggers.Logger instances; got {type(user_logger).__name__}.")
        option_names = {f.name for f in dataclasses.fields(TrainerOptions)}
        self.options = TrainerOptions(**{k: kwargs[k] for k in option_names if k in kwargs})
        if not isinstance(check_val_every_n_epoch, int) or check_val_every_n_epoch < 1:
            raise ValueError(f"check_val_every_n_epoch must be a positive int, got {check_val_every_n_epoch!r}.")
        self.model_class = model_class
        self.model_hparams = dict(model_hparams or {})
        self.optimizer_hparams = optimizer_hparams
        self.seed = seed
        self.enable_progress_bar = enable_progress_bar
        self.debug = debug
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.exmp_input = exmp_input
        self.config = {
            "model_class": _class_path(model_class),
            "model_hparams": self.model_hparams,
            "optimizer_hparams": optimizer_hparams,
            "logger_params": dict(logger_params or {}),
            "enable_progress_bar": enable_progress_bar,
            "debug": debug,
            "check_val_every_n_epoch": check_val_every_n_epoch,
            "seed": seed,
        }
        self.config.update(kwargs)
        self.global_step = 0
        self._hparams_written = False
        self._acc_templates: dict = {}
        self._eval_compiler: threading.Thread | None = None
        self._epoch_ahead: DeviceEpoch | None = None
        self._lr_values: tuple | None = None  # (schedule, jitted vectorised schedule)
        self._lr_table: tuple | None = None  # (schedule, first step, rates of the steps from there)
        self._interrupt_signal: int | None = None
        self._next_event_step = 0
        self._best_eval_metrics: dict | None = None
        self._loop = _LoopState(running_log=_RunningLog(self, prefix="train/", suffix="_step"))
        self.should_stop = False
        self.stop_reason: str | None = None
        self.callback_metrics: dict[str, float] = {}
        self.nonfinite_steps = 0
        self.nonfinite_checked_step = 0
        self.compile_time: float | None = None
        self.batch_size: int | None = None
        self.num_epochs: int | None = None
        self.steps_per_epoch: int | None = None
        self.optimizer_plan = None
        self.callbacks: list[Callback] = self._default_callbacks(callbacks)
        checkpointers = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
        self._checkpoint_callback: ModelCheckpoint | None = checkpointers[0] if checkpointers else None
        self._val_loader = None
        self._nonfinite_before_epoch = 0
        self._skip_nonfinite = any(isinstance(cb, NaNGuard) and cb.skips_updates for cb in self.callbacks)
        enable_compilation_cache(self.options.compilation_cache)
        if mesh is None and self.options.distributed is not None:
            mesh = dist.make_mesh()
        self.mesh = mesh
        self.distributed_mode: str | None = None
        self.model_adapter = make_adapter(self.model_class, self.model_hparams, seed=seed)
        self.model = self.model_adapter.module  # the Linen module, or the live NNX module
        if self.options.enable_model_summary:
            self.print_tabulate(exmp_input)
        if jax.process_count() > 1 and not (logger_params or {}).get("log_dir") and not self.options.fast_dev_run:
            raise ValueError("Training with several processes needs logger_params={'log_dir': ...}: one folder that "
                             "every process can reach, for the checkpoints.")
        if self.options.fast_dev_run:  # a smoke test writes nothing: no log dir, loggers or checkpoints
            self.log_dir = None
            self.logger = LoggerCollection([])
            self.checkpointer = Checkpointer(os.path.join(tempfile.gettempdir(), "flaxlight-fast-dev-run-unused"))
        else:
            self.init_logger(logger_params)
            if not dist.is_main_process():  # only process 0 logs; all take part in checkpoints
                self.logger = LoggerCollection([])
        self.create_jitted_functions()
        self.init_model(exmp_input)

    def _default_callbacks(self, callbacks: list[Callback]) -> list[Callback]:
        """The user's callbacks, in their order, plus the defaults the settings ask for."""
        options = self.options
        kinds = {type(cb) for cb in callbacks}
        if options.fast_dev_run:
            callbacks = [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)]
        elif ModelCheckpoint not in kinds and options.enable_checkpointing:
            callbacks.append(ModelCheckpoint(monitor=options.monitor, mode=options.mode))
        if options.max_time is not None and Timer not in kinds:
            callbacks.append(Timer(options.max_time))
        if self.enable_progress_bar and ProgressBar not in kinds and dist.is_main_process():
            callbacks.append(ProgressBar())
        return callbacks

    # ------------------------------------------------------------------ model and optimizer
    def init_model(self, exmp_input: Any) -> None:
        """Initialise parameters (and batch stats) from ``exmp_input``; no optimizer yet."""
        model_rng = jax.random.PRNGKey(self.seed)
        model_rng, init_rng = jax.random.split(model_rng)
        variables = self.run_model_init(_as_input_list(exmp_input), init_rng)
        self.state = TrainState.create(
            apply_fn=self.model_adapter.apply,
            params=variables["params"],
            batch_stats=variables.get("batch_stats"),
            rng=model_rng,
            tx=None,
        )

    def run_model_init(self, exmp_input: Sequence[Any], init_rng) -> dict:
        """Initial variables (``params``, maybe ``batch_stats``) in training mode.

        Linen: ``model.init`` with ``params`` and ``dropout`` RNG streams, jitted (one
        compilation instead of one per operation) unless ``debug=True``. NNX: the state the
        module was constructed with (seeded by ``seed``).
        """
        init = self.model_adapter.init
        if self.debug or self.model_adapter.kind == "nnx":
            return init(init_rng, exmp_input)
        return jax.jit(init)(init_rng, exmp_input)

    def print_tabulate(self, exmp_input: Any) -> None:
        """Print the model's layers, shapes and parameter counts."""
        print(self.model_adapter.tabulate(_as_input_list(exmp_input)))

    def init_optimizer(self, num_epochs: int, num_steps_per_epoch: int) -> None:
        """Build the optimizer for ``num_epochs * num_steps_per_epoch`` train steps; keep params.

        The run's length reaches schedules and optimizer factories (learned optimizers such as
        VeLO); ``self.optimizer_plan`` keeps what was built (schedule, weight decay in effect).
        """
        plan = make_optimizer_plan(self.optimizer_hparams, total_steps=num_epochs * num_steps_per_epoch)
        if plan.regularizer is not None and not getattr(self, "_l2_in_step", False):
            optim_logger.warning(
                "weight_decay_mode='l2' adds its penalty inside the train step, but %s.create_functions() builds its "
                "own step: pass `regularizer=flaxlight.optim.as_optimizer_config(self.optimizer_hparams).l2_regularizer()` "
                "to your TrainStep (or add the penalty to your loss), or use weight_decay_mode='decoupled'.",
                type(self).__name__)
        self.optimizer_plan = plan
        tx = plan.tx
        self.state = TrainState.create(
            apply_fn=self.state.apply_fn,
            params=self.state.params,
            batch_stats=self.state.batch_stats,
            rng=self.state.rng,
            epoch=self.state.epoch,
            step=self.state.step,
            tx=tx,
        )

    # ------------------------------------------------------------------ steps
    def loss_fn(self, params, batch, *, train: bool, rng, state: TrainState):
        """Override to return ``(loss, metrics)`` or ``(loss, (metrics, updates))``.

        ``updates`` holds changed model collections (``{"batch_stats": ...}``), as returned by
        ``state.apply_model(params, x, train=train, rng=rng)``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must override loss_fn(params, batch, *, train, rng, state) "
            f"or create_functions() returning (train_step, eval_step)."
        )

    def create_functions(self) -> tuple[Callable, Callable]:
        """Return ``(train_step, eval_step)``: ``(state, batch) -> (state, metrics)`` and
        ``(state, batch) -> metrics``. The default builds both from :meth:`loss_fn`."""
        if type(self).loss_fn is TrainerModule.loss_fn:
            self.loss_fn(None, None, train=True, rng=None, state=None)  # raises the explanation
        # Runs before init_optimizer: the step's part of the optimizer settings (the L2 term of
        # weight_decay_mode="l2", precision) comes from the validated hparams, known already.
        config = as_optimizer_config(self.optimizer_hparams)
        regularizer = config.l2_regularizer() if config is not None else None
        precision = config.precision if config is not None else "fp32"
        step = TrainStep(self.loss_fn, regularizer=regularizer, precision=precision)
        self._l2_in_step = regularizer is not None
        return step.step, step.eval_step

    def create_jitted_functions(self) -> None:
        """Jit the steps once (train state donated); ``debug=True`` keeps them un-jitted."""
        functions = self.create_functions()
        if not (isinstance(functions, (tuple, list)) and len(functions) == 2 and all(map(callable, functions))):
            got = f"{type(functions).__name__} of length {len(functions)}" if isinstance(functions, (tuple, list)) \
                else type(functions).__name__
            raise TypeError(
                f"{type(self).__name__}.create_functions() must return a pair (train_step, eval_step) of "
                f"functions; got {got}."
            )
        train_step, eval_step = functions

        skip_nonfinite = self._skip_nonfinite

        def train_and_accumulate(state, acc, batch):
            new_state, metrics = train_step(state, batch)
            if skip_nonfinite:  # NaNGuard(action="skip"): keep params and optimizer state of bad steps
                ok = all_finite(metrics)
                kept = state.replace(step=new_state.step)
                new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, kept)
            return new_state, accumulate(acc, metrics, batch_size(batch))

        def eval_and_accumulate(state, acc, batch):
            return accumulate(acc, eval_step(state, batch), batch_size(batch))

        def train_block(state, acc, block):  # steps_per_execution steps in one dispatch
            def body(carry, batch):
                return train_and_accumulate(*carry, batch), None

            return jax.lax.scan(body, (state, acc), block)[0]

        block_length = self.options.steps_per_execution

        def train_at(state, acc, item):  # item: (a DeviceEpoch's (data, rows), row index)
            return train_and_accumulate(state, acc, take_batches(*item))

        def block_at(state, acc, item):
            return train_block(state, acc, take_batches(*item, count=block_length))

        self._step_shapes = {"train": train_step, "eval": eval_step}
        self._loop_functions = (train_and_accumulate, train_block, eval_and_accumulate)
        self._indexed_functions = (train_at, block_at)
        self._lean = {}  # per data path, the loop's functions without idle state fields (found at the first step)
        if self.debug:
            print("debug=True: the train and eval steps run un-jitted (prints and breakpoints work).")
            self.train_step, self.eval_step = train_step, eval_step
            self._train_and_accumulate, self._eval_and_accumulate = train_and_accumulate, eval_and_accumulate
            self._train_block = train_block
            self._train_at, self._block_at = train_at, block_at
        else:
            self.train_step = jax.jit(train_step, donate_argnums=0)
            self.eval_step = jax.jit(eval_step)
            self._jit_loop_functions()

    def _jit_loop_functions(self, state_shardings=None) -> None:
        """Jit the loop's fused functions; on a mesh with explicit in/out shardings."""
        train_and_accumulate, train_block, eval_and_accumulate = self._loop_functions
        self._lean = {}
        if state_shardings is None:
            self._train_and_accumulate = jax.jit(train_and_accumulate, donate_argnums=(0, 1))
            self._train_block = jax.jit(train_block, donate_argnums=(0, 1))
            self._train_at, self._block_at = (jax.jit(fn, donate_argnums=(0, 1)) for fn in self._indexed_functions)
            self._eval_and_accumulate = jax.jit(eval_and_accumulate, donate_argnums=1)
            return
        rep, batch, block = (dist.replicated(self.mesh), dist.batch_sharding(self.mesh),
                             NamedSharding(self.mesh, PartitionSpec(None, dist.DATA_AXIS)))
        bounded = self._in_flight_bound()

        def jit_train(fn, data_sharding):
            def with_token(state, acc, data):  # the token (a copy of the step) is never donated
                state, acc = fn(state, acc, data)
                return state, acc, state.step + 0

            return bounded(jax.jit(with_token, in_shardings=(state_shardings, rep, data_sharding),
                                   out_shardings=(state_shardings, rep, rep), donate_argnums=(0, 1)))

        self._train_and_accumulate = jit_train(train_and_accumulate, batch)
        self._train_block = jit_train(train_block, block)
        self._eval_and_accumulate = jax.jit(eval_and_accumulate, in_shardings=(state_shardings, rep, batch),
                                            out_shardings=rep, donate_argnums=1)

    def _in_flight_bound(self):
        """On several CPU devices, wait for the step from 8 steps back before dispatching more:
        XLA's CPU collectives deadlock with too many steps in flight. Elsewhere: no wrapper."""
        in_flight: collections.deque = collections.deque()
        bound = 8 if self.mesh.devices.size > 1 and jax.devices()[0].platform == "cpu" else None

        def wrap(fn):
            def bounded(state, acc, batch):
                state, acc, token = fn(state, acc, batch)
                if bound is not None:
                    in_flight.append(token)
                    if len(in_flight) > bound:
                        in_flight.popleft().block_until_ready()
                return state, acc

            return bounded

        return wrap

    def _place_state(self) -> None:
        """On a mesh: shard (or replicate) the state's arrays and re-jit the loop to match."""
        if self.mesh is None:
            return
        self.distributed_mode = dist.resolve_mode(self.options.distributed or "data_parallel", self.state.params)
        shardings = dist.state_shardings(self.state, self.mesh, self.distributed_mode)
        self.state = dist.place(self.state, shardings)
        if not self.debug:
            self._jit_loop_functions(shardings)

    def _zero_accumulator(self, kind: str, batch) -> dict:
        """Zeroed metric sums for this step kind and batch structure (shapes traced once)."""
        key = (kind, jax.tree.structure(batch), tuple((np.shape(x), np.result_type(x.dtype)) for x in jax.tree.leaves(batch)))
        if key not in self._acc_templates:
            if kind == "train":
                _, metrics = jax.eval_shape(self._step_shapes["train"], self.state, batch)
            else:
                metrics = jax.eval_shape(self._step_shapes["eval"], self.state, batch)
            if not isinstance(metrics, Mapping):
                raise TypeError(f"The {kind} step must return metrics as a dict; got {type(metrics).__name__}.")
            self._acc_templates[key] = init_accumulator(metrics)
        return fresh_zeros(self._acc_templates[key])  # fresh buffers: the sums are donated

    def _check_first_batch(self, batch, loader_name: str) -> None:
        check_batch(batch, where=f"first batch of {loader_name}")
        check_input_shapes(batch, _as_input_list(self.exmp_input))

    # ------------------------------------------------------------------ the loop
    def train_model(
        self,
        train_loader: Iterable,
        val_loader: Iterable | None,
        test_loader: Iterable | None = None,
        num_epochs: int = 500,
        steps_per_epoch: int | None = None,
        resume: bool = False,
        resume_from: str | os.PathLike | None = None,
    ) -> dict[str, float]:
        """Train ``num_epochs``, validate every ``check_val_every_n_epoch``, keep the best model.

        Returns the best validation metrics merged with that epoch's train metrics and, when a
        ``test_loader`` is given, the best model's ``test/...`` metrics.

        ``resume=True`` continues from the newest readable checkpoint in this run's log dir (a
        fresh start when there is none); ``resume_from`` names a run dir, its ``checkpoints``
        dir or one ``checkpoints/<step>`` dir. A resumed run ends exactly as an uninterrupted one
        when the data order is a pure function of the epoch (see :class:`ArrayLoader`; a loader
        of your own needs a ``set_epoch(epoch)`` method or an order that never changes).
        SIGTERM/SIGINT make the loop finish the current step, save a checkpoint and exit.
        """
        options = self.options
        if options.fast_dev_run:
            num_epochs = 1
        if not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}.")
        if val_loader is not None and self.check_val_every_n_epoch > num_epochs and not options.fast_dev_run:
            raise ValueError(
                f"check_val_every_n_epoch={self.check_val_every_n_epoch} > num_epochs={num_epochs}: no validation "
                f"would run, so there would be no best model to test. Lower check_val_every_n_epoch or train longer."
            )
        if steps_per_epoch is None:
            steps_per_epoch = _loader_length(train_loader, "train_loader")
        if steps_per_epoch < 1:
            raise ValueError("train_loader yielded no batches (its len() is 0): check the dataset size, "
                             "batch_size and drop_last.")
        steps_per_epoch = self._limit(steps_per_epoch, 1 if options.fast_dev_run else options.limit_train_batches,
                                      "limit_train_batches")
        self.num_epochs, self.steps_per_epoch = num_epochs, steps_per_epoch
        total_steps = num_epochs * steps_per_epoch
        if options.max_steps is not None:
            total_steps = min(total_steps, options.max_steps)
        if total_steps < num_epochs * steps_per_epoch:  # max_steps ends the run first: fit the schedule to it
            self.init_optimizer(1, total_steps)
        else:
            self.init_optimizer(num_epochs, steps_per_epoch)
        self._place_state()
        self._loop = _LoopState(running_log=_RunningLog(self, prefix="train/", suffix="_step"))
        self._best_eval_metrics = None
        self.should_stop, self.stop_reason = False, None
        if resume or resume_from is not None:
            self._resume(resume_from, train_loader)
        self.global_step = int(to_host(self.state.step))
        self._val_loader = val_loader
        self._write_hparams()
        self._compile_eval_ahead(val_loader)
        loop = self._loop
        try:
            with _SignalGuard(self):
                self.on_training_start()
                self._call_callbacks("on_fit_start")
                for epoch_idx in range(loop.epoch, num_epochs + 1):
                    if self.should_stop or self._reached_max_steps():
                        break
                    self._run_epoch(epoch_idx, train_loader, val_loader)
                if self.stop_reason:
                    print(self.stop_reason, file=sys.stderr, flush=True)
                best_eval_metrics = dict(self._best_eval_metrics or loop.train_metrics)
                if test_loader is not None:
                    best_eval_metrics.update(self._test(test_loader))
                self.on_training_end()
                self._call_callbacks("on_fit_end")
        except _Interrupted as interrupt:
            self._save_on_interrupt(interrupt)
        except BaseException as exc:
            self._call_callbacks("on_exception", exc)
            self._finish_files("failed")
            raise
        self._finish_files("success")
        return best_eval_metrics

    def _compile_eval_ahead(self, val_loader) -> None:
        """Compile the evaluation step for the validation batches' shapes in a background thread
        while the first epoch trains, so the first validation does not stall.

        The shapes come from ``val_loader.example_batches()`` (:class:`ArrayLoader`: the first
        and the smaller last batch) or from the first and last batch of a list; other loaders
        are not touched (iterating them may draw random numbers) and compile at first use. A
        batch that fails here fails again, with the readable message, when :meth:`eval_model`
        runs it.
        """
        if val_loader is None or self.debug or self._eval_compiler is not None:
            return
        try:
            examples = _example_batches(val_loader)
            for batch in examples:
                check_batch(batch, where="validation batch")
            specs = [self._eval_specs(batch) for batch in examples]
        except Exception:  # noqa: BLE001 - reported by eval_model, where the batch is really used
            return
        if not specs:
            return

        def compile_all():
            for args in specs:
                try:
                    self._eval_and_accumulate.lower(*args).compile()
                except Exception:  # noqa: BLE001 - as above
                    return

        self._eval_compiler = threading.Thread(target=compile_all, daemon=True, name="flaxlight-eval-compile")
        self._eval_compiler.start()

    def _eval_specs(self, batch) -> tuple:
        """Shapes and dtypes of ``(state, sums, batch)`` as the eval step gets them (shardings
        come from the jitted function's own ``in_shardings`` on a mesh)."""
        if self.mesh is not None:
            batch = dist.to_global_batch(batch, self.mesh)
        acc = self._zero_accumulator("eval", batch)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (self.state, acc, batch))

    def _run_epoch(self, epoch_idx: int, train_loader, val_loader) -> None:
        """Train one epoch (or its rest, after a resume), validate when due, run the epoch hooks."""
        loop = self._loop
        loop.epoch = epoch_idx
        if loop.phase != "val":  # "val": resumed after this epoch's training, before its validation
            _set_loader_epoch(train_loader, epoch_idx)
            self._call_callbacks("on_train_epoch_start", epoch_idx)
            loop.train_metrics = self.train_epoch(train_loader)
            epoch = np.asarray(epoch_idx, np.int32)
            self.state = self.state.replace(epoch=jax.device_put(epoch, dist.replicated(self.mesh))
                                            if self.mesh is not None else jnp.asarray(epoch))
            self._log({**loop.train_metrics, "epoch": epoch_idx})
            self.on_training_epoch_end(epoch_idx)
            self._call_callbacks("on_train_epoch_end", epoch_idx, loop.train_metrics)
        if val_loader is not None and (epoch_idx % self.check_val_every_n_epoch == 0 or self.options.fast_dev_run):
            self._validate(val_loader)
        loop.phase = "epoch_end"
        self._call_callbacks("on_epoch_end", epoch_idx)
        self.logger.flush()  # the epoch's records are on disk (loggers buffer between epochs)

    def _validate(self, val_loader) -> dict[str, float]:
        """Evaluate on the validation set, record the best model and tell hooks and callbacks."""
        loop = self._loop
        limit = 1 if self.options.fast_dev_run else self.options.limit_val_batches
        if limit is not None:
            val_loader = itertools.islice(val_loader, self._limit(_safe_len(val_loader), limit, "limit_val_batches"))
        eval_metrics = self.eval_model(val_loader, log_prefix="val/")
        self.on_validation_epoch_end(loop.epoch, eval_metrics, val_loader)
        self._log({**eval_metrics, "epoch": loop.epoch})
        self.save_metrics(f"eval_epoch_{loop.epoch:03d}" if loop.phase != "train" else f"eval_step_{self.global_step}",
                          eval_metrics)
        if self.is_new_model_better(eval_metrics, self._best_eval_metrics):
            self._best_eval_metrics = {**eval_metrics, **loop.train_metrics}
            self.save_metrics("best_eval", eval_metrics)
        self._call_callbacks("on_validation_end", loop.epoch, eval_metrics)
        return eval_metrics

    def _test(self, test_loader) -> dict[str, float]:
        """Restore the best checkpoint (when there is one) and evaluate it on ``test_loader``."""
        if self.checkpointer.all_steps():
            self.load_model()
        test_metrics = self.eval_model(test_loader, log_prefix="test/")
        self._log(test_metrics)
        self.save_metrics("test", test_metrics)
        self._call_callbacks("on_test_end", test_metrics)
        return test_metrics

    def train_epoch(self, train_loader: Iterable) -> dict[str, float]:
        """One pass over ``train_loader``; returns ``train/...`` means and ``epoch_time``.

        Metrics are summed on the device; the only reads are asynchronous copies at log points
        and one read at the end of the epoch. After a resume mid-epoch, the batches already
        trained on are skipped and the epoch's sums continue from the checkpoint. The epoch ends
        early at ``limit_train_batches``, ``max_steps`` or when a callback calls :meth:`stop`.
        """
        start = time.time()
        loop = self._loop
        if loop.phase != "train":  # a fresh epoch (not the rest of one interrupted mid-way)
            loop.phase, loop.batch_index, loop.acc = "train", 0, None
            loop.running_log.reset()
            self._nonfinite_before_epoch = self.nonfinite_steps
        acc = loop.acc
        limit = self.steps_per_epoch if self.steps_per_epoch is not None else _safe_len(train_loader)
        prefetcher, path = None, "batches"
        if self._device_epochs(train_loader):  # the whole epoch moves to the device at once
            epoch, self._epoch_ahead = self._epoch_ahead, None
            if epoch is None or not epoch.serves(train_loader, limit):
                epoch = DeviceEpoch(train_loader, stop=limit)
            items, path = epoch.items(loop.batch_index, self.options.steps_per_execution, self.global_step), "indexed"
            first_batch = epoch.first_batch
        else:
            batches = itertools.islice(iter(train_loader), loop.batch_index, limit)
            items = group_batches(batches, self.options.steps_per_execution, start=self.global_step)
            if self.options.prefetch:
                items = prefetcher = Prefetcher(items, size=self.options.prefetch, transform=self._payload_to_device)
            elif self.mesh is not None:
                items = map(self._payload_to_device, items)
            first_batch = None
        self._schedule_events()
        if limit is not None:
            self._schedule_lr_table(self.global_step, max(limit - loop.batch_index, 0))
        try:
            items = iter(items)
            head = next(items, None)
            if head is not None:
                items = itertools.chain([head], items)
                if acc is None:
                    if first_batch is None:
                        first_batch = head[1] if head[0] == 1 else jax.tree.map(lambda x: x[0], head[1])
                    acc = self._start_epoch_sums(first_batch)
                lean = self._lean_loop(path, acc, head)
                state, kept = lean.split(self.state)
                state, acc = self._run_batches(items, lean, state, kept, acc)
                last_epoch = loop.epoch == getattr(self, "num_epochs", None)
                if path == "indexed" and not (last_epoch or self.should_stop or self._reached_max_steps()):
                    # The next epoch's data, made before this epoch's end waits for its last steps.
                    self._epoch_ahead = DeviceEpoch(train_loader, stop=limit, epoch=train_loader.epoch + 1)
        finally:
            if prefetcher is not None:
                prefetcher.close()
        if acc is None:
            raise ValueError("train_loader yielded no batches: check the dataset size, batch_size and drop_last.")
        if limit is not None and loop.batch_index < limit and not (self.should_stop or self._reached_max_steps()) \
                and self._interrupt_signal is None:
            warnings.warn(f"train_loader ran out after {loop.batch_index} of the epoch's {limit} batches "
                          f"(steps_per_epoch or len()): the learning-rate schedule was sized for {limit} per epoch. "
                          f"Pass the loader's real number of batches as steps_per_epoch.", RuntimeWarning, stacklevel=2)
        loop.running_log.flush()
        loop.phase = "val"
        host = to_host(acc)  # the epoch's one read of the sums
        metrics = read_means(host, prefix="train/")
        self._note_nonfinite(self.global_step, int(host["nonfinite"]))
        metrics["epoch_time"] = time.time() - start
        return metrics

    def _payload_to_device(self, item: tuple[int, Any]) -> tuple[int, Any]:
        """``(steps, batch or block)`` with the data on the device(s), split over the mesh if any.

        A batch JAX cannot take is passed on as it is, so that the training thread reports it
        with a readable message.
        """
        steps, payload = item
        try:
            if self.mesh is None:
                return steps, jax.device_put(payload)
            return steps, dist.to_global_batch(payload, self.mesh, block=steps > 1)
        except (TypeError, ValueError):
            return steps, payload

    def _run_batches(self, items, lean: LeanLoop, state, kept: dict, acc) -> tuple[Any, dict]:
        """The hot loop: locals only, one comparison per step; everything else happens at events.

        ``state`` is the train state without the fields ``lean`` leaves out (``kept``); the
        trainer's full ``self.state`` is put back together at events and at the end. Returns the
        (lean) state and the sums; ``self.state``, ``self.global_step`` and the loop position are
        current when it returns, also by an exception.
        """
        loop = self._loop
        single, fused = lean.single, lean.fused
        step, batch_index = self.global_step, loop.batch_index
        time_first = self.compile_time is None
        try:
            for steps, item in items:  # `steps` batches: 1, or a stacked block of steps_per_execution
                if time_first:  # the trainer's very first step, timed to completion: its compile time
                    first = time.perf_counter()
                    state, acc = jax.block_until_ready((single if steps == 1 else fused)(state, acc, item))
                    self.compile_time, time_first = time.perf_counter() - first, False
                elif steps == 1:
                    state, acc = single(state, acc, item)
                else:
                    state, acc = fused(state, acc, item)
                step += steps
                batch_index += steps
                if step >= self._next_event_step:
                    self.state, self.global_step = lean.join(state, kept), step
                    loop.batch_index, loop.acc = batch_index, acc
                    end_epoch = self._step_events(steps)
                    state, kept = lean.split(self.state)
                    if end_epoch:
                        break
        finally:
            self.state, self.global_step = lean.join(state, kept), step
            loop.batch_index, loop.acc = batch_index, acc
        return state, acc

    def _lean_loop(self, path: str, acc, head: tuple[int, Any]) -> LeanLoop:
        """The loop's jitted functions for a data path (``"batches"``: batches or stacked blocks;
        ``"indexed"``: a :class:`DeviceEpoch` and an index), without the state fields the step
        never uses (found once per path, from the first item; see :mod:`flaxlight.lean`). On a
        mesh or with ``debug=True`` the full state goes through."""
        if path not in self._lean:
            if path == "indexed":
                functions, jitted = self._indexed_functions, (self._train_at, self._block_at)
            else:
                functions, jitted = self._loop_functions[:2], (self._train_and_accumulate, self._train_block)
            if self.debug or self.mesh is not None:
                self._lean[path] = LeanLoop((), *jitted)
            else:
                steps, item = head
                if path == "batches" and steps > 1:
                    item = jax.tree.map(lambda x: x[0], item)
                self._lean[path] = LeanLoop.analyse(*functions, self.state, acc, item, jitted=jitted)
        return self._lean[path]

    def _device_epochs(self, loader) -> bool:
        """Whether this epoch moves to the device in one go (:class:`DeviceEpoch`): an
        :class:`ArrayLoader` that allows it, one device, no ``debug``."""
        return (isinstance(loader, ArrayLoader) and loader.serves_device_epochs() and self.mesh is None
                and not self.debug)

    def _start_epoch_sums(self, batch) -> dict:
        """Check the epoch's first batch and return zeroed metric sums for its structure."""
        self._check_first_batch(batch, "train_loader")
        self.batch_size = batch_size(batch)
        if self.mesh is not None:
            dist.check_batch_divisible(self.batch_size, self.mesh)
        return self._zero_accumulator("train", batch)

    def _schedule_events(self) -> None:
        """The next step at which the loop must look up: a log point, a callback's ``on_step``,
        a validation (``val_check_interval``) or ``max_steps``; decided here, in one place."""
        step = self.global_step
        intervals = [self.options.log_every_n_steps] + [cb.every_n_steps for cb in self.callbacks if cb.every_n_steps]
        if self.options.val_check_interval:
            intervals.append(self.options.val_check_interval)
        next_step = min((step // n + 1) * n for n in intervals)
        if self.options.max_steps is not None:
            next_step = min(next_step, max(self.options.max_steps, step + 1))
        self._next_event_step = 0 if self._interrupt_signal is not None else next_step

    def _step_events(self, steps: int = 1) -> bool:
        """Log points, ``on_step`` callbacks, step validations and interrupts, off the fast path.

        ``steps`` optimizer steps ran since the last call (a fused block): an interval whose
        multiple was passed inside the block fires now, at the block's end. Returns True when
        the epoch must end now (``max_steps`` reached or :meth:`stop` called).
        """
        step, loop = self.global_step, self._loop
        previous = step - steps

        def due(every: int | None) -> bool:
            return bool(every) and step // every > previous // every

        if self._interrupt_signal is not None:
            raise _Interrupted(self._interrupt_signal)
        if due(self.options.log_every_n_steps):
            loop.running_log.mark(step, loop.acc)
        if due(self.options.val_check_interval) and self._val_loader is not None \
                and loop.batch_index < self.steps_per_epoch:
            self._validate(self._val_loader)
        for callback in self.callbacks:
            if due(callback.every_n_steps):
                callback.on_step(self, step)
        if self._interrupt_signal is not None:  # arrived while the callbacks ran
            raise _Interrupted(self._interrupt_signal)
        self._schedule_events()
        return self.should_stop or self._reached_max_steps()

    def _reached_max_steps(self) -> bool:
        if self.options.max_steps is not None and self.global_step >= self.options.max_steps:
            self.stop_reason = self.stop_reason or f"max_steps={self.options.max_steps} reached."
            return True
        return False

    def _limit(self, available: int | None, limit, name: str) -> int | None:
        """Batches to use given ``limit_*_batches`` (an int, or a fraction of ``available``)."""
        if limit is None:
            return available
        if isinstance(limit, float):
            if available is None:
                raise TypeError(f"{name}={limit} is a fraction, but the loader has no len(); give a number of batches.")
            return max(1, int(available * limit))
        if available is not None and limit > available:
            warnings.warn(f"{name}={limit} is more than the loader's {available} batches; using {available}.",
                          RuntimeWarning, stacklevel=3)
            return available
        return limit

    def eval_model(self, data_loader: Iterable, log_prefix: str = "") -> dict[str, float]:
        """Evaluate on ``data_loader``; per-example weighted means keyed ``log_prefix + name``."""
        if self._eval_compiler is not None:  # compiling ahead: wait for it rather than compile twice
            self._eval_compiler.join()
            self._eval_compiler = None
        acc = None
        for batch in data_loader:
            if acc is None:
                self._check_first_batch(batch, "the evaluation loader")
                acc = self._zero_accumulator("eval", batch)
            if self.mesh is not None:
                batch = dist.to_global_batch(batch, self.mesh)
                dist.check_batch_divisible(batch_size(batch), self.mesh)
            acc = self._eval_and_accumulate(self.state, acc, batch)
            if self._interrupt_signal is not None:
                raise _Interrupted(self._interrupt_signal)
        if acc is None:
            raise ValueError(f"The evaluation loader ({log_prefix or 'eval'}) yielded no batches.")
        return read_means(acc, prefix=log_prefix)

    # ------------------------------------------------------------------ what callbacks use
    def stop(self, reason: str) -> None:
        """Ask the loop to stop after the current step's work (and the epoch's end routine)."""
        if not self.should_stop:
            self.should_stop, self.stop_reason = True, reason

    @property
    def current_epoch(self) -> int:
        """The epoch being trained (1-based; the next one between epochs)."""
        return self._loop.epoch

    @property
    def batch_in_epoch(self) -> int:
        """Batches of the current epoch already trained on."""
        return self._loop.batch_index if self._loop.phase == "train" else 0

    def learning_rate(self, step: int | None = None) -> float | None:
        """The learning rate at ``step`` (default: now) from the schedule.

        Read from a table of the epoch's rates computed at the epoch's start (so a log point
        does not wait for the steps in flight); other steps are computed when asked.
        """
        schedule = getattr(self.optimizer_plan, "schedule", None)
        if schedule is None:
            return None
        step = self.global_step if step is None else int(step)
        table = self._lr_table
        if table is None or table[0] is not schedule or not 0 <= step - table[1] < len(table[2]):
            self._schedule_lr_table(step, 1)
            table = self._lr_table
        if not isinstance(table[2], np.ndarray):  # first use: the copy started at the epoch's start
            table = self._lr_table = (table[0], table[1], np.asarray(table[2]))
        return float(table[2][step - table[1]])

    def _schedule_lr_table(self, start: int, count: int) -> None:
        """Start computing the learning rates of steps ``start .. start + count`` (one dispatch,
        copied to the host in the background) for :meth:`learning_rate`."""
        schedule = getattr(self.optimizer_plan, "schedule", None)
        if schedule is None:
            return
        if self._lr_values is None or self._lr_values[0] is not schedule:
            self._lr_values = (schedule, jax.jit(jax.vmap(schedule)))
        values = self._lr_values[1](jax.device_put(np.arange(start, start + count + 1, dtype=np.int32)))
        values.copy_to_host_async()
        self._lr_table = (schedule, start, values)

    def monitored_value(self, name: str, owner: str = "monitor") -> float:
        """The latest logged value of ``name``; a clear error naming the logged keys if absent."""
        if name not in self.callback_metrics:
            close = difflib.get_close_matches(name, list(self.callback_metrics), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(f"{owner} monitors {name!r}, which was never logged.{hint} "
                           f"Logged metrics: {sorted(self.callback_metrics)}.")
        return self.callback_metrics[name]

    def _note_nonfinite(self, step: int, count: int) -> None:
        """Host copy of the non-finite step count of this epoch, as of ``step``."""
        self.nonfinite_checked_step = step
        self.nonfinite_steps = max(self.nonfinite_steps, self._nonfinite_before_epoch + count)

    def _log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        step = self.global_step if step is None else step
        self.callback_metrics.update(metrics)
        self.logger.log_metrics(metrics, step=step)
        self._call_callbacks("on_log", step, metrics)

    def _call_callbacks(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def is_new_model_better(self, new_metrics: Mapping[str, float], old_metrics: Mapping[str, float] | None) -> bool:
        """True when ``new_metrics`` beat ``old_metrics`` on ``monitor`` (or the seed's priority)."""
        if old_metrics is None:
            return True
        if self.options.monitor is not None:
            candidates = ((self.options.monitor, self.options.mode == "max"),)
        else:
            candidates = DEFAULT_MONITORS
        for key, larger_is_better in candidates:
            if key in new_metrics:
                if larger_is_better:
                    return new_metrics[key] > old_metrics[key]
                return new_metrics[key] < old_metrics[key]
        wanted = [key for key, _ in candidates]
        raise KeyError(
            f"None of the metrics {wanted} used to pick the best model is among the validation metrics "
            f"{sorted(new_metrics)}. Pass monitor='val/<name>' (and mode='min'/'max') to the trainer, "
            f"or override is_new_model_better."
        )

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
        """Pick the log dir (``base_log_dir/<Model>/version_N`` unless ``log_dir``) and loggers.

        ``logger_params`` keys: ``log_dir``, ``base_log_dir`` (default ``"checkpoints"``),
        ``logger_type`` (``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"``, any case, or a
        list; default CSV plus TensorBoard when tensorboardX is installed, or CSV alone when
        ``loggers=[...]`` is given), ``project_name`` (W&B project / MLflow experiment),
        ``run_name`` (default: the log dir's name), ``loggers`` (extra :class:`Logger` objects).
        A :class:`CSVLogger` (``metrics.csv``) is always kept; the trainer's ``loggers=[...]``
        are added after the ones ``logger_type`` picks. See docs/logging.md.
        """
        params = dict(logger_params or {})
        log_dir = params.get("log_dir")
        if not log_dir:
            base = os.path.join(params.get("base_log_dir", "checkpoints"), self.model_class.__name__)
            log_dir = _next_version_dir(base)
        self.log_dir = os.path.abspath(os.fspath(log_dir))
        os.makedirs(os.path.join(self.log_dir, "metrics"), exist_ok=True)
        extra: list[Logger] = []
        for user_logger in list(params.get("loggers") or []) + list(getattr(self, "_user_loggers", [])):
            if isinstance(user_logger, str):  # a logger's repr saved in hparams.yaml: not rebuilt on load
                continue
            if not isinstance(user_logger, Logger):
                raise TypeError(f"loggers must be flaxlight.loggers.Logger instances; got {type(user_logger).__name__}.")
            extra.append(user_logger)
        types = params.get("logger_type")
        if types is None:
            types = ["csv", "tensorboard"] if tensorboard_available() and not extra else ["csv"]
        types = [types] if isinstance(types, str) else list(types)
        kinds = ["csv"]  # metrics.csv is always written
        for kind in types:
            kinds.append("wandb" if str(kind).lower() == "w&b" else str(kind).lower())
        from flaxlight.loggers.base import run_display_name

        project = params.get("project_name") or "flaxlight"
        run_name = params.get("run_name") or run_display_name(self.log_dir)
        loggers: list[Logger] = []
        for kind in dict.fromkeys(kinds):
            if kind == "csv":
                loggers.append(CSVLogger(self.log_dir))
            elif kind == "tensorboard":
                loggers.append(TensorBoardLogger(self.log_dir))
            elif kind == "wandb":
                from flaxlight.loggers.wandb import WandbLogger

                loggers.append(WandbLogger(project=project, name=run_name, save_dir=self.log_dir))
            elif kind == "mlflow":
                from flaxlight.loggers.mlflow import MLflowLogger

                loggers.append(MLflowLogger(experiment_name=project, run_name=run_name, save_dir=self.log_dir))
            else:
                raise ValueError(f"Unknown logger_type {kind!r} in logger_params; valid: {', '.join(LOGGER_TYPES)} "
                                 f"(any case), or a list of them.")
        self.logger = LoggerCollection(loggers + extra)
        self.checkpointer = Checkpointer(os.path.join(self.log_dir, CHECKPOINT_DIR), max_to_keep=None)

    def _write_hparams(self) -> None:
        if self._hparams_written or self.options.fast_dev_run or not dist.is_main_process():
            return
        hparams = _to_yaml_safe(self.config)
        with open(os.path.join(self.log_dir, HPARAMS_FILE), "w") as f:
            yaml.safe_dump(hparams, f, sort_keys=False)
        self.logger.log_hyperparams(hparams)
        self._hparams_written = True

    def save_metrics(self, filename: str, metrics: Mapping[str, float]) -> None:
        """Write ``metrics`` to ``<log_dir>/metrics/<filename>.json`` (nothing in ``fast_dev_run``)."""
        if self.options.fast_dev_run or not dist.is_main_process():
            return
        with open(os.path.join(self.log_dir, "metrics", f"{filename}.json"), "w") as f:
            json.dump(dict(metrics), f, indent=4)

    def log_image(self, tag: str, image: Any, step: int | None = None) -> None:
        """Send one image to every logger that shows images (TensorBoard, W&B, MLflow; CSV skips it).

        ``image`` is ``(H, W)`` or ``(H, W, C)`` (C = 1, 3 or 4), uint8 in [0, 255] or float in
        [0, 1], numpy or JAX; ``step`` defaults to the current ``global_step``. Call it from a hook,
        e.g. ``on_validation_epoch_end``, to log reconstructions (nothing in ``fast_dev_run``).
        """
        if self.options.fast_dev_run:
            return
        self.logger.log_image(tag, image, self.global_step if step is None else int(step))

    def bind_model(self):
        """The model with the trained variables, for interactive use: ``model(x, train=False)``.

        Linen: the module bound to the variables. NNX: a live module carrying them (eval mode).
        """
        return self.model_adapter.bind(self.state.variables())

    def tracker(self, iterator: Iterable, **kwargs):
        """``iterator`` with a progress bar when enabled (the seed's helper)."""
        return progress(iterator, self.enable_progress_bar, **kwargs)

    # ------------------------------------------------------------------ checkpoints and resume
    def save_checkpoint(self, step: int | None = None, metrics: Mapping[str, float] | None = None) -> None:
        """Checkpoint everything needed to continue: state, loop position, callbacks, log history.

        Called by :class:`ModelCheckpoint`; the arrays are copied off the device before this
        returns and written in the background (orbax, atomic).
        """
        step = self.global_step if step is None else int(step)
        loop = self._loop
        if not self._skip_nonfinite and self._nonfinite_now() > 0:
            warnings.warn(f"Not saving checkpoint {step}: the loss was NaN/Inf in {self._nonfinite_now()} step(s), "
                          f"so the model is damaged; the earlier checkpoints are kept.", RuntimeWarning, stacklevel=2)
            return
        self._write_hparams()
        loop.running_log.flush()  # the log history up to `step` is complete and on disk before it is saved
        self.logger.flush()
        meta = {
            "step": step,
            "epoch": loop.epoch,
            "phase": loop.phase,
            "batch_index": loop.batch_index,
            "train_metrics": loop.train_metrics,
            "train_sums": _host_accumulator(loop.acc),
            "running_log": loop.running_log.state_dict(),
            "best_eval_metrics": self._best_eval_metrics,
            "best_step": self._best_checkpoint_step(),
            "metrics": dict(metrics) if metrics is not None else None,
            "num_epochs": getattr(self, "num_epochs", None),
            "steps_per_epoch": getattr(self, "steps_per_epoch", None),
            "callbacks": {name: cb.state_dict() for name, cb in _named(self.callbacks)},
        }
        if step in self.checkpointer.all_steps():  # e.g. a step checkpoint, now also the epoch's best
            self.checkpointer.delete(step, background=False)
        self.checkpointer.save(step, self.state, meta=meta)

    def _nonfinite_now(self) -> int:
        """Non-finite steps so far, read from the device now (only called when saving)."""
        loop = self._loop
        current = int(to_host(loop.acc["nonfinite"])) if loop.acc is not None and loop.phase == "train" else 0
        return max(self.nonfinite_steps, self._nonfinite_before_epoch + current)

    def save_model(self, step: int | None = None) -> None:
        """Checkpoint the current state now (the seed's name for :meth:`save_checkpoint`)."""
        self.save_checkpoint(step)

    def load_model(self, step: int | None = None) -> None:
        """Restore a checkpoint into ``self.state``: ``step``, else the best, else the newest."""
        self.checkpointer.wait()
        if step is None:
            step = self._best_checkpoint_step()
        self.state = self.checkpointer.restore(self.state, step=step)

    def _best_checkpoint_step(self) -> int | None:
        best = self._checkpoint_callback.best_step if self._checkpoint_callback is not None else None
        return best if best is not None and best in self.checkpointer.all_steps() else None

    def _resume(self, resume_from, train_loader) -> None:
        """Restore state, loop position, callbacks and logs from the newest readable checkpoint."""
        checkpointer = self.checkpointer if resume_from is None else _checkpointer_for(resume_from)
        wanted_step = _step_in_path(resume_from) if resume_from is not None else None
        if not checkpointer.all_steps():
            if resume_from is not None:
                raise FileNotFoundError(f"resume_from={os.fspath(resume_from)!r}: no checkpoint there.")
            _log.info("resume=True: no checkpoint in %s yet, starting from scratch.", checkpointer.directory)
            return
        if wanted_step is not None:
            self.state = checkpointer.restore(self.state, step=wanted_step)
            meta, step = checkpointer.read_meta(wanted_step), wanted_step
        else:
            self.state, meta, step = checkpointer.restore_latest_valid(self.state)
            if checkpointer is self.checkpointer:
                for newer in [s for s in checkpointer.all_steps() if s > step]:
                    checkpointer.delete(newer)  # unreadable: it would block re-saving that step
        loop = self._loop
        loop.epoch, loop.phase, loop.batch_index = meta["epoch"], meta["phase"], meta["batch_index"]
        loop.train_metrics = meta.get("train_metrics") or {}
        loop.running_log.load_state_dict(meta.get("running_log") or {})
        if meta.get("train_sums") is not None:
            sums = meta["train_sums"]
            loop.acc = {"sums": {k: jnp.asarray(v, jnp.float32) for k, v in sums["sums"].items()},
                        "count": jnp.asarray(sums["count"], jnp.float32),
                        "nonfinite": jnp.asarray(sums.get("nonfinite", 0), jnp.int32)}
        if loop.phase == "epoch_end":
            loop.epoch, loop.batch_index = loop.epoch + 1, 0
        self._best_eval_metrics = meta.get("best_eval_metrics")
        saved = meta.get("callbacks") or {}
        for name, callback in _named(self.callbacks):
            if name in saved:
                callback.load_state_dict(saved[name])
        self.logger.resume_from_step(step)
        if _epoch_setter(train_loader) is None:
            warnings.warn(
                "Resuming with a train_loader that has no set_epoch(epoch) method: the run continues exactly "
                "only if the loader's order does not depend on how often it was iterated before.",
                RuntimeWarning, stacklevel=3,
            )
        print(f"Resumed from checkpoint {step} in {checkpointer.directory} (epoch {loop.epoch}, "
              f"batch {loop.batch_index}).", file=sys.stderr, flush=True)

    def _save_on_interrupt(self, interrupt: "_Interrupted") -> None:
        name = signal.Signals(interrupt.signum).name
        self.save_checkpoint(self.global_step)
        self.checkpointer.wait()
        self._call_callbacks("on_exception", interrupt)
        self._finish_files("interrupted")
        print(
            f"\n{name} received: stopped after step {self.global_step} (epoch {self._loop.epoch}) and saved a "
            f"checkpoint in {self.checkpointer.directory}.\nTo resume, build the same trainer with "
            f"logger_params={{'log_dir': {self.log_dir!r}}} and call train_model(..., resume=True).",
            file=sys.stderr, flush=True,
        )
        raise SystemExit(128 + interrupt.signum)

    def _finish_files(self, status: str) -> None:
        self.checkpointer.wait()
        self.logger.finalize(status)

    @classmethod
    def load_from_checkpoint(cls, checkpoint: str | os.PathLike, exmp_input: Any, which: str = "best",
                             with_optimizer: bool = False, **overrides: Any) -> "TrainerModule":
        """Rebuild a trainer from a run's log dir (``hparams.yaml`` + a checkpoint).

        ``which`` is ``"best"`` (the best model kept by ModelCheckpoint; the newest when no
        validation ran) or ``"last"``. ``with_optimizer=True`` also restores the optimizer state,
        to fine-tune or keep training; otherwise the state is for inference (``opt_state`` None).
        Works for subclasses that take ``model_class``/``model_hparams`` and for the seed's
        pattern of a constructor taking the model hyperparameters by name. ``overrides`` replace
        saved settings (e.g. ``enable_progress_bar=False``).

        Example:
            >>> trainer = MyTrainer.load_from_checkpoint("checkpoints/MLP/version_0", exmp_input=x[:1])  # doctest: +SKIP
        """
        if which not in ("best", "last"):
            raise ValueError(f"which must be 'best' or 'last', got {which!r}.")
        log_dir = os.path.abspath(os.fspath(checkpoint))
        hparams_path = os.path.join(log_dir, HPARAMS_FILE)
        if not os.path.isfile(hparams_path):
            raise FileNotFoundError(
                f"No {HPARAMS_FILE} in {log_dir}. load_from_checkpoint expects a run's log dir, the folder that "
                f"holds {HPARAMS_FILE} and {CHECKPOINT_DIR}/ (e.g. checkpoints/MLP/version_0)."
            )
        ckpt_dir = os.path.join(log_dir, CHECKPOINT_DIR)
        if not os.path.isdir(ckpt_dir) or not Checkpointer(ckpt_dir, read_only=True).all_steps():
            raise FileNotFoundError(f"No checkpoint in {ckpt_dir}: this run saved no model yet.")
        with open(hparams_path) as f:
            hparams = yaml.safe_load(f) or {}
        model_class_path = hparams.pop("model_class")
        model_hparams = hparams.pop("model_hparams", {}) or {}
        logger_params = dict(hparams.get("logger_params") or {})
        logger_params["log_dir"] = log_dir
        hparams["logger_params"] = logger_params
        hparams["enable_model_summary"] = False  # loading prints no model table (an override can ask for one)
        named = _explicit_parameters(cls)
        if "model_hparams" in named or not set(model_hparams) <= named:
            hparams["model_hparams"] = model_hparams
            if "model_class" not in overrides:
                hparams["model_class"] = _import_class(model_class_path)
        else:  # the seed's pattern: MyTrainer(hidden_dims, output_dim, **kwargs)
            hparams.update(model_hparams)
        hparams.update(overrides)
        trainer = cls(exmp_input=exmp_input, **hparams)
        trainer._hparams_written = True  # the file on disk describes this run already
        steps = trainer.checkpointer.all_steps()
        meta = trainer.checkpointer.read_meta(max(steps))
        step = meta.get("best_step") if which == "best" and meta.get("best_step") in steps else max(steps)
        if with_optimizer:
            trainer.init_optimizer(meta.get("num_epochs") or 1, meta.get("steps_per_epoch") or 1)
        trainer._place_state()
        trainer.state = trainer.checkpointer.restore(trainer.state, step=step, with_opt_state=with_optimizer)
        trainer.global_step = int(to_host(trainer.state.step))
        return trainer


def _explicit_parameters(cls) -> set[str]:
    """Names a constructor takes explicitly (not through ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}


def _epoch_setter(loader) -> Callable[[int], None] | None:
    """The ``set_epoch`` that orders ``loader``'s data: its own (flaxlight's ArrayLoader, yours)
    or, for a torch ``DataLoader``, its sampler's (``DistributedSampler``)."""
    for owner in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        set_epoch = getattr(owner, "set_epoch", None)
        if callable(set_epoch):
            return set_epoch
    return None


def _set_loader_epoch(loader, epoch: int) -> None:
    """Tell a loader which epoch comes (see :func:`_epoch_setter`)."""
    set_epoch = _epoch_setter(loader)
    if set_epoch is not None:
        set_epoch(epoch)


def enable_compilation_cache(setting: bool | str) -> str | None:
    """Turn on JAX's persistent compilation cache (see ``TrainerOptions.compilation_cache``)."""
    if setting is False or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = setting if isinstance(setting, str) else os.environ.get(
        "FLAXLIGHT_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "flaxlight", "jax"))
    jax.config.update("jax_compilation_cache_dir", folder)
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default skips small programs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return folder


def _example_batches(loader) -> list:
    """A batch of each shape ``loader`` yields, when that is cheap to know: see
    :meth:`TrainerModule._compile_eval_ahead`."""
    if hasattr(loader, "example_batches"):
        return list(loader.example_batches())
    if isinstance(loader, (list, tuple)) and loader:  # other loaders may draw random numbers when iterated
        first, last = loader[0], loader[-1]
        return [first] if same_shapes(first, last) else [first, last]
    return []


def _safe_len(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _named(callbacks: Sequence[Callback]) -> list[tuple[str, Callback]]:
    """Stable names for callback states in checkpoints: class name, numbered when repeated."""
    counts: dict[str, int] = {}
    named = []
    for callback in callbacks:
        base = type(callback).__name__
        counts[base] = counts.get(base, 0) + 1
        named.append((base if counts[base] == 1 else f"{base}_{counts[base]}", callback))
    return named


def _host_accumulator(acc) -> dict | None:
    """The epoch's metric sums as JSON floats (exact: float32 -> float64 -> float32 round-trips)."""
    if acc is None:
        return None
    host = to_host(acc)
    return {"sums": {k: float(v) for k, v in host["sums"].items()}, "count": float(host["count"]),
            "nonfinite": int(host["nonfinite"])}


def _checkpointer_for(path) -> Checkpointer:
    """A read-only view of the checkpoints named by a run dir, a checkpoints dir or a step dir."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, HPARAMS_FILE)):
        path = os.path.join(path, CHECKPOINT_DIR)
    elif _step_in_path(path) is not None:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No checkpoint directory at {path}.")
    return Checkpointer(path, read_only=True)


def _step_in_path(path) -> int | None:
    """``.../checkpoints/120`` -> 120 (a step dir written by orbax), else None."""
    path = os.path.abspath(os.fspath(path))
    name = os.path.basename(path)
    if name.isdigit() and os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")):
        return int(name)
    return None


@dataclasses.dataclass
class _LoopState:
    """Where the loop is: what a checkpoint must hold to continue exactly from here."""

    running_log: "_RunningLog"
    epoch: int = 1
    phase: str = "epoch_end"  # "train" (mid-epoch), "val" (training done), "epoch_end"
    batch_index: int = 0
    acc: Any = None
    train_metrics: dict = dataclasses.field(default_factory=dict)


class _Interrupted(Exception):
    """Raised inside the loop after a SIGTERM/SIGINT, once the current step has finished."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


class _SignalGuard:
    """While training: SIGTERM/SIGINT set a flag the loop checks after each step.

    A second SIGINT falls through to Python's default (KeyboardInterrupt) for an impatient user.
    Only the main thread can install handlers; elsewhere the guard does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, trainer: "TrainerModule"):
        self.trainer = trainer
        self.previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.trainer._interrupt_signal = signum
        self.trainer._next_event_step = 0
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def __enter__(self):
        self.trainer._interrupt_signal = None
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.trainer._interrupt_signal = None
        return None


class _RunningLog:
    """Interval means of the train metrics at log points, read one log point late (no waiting)."""

    def __init__(self, trainer: "TrainerModule", prefix: str, suffix: str):
        self.trainer = trainer
        self.prefix, self.suffix = prefix, suffix
        self.pending: tuple[int, HostSnapshot] | None = None
        self.reset()

    def reset(self) -> None:
        """A new epoch: the sums start from zero again."""
        self.pending = None
        self.last_sums: dict[str, float] = {}
        self.last_count = 0.0

    def mark(self, step: int, acc: dict) -> dict[str, float]:
        """Start copying ``acc``; log and return the previous log point's values."""
        previous, self.pending = self.pending, (step, HostSnapshot(acc))
        return self._emit(previous) if previous else {}

    def flush(self) -> None:
        """Log the pending log point now (waits for its copy)."""
        if self.pending:
            pending, self.pending = self.pending, None
            self._emit(pending)

    def state_dict(self) -> dict:
        return {"last_sums": self.last_sums, "last_count": self.last_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pending = None
        self.last_sums = dict(state.get("last_sums", {}))
        self.last_count = float(state.get("last_count", 0.0))

    def _emit(self, pending: tuple[int, HostSnapshot]) -> dict[str, float]:
        step, snapshot = pending
        sums, count, nonfinite = snapshot.sums_and_count()
        self.trainer._note_nonfinite(step, nonfinite)
        examples = count - self.last_count
        if examples <= 0:
            return {}
        means = {
            f"{self.prefix}{name}{self.suffix}": (total - self.last_sums.get(name, 0.0)) / examples
            for name, total in sums.items()
        }
        self.last_sums, self.last_count = sums, count
        self.trainer._log(means, step=step)
        return means
