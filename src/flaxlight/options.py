"""``TrainerOptions``: every knob of the loop beyond the seed's constructor arguments, validated once.

Examples:
    >>> options = TrainerOptions(max_steps=1000, val_check_interval=200, log_every_n_steps=10)
    >>> options.steps_per_execution
    1
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Mapping, Sequence

import numpy as np

from flaxlight import distributed as dist
from flaxlight.messages import logger as messages, warn_at_user
from flaxlight.metrics import name_direction
from flaxlight.models import rngs_given_message
from flaxlight.optim import accumulated_updates
from flaxlight.registry import explicit_parameters

__all__ = ["TrainerOptions", "DEFAULT_MONITORS", "LIGHTNING_TRAINER_ARGUMENTS", "FOREIGN_TRAINER_METHODS",
           "FOREIGN_TRAINER_ARGUMENTS", "check_foreign_arguments", "foreign_argument_message",
           "check_monitors_are_numbers", "check_trainer_arguments", "declared_keywords", "foreign_method_message",
           "foreign_assignment_message", "lightning_argument_message", "rank_key", "written_otherwise"]

# The constructor arguments of TrainerModule itself (for messages).
TRAINER_ARGUMENTS = ("model_class", "model_hparams", "optimizer_hparams", "exmp_input", "seed", "logger_params",
                     "enable_progress_bar", "debug", "check_val_every_n_epoch")

# Lightning ``Trainer`` arguments that flaxlight spells otherwise or does not have: what to write
# instead ({value}: the value given). Kept as an extra hparam, such a keyword would do nothing.
LIGHTNING_TRAINER_ARGUMENTS = {
    "max_epochs": "the number of epochs is train_model's: trainer.train_model(train_loader, val_loader, "
                  "num_epochs={value!r})",
    "min_epochs": "flaxlight has no minimum number of epochs: train_model(num_epochs=...) sets the length, and an "
                  "EarlyStopping callback may stop at any validation; drop min_epochs",
    "min_steps": "flaxlight has no minimum number of steps: max_steps=N sets the length, and an EarlyStopping "
                 "callback may stop at any validation; drop min_steps",
    "accumulate_grad_batches": "it is an optimizer setting: optimizer_hparams={{..., 'accumulate_grad_batches': "
                               "{value!r}}} (a ready optax transformation: "
                               "optax.MultiSteps(tx, {value!r}).gradient_transformation())",
    "gradient_clip_val": "it is an optimizer setting: optimizer_hparams={{..., 'gradient_clip': {value!r}}} (clip by "
                         "global norm, Lightning's default algorithm; 'gradient_clip_value': {value!r} clips each "
                         "entry). flaxlight clips at global norm 1.0 by default; 'gradient_clip': None turns it off",
    "gradient_clip_algorithm": "the algorithm is the optimizer_hparams key: 'gradient_clip': v clips by global norm "
                               "('norm'), 'gradient_clip_value': v each entry ('value')",
    "precision": "it is an optimizer setting: optimizer_hparams={{..., 'precision': 'bf16'}} (bf16 compute with fp32 "
                 "master weights and optimizer state: Lightning's 'bf16-mixed') or 'fp32' (the default); fp16 "
                 "('16-mixed') is not offered: bf16 has float32's range and needs no loss scaling",
    "deterministic": "flaxlight has no such switch: a run is a function of its seeds (seed= for initialisation and "
                     "dropout, the loader's seed for the data order), and on CPU the same seeds give the same "
                     "parameters, bit for bit, on the same machine with the same number of cores (XLA splits a "
                     "matmul's work by thread count, so another core count rounds differently); on a GPU, also set "
                     "XLA_FLAGS=--xla_gpu_deterministic_ops=true before JAX starts; drop deterministic",
    "num_sanity_val_steps": "flaxlight runs no sanity validation: before the first epoch, train_model checks the "
                            "validation loader's first batch and traces the eval step on it (nothing is logged); "
                            "check_batches=False skips that check",
    "default_root_dir": "the run's folder is set by logger_params: logger_params={{'base_log_dir': {value!r}}} (runs "
                        "go to <base_log_dir>/<Model>/version_N) or {{'log_dir': ...}} for one folder",
    "logger": "loggers are given as loggers=[...] (flaxlight.loggers.TensorBoardLogger(log_dir), ...) or "
              "logger_params={{'logger_type': [...]}}; metrics.csv is always written",
    "limit_test_batches": "it is test()'s steps=N (batches to test on): trainer.test(data, steps=N); a fraction is "
                          "a shorter loader (e.g. arrays x[:n], y[:n])",
    "limit_predict_batches": "it is predict()'s steps=N (batches to take): trainer.predict(data, steps=N); a fraction "
                             "is a shorter loader (e.g. x[:n])",
    "overfit_batches": "flaxlight has no overfit mode: train and validate on the same few examples, e.g. "
                       "train_model((x[:n], y[:n]), (x[:n], y[:n]), batch_size=n)",
    "strategy": "several devices are used with distributed='data_parallel' or 'fsdp' (or mesh=...; see "
                "docs/distributed.md)",
    "accelerator": "JAX picks the platform (set JAX_PLATFORMS=cpu to force the CPU); distributed='data_parallel' "
                   "trains on all its devices; drop accelerator",
    "devices": "one device is used unless distributed='data_parallel' / 'fsdp' (all devices) or mesh=... (a "
               "jax.sharding.Mesh of the ones chosen) is given",
    "num_nodes": "several hosts start with flaxlight.distributed.initialize() in each process (see "
                 "docs/distributed.md), then distributed='data_parallel'",
    "detect_anomaly": "callbacks=[flaxlight.callbacks.NaNGuard()] stops at a non-finite loss; "
                      "jax.config.update('jax_debug_nans', True) finds the operation that made it",
    "reload_dataloaders_every_n_epochs": "the loaders are yours and are kept: the trainer calls a loader's "
                                         "set_epoch(epoch) before each epoch, where it may rebuild its data",
}

# Keras' model.compile(optimizer, loss, metrics) and a plain NNX loop's names for what a trainer
# is given otherwise: what to write instead ({value}: the value given, {name}: a class's name).
# Kept as an extra hparam, such a keyword would do nothing (the configured optimizer would train).
FOREIGN_TRAINER_ARGUMENTS = {
    "optimizer": "the optimizer is given as optimizer_hparams: a ready optax transformation, "
                 "optimizer_hparams=optax.adam(1e-3) (an nnx.Optimizer's transformation alone: nnx.Optimizer(model, "
                 "tx, wrt=nnx.Param) -> optimizer_hparams=tx), or flaxlight's dict form, optimizer_hparams="
                 "{{'optimizer': 'adam', 'lr': 1e-3}} (with a schedule fitted to the run and clipping)",
    "model": "the trainer builds the model itself, from its class and arguments: model_class={name}, "
             "model_hparams={{...}} (the arguments of {name}'s __init__ or fields; an NNX module's rngs come from "
             "seed=). A module trained elsewhere gives its weights afterwards (docs/models.md, 'Coming from a plain "
             "NNX training loop')",
    "loss": "the loss is your trainer's method: def loss_fn(self, params, batch, *, train, rng, state) returning "
            "(loss, metrics), e.g. optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() (docs/models.md)",
    "metrics": "metrics are the dict loss_fn returns: return loss, {{'acc': (logits.argmax(-1) == y).mean()}} (logged "
               "as train/acc and val/acc; metric objects such as flaxlight.metric_objects.F1 go in the same dict)",
}


def foreign_argument_message(owner: str, key: str, value: Any) -> str:
    """Why Keras' / a plain NNX loop's ``optimizer=``, ``model=``, ``loss=`` or ``metrics=`` given to
    a trainer is refused, and what to write.

    Examples:
        >>> print(foreign_argument_message("MyTrainer", "optimizer", "adam"))  # doctest: +ELLIPSIS
        MyTrainer got optimizer='adam', which flaxlight does not take: the optimizer is given as optimizer_hparams...
    """
    shown = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else \
        f"<{value.__name__ if isinstance(value, type) else 'a ' + type(value).__name__}>"
    name = value.__name__ if isinstance(value, type) else type(value).__name__ if key == "model" else "MyModel"
    hint = FOREIGN_TRAINER_ARGUMENTS[key].format(value=value, name=name)
    return (f"{owner} got {key}={shown}, which flaxlight does not take: {hint}. (Kept as an extra hparam, as other "
            f"unknown keywords are, it would change nothing; so it is refused. A hparam of your own trainer's under "
            f"this name: declare it in {owner}.__init__, e.g. def __init__(self, *args, {key}=..., **kwargs), and "
            f"pass it up, super().__init__(*args, {key}={key}, **kwargs), to have it recorded.)")


def check_foreign_arguments(trainer_class: type, kwargs: Mapping[str, Any]) -> None:
    """Refuse :data:`FOREIGN_TRAINER_ARGUMENTS` given to a trainer class whose ``__init__`` is
    flaxlight's own (before Python's "missing required positional argument": ``model=`` instead of
    ``model_class=`` is the likelier mistake). A class with an ``__init__`` of its own may take
    them itself; ``TrainerOptions.split_kwargs`` refuses those it passes up undeclared."""
    if any("__init__" in vars(klass) and not (klass.__module__ in ("flaxlight", "builtins")
                                              or klass.__module__.startswith("flaxlight."))
           for klass in trainer_class.__mro__):
        return
    for key in FOREIGN_TRAINER_ARGUMENTS:
        if key in kwargs:
            raise TypeError(foreign_argument_message(trainer_class.__name__, key, kwargs[key]))


# The seed's priority for choosing the best model: (metric, higher is better).
DEFAULT_MONITORS = (("val/val_metric", False), ("val/acc", True), ("val/loss", False))


class MetricNotLoggedError(KeyError):
    """A metric asked for (a monitor, a study's objective) is not among the metrics logged: a
    set-up error, raised at the first validation."""

    def __str__(self) -> str:  # the message as written (KeyError would quote it)
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass
class TrainerOptions:
    """Trainer settings beyond the seed's constructor arguments (pass them as keyword arguments).

    Attributes:
        monitor: metric that picks the best model, e.g. ``"val/acc"``; None uses the seed's
            priority (``val/val_metric`` lower, ``val/acc`` higher, ``val/loss`` lower).
        mode: ``"min"`` or ``"max"`` for ``monitor`` (default ``"min"``, as in Lightning).
        log_every_n_steps: how often running train metrics are logged (values are copied off the
            device asynchronously and logged one log point later, so the loop never waits; when
            no callback acts on them, the loop notes the points without stopping and logs them at
            its next stop: :attr:`Callback.on_log_may_lag`).
        enable_model_summary: print the model table (``print_tabulate``) at construction.
        enable_checkpointing: add a default :class:`ModelCheckpoint` (``monitor``/``mode`` as
            above, best and last kept) unless one is among the callbacks.
        max_steps: stop after this many train steps (batches; the trainer's ``global_step``),
            mid-epoch too; the learning-rate schedule is fitted to it. With
            ``accumulate_grad_batches=N`` an update takes N batches (and one more ends each
            epoch), so these are not optimizer updates: Lightning's ``max_steps`` counts updates,
            and its ``max_steps=U`` is ``max_steps=U * N`` here (said at the start of a run).
        max_time: stop after this much training time (seconds, ``timedelta`` or
            ``"DD:HH:MM:SS"``), via a :class:`Timer` callback.
        val_check_interval: also validate every N steps (global steps N, 2N, ...), not only at
            epoch ends, within the epochs ``check_val_every_n_epoch`` validates (with 2: in
            epochs 2, 4, ..., as in Lightning); with ``check_val_every_n_epoch=None``, only
            every N steps, in every epoch. Never twice at one step.
        limit_train_batches / limit_val_batches: batches per epoch / per validation (an int)
            or a fraction of the loader (a float in (0, 1]).
        fast_dev_run: True: one train, one validation and one test batch, one epoch, nothing
            written: a smoke test of the whole loop. An int N: N batches of each (fewer where
            a loader has fewer), as Lightning's ``fast_dev_run=N``; 0 is off.
        steps_per_execution: train steps fused into one dispatch (``lax.scan`` over a stacked
            block of batches); the same results as single steps (bitwise for the MLPs tested,
            with and without BatchNorm and dropout, on the CPU; XLA may compile a convolution differently
            inside the fused loop, which changes the last bits). Log points and ``on_step``
            callbacks fire at block ends (intervals that are multiples of it stay exact).
            ``"auto"``: single steps in the first epoch, which also times single steps and
            blocks of 16 on its first batch (on a copy of the state) and picks K from 1, 2, 4,
            8, 16, 32 so that a dispatch costs at most 3% of the work it launches (said once).
        prefetch: batches (or blocks) loaded, stacked and put on the device ahead of use by a
            background thread (for loaders whose host work is slow); 0, the default, loads them
            in the training thread, which is faster when a batch is cheap to make (the thread's
            hand-over halved the steps/s of a tiny MLP on a 2-core CPU). An :class:`ArrayLoader`
            on one device needs none: its data live on the device and each epoch is gathered
            there (see :class:`flaxlight.data.DeviceEpoch`).
        compilation_cache: JAX's persistent compilation cache, so a second start-up skips
            compiling: True uses ``$FLAXLIGHT_CACHE_DIR`` or ``~/.cache/flaxlight/jax``, a string
            names the folder (a file there is an error), False leaves JAX's settings alone. A
            cache folder the user already configured in JAX is kept.
        distributed: ``"data_parallel"``, ``"fsdp"`` or ``"auto"`` trains on all devices (all
            processes) over a ``jax.sharding.Mesh``; ``mesh=`` gives one explicitly. See
            :mod:`flaxlight.distributed`.
        check_batches: check each loader's first batch against ``exmp_input``. A batch shaped
            otherwise is an error where flaxlight's own loss feeds it to the model; with your
            ``loss_fn`` it is accepted when the loss traces on it (it may reshape the batch
            first), with your steps (``create_functions``) when the step traces on it (a
            generator fed latent z). False skips the check.
        sharding_rules: logical axis rules for parameters annotated with Linen's
            ``nn.with_logical_partitioning``: pairs ``(logical name, mesh axis or None)``, e.g.
            ``[("embed", None), ("mlp", "model")]``, as flax defines them.
        log_grad_norm: add ``train/grad_norm``, the global L2 norm of each step's gradients
            before clipping (of each batch's gradient, before ``accumulate_grad_batches`` adds
            them up; the frozen parameters' left out), computed in the step and averaged like the loss. It needs flaxlight's own
            train step (a ``loss_fn``); a ``create_functions`` of your own is an error with it.
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
    fast_dev_run: bool | int = False
    steps_per_execution: int | str = 1
    prefetch: int = 0
    compilation_cache: bool | str = True
    distributed: str | None = None
    check_batches: bool = True
    log_grad_norm: bool = False
    sharding_rules: Any = None

    def __post_init__(self):
        _require(self, "steps_per_execution", self.steps_per_execution == "auto" or _is_int(self.steps_per_execution, 1),
                 "a positive int, or 'auto' (measured in the first epoch)")
        _require(self, "log_every_n_steps", _is_int(self.log_every_n_steps, 1), "a positive int")
        _require(self, "log_grad_norm", isinstance(self.log_grad_norm, bool), "True or False")
        _require(self, "sharding_rules", self.sharding_rules is None or (
            isinstance(self.sharding_rules, (list, tuple)) and all(
                isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
                for rule in self.sharding_rules)), "a list of (logical name, mesh axis or None) pairs")
        _require(self, "prefetch", _is_int(self.prefetch, 0), "an int >= 0 (0: no background loading)")
        _require(self, "fast_dev_run", isinstance(self.fast_dev_run, bool) or _is_int(self.fast_dev_run, 0),
                 "True or False, or an int N (N train and N validation batches, one epoch, nothing written, as "
                 "Lightning's fast_dev_run=N; True is N=1, 0 is off)")
        if isinstance(self.val_check_interval, float):
            raise ValueError(fraction_of_an_epoch_message(self.val_check_interval))
        for name in ("max_steps", "val_check_interval"):
            value = getattr(self, name)
            _require(self, name, value is None or _is_int(value, 1), "a positive int (or None)")
        for name in ("limit_train_batches", "limit_val_batches"):
            value = getattr(self, name)
            fraction = isinstance(value, float) and 0 < value <= 1
            _require(self, name, value is None or _is_int(value, 1) or fraction,
                     "a number of batches (int >= 1) or a fraction in (0, 1]")
        _require(self, "mode", self.mode in ("min", "max"), "'min' or 'max'")
        if self.monitor:
            warn_if_mode_contradicts_name("the trainer", self.monitor, self.mode)
        _require(self, "distributed", self.distributed is None or self.distributed in dist.MODES,
                 f"one of {dist.MODES} or None")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], owner: str = "TrainerModule") -> "TrainerOptions":
        """The options among a trainer's extra keyword arguments; any other key is an error
        (a misspelt ``max_step=3`` must not train a whole epoch silently)."""
        options, extras = cls.split_kwargs(kwargs, owner, keep_extras=False)
        return options

    @classmethod
    def split_kwargs(cls, kwargs: Mapping[str, Any], owner: str | None = None, keep_extras: bool = True,
                     trainer_class: type | None = None) -> tuple["TrainerOptions", dict[str, Any]]:
        """``(options, extras)`` from a trainer's extra keyword arguments. As in the seed, keywords
        that are no option are kept (in the run's config: ``extra_args=...``) and listed once (not
        those ``trainer_class``'s ``__init__`` declares: its own, which its code reads); one
        close to an option's name (``max_step``, ``check_val_every_n_nepoch``) is an error naming it,
        and so is an argument of Lightning's ``Trainer`` (``max_epochs``, ``gradient_clip_val``, ...:
        :data:`LIGHTNING_TRAINER_ARGUMENTS`) or of ``train_model`` (``resume``, ``overwrite``, ...:
        :data:`TRAIN_MODEL_ARGUMENTS`; ``num_epochs`` and ``batch_size`` are recorded with a warning),
        with what flaxlight writes instead, unless
        ``trainer_class``'s ``__init__`` declares it (:func:`declared_keywords`: the class's own
        hparam, passed up to be recorded). ``owner``: the name in messages (default: the class's).

        Examples:
            >>> TrainerOptions.split_kwargs({"max_steps": 5, "extra_args": 1})[1]   # doctest: +SKIP
            {'extra_args': 1}
        """
        owner = owner or (trainer_class.__name__ if trainer_class is not None else "TrainerModule")
        names = [f.name for f in dataclasses.fields(cls)]
        known = names + list(TRAINER_ARGUMENTS) + ["callbacks", "loggers", "mesh"]
        declared = declared_keywords(trainer_class) if trainer_class is not None else set()
        extras = {key: value for key, value in kwargs.items() if key not in names}
        for key, value in extras.items():
            if key in declared:  # the subclass's own keyword, whatever its name
                continue
            if key in LIGHTNING_TRAINER_ARGUMENTS:
                raise TypeError(lightning_argument_message(owner, key, value))
            if key in TRAIN_MODEL_ARGUMENTS:
                raise TypeError(train_model_argument_message(owner, key, value))
            if key == "rngs":  # NNX's habit: it would be kept as an extra hparam and do nothing
                raise TypeError(rngs_given_message(f"{owner} got", value))
            if key in FOREIGN_TRAINER_ARGUMENTS:  # Keras' / nnx.Optimizer's spelling: the same
                raise TypeError(foreign_argument_message(owner, key, value))
            if key in RECORDED_TRAIN_MODEL_ARGUMENTS:
                warn_at_user(f"{owner} got {key}={value!r}: it is recorded in the run's config, but only "
                             f"train_model's {key} is used (trainer.train_model(..., {key}={value!r})). Declare "
                             f"{key} in {owner}.__init__ (and pass it up) to record it without this warning.")
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.8 if keep_extras else 0.6)
            if close or not keep_extras:
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{owner} got an unknown keyword argument {key!r}.{hint} It takes the seed's arguments "
                                f"({', '.join(TRAINER_ARGUMENTS)}), callbacks, loggers, mesh, and the TrainerOptions "
                                f"fields: {', '.join(names)}.")
        undeclared = sorted(key for key in extras if key not in declared)  # a declared one is the class's own
        if undeclared:
            messages.info(f"{owner}: extra hparams kept in the run's config (no trainer option reads them): "
                          f"{', '.join(undeclared)}.")
        return cls(**{key: value for key, value in kwargs.items() if key in names}), extras

    def reached_max_steps(self, step: int) -> bool:
        return self.max_steps is not None and step >= self.max_steps

    def max_steps_note(self, plan: Any, steps_per_epoch: int | None) -> str | None:
        """What ``max_steps`` gives under ``accumulate_grad_batches`` (an
        :class:`~flaxlight.optim.OptimizerPlan`'s), said at the start of a run; None without both."""
        every = getattr(getattr(plan, "config", None), "accumulate_grad_batches", 1)
        if self.max_steps is None or every == 1:
            return None
        updates = accumulated_updates(self.max_steps, every, steps_per_epoch)
        return (f"max_steps={self.max_steps} counts batches (train steps), not optimizer updates: with "
                f"accumulate_grad_batches={every} (an update every {every} batches, and one at each epoch's end; "
                f"{steps_per_epoch} batches per epoch) it gives {updates} optimizer updates (the batches after the "
                f"last of them, when max_steps ends an epoch early, wait in the optimizer state for a resumed run). "
                f"Lightning's max_steps "
                f"counts updates: to port its max_steps=U, write max_steps=U * {every}.")

    def monitored(self, metrics: Mapping[str, float]) -> tuple[str, bool]:
        """``(key, larger_is_better)`` that picks the best model among validation ``metrics``:
        ``monitor``/``mode``, or else the first of the seed's priority (:data:`DEFAULT_MONITORS`)
        present. A clear error when it is absent (a misspelt ``monitor`` included)."""
        candidates = ((self.monitor, self.mode == "max"),) if self.monitor else DEFAULT_MONITORS
        for key, larger_is_better in candidates:
            if key in metrics:
                return key, larger_is_better
        raise MetricNotLoggedError(self.missing_monitor_message(metrics))

    def missing_monitor_message(self, metrics: Mapping[str, float], logged_before: Sequence[str] = (),
                                ahead: bool = False) -> str:
        """Why the best model cannot be picked among a validation's ``metrics`` (the eval step's
        and those logged during it): no default monitor there, or ``monitor`` absent: a train
        metric, one logged only at other times (``logged_before``: the names logged outside the
        validation), an eval metric's name written another way (``val_loss``), or never logged
        (``ahead``: before training, where nothing of the user's runs during validations to log it).

        Examples:
            >>> print(TrainerOptions(monitor="val_loss").missing_monitor_message({"val/loss": 0.1}))  # doctest: +ELLIPSIS
            The best model is picked by monitor 'val_loss', which is not a metric of this run: ... Did you mean 'val/loss'? ...
        """
        fix = "Pass monitor='val/<name>' (and mode='min'/'max') to the trainer, or override is_new_model_better."
        if not self.monitor:
            return (f"None of the metrics {[key for key, _ in DEFAULT_MONITORS]} that pick the best model by default "
                    f"is among the validation metrics {sorted(metrics)}. {fix}")
        close = written_otherwise(self.monitor, metrics) or (None if self.monitor.startswith("train/") else next(
            iter(difflib.get_close_matches(self.monitor, list(metrics), n=1, cutoff=0.7)), None))  # not val/f1 -> val/acc
        hint = f" Did you mean {close!r}?" if close else ""
        said = f"The best model is picked by monitor {self.monitor!r}"
        where = (f"the best model (and ModelCheckpoint's ranking) is chosen at each validation among the eval step's "
                 f"metrics {sorted(metrics)} and the values logged during the validation")
        during = (" A value counts when it is logged during the validation before the best model is chosen: by the "
                  "trainer's on_validation_epoch_end, or a callback's on_validation_end (ModelCheckpoint runs after "
                  "the other callbacks; a callback reading trainer.is_best_validation must come after the one that "
                  "logs it).")
        if self.monitor.startswith("train/"):
            return (f"{said}, a train metric, but {where}.{hint} Monitor one of those; to stop on a train metric, use "
                    f"EarlyStopping(monitor={self.monitor!r}).")
        if self.monitor in logged_before:
            return f"{said}, which is logged, but not during this validation: {where}.{hint}{during}"
        if close and not self.monitor.startswith("val/"):  # Lightning's "val_loss"
            return (f"{said}, which is not a metric of this run: flaxlight names validation metrics 'val/<name>' "
                    f"(Lightning's 'val_loss' is 'val/loss').{hint} {fix}")
        if ahead:
            return (f"{said}, which no validation of this run logs: it is not among the eval step's metrics "
                    f"{sorted(metrics)}, and nothing of yours runs during a validation to log it (an "
                    f"on_validation_epoch_end override, or a callback's on_validation_end or on_log).{hint} {fix}")
        return (f"{said}, which was never logged: it is not among the validation metrics {monitorable(metrics)}.{hint}"
                f"{during} {fix}")

    def describe_monitor(self, metrics: Mapping[str, float]) -> str:
        """What picks the best model, said once at the first validation (a fallback names why)."""
        key, larger = self.monitored(metrics)
        said = f"The best model is picked by {key} ({'max' if larger else 'min'})"
        if self.monitor:
            return said + "."
        return said + (f", the default among the validation metrics {monitorable(metrics)}; pass "
                       f"monitor='val/<name>', mode='min'/'max' to choose another.")

    def is_better(self, new: Mapping[str, float], old: Mapping[str, float] | None) -> bool:
        """Whether ``new`` validation metrics beat ``old`` (the best so far; None: there is none) on
        ``monitor``/``mode``, or else by the seed's priority (:data:`DEFAULT_MONITORS`).

        A NaN ranks below every number (as in Lightning's ``ModelCheckpoint``): a finite value
        beats it, it never beats a finite one. Two NaNs cannot be ranked, so the newer counts as
        better: while every validation is NaN, the best model is the newest validated one.

        Examples:
            >>> options = TrainerOptions(monitor="val/acc", mode="max")
            >>> options.is_better({"val/acc": 0.5}, {"val/acc": float("nan")})
            True
            >>> options.is_better({"val/acc": float("nan")}, {"val/acc": 0.5})
            False
        """
        key, larger_is_better = self.monitored(new)
        if old is None:
            return True
        return rank_key(new[key], 1, larger_is_better) < rank_key(old[key], 0, larger_is_better)  # new is the newer

    def nan_monitor_message(self, metrics: Mapping[str, float], epoch: int, step: int) -> str | None:
        """The warning for a validation whose monitored value is NaN (None when it is not)."""
        key, _ = self.monitored(metrics)
        if not _is_nan(metrics[key]):
            return None
        return (f"The monitored metric {key} is NaN at the validation of epoch {epoch} (step {step}). A NaN ranks "
                f"below every number: it never replaces a best model whose {key} is a number, and the next number "
                f"beats it; only while every validation gives NaN does the newest count as the best (test(), "
                f"which='best' and metrics/best_eval.json follow). Check how {key} is computed (a 0/0, such as the "
                f"precision of a class the model never predicts, is NaN) or monitor another metric. (Said once.)")


def declared_keywords(trainer_class: type) -> set[str]:
    """The keywords that ``trainer_class``'s ``__init__``, or a base class's, declares by name
    (not through ``**kwargs``): the class's own hparams, which a subclass passes up to
    ``TrainerModule.__init__`` to have them recorded, whatever their names (``strategy``).

    Examples:
        >>> class Beam:
        ...     def __init__(self, *args, strategy="greedy", **kwargs): ...
        >>> declared_keywords(Beam)
        {'strategy'}
    """
    return {name for klass in trainer_class.__mro__ if "__init__" in vars(klass)
            for name in explicit_parameters(vars(klass)["__init__"])}


# train_model's own keywords: given to the constructor, each would be kept as an extra hparam and
# do nothing (a run that was to resume starts over). Refused; num_epochs and batch_size, which a
# run may well record as hparams, are warned of (train_model's default is 500 epochs).
TRAIN_MODEL_ARGUMENTS = ("resume", "resume_from", "overwrite", "steps_per_epoch", "test_loader")
RECORDED_TRAIN_MODEL_ARGUMENTS = ("num_epochs", "batch_size")


def train_model_argument_message(owner: str, key: str, value: Any) -> str:
    """Why a ``train_model`` keyword given to a trainer's constructor is refused, and what to write.

    Examples:
        >>> print(train_model_argument_message("MyTrainer", "resume", True))  # doctest: +ELLIPSIS
        MyTrainer got resume=True, a keyword of train_model, not of the trainer: pass it there, trainer.train_model(..., resume=True). ...
    """
    return (f"{owner} got {key}={value!r}, a keyword of train_model, not of the trainer: pass it there, "
            f"trainer.train_model(..., {key}={value!r}). (Kept as an extra hparam, as other unknown keywords are, "
            f"it would change nothing; so it is refused. A hparam of your own trainer's under this name: declare "
            f"it in {owner}.__init__ and pass it up, as for any hparam.)")


def monitorable(metrics: Mapping[str, Any]) -> list[str]:
    """The names of ``metrics`` a monitor may name, sorted: those of one number (a metric object's
    array result, a confusion matrix, ranks nothing).

    Examples:
        >>> monitorable({"val/loss": 0.3, "val/confusion": np.zeros((3, 3)), "val/acc": np.float32(0.9)})
        ['val/acc', 'val/loss']
    """
    return sorted(name for name, value in metrics.items() if np.size(value) == 1)


def check_monitors_are_numbers(monitors: Sequence[tuple[str, str | None]], shapes: Mapping[str, tuple]) -> None:
    """Refuse a monitor (``(who, name)`` pairs) that names a validation metric whose value is an
    array of more than one number (``shapes``: the eval step's metric objects' results, traced ahead).

    Examples:
        >>> check_monitors_are_numbers([("EarlyStopping", "val/cm")], {"cm": (3, 3)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: EarlyStopping monitors 'val/cm', a metric object's result of shape (3, 3): ...
    """
    for who, monitor in monitors:
        shape = shapes.get(monitor[len("val/"):]) if monitor and monitor.startswith("val/") else None
        if shape is not None and int(np.prod(shape)) != 1:
            raise ValueError(
                f"{who} monitors {monitor!r}, a metric object's result of shape {tuple(shape)}: a monitor must be one "
                f"number (such a result is kept in trainer.history and metrics/*.json, not logged). Monitor a "
                f"metric of one number, e.g. an F1 object's 'val/f1', or have the object's compute() return a dict "
                f"of numbers (logged as '{monitor}/<key>').")


# Lightning's / Keras' method names that a trainer of theirs has and flaxlight's has not: what to
# call instead (TrainerModule.__getattr__ says it for a name not found otherwise).
FOREIGN_TRAINER_METHODS = {
    "fit": "Lightning's trainer.fit(model, train_dl, val_dl) and Keras' model.fit(x, y, epochs=10) are "
           "trainer.train_model(train_loader, val_loader, num_epochs=10) (arrays: trainer.train_model((x, y), "
           "(x_val, y_val), num_epochs=10, batch_size=64); a LightningDataModule: dm.setup('fit'), then "
           "trainer.train_model(dm.train_dataloader(), dm.val_dataloader()))",
    "validate": "Lightning's trainer.validate(model, val_dl) is trainer.eval_model(val_loader, log_prefix='val/') "
                "(the model as it is; arrays: eval_model((x, y), log_prefix='val/', batch_size=256)), or "
                "trainer.test(data) for the best checkpoint's metrics, logged and saved",
    "evaluate": "Keras' model.evaluate(x, y, batch_size=256) is trainer.eval_model((x, y), log_prefix='val/', "
                "batch_size=256) (the model as it is), or trainer.test((x, y), batch_size=256) for the best "
                "checkpoint's metrics, logged and saved",
    "log": "Lightning's self.log('acc', acc) in a step is a value of loss_fn's metrics: return loss, {'acc': acc} "
           "(logged as train/acc, val/acc, test/acc; per-head dicts {'cls': {'acc': acc}} as cls/acc); from a "
           "callback or a hook, outside the step, trainer.log_metrics({'val/f1': f1})",
    "log_dict": "Lightning's self.log_dict({'acc': acc, ...}) in a step is loss_fn's metrics dict: return loss, "
                "{'acc': acc, ...} (logged as train/acc, val/acc, test/acc); from a callback or a hook, outside the "
                "step, trainer.log_metrics({'val/f1': f1, ...})",
    "compile": "Keras' model.compile(optimizer, loss, metrics) is the trainer's construction: "
               "optimizer_hparams={'optimizer': 'adam', 'lr': 1e-3} for the optimizer, and loss_fn returning "
               "(loss, {'acc': ...}) for the loss and the metrics (the steps are jitted by the trainer)",
    "summary": "Keras' model.summary() is trainer.print_tabulate(exmp_input) (printed when the trainer is built "
               "unless enable_model_summary=False)",
    "save_checkpoint": "Lightning's trainer.save_checkpoint(path) is trainer.save_model() (a checkpoint of the "
                       "current step in <log_dir>/checkpoints/<step>; the run's folder is set by logger_params)",
    "freeze": "Lightning's module.freeze() for inference needs nothing here: predict(), test() and export() run "
              "the model in eval mode and compute no gradients. Layers kept fixed while training (Lightning's "
              "BaseFinetuning.freeze(self.backbone), Keras' layer.trainable = False) are an optimizer setting, "
              "optimizer_hparams={..., 'freeze': ['Dense_0']} (layer or parameter paths), given when the trainer is "
              "built or loaded: MyTrainer.load_from_checkpoint(run, exmp_input=x[:1], optimizer_hparams={'optimizer': "
              "'adamw', 'lr': 1e-3, 'freeze': ['Dense_0']}, logger_params={'log_dir': 'runs/frozen'}) (docs/models.md, "
              "'Freezing layers')",
    "unfreeze": "Lightning's unfreeze() (BaseFinetuning's unfreeze_and_add_param_group): freezing is a setting of a "
                "run's optimizer, so unfreezing is a new run from the frozen one's checkpoint with optimizer_hparams "
                "that hold no 'freeze': MyTrainer.load_from_checkpoint('runs/frozen', exmp_input=x[:1], "
                "optimizer_hparams={'optimizer': 'adamw', 'lr': 1e-4}, logger_params={'log_dir': 'runs/unfrozen'}); in "
                "one run, a backbone group whose rate is 0 until an epoch (docs/models.md, 'Gradual unfreezing')",
    **dict.fromkeys(("to_onnx", "to_torchscript"),
                    "Lightning's to_onnx(path) / to_torchscript() is trainer.export(path): a jax.export (StableHLO) "
                    "artifact of the eval-mode forward pass with the trained variables, which plain JAX serves "
                    "(flaxlight.load_exported(path)(x), or jax.export.deserialize(...).call(x)); there is no ONNX or "
                    "TorchScript file. After training it exports the best checkpoint; trainer.export(path, "
                    "which='current') exports the weights as they are now, as Lightning's do (docs/models.md, "
                    "'Serving without flaxlight')"),
    "stop_training": "Keras' model.stop_training = True (in a callback) is trainer.should_stop = True (Lightning's "
                     "name), or trainer.stop('why') to give the reason the run's end message shows",
    "trainable": "Keras' model.trainable = False is an optimizer setting here: layers kept fixed while training are "
                 "optimizer_hparams={..., 'freeze': ['Dense_0']} (layer or parameter paths, given when the trainer is "
                 "built or loaded); for inference nothing is needed: predict(), test() and export() run the model in "
                 "eval mode and compute no gradients (docs/models.md, 'Freezing layers')",
    "save": "Keras' model.save('m.keras'): checkpoints are written while training (the best and the last, in "
            "<log_dir>/checkpoints/<step>/), and trainer.save_model() writes one of the trainer's state now; "
            "keras.models.load_model is MyTrainer.load_from_checkpoint(log_dir, exmp_input=x[:1]); a model to serve "
            "without flaxlight (Keras' model.export) is trainer.export(path)",
    "save_weights": "Keras' model.save_weights(path) is trainer.save_model() (a checkpoint of the trainer's state now "
                    "in <log_dir>/checkpoints/<step>/; the arrays themselves are trainer.state.params and "
                    "trainer.state.batch_stats), loaded by MyTrainer.load_from_checkpoint(log_dir, exmp_input=x[:1])",
    "load_weights": "Keras' model.load_weights(path) is MyTrainer.load_from_checkpoint(log_dir, exmp_input=x[:1]) (a "
                    "new trainer with the run's best checkpoint; which='last' for its newest), or trainer.load_model() "
                    "into this trainer from its own run (load_model(step) for another step); load_weights(path, "
                    "skip_mismatch=True) for a new head is a new trainer given the loaded run's matching layers "
                    "(docs/models.md, 'A new head: restore only the backbone')",
    "eval": "Lightning's (and NNX's) model.eval() needs nothing here: validation, test(), predict() and export() run "
            "the model in eval mode (train=False), and the train step in training mode",
    "train": "NNX's and PyTorch's model.train() needs nothing here: the trainer switches modes itself, the train step "
             "running the model in training mode (train=True; an NNX module's model.train() is called for it) and "
             "validation, test(), predict() and export() in eval mode. To train, call "
             "trainer.train_model(train_loader, val_loader, num_epochs=10) (docs/models.md, 'Coming from a plain NNX "
             "training loop')",
    "half": "Lightning's model.half(): fp16 is not offered (bf16 has float32's range and needs no loss scaling); "
            "bf16 computing is the optimizer setting optimizer_hparams={..., 'precision': 'bf16'}, and "
            "trainer.export(path, precision='bf16') exports a bf16 forward pass",
    "logged_metrics": "Lightning's trainer.logged_metrics is trainer.callback_metrics: the latest value of each "
                      "metric logged (train/..., val/..., and what trainer.log_metrics adds); each epoch's and each "
                      "validation's values are the rows of trainer.history (also <log_dir>/metrics.csv)",
    "estimated_stepping_batches": "Lightning's trainer.estimated_stepping_batches (the run's optimizer updates, read "
                                  "in configure_optimizers to size a schedule) needs no reading here: flaxlight's "
                                  "schedules are fitted to the run's length (optimizer_hparams={..., 'schedule': "
                                  "'warmup_cosine'}), a function given as optimizer_hparams is called with it "
                                  "(total_steps -> an optax transformation), and an init_optimizer(num_epochs, "
                                  "num_steps_per_epoch) override gets it too. Once train_model has built the "
                                  "optimizer, trainer.optimizer_plan.num_updates is that count "
                                  "(trainer.optimizer_plan.total_steps counts train steps, batches)",
    "lightning_module": "Lightning's trainer.lightning_module is the trainer itself here: the model, its hooks and "
                        "the loop are one object (the parameters are trainer.state.params, the module trainer.model, "
                        "the model bound to its trained variables trainer.bind_model())",
    **dict.fromkeys(("optimizers", "manual_backward", "toggle_optimizer"),
                    "Lightning's manual optimization (self.optimizers(), manual_backward, opt.step()) is a train step "
                    "of yours: create_functions returns a pure (state, batch) -> (state, metrics) that updates the "
                    "optimizer of state.tx with state.apply_gradients and a second one kept in a field of your "
                    "TrainState subclass (docs/optimizers.md, 'Several optimizers')"),
}


def foreign_method_message(owner: str, name: str) -> str | None:
    """What to call instead of Lightning's / Keras' trainer method ``name`` (None for another name).

    Examples:
        >>> print(foreign_method_message("MyTrainer", "fit"))  # doctest: +ELLIPSIS
        'MyTrainer' object has no attribute 'fit': Lightning's trainer.fit(...) ... trainer.train_model(...)...
    """
    hint = FOREIGN_TRAINER_METHODS.get(name)
    if hint is None:
        return None
    return (f"{owner!r} object has no attribute {name!r}: {hint}. See docs/from-lightning.md and "
            f"docs/from-keras.md.")


def foreign_assignment_message(owner: str, name: str, value: Any) -> str:
    """Why assigning Keras' ``model.<name>`` (``stop_training``, ``trainable``) on a trainer is
    refused: as a plain attribute it would be kept and change nothing.

    Examples:
        >>> print(foreign_assignment_message("MyTrainer", "stop_training", True))  # doctest: +ELLIPSIS
        MyTrainer.stop_training = True would change nothing: Keras' ... trainer.should_stop = True ...
    """
    return f"{owner}.{name} = {value!r} would change nothing: {FOREIGN_TRAINER_METHODS[name]}."


def lightning_argument_message(owner: str, key: str, value: Any) -> str:
    """Why a Lightning ``Trainer`` argument given to a trainer is refused, and what to write.

    Examples:
        >>> print(lightning_argument_message("MyTrainer", "max_epochs", 3))  # doctest: +ELLIPSIS
        MyTrainer got max_epochs=3, an argument of Lightning's Trainer and none of flaxlight's: ... num_epochs=3)...
    """
    hint = LIGHTNING_TRAINER_ARGUMENTS[key].format(value=value)
    return (f"{owner} got {key}={value!r}, an argument of Lightning's Trainer and none of flaxlight's: "
            f"{hint}. (Kept as an extra hparam, as other unknown keywords are, it would change nothing; so it is "
            f"refused. A hparam of your own trainer's under this name: declare it in {owner}.__init__, e.g. "
            f"def __init__(self, *args, {key}={value!r}, **kwargs), and pass it up, super().__init__(*args, "
            f"{key}={key}, **kwargs), to have it recorded. See docs/from-lightning.md.)")


def warn_if_mode_contradicts_name(owner: str, monitor: str, mode: str) -> None:
    """Warn (at the user's line) when ``mode`` keeps the opposite of what ``monitor``'s name reads
    as: ``monitor="val/acc"`` with the default ``mode="min"`` (Lightning's default too) keeps the
    model with the lowest accuracy.

    Examples:
        >>> warn_if_mode_contradicts_name("EarlyStopping", "val/acc", "max")  # no warning
    """
    named = name_direction(monitor)
    if named is None or named == mode:
        return
    kept = "lowest" if mode == "min" else "highest"
    warn_at_user(f"{owner}: monitor={monitor!r} with mode={mode!r} keeps the {kept} {monitor}, but its name reads as a "
                 f"metric to {'maximize' if named == 'max' else 'minimize'}: pass mode={named!r}. (mode defaults to "
                 f"'min', as in Lightning; if the {kept} is meant, ignore this warning.)")


def check_trainer_arguments(*, model_hparams: Any, enable_progress_bar: Any, debug: Any, callbacks: Any,
                            loggers: Any, check_val_every_n_epoch: Any) -> None:
    """The seed's constructor arguments of the wrong kind, named with the value and the fix."""
    if model_hparams is not None and not isinstance(model_hparams, Mapping):
        raise TypeError(f"model_hparams must be a dict of the model's arguments, got {model_hparams!r}; "
                        f"e.g. model_hparams={{'hidden_dims': [64]}}.")
    for name, value in (("enable_progress_bar", enable_progress_bar), ("debug", debug)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {value!r}.")
    for name, value, example in (("callbacks", callbacks, "ModelCheckpoint()"), ("loggers", loggers, "CSVLogger(dir)")):
        if value is not None and not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list, got {type(value).__name__} {value!r}; e.g. {name}=[{example}].")
    if check_val_every_n_epoch is not None and not _is_int(check_val_every_n_epoch, 1):
        raise ValueError(f"check_val_every_n_epoch must be a positive int, or None to validate only every "
                         f"val_check_interval steps; got {check_val_every_n_epoch!r}.")


def written_otherwise(name: str, names: Sequence[str]) -> str | None:
    """The one of ``names`` that ``name`` writes another way (case, and ``_ - . /`` between its
    words): Lightning's ``val_loss`` for flaxlight's ``val/loss``; None if none or ``name`` itself.

    Examples:
        >>> written_otherwise("val_loss", ["val/loss", "val/acc"]), written_otherwise("val/f1", ["val/acc"])
        ('val/loss', None)
    """
    def plain(text: str) -> str:
        return re.sub(r"[^0-9a-z]+", "/", text.lower()).strip("/")

    found = [other for other in names if other != name and plain(other) == plain(name)]
    return found[0] if len(found) == 1 else None


def rank_key(value: Any, order: int, larger_is_better: bool = False) -> tuple:
    """The one rule that ranks validations by a monitored ``value`` (the trainer's best model,
    :meth:`TrainerOptions.is_better`, and ``ModelCheckpoint``'s ranking): a smaller key ranks
    higher. Numbers rank by value (equal ones tie); a NaN ranks below every number, and of two
    NaNs, which cannot be compared, the newer (larger ``order``, e.g. the step) ranks higher, so
    while every validation is NaN the newest is the best.

    Examples:
        >>> rank_key(0.5, order=8) < rank_key(float("nan"), order=16)
        True
        >>> rank_key(float("nan"), order=16) < rank_key(float("nan"), order=8)
        True
        >>> rank_key(0.9, order=8, larger_is_better=True) < rank_key(0.5, order=16, larger_is_better=True)
        True
    """
    if _is_nan(value):
        return (1, -order)
    return (0, -float(value) if larger_is_better else float(value))


def _is_nan(value: Any) -> bool:
    """Whether a metric value is a NaN number (an array or a non-number is not)."""
    try:
        return np.ndim(value) == 0 and bool(np.isnan(value))
    except TypeError:
        return False


def fraction_of_an_epoch_message(value: float) -> str:
    """Why a float ``val_check_interval`` (Lightning's fraction of an epoch) is refused, and what to write.

    Examples:
        >>> print(fraction_of_an_epoch_message(1.0))  # doctest: +ELLIPSIS
        val_check_interval=1.0 is Lightning's default, a whole epoch: ... drop it.
    """
    if value == 1.0:
        return ("val_check_interval=1.0 is Lightning's default, a whole epoch: flaxlight validates at each epoch's end "
                "without it (every check_val_every_n_epoch epochs): drop it.")
    if 0 < value < 1:
        return (f"val_check_interval={value!r} is Lightning's fraction of an epoch; flaxlight takes a number of train "
                f"steps (batches), counted over the run: val_check_interval=round({value!r} * batches per epoch) "
                f"(with 20 batches per epoch: {max(1, round(value * 20))}), and validates at each epoch's end as well. "
                f"A whole epoch (1.0) is the default: drop it for that.")
    return (f"val_check_interval must be a positive int (a number of train steps), or None; got {value!r}. "
            f"(Lightning's float is a fraction of an epoch, in (0, 1].)")


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _require(options: TrainerOptions, name: str, ok: bool, expected: str) -> None:
    """The one validation helper: ``name`` must be ``expected``; the error names both."""
    if not ok:
        raise ValueError(f"{name} must be {expected}; got {getattr(options, name)!r}.")
