"""``TrainerModule``: the training loop of the UvA "Research Projects with JAX" guide, kept fast.

Subclass it and either override :meth:`TrainerModule.loss_fn` (the common way: the trainer builds
the train and eval steps) or :meth:`TrainerModule.create_functions` (full control, the seed's way).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from flaxlight.checkpoint import Checkpointer
from flaxlight.data import check_batch, check_input_shapes
from flaxlight.loggers import CSVLogger, Logger, LoggerCollection, TensorBoardLogger, tensorboard_available
from flaxlight.metrics import HostSnapshot, accumulate, batch_size, init_accumulator, read_means
from flaxlight.optim import make_optimizer
from flaxlight.progress import format_metrics, is_ci, progress
from flaxlight.state import TrainState
from flaxlight.step import TrainStep

__all__ = ["TrainerModule", "TrainerOptions"]

HPARAMS_FILE = "hparams.yaml"
CHECKPOINT_DIR = "checkpoints"
LOGGER_TYPES = ("csv", "tensorboard")
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
    """

    monitor: str | None = None
    mode: str = "min"
    log_every_n_steps: int = 50
    enable_model_summary: bool = True

    def __post_init__(self):
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
        self.model = self.model_class(**self.model_hparams)
        if self.options.enable_model_summary:
            self.print_tabulate(exmp_input)
        self.init_logger(logger_params)
        self.create_jitted_functions()
        self.init_model(exmp_input)

    # ------------------------------------------------------------------ model and optimizer
    def init_model(self, exmp_input: Any) -> None:
        """Initialise parameters (and batch stats) from ``exmp_input``; no optimizer yet."""
        model_rng = jax.random.PRNGKey(self.seed)
        model_rng, init_rng = jax.random.split(model_rng)
        variables = self.run_model_init(_as_input_list(exmp_input), init_rng)
        self.state = TrainState.create(
            apply_fn=self.model.apply,
            params=variables["params"],
            batch_stats=variables.get("batch_stats"),
            rng=model_rng,
            tx=None,
        )

    def run_model_init(self, exmp_input: Sequence[Any], init_rng) -> dict:
        """``model.init`` in training mode, with ``params`` and ``dropout`` RNG streams."""
        params_rng, dropout_rng = jax.random.split(init_rng)
        return self.model.init({"params": params_rng, "dropout": dropout_rng}, *exmp_input, train=True)

    def print_tabulate(self, exmp_input: Any) -> None:
        """Print the model's layers, shapes and parameter counts (``flax.linen`` tabulate)."""
        rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
        print(self.model.tabulate(rngs, *_as_input_list(exmp_input), train=True,
                                 console_kwargs={"width": 120, "force_terminal": sys.stdout.isatty()}))

    def init_optimizer(self, num_epochs: int, num_steps_per_epoch: int) -> None:
        """Build the optimizer for ``num_epochs * num_steps_per_epoch`` updates; keep params."""
        tx = make_optimizer(self.optimizer_hparams, total_steps=num_epochs * num_steps_per_epoch)
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
        step = TrainStep(self.loss_fn)
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

        def train_and_accumulate(state, acc, batch):
            state, metrics = train_step(state, batch)
            return state, accumulate(acc, metrics, batch_size(batch))

        def eval_and_accumulate(state, acc, batch):
            return accumulate(acc, eval_step(state, batch), batch_size(batch))

        self._step_shapes = {"train": train_step, "eval": eval_step}
        if self.debug:
            print("debug=True: the train and eval steps run un-jitted (prints and breakpoints work).")
            self.train_step, self.eval_step = train_step, eval_step
            self._train_and_accumulate, self._eval_and_accumulate = train_and_accumulate, eval_and_accumulate
        else:
            self.train_step = jax.jit(train_step, donate_argnums=0)
            self.eval_step = jax.jit(eval_step)
            self._train_and_accumulate = jax.jit(train_and_accumulate, donate_argnums=0)
            self._eval_and_accumulate = jax.jit(eval_and_accumulate)

    def _zero_accumulator(self, kind: str, batch) -> dict:
        """Zeroed metric sums for this step kind and batch structure (shapes traced once)."""
        key = (kind, jax.tree.structure(batch), tuple((np.shape(x), np.result_type(x)) for x in jax.tree.leaves(batch)))
        if key not in self._acc_templates:
            if kind == "train":
                _, metrics = jax.eval_shape(self._step_shapes["train"], self.state, batch)
            else:
                metrics = jax.eval_shape(self._step_shapes["eval"], self.state, batch)
            if not isinstance(metrics, Mapping):
                raise TypeError(f"The {kind} step must return metrics as a dict; got {type(metrics).__name__}.")
            self._acc_templates[key] = init_accumulator(metrics)
        return self._acc_templates[key]

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
    ) -> dict[str, float]:
        """Train ``num_epochs``, validate every ``check_val_every_n_epoch``, keep the best model.

        Returns the best validation metrics merged with that epoch's train metrics and, when a
        ``test_loader`` is given, the best model's ``test/...`` metrics.
        """
        if not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}.")
        if val_loader is not None and self.check_val_every_n_epoch > num_epochs:
            raise ValueError(
                f"check_val_every_n_epoch={self.check_val_every_n_epoch} > num_epochs={num_epochs}: no validation "
                f"would run, so there would be no best model to test. Lower check_val_every_n_epoch or train longer."
            )
        if steps_per_epoch is None:
            steps_per_epoch = _loader_length(train_loader, "train_loader")
        self.init_optimizer(num_epochs, steps_per_epoch)
        self.global_step = int(self.state.step)
        self._write_hparams()
        self.on_training_start()
        best_eval_metrics: dict | None = None
        try:
            epochs = progress(range(1, num_epochs + 1), self.enable_progress_bar, desc="Epochs")
            for epoch_idx in epochs:
                _set_loader_epoch(train_loader, epoch_idx)
                train_metrics = self.train_epoch(train_loader)
                self.state = self.state.replace(epoch=jnp.asarray(epoch_idx, jnp.int32))
                self.logger.log_metrics({**train_metrics, "epoch": epoch_idx}, step=self.global_step)
                self.on_training_epoch_end(epoch_idx)
                shown = dict(train_metrics)
                if val_loader is not None and epoch_idx % self.check_val_every_n_epoch == 0:
                    eval_metrics = self.eval_model(val_loader, log_prefix="val/")
                    self.on_validation_epoch_end(epoch_idx, eval_metrics, val_loader)
                    self.logger.log_metrics({**eval_metrics, "epoch": epoch_idx}, step=self.global_step)
                    self.save_metrics(f"eval_epoch_{epoch_idx:03d}", eval_metrics)
                    shown.update(eval_metrics)
                    if self.is_new_model_better(eval_metrics, best_eval_metrics):
                        best_eval_metrics = dict(eval_metrics)
                        best_eval_metrics.update(train_metrics)
                        self.save_model(step=self.global_step)
                        self.save_metrics("best_eval", eval_metrics)
                self._show_epoch(epochs, epoch_idx, num_epochs, shown)
            if best_eval_metrics is None:  # no validation loader: the last model is the one kept
                best_eval_metrics = dict(train_metrics)
                self.save_model(step=self.global_step)
            if test_loader is not None:
                self.load_model()
                test_metrics = self.eval_model(test_loader, log_prefix="test/")
                self.logger.log_metrics(test_metrics, step=self.global_step)
                self.save_metrics("test", test_metrics)
                best_eval_metrics.update(test_metrics)
            self.on_training_end()
        except BaseException:
            self.checkpointer.wait()
            self.logger.finalize("failed")
            raise
        self.checkpointer.wait()
        self.logger.finalize("success")
        return best_eval_metrics

    def train_epoch(self, train_loader: Iterable) -> dict[str, float]:
        """One pass over ``train_loader``; returns ``train/...`` means and ``epoch_time``.

        Metrics are summed on the device; the only reads are asynchronous copies at log points
        and one read at the end of the epoch.
        """
        start = time.time()
        acc = None
        log_every = self.options.log_every_n_steps
        log_points = _RunningLog(self.logger, prefix="train/", suffix="_step")
        bar = progress(train_loader, self.enable_progress_bar, desc="Training", leave=False)
        for batch in bar:
            if acc is None:
                self._check_first_batch(batch, "train_loader")
                acc = self._zero_accumulator("train", batch)
            self.state, acc = self._train_and_accumulate(self.state, acc, batch)
            self.global_step += 1
            if self.global_step % log_every == 0:
                shown = log_points.mark(self.global_step, acc)
                if shown and hasattr(bar, "set_postfix"):
                    bar.set_postfix({k.split("/", 1)[-1]: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        if acc is None:
            raise ValueError("train_loader yielded no batches: check the dataset size, batch_size and drop_last.")
        log_points.finish()
        metrics = read_means(acc, prefix="train/")
        metrics["epoch_time"] = time.time() - start
        return metrics

    def eval_model(self, data_loader: Iterable, log_prefix: str = "") -> dict[str, float]:
        """Evaluate on ``data_loader``; per-example weighted means keyed ``log_prefix + name``."""
        acc = None
        for batch in data_loader:
            if acc is None:
                self._check_first_batch(batch, "the evaluation loader")
                acc = self._zero_accumulator("eval", batch)
            acc = self._eval_and_accumulate(self.state, acc, batch)
        if acc is None:
            raise ValueError(f"The evaluation loader ({log_prefix or 'eval'}) yielded no batches.")
        return read_means(acc, prefix=log_prefix)

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
        ``logger_type`` (``"csv"``, ``"tensorboard"`` or a list; default CSV plus TensorBoard
        when tensorboardX is installed), ``loggers`` (extra :class:`Logger` objects).
        """
        params = dict(logger_params or {})
        log_dir = params.get("log_dir")
        if not log_dir:
            base = os.path.join(params.get("base_log_dir", "checkpoints"), self.model_class.__name__)
            log_dir = _next_version_dir(base)
        self.log_dir = os.path.abspath(os.fspath(log_dir))
        os.makedirs(os.path.join(self.log_dir, "metrics"), exist_ok=True)
        types = params.get("logger_type")
        if types is None:
            types = ["csv", "tensorboard"] if tensorboard_available() else ["csv"]
        types = [types] if isinstance(types, str) else list(types)
        loggers: list[Logger] = []
        for kind in types:
            kind = str(kind).lower()
            if kind == "csv":
                loggers.append(CSVLogger(self.log_dir))
            elif kind == "tensorboard":
                loggers.append(TensorBoardLogger(self.log_dir))
            else:
                raise ValueError(f"Unknown logger_type {kind!r} in logger_params; valid: {', '.join(LOGGER_TYPES)}.")
        loggers.extend(params.get("loggers", []))
        self.logger = LoggerCollection(loggers)
        self.checkpointer = Checkpointer(os.path.join(self.log_dir, CHECKPOINT_DIR), max_to_keep=1)

    def _write_hparams(self) -> None:
        if self._hparams_written:
            return
        hparams = _to_yaml_safe(self.config)
        with open(os.path.join(self.log_dir, HPARAMS_FILE), "w") as f:
            yaml.safe_dump(hparams, f, sort_keys=False)
        self.logger.log_hyperparams(hparams)
        self._hparams_written = True

    def save_metrics(self, filename: str, metrics: Mapping[str, float]) -> None:
        """Write ``metrics`` to ``<log_dir>/metrics/<filename>.json``."""
        with open(os.path.join(self.log_dir, "metrics", f"{filename}.json"), "w") as f:
            json.dump(dict(metrics), f, indent=4)

    def save_model(self, step: int | None = None) -> None:
        """Checkpoint the whole train state (orbax, asynchronous) as the run's kept model."""
        self._write_hparams()
        step = self.global_step if step is None else int(step)
        self.checkpointer.save(step, self.state, meta={"step": step, "log_dir": self.log_dir})

    def load_model(self, step: int | None = None) -> None:
        """Restore the kept checkpoint (the best model) into ``self.state``."""
        self.checkpointer.wait()
        self.state = self.checkpointer.restore(self.state, step=step)

    def bind_model(self):
        """The model bound to the trained variables, for interactive use: ``model(x, train=False)``."""
        return self.model.bind(self.state.variables())

    def tracker(self, iterator: Iterable, **kwargs):
        """``iterator`` with a progress bar when enabled (the seed's helper)."""
        return progress(iterator, self.enable_progress_bar, **kwargs)

    def _show_epoch(self, bar, epoch_idx: int, num_epochs: int, metrics: Mapping[str, float]) -> None:
        if not self.enable_progress_bar:
            return
        if is_ci():
            print(f"Epoch {epoch_idx}/{num_epochs} ({metrics.get('epoch_time', 0):.2f}s): {format_metrics(metrics)}",
                  flush=True)
        elif hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(format_metrics(metrics), refresh=True)

    @classmethod
    def load_from_checkpoint(cls, checkpoint: str | os.PathLike, exmp_input: Any, **overrides: Any) -> "TrainerModule":
        """Rebuild a trainer from a run's log dir (``hparams.yaml`` + best checkpoint).

        Works for subclasses that take ``model_class``/``model_hparams`` and for the seed's
        pattern of a constructor taking the model hyperparameters by name. ``overrides`` replace
        saved settings (e.g. ``enable_progress_bar=False``).

        Example:
            >>> trainer = MyTrainer.load_from_checkpoint("checkpoints/MLP/version_0", exmp_input=x[:1])  # doctest: +SKIP
        """
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
        hparams.setdefault("enable_model_summary", False)
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
        trainer.load_model()
        trainer.global_step = int(trainer.state.step)
        return trainer


def _explicit_parameters(cls) -> set[str]:
    """Names a constructor takes explicitly (not through ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}


def _set_loader_epoch(loader, epoch: int) -> None:
    """Tell a loader which epoch comes (``set_epoch``: flaxlight's ArrayLoader, torch samplers)."""
    set_epoch = getattr(loader, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


class _RunningLog:
    """Interval means of the train metrics at log points, read one log point late (no waiting)."""

    def __init__(self, logger: Logger, prefix: str, suffix: str):
        self.logger = logger
        self.prefix, self.suffix = prefix, suffix
        self.pending: tuple[int, HostSnapshot] | None = None
        self.last_sums: dict[str, float] = {}
        self.last_count = 0.0

    def mark(self, step: int, acc: dict) -> dict[str, float]:
        """Start copying ``acc``; log and return the previous log point's values."""
        previous, self.pending = self.pending, (step, HostSnapshot(acc))
        return self._emit(previous) if previous else {}

    def finish(self) -> None:
        if self.pending:
            self._emit(self.pending)
            self.pending = None

    def _emit(self, pending: tuple[int, HostSnapshot]) -> dict[str, float]:
        step, snapshot = pending
        sums, count = snapshot.sums_and_count()
        examples = count - self.last_count
        if examples <= 0:
            return {}
        means = {
            f"{self.prefix}{name}{self.suffix}": (total - self.last_sums.get(name, 0.0)) / examples
            for name, total in sums.items()
        }
        self.last_sums, self.last_count = sums, count
        self.logger.log_metrics(means, step=step)
        return means
