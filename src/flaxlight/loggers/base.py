"""The logger interface and the fan-out that sends every record to several loggers."""

from __future__ import annotations

import decimal
import numbers
import os
import re
import time
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from flaxlight.writer import BackgroundWriter

__all__ = ["Logger", "LoggerCollection", "as_image", "flatten_params", "run_display_name"]


class Logger:
    """Receives scalar metrics at log points; subclasses write them somewhere.

    Values arrive as Python floats (already on the host). ``step`` counts optimizer updates.

    Examples:
        >>> class PrintLogger(Logger):
        ...     def log_metrics(self, metrics, step):
        ...         print(step, metrics)
    """

    def set_run_dir(self, log_dir: str | os.PathLike) -> None:
        """The folder of the trainer's run this logger writes for (called when the trainer is
        built, before any record). W&B and MLflow keep their run id there, so resuming the run
        reopens its own W&B / MLflow run. The default does nothing."""

    def log_hyperparams(self, params: Mapping) -> None:
        """Record the run's hyperparameters (the trainer's once; a later call adds to them)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalars at ``step``."""

    def log_image(self, tag: str, image: Any, step: int) -> None:
        """Record one image at ``step`` (``HWC`` or ``HW``; uint8 in [0, 255] or float in [0, 1]).

        The default does nothing: loggers that cannot show images (CSV) ignore them.
        """

    def log_best_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """The run's best validation metrics (and test metrics), once, at the end of a
        successful ``train_model``; e.g. TensorBoard's HParams tab. The default does nothing."""

    def resume_from_step(self, step: int) -> None:
        """Continue a resumed run whose checkpoint was taken at ``step``: records logged after
        ``step`` by the interrupted run are dropped, so the history has no duplicates."""

    def continue_run(self) -> None:
        """Add to the records a run left in this logger's folder (a trainer rebuilt from it by
        ``load_from_checkpoint``): nothing is dropped or rewritten. The default does nothing."""

    def start_run(self) -> None:
        """A training run starts writing (after its folder was claimed; ``overwrite=True`` may
        have deleted the files a loaded run's records were read from). The default does nothing."""

    def flush(self) -> None:
        """Make everything logged so far readable by other processes."""

    def finalize(self, status: str) -> None:
        """End of the run (``status``: ``"success"``, ``"failed"``, ``"interrupted"``)."""

    def close(self) -> None:
        """End what a successful run leaves open for late records (a W&B run); the default does nothing."""


class LoggerCollection(Logger):
    """Fan-out: forwards each call to every logger, in order, on one background writer thread.

    The caller's thread only queues the records (their values are already Python floats):
    formatting and writing (CSV rows, TensorBoard events, W&B, MLflow) happen on the writer, in
    the order logged. Metric records do not wake the writer: it takes them in one go with the
    next other call, at a flush, or within a second. :meth:`flush` and :meth:`finalize` wait
    until everything queued is written; :meth:`flush_soon` (the trainer's call at each epoch
    end) asks for a flush without waiting, at most once per ``flush_seconds``; one it skipped
    is queued to run with the records, within the writer's idle time (a second) at the latest,
    so a long stretch without records after short epochs does not leave the files behind.
    A logger's error comes out on
    the caller's thread at the next call. ``background=False`` calls the loggers directly.
    A record sent after :meth:`finalize` (``trainer.log_image`` after ``train_model``) goes to
    the same run, which is then finalized again with the same status (an MLflow run does not
    stay RUNNING; a W&B run stays open until :meth:`close` or the interpreter's exit).

    This is the trainer's ``trainer.logger``; the loggers themselves (for ``.experiment``,
    ``.save_dir``, ...) are ``trainer.loggers``, the same list as :attr:`loggers`.

    Examples:
        >>> logger = LoggerCollection([CSVLogger(log_dir)])   # doctest: +SKIP
    """

    flush_seconds = 1.0  # flush_soon flushes at most this often (flush and finalize always do)

    def __init__(self, loggers: Sequence[Logger], background: bool = True):
        self.loggers = list(loggers)
        self._writer = BackgroundWriter("logs") if background and self.loggers else None
        self._final_status: str | None = None
        self._flushed_at = -float("inf")  # time.monotonic() of the latest flush (flush_soon's or a deferred one)
        self._deferred: Any = None  # the queued job of a flush that flush_soon skipped
        self._save_flush: Any = None  # the queued job of the newest save's flush (start_flush)
        self._save_flushes_queued = self._save_flushes_done = 0  # start_flush's flushes, numbered

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or "loggers" not in self.__dict__:
            raise AttributeError(name)
        having = [f"trainer.loggers[{i}] ({type(lg).__name__})" for i, lg in enumerate(self.loggers)
                  if name in dir(lg)]  # not hasattr: W&B's experiment would start a run
        where = f" It is on {', '.join(having)}." if having else ""
        folder = " The run's folder is trainer.log_dir." if name in ("log_dir", "save_dir", "version") else ""
        raise AttributeError(
            f"'LoggerCollection' object has no attribute {name!r}: trainer.logger sends each record to all of "
            f"the run's loggers; the loggers themselves are the list trainer.loggers "
            f"({', '.join(type(lg).__name__ for lg in self.loggers) or 'none'}).{where}{folder}")

    def _each(self, method: str, *args: Any) -> None:
        for logger in self.loggers:
            getattr(logger, method)(*args)

    def _send(self, method: str, *args: Any, lazy: bool = False) -> None:
        calls = [(method, args)]
        if self._final_status is not None and method != "flush":  # after the run ended: close it again
            calls.append(("finalize", (self._final_status,)))
            lazy = False
        for name, arguments in calls:
            if self._writer is None:
                self._each(name, *arguments)
            else:
                self._writer.raise_failure_as(self._failure)
                self._writer.submit(self._each, name, *arguments, lazy=lazy)

    def _now(self, method: str, *args: Any) -> None:
        """Call ``method`` once everything queued is written (and raise a writer's failure)."""
        try:
            if self._writer is not None:
                if self._deferred is not None and method in ("flush", "finalize"):  # these flush anyway
                    self._writer.withdraw([self._deferred])
                    self._deferred = None
                self._writer.flush_as(self._failure)
        finally:  # also after a failure: files are closed, runs ended
            self._each(method, *args)

    @staticmethod
    def _failure(exc: BaseException) -> RuntimeError:
        return RuntimeError(f"A logger failed while writing in the background ({type(exc).__name__}: {exc}); "
                            f"the records logged after it were not written.")

    def log_hyperparams(self, params: Mapping) -> None:
        self._send("log_hyperparams", params)

    def set_run_dir(self, log_dir: str | os.PathLike) -> None:
        """Tell every logger the trainer's run folder (at once: no record is written yet)."""
        self._each("set_run_dir", log_dir)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        # Lazy: records are written in batches, with the next call that wakes the writer (a flush,
        # an image, hyperparameters) or at the latest a second later.
        self._send("log_metrics", _scalars(metrics), step, lazy=True)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        # Checked here, on the caller's thread (a CHW array fails at the call); a copy: the caller may reuse its buffer.
        self._send("log_image", tag, np.array(as_image(image)), step)

    def log_best_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._send("log_best_metrics", _scalars(metrics), step)

    def resume_from_step(self, step: int) -> None:
        self._now("resume_from_step", step)

    def continue_run(self) -> None:
        """Continue the records of the run in the folder (see :meth:`Logger.continue_run`); the
        records sent from now on end the run again after each (an MLflow run goes back to its
        status), as after :meth:`finalize`."""
        self._now("continue_run")
        self._final_status = "success"

    def start_run(self) -> None:
        """A training run starts: its records are not late ones (see :meth:`continue_run`)."""
        self._final_status = None
        self._now("start_run")

    def flush(self) -> None:
        self._now("flush")

    def start_flush(self) -> Callable[[], None]:
        """Queue a flush behind the records logged so far, without waking the writer, and return a
        function that waits, from any thread, until that flush (or a later one of this method's) has
        run (a checkpoint's writer waits for it right before the write: the training thread does
        not). A save at each new best model is mostly replaced before its write: its flush then
        runs with the records, within the writer's idle time (a second), unless the next save's
        flush, queued behind newer records, takes its place first (a flush per new best cost a
        small model's epochs ~0.4 ms of CPU). A writer's failure is raised at the next call, as for
        any record. Without a background writer, the flush is made now.

        Examples:
            >>> wait = logger.start_flush()   # doctest: +SKIP
            >>> wait()                        # doctest: +SKIP
        """
        if self._writer is None:
            self._each("flush")
            return lambda: None
        self._writer.raise_failure_as(self._failure)
        self._writer.withdraw([job for job in (self._deferred, self._save_flush) if job is not None])
        self._deferred, self._save_flushes_queued = None, self._save_flushes_queued + 1
        number, writer = self._save_flushes_queued, self._writer
        self._save_flush = writer.submit(self._flush_for_save, number, lazy=True)
        return lambda: writer.wait_until(lambda: self._save_flushes_done >= number)

    def _flush_for_save(self, number: int) -> None:
        """:meth:`start_flush`'s flush (on the writer thread): the saves numbered up to ``number`` may be written."""
        self._flushed_at = time.monotonic()
        self._each("flush")
        self._save_flushes_done = number

    def flush_soon(self) -> None:
        """Queue a flush behind the records logged so far; returns at once. Within
        ``flush_seconds`` of the previous flush (a flush costs the writer ~0.1 ms per logger:
        epochs of a few milliseconds would spend a few percent of a core on it) the flush is
        deferred instead: one flush waits behind the newest records without waking the writer,
        which runs it with them, within its idle time (a second) at the latest."""
        now = time.monotonic()
        if self._writer is None or now - self._flushed_at >= self.flush_seconds:
            self._flushed_at = now
            self._send("flush")
            return
        if self._deferred is not None:  # one deferred flush, behind the newest records
            self._writer.withdraw([self._deferred])
        self._writer.raise_failure_as(self._failure)
        self._deferred = self._writer.submit(self._deferred_flush, lazy=True)

    def _deferred_flush(self) -> None:
        """A flush that :meth:`flush_soon` put off (on the writer thread)."""
        self._flushed_at = time.monotonic()
        self._each("flush")

    def finalize(self, status: str) -> None:
        self._final_status = status
        self._now("finalize", status)

    def close(self) -> None:
        """Write what is queued, then close every logger (ends a W&B run kept open for late records)."""
        self._now("close")


def checked_scalars(metrics: Mapping[str, Any], where: str = "log_metrics") -> dict[str, float]:
    """``metrics`` as Python floats, or an error naming the first key whose value is not one real
    number (a Python number, a numpy or JAX scalar or one-element array, bf16 included; NaN and inf
    are numbers) or whose name the loggers keep for themselves (``step``, an empty name).

    Examples:
        >>> checked_scalars({"lr": np.float32(0.5), "done": True, "scale": jnp.bfloat16(2)})
        {'lr': 0.5, 'done': 1.0, 'scale': 2.0}
    """
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key.strip() in ("", "step"):
            raise TypeError(f"{where}: metric names must be non-empty strings other than 'step' (the step column "
                            f"of every logger); got {key!r}.")
        out[key] = _one_number(value, key, where)
    return out


def _one_number(value: Any, key: str, where: str) -> float:
    if isinstance(value, (numbers.Real, decimal.Decimal)):  # int, float, bool, Fraction, numpy scalars
        return float(value)
    kind = np.asarray(value).dtype if np.size(value) == 1 and not isinstance(value, (str, bytes)) else None
    real = kind is not None and (kind == np.bool_ or jnp.issubdtype(kind, jnp.integer)
                                 or jnp.issubdtype(kind, jnp.floating))  # bfloat16 too (numpy alone says no)
    if not real:
        what = f"an array of shape {np.shape(value)}" if np.size(value) != 1 else f"{value!r} ({type(value).__name__})"
        raise TypeError(f"{where}: {key!r} is {what}; loggers take one number per name (a Python or numpy "
                        f"number, or a one-element array). Log a reduction such as float(x.mean()), or an image "
                        f"with log_image.")
    return float(np.asarray(value).reshape(()))


def _scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of ``metrics``: a metric object's array result (a confusion matrix) is not a scalar series."""
    return {key: value for key, value in metrics.items() if np.ndim(value) == 0}


def as_image(image: Any) -> np.ndarray:
    """``image`` as a uint8 numpy array of shape ``(H, W)`` or ``(H, W, 3|4)``.

    Accepts numpy or JAX arrays shaped ``(H, W)`` or ``(H, W, C)`` with C in 1, 3, 4. Floats are
    read as [0, 1] (clipped) and scaled to [0, 255]; a single channel is squeezed to ``(H, W)``.

    Examples:
        >>> as_image(np.ones((2, 3, 1), np.float32)).shape
        (2, 3)
    """
    array = np.asarray(image)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise ValueError(
            f"log_image expects one image shaped (H, W) or (H, W, C) with C in 1, 3, 4 (channels last); "
            f"got shape {tuple(np.shape(image))}. For a CHW array pass image.transpose(1, 2, 0); "
            f"for a batch, log one image at a time or tile them into one."
        )
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.floating):
        return np.round(np.clip(np.nan_to_num(array), 0.0, 1.0) * 255).astype(np.uint8)
    if np.issubdtype(array.dtype, np.integer):
        return np.clip(array, 0, 255).astype(np.uint8)
    raise ValueError(f"log_image expects a numeric image, got dtype {array.dtype}.")


def flatten_params(params: Mapping, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested mappings flattened to dotted keys: ``{"opt": {"lr": 1}}`` -> ``{"opt.lr": 1}``.

    Examples:
        >>> flatten_params({"opt": {"lr": 0.1}, "seed": 0})
        {'opt.lr': 0.1, 'seed': 0}
    """
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, name, sep))
        else:
            flat[name] = value
    return flat


def rebound_run_dir(logger: Any, log_dir: str | os.PathLike, service: str) -> str:
    """``log_dir`` as the absolute run folder a W&B / MLflow ``logger`` keeps its run id in; an
    error when the logger already keeps a started run in another (one object for two trainers
    would put the second run into the first).

    Examples:
        >>> self._run_dir = rebound_run_dir(self, log_dir, "MLflow")   # doctest: +SKIP
    """
    run_dir = os.path.abspath(os.fspath(log_dir))
    if logger._run_dir is not None and run_dir != logger._run_dir and os.path.isfile(logger._run_file):
        raise ValueError(f"This {type(logger).__name__} already logs the run in {logger._run_dir} (its {service} run); "
                         f"a second trainer's run ({run_dir}) would go into that run. Give each trainer a logger "
                         f"object of its own.")
    return run_dir


def run_display_name(log_dir: str | os.PathLike) -> str:
    """A short name for a run directory: its folder name, or ``parent/version_N`` for versioned runs.

    Examples:
        >>> run_display_name("checkpoints/MLP/version_3")
        'MLP/version_3'
    """
    path = os.path.normpath(os.path.abspath(os.fspath(log_dir)))
    name = os.path.basename(path)
    if re.fullmatch(r"version_\d+", name):
        name = f"{os.path.basename(os.path.dirname(path))}/{name}"
    return name
