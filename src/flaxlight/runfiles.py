"""The run directory: its versioned folder, its loggers, its hparams and metrics files.

A run's folder (``log_dir``) holds ``hparams.yaml`` (how the trainer was built: plain YAML,
never pickled; arrays as lists, listed with their dtype and shape under ``array_hparams``; dtypes by
name, listed under ``dtype_hparams``; model hparams written by name only, under ``by_name_hparams``),
``metrics.csv`` and the other loggers' files, ``metrics/<name>.json`` and ``checkpoints/``.

Examples:
    >>> params = LoggerParams.from_mapping({"base_log_dir": "runs", "logger_type": "csv"})
    >>> params.logger_kinds(extra_loggers=False)
    ['csv']
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
import warnings
import weakref
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from flaxlight import optim
from flaxlight.checkpoint import Checkpointer
from flaxlight.distributed import fit_mesh
from flaxlight.export import INFO_FILE as EXPORT_INFO_FILE
from flaxlight.loggers import CSVLogger, Logger, LoggerCollection, TensorBoardLogger, tensorboard_available
from flaxlight.loggers.base import run_display_name
from flaxlight.messages import logger as messages, warn_at_user
from flaxlight.options import (FOREIGN_TRAINER_ARGUMENTS, LIGHTNING_TRAINER_ARGUMENTS, TRAIN_MODEL_ARGUMENTS,
                               TRAINER_ARGUMENTS, TrainerOptions, declared_keywords)
from flaxlight.registry import RegistryError, explicit_parameters, import_object
from flaxlight.writer import BackgroundWriter

__all__ = ["RunInUseError", "LoggerParams", "HPARAMS_FILE", "CHECKPOINT_DIR", "METRICS_DIR", "LOGGER_TYPES", "next_version_dir",
           "open_run", "no_run_files", "finish_run", "claim_run", "RunLock", "run_files_present", "failed_start",
           "set_aside_failed_start", "FAILED_START_DIR", "make_loggers",
           "write_hparams", "read_hparams", "hparams_record", "with_arrays", "ARRAYS_KEY", "DTYPES_KEY", "BY_NAME_KEY",
           "RECORD_KEYS", "ARRAY_SIZE_LIMIT", "ByNameHparamError",
           "trainer_kwargs", "load_overrides", "write_metrics", "MetricFiles", "to_yaml_safe", "class_path", "enable_compilation_cache"]

HPARAMS_FILE = "hparams.yaml"
#: The key of ``hparams.yaml`` that lists which values were arrays (path, dtype, shape): they load back as arrays.
ARRAYS_KEY = "array_hparams"
#: The key of ``hparams.yaml`` that lists which values were dtypes (path, name): they load back as ``np.dtype``.
DTYPES_KEY = "dtype_hparams"
#: The key of ``hparams.yaml`` that lists the model hparams written by name only (path, kind: a function, a class,
#: a module, another object): nothing is imported or called from a run's files, so they are passed again at load.
BY_NAME_KEY = "by_name_hparams"
#: The keys of ``hparams.yaml`` that describe the settings rather than being settings.
RECORD_KEYS = (ARRAYS_KEY, DTYPES_KEY, BY_NAME_KEY)
#: Trainer settings ``hparams.yaml`` leaves out: they act when a trainer is built, before any run (the model
#: table), so they say nothing of the run; ``load_from_checkpoint`` sets ``enable_model_summary=False`` itself.
NOT_RECORDED = ("enable_model_summary",)
#: Elements of an array in the hparams above which its values are not written (its summary is, with a warning).
ARRAY_SIZE_LIMIT = 10_000
CHECKPOINT_DIR = "checkpoints"
METRICS_DIR = "metrics"
ABANDONED_DIR = "abandoned"  # <log_dir>/abandoned/after_step_<N>/: a branch a resume set aside (flaxlight.resume)
FAILED_START_DIR = "failed_start"  # <log_dir>/failed_start_<N>/: the files of a start that failed, set aside
LOGGER_TYPES = ("csv", "tensorboard", "wandb", "mlflow")


@dataclasses.dataclass(kw_only=True)
class LoggerParams:
    """Where a run logs (the trainer's ``logger_params``; same keys).

    Attributes:
        log_dir: the run's folder; None: ``<base_log_dir>/<ModelClass>/version_N``, a new N each run.
        base_log_dir: parent of the versioned folders.
        logger_name: a folder between the model's and the versions, as in the UvA guide:
            ``<base_log_dir>/<ModelClass>/<logger_name>/version_N`` (not used with ``log_dir``).
        logger_type: ``csv``, ``tensorboard``, ``wandb``, ``mlflow`` or a list; None: CSV plus
            TensorBoard when tensorboardX is installed (CSV alone when ``loggers`` are given).
        project_name: W&B project / MLflow experiment.
        run_name: the run's display name (default: from the log dir).
    """

    log_dir: str | None = None
    base_log_dir: str = "checkpoints"
    logger_name: str | None = None
    logger_type: str | list[str] | None = None
    project_name: str | None = None
    run_name: str | None = None

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | None) -> "LoggerParams":
        """Checked ``logger_params`` (an unknown key fails with the valid ones); ``loggers``
        (extra logger objects) is the trainer's to take, not a field."""
        params = {k: v for k, v in dict(params or {}).items() if k != "loggers"}
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in params:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"Unknown logger_params key {key!r}.{hint} Valid keys: {', '.join(fields)}, loggers.")
        params = {k: v for k, v in params.items() if v is not None or k == "log_dir"}
        return cls(**params)

    def __post_init__(self):
        if self.logger_type is not None:
            self._kinds(self.logger_type)  # an unknown type fails here, before any folder is made

    @staticmethod
    def _kinds(types: str | list[str]) -> list[str]:
        types = [types] if isinstance(types, str) else list(types)
        kinds = ["wandb" if str(kind).lower() == "w&b" else str(kind).lower() for kind in types]
        for kind in kinds:
            if kind not in LOGGER_TYPES:
                raise ValueError(f"Unknown logger_type {kind!r} in logger_params; valid: {', '.join(LOGGER_TYPES)} "
                                 f"(any case), or a list of them.")
        return kinds

    def logger_kinds(self, extra_loggers: bool) -> list[str]:
        """The logger types to build, CSV first (``metrics.csv`` is always written)."""
        types = self.logger_type
        if types is None:
            types = ["csv", "tensorboard"] if tensorboard_available() and not extra_loggers else ["csv"]
        return list(dict.fromkeys(["csv"] + self._kinds(types)))


class RunInUseError(RuntimeError):
    """Another live process holds the run folder's lock: two runs must not write into one folder.

    Attributes:
        log_dir: the folder; pid, host: the process holding it, as its lock file says ("?" unknown).
    """

    def __init__(self, message: str, log_dir: str = "", pid: str = "?", host: str = "?"):
        super().__init__(message)
        self.log_dir, self.pid, self.host = log_dir, pid, host

    @property
    def in_this_process(self) -> bool:
        """Whether the holder is this very process (another trainer object of it)."""
        return self.pid == str(os.getpid()) and self.host == socket.gethostname()


def next_version_dir(base: str | os.PathLike) -> str:
    """Claim ``<base>/version_<N>``, N one more than the highest there (``version_0`` first).

    The folder is created here, atomically: runs started together get distinct versions.
    """
    base = os.fspath(base)
    os.makedirs(base, exist_ok=True)
    while True:
        versions = [int(n.split("_", 1)[1]) for n in os.listdir(base)
                    if n.startswith("version_") and n.split("_", 1)[1].isdigit()]
        path = os.path.join(base, f"version_{max(versions, default=-1) + 1}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:  # another run took it first: try the next number
            continue


def check_folders(log_dir: str) -> None:
    """A clear error when the run folder, or a folder the run writes into, is a file."""
    folders = (("logger_params['log_dir']", log_dir),
               ("the run's checkpoints folder", os.path.join(log_dir, CHECKPOINT_DIR)),
               ("the run's metrics folder", os.path.join(log_dir, METRICS_DIR)))
    for what, path in folders:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(f"{what} {path} is a file, not a folder: move it away or choose another log_dir.")


def run_dir(params: LoggerParams, owner_name: str) -> str:
    """The run's folder, absolute: ``log_dir``, or the next version under ``base_log_dir/owner_name``
    (``/logger_name``, when given)."""
    versions = os.path.join(params.base_log_dir, owner_name)
    if params.logger_name:  # the UvA guide's sub-folder
        versions = os.path.join(versions, os.fspath(params.logger_name))
    log_dir = params.log_dir or next_version_dir(versions)
    return os.path.abspath(os.fspath(log_dir))


def open_run(logger_params: Mapping[str, Any] | None, owner_name: str,
             user_loggers: list[Logger]) -> tuple[str, LoggerCollection, Checkpointer]:
    """``(log_dir, loggers, checkpointer)`` of a new or named run folder (``logger_params``'s
    ``loggers`` and ``user_loggers`` are added after the ones ``logger_type`` picks)."""
    params = LoggerParams.from_mapping(logger_params)
    given = [lg for lg in (logger_params or {}).get("loggers") or [] if not isinstance(lg, str)]  # str: a saved repr
    extra = given + list(user_loggers)
    for logger in extra:  # before the folder is made: a refused trainer leaves nothing behind
        if not isinstance(logger, Logger):
            raise TypeError(f"loggers must be flaxlight.loggers.Logger instances; got {type(logger).__name__}.")
    log_dir = run_dir(params, owner_name)
    made = not params.log_dir or not os.path.exists(log_dir)  # a version claimed, or a folder made, for this trainer
    check_folders(log_dir)
    loggers = make_loggers(params, log_dir, extra)  # a missing extra (wandb, mlflow) fails before the folder is made
    os.makedirs(os.path.join(log_dir, METRICS_DIR), exist_ok=True)
    checkpointer = Checkpointer(os.path.join(log_dir, CHECKPOINT_DIR), max_to_keep=None)
    _FOLDERS_IN_USE[checkpointer] = log_dir
    if made:  # given back when its trainer is gone without writing into it
        weakref.finalize(checkpointer, _remove_if_unused, log_dir, id(checkpointer))
    return log_dir, loggers, checkpointer


# The run folder of each trainer alive in this process (by its checkpointer, which lives as long as it).
_FOLDERS_IN_USE: "weakref.WeakKeyDictionary[Checkpointer, str]" = weakref.WeakKeyDictionary()


def _remove_if_unused(log_dir: str, owner: int | None = None) -> bool:
    """Remove ``log_dir`` when it holds nothing but the empty ``metrics/`` folder a trainer makes
    at construction (a trainer built and dropped, never trained, or refused before training: a
    notebook cell run again), so that empty ``version_N`` folders do not pile up; not while another
    trainer of this process was given the folder; ``os.rmdir`` never removes a file. ``owner``: the
    id of the checkpointer going away, still listed when this runs at interpreter exit (its finalizer)."""
    if any(folder == log_dir and id(user) != owner for user, folder in list(_FOLDERS_IN_USE.items())):
        return False
    try:
        if os.listdir(log_dir) != [METRICS_DIR] or os.listdir(os.path.join(log_dir, METRICS_DIR)):
            return False
        os.rmdir(os.path.join(log_dir, METRICS_DIR))
        os.rmdir(log_dir)
    except OSError:  # gone already, or written into meanwhile
        return False
    return True


def run_files_present(log_dir: str) -> list[str]:
    """The files of an earlier run in ``log_dir`` (checkpoints, hparams, metrics), by name."""
    found = [name for name in (HPARAMS_FILE, "metrics.csv") if os.path.isfile(os.path.join(log_dir, name))]
    checkpoints = os.path.join(log_dir, CHECKPOINT_DIR)
    if os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints)):
        found.append(CHECKPOINT_DIR + "/")
    return found


def failed_start(log_dir: str) -> bool:
    """Whether ``log_dir`` holds only what a run that failed before its first record left: its
    settings (``hparams.yaml``), and no checkpoint, no row in ``metrics.csv``, no file in ``metrics/``.

    Examples:
        >>> failed_start("runs/never_made")
        False
    """
    present = run_files_present(log_dir)
    if not present or CHECKPOINT_DIR + "/" in present:
        return False
    csv = os.path.join(log_dir, "metrics.csv")
    if os.path.isfile(csv):
        with open(csv, encoding="utf-8", errors="replace") as f:
            if sum(1 for line in f if line.strip()) > 1:  # a header and a row
                return False
    metrics = os.path.join(log_dir, METRICS_DIR)
    return not (os.path.isdir(metrics) and any(os.scandir(metrics)))


def _start_file(name: str) -> bool:
    """A file a run writes at its start in its folder (``config.yaml``: what ``flaxlight fit`` saves)."""
    return name in (HPARAMS_FILE, "metrics.csv", "wandb_run.json", "mlflow_run.json", "config.yaml") \
        or name.startswith("events.out.tfevents.") or re.fullmatch(r"(hparams|config)\.[0-9]+\.yaml", name) is not None


def set_aside_failed_start(log_dir: str) -> str:
    """Move the files of a start that failed (:func:`failed_start`) into ``<log_dir>/failed_start_<N>/``
    and return that folder: a new run can start in ``log_dir``, and nothing is deleted.

    Examples:
        >>> set_aside_failed_start("runs/r")   # doctest: +SKIP
        'runs/r/failed_start_1'
    """
    target = next(path for n in itertools.count(1)
                  if not os.path.exists(path := os.path.join(log_dir, f"{FAILED_START_DIR}_{n}")))
    os.makedirs(target)
    for name in sorted(os.listdir(log_dir)):
        if _start_file(name) and os.path.isfile(os.path.join(log_dir, name)):
            os.replace(os.path.join(log_dir, name), os.path.join(target, name))
    return target


def claim_run(log_dir: str, checkpointer: Checkpointer, *, continuing: bool, overwrite: bool,
              owned: bool) -> "RunLock":
    """Make sure training into ``log_dir`` overwrites no other run, and lock it for this process.

    A folder holding an earlier run's files is an error unless the run is continued (``resume``)
    or replaced (``overwrite=True``: its checkpoints, ``hparams.yaml``, ``metrics.csv``,
    ``metrics/``, TensorBoard event files and the W&B / MLflow run ids are deleted first, so the
    loggers start new runs); ``owned``: this trainer wrote them itself, in this process. The files
    of a run that failed before its first record (:func:`failed_start`: no checkpoint, no metrics)
    are no run: they are moved into ``failed_start_<N>/`` and the new run starts there. The lock's
    ``replaced`` says whether the folder's earlier files went (deleted or set aside, its
    ``hparams.yaml`` with them): the new run then writes its own.
    """
    if not os.path.isdir(log_dir) and continuing:  # a resume of nothing: a mistake, or a mount that went away
        raise FileNotFoundError(f"resume: the run's folder {log_dir} is gone (removed after the trainer was built, or "
                                f"on a disk no longer mounted): there is nothing to continue. Bring it back, or train "
                                f"without resume to start a new run there.")
    if not os.path.isdir(log_dir):  # removed since the trainer made it (`rm -rf runs/` in a notebook): made again
        messages.info(f"log_dir {log_dir} is gone (removed after the trainer was built): it is made again for "
                      f"this run.")
        check_folders(log_dir)
        os.makedirs(os.path.join(log_dir, METRICS_DIR), exist_ok=True)
    lock = RunLock(log_dir)
    lock.acquire()
    try:
        present = run_files_present(log_dir)
        if present and not (continuing or owned) and failed_start(log_dir):
            kept = set_aside_failed_start(log_dir)
            messages.info(f"log_dir {log_dir} held a run that failed before its first record or checkpoint: its "
                          f"files ({', '.join(sorted(os.listdir(kept)))}) were moved to {kept}, and this run starts "
                          f"there.")
            present, lock.replaced = [], True
        if present and not (continuing or owned):
            if not overwrite:
                resume = "Pass train_model(..., resume=True) to continue it, " if CHECKPOINT_DIR + "/" in present \
                    else "It saved no checkpoint, so it cannot be resumed. Pass "
                raise FileExistsError(
                    f"log_dir {log_dir} already holds a run ({', '.join(present)}). {resume}train_model(..., "
                    f"overwrite=True) to replace it, or choose another log_dir (without log_dir, each run gets a new "
                    f"version_N folder).")
            checkpointer.wait()
            messages.info(f"overwrite=True: deleting the run in {log_dir}: {_replaced_run_contents(log_dir)}.")
            _delete_replaced_run(log_dir)
            os.makedirs(os.path.join(log_dir, METRICS_DIR), exist_ok=True)
            checkpointer.reload()
            lock.replaced = True
    except BaseException:
        lock.release()
        raise
    return lock


def _replaced_run_contents(log_dir: str) -> str:
    """What ``overwrite=True`` deletes of the run in ``log_dir``, for its message: ``"checkpoints
    19, 38, 57, metrics.csv (9 rows), hparams.yaml, metrics/ (2 files), 1 TensorBoard event file"``."""
    def inside(name: str) -> list[str]:
        return sorted(os.listdir(os.path.join(log_dir, name))) if os.path.isdir(os.path.join(log_dir, name)) else []
    steps = sorted(int(name) for name in inside(CHECKPOINT_DIR) if name.isdigit())
    parts = [f"checkpoint{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"] if steps else []
    if os.path.isfile(csv := os.path.join(log_dir, "metrics.csv")):
        with open(csv, encoding="utf-8", errors="replace") as f:
            parts.append(f"metrics.csv ({max(sum(1 for line in f if line.strip()) - 1, 0)} rows)")
    names = os.listdir(log_dir)
    parts += sorted(name for name in names if name.startswith("hparams") and name.endswith(".yaml"))
    parts += [f"{name}/ ({len(inside(name))} entries)" for name in (METRICS_DIR, ABANDONED_DIR) if inside(name)]
    events = sum(name.startswith("events.out.tfevents.") for name in names)
    parts += [f"{events} TensorBoard event file{'s' if events > 1 else ''}"] if events else []
    return ", ".join(parts) or "no files of a run"


def _delete_replaced_run(log_dir: str) -> None:
    """What ``overwrite=True`` deletes of the run it replaces: its checkpoints, ``metrics/``,
    ``hparams.yaml`` (and ``hparams.N.yaml``), ``metrics.csv``, TensorBoard event files, W&B /
    MLflow run ids (so those loggers start new runs), the branches its rewinds set aside
    (``abandoned/``) and its outputs at ``flaxlight predict`` / ``export``'s default paths
    (``predictions*.npy``, ``export/``, ``export_last/``), which would pass for the new run's."""
    for name in (CHECKPOINT_DIR, METRICS_DIR, ABANDONED_DIR):
        shutil.rmtree(os.path.join(log_dir, name), ignore_errors=True)
    for name in ("export", "export_last"):  # flaxlight's artifacts only (a folder of the user's named so stays)
        if os.path.isfile(os.path.join(log_dir, name, EXPORT_INFO_FILE)):
            shutil.rmtree(os.path.join(log_dir, name), ignore_errors=True)
    replaced = [HPARAMS_FILE, "metrics.csv", "wandb_run.json", "mlflow_run.json"]  # the last two: a new run
    replaced += [name for name in os.listdir(log_dir) if name.startswith("events.out.tfevents.")
                 or (name.startswith("hparams.") and name.endswith(".yaml"))  # hparams.1.yaml, ...
                 or re.fullmatch(r"predictions(_train|_val)?(_last)?\.npy", name)]
    for name in replaced:
        if os.path.isfile(os.path.join(log_dir, name)):
            os.remove(os.path.join(log_dir, name))


_HELD_HERE: dict[str, int] = {}  # the lock files held in this process (by RunLock), by real path: the pid


class RunLock:
    """``<log_dir>/.flaxlight.lock``: the process training into the folder (pid and host).

    A second process that tries to train into a live run's folder is refused; a lock left by a
    process that no longer runs (on this host) is taken over with a warning. In one process, a
    second lock on a folder this process holds (another trainer object's, e.g. one built in a
    callback of the ``train_model`` that holds it) is refused too, and the holder's lock stays;
    a lock file naming this process's pid that this process does not hold (left by an earlier
    process that had the same pid, as in a restarted container) is taken over.

    Examples:
        >>> lock = RunLock("runs/sine"); lock.acquire()   # doctest: +SKIP
        >>> lock.release()                                # doctest: +SKIP
    """

    FILE = ".flaxlight.lock"

    def __init__(self, log_dir: str):
        self.path, self.held = os.path.join(log_dir, self.FILE), False
        self.replaced = False  # claim_run: the folder's earlier run was deleted (overwrite) or set aside
        self._key = os.path.realpath(self.path)  # one folder reached by two paths is one lock

    def acquire(self) -> None:
        me = f"{os.getpid()} {socket.gethostname()}"
        if _HELD_HERE.get(self._key) == os.getpid():
            raise self._in_use(str(os.getpid()), socket.gethostname())
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                fd = None
            if fd is None:  # outside the except: the owner's error is the only one shown
                self._check_owner()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held, _HELD_HERE[self._key] = True, os.getpid()
            return
        raise RuntimeError(f"Could not take the lock {self.path}: other processes keep claiming it.")

    def _check_owner(self) -> None:
        """Raise when the lock's owner runs; remove the lock when it is gone (or an earlier process
        with this one's pid: :meth:`acquire` refused the locks this process holds)."""
        try:
            with open(self.path) as f:
                pid_text, _, host = f.read().strip().partition(" ")
        except FileNotFoundError:
            return
        pid = int(pid_text) if pid_text.isdigit() else None
        if pid is not None and host == socket.gethostname() and (pid == os.getpid() or not _process_alive(pid)):
            if pid != os.getpid():
                warnings.warn(f"Taking over {self.path}: process {pid}, which held it, no longer runs.",
                              RuntimeWarning, stacklevel=4)
            os.remove(self.path)
            return
        raise self._in_use(pid_text or "?", host or "?")

    def _in_use(self, pid: str, host: str) -> RunInUseError:
        folder = os.path.dirname(self.path)
        if pid == str(os.getpid()) and host == socket.gethostname():
            return RunInUseError(
                f"{folder} is in use by this process ({pid} on {host}, lock file {self.path}): another trainer object "
                f"trains into it (e.g. the one whose train_model runs the callback asking now) or writes its records. "
                f"Two trainers must not write into one folder: write through that trainer, or choose another log_dir.",
                folder, pid, host)
        return RunInUseError(
            f"{folder} is in use by process {pid} on {host} (lock file {self.path}): two runs must not write into one "
            f"folder. Wait for it to finish or choose another log_dir; if that process is gone, delete the lock file.",
            folder, pid, host)

    def release(self) -> None:
        if self.held:
            self.held = False
            _HELD_HERE.pop(self._key, None)
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def finish_run(status: str, checkpointer: Checkpointer, logger: LoggerCollection, lock: "RunLock | None",
               before: Callable[[], None] | None = None, best: tuple[Mapping, int] | None = None) -> None:
    """End a run's files: ``before()`` (e.g. join background work), wait for the checkpoints, then
    finalize the loggers and release the lock whatever failed. A checkpoint write error is raised
    after that cleanup, unless the run failed already (its own error stays the one raised).
    ``best``: ``(metrics, step)`` of a successful run, given to the loggers' ``log_best_metrics``."""
    try:
        if status == "success" and best is not None and best[0]:
            logger.log_best_metrics(*best)
        if before is not None:
            before()
        checkpointer.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised below unless the run already failed
        if status != "failed":
            raise
        warnings.warn(f"While ending a failed run: {exc}", RuntimeWarning, stacklevel=3)
    finally:
        try:
            logger.finalize(status)
        except Exception as exc:  # noqa: BLE001 - a failed run keeps its own error; the lock goes anyway
            if status != "failed":
                raise
            warnings.warn(f"While ending a failed run, the loggers failed: {exc}", RuntimeWarning, stacklevel=3)
        finally:
            if lock is not None:
                lock.release()


def no_run_files() -> tuple[None, LoggerCollection, Checkpointer]:
    """What ``fast_dev_run`` writes to: no log dir, no loggers, a checkpointer nothing uses."""
    unused = os.path.join(tempfile.gettempdir(), f"flaxlight-fast-dev-run-{uuid.uuid4().hex}")  # never created
    return None, LoggerCollection([]), Checkpointer(unused)


def make_loggers(params: LoggerParams, log_dir: str, extra: list[Logger]) -> LoggerCollection:
    """The loggers ``params.logger_type`` names, writing under ``log_dir``, then ``extra`` (checked
    to be :class:`Logger` instances by :func:`open_run`). An ``extra`` CSV or TensorBoard logger
    writing where a built-in one would (the run's ``metrics.csv``, its event folder) takes that
    one's place: one writer per file. Every logger is told the run's folder (``set_run_dir``)."""
    project = params.project_name or "flaxlight"
    run_name = params.run_name or run_display_name(log_dir)
    loggers: list[Logger] = []
    for kind in params.logger_kinds(extra_loggers=bool(extra)):
        if kind == "csv":
            loggers.append(CSVLogger(log_dir))
        elif kind == "tensorboard":
            loggers.append(TensorBoardLogger(log_dir))
        elif kind == "wandb":
            from flaxlight.loggers.wandb import WandbLogger

            loggers.append(WandbLogger(project=project, name=run_name, save_dir=log_dir))
        else:
            from flaxlight.loggers.mlflow import MLflowLogger

            loggers.append(MLflowLogger(experiment_name=project, run_name=run_name, save_dir=log_dir))
    collection = LoggerCollection(_merge_loggers(loggers, list(extra)))
    collection.set_run_dir(log_dir)
    return collection


def _file_target(logger: Logger) -> tuple[str, str] | None:
    """What a CSV or TensorBoard logger writes (a second writer there would duplicate its records)."""
    if isinstance(logger, CSVLogger):
        return "metrics file", os.path.abspath(logger.path)
    if isinstance(logger, TensorBoardLogger):
        return "TensorBoard folder", os.path.abspath(logger.log_dir)
    return None


def _merge_loggers(built: list[Logger], extra: list[Logger]) -> list[Logger]:
    """``built`` then ``extra``, where an ``extra`` logger on a built-in one's file replaces it in
    its place; two loggers given on one file are refused."""
    merged, taken = list(built), {}
    for logger in extra:
        target = _file_target(logger)
        if target is not None and target in taken:
            raise ValueError(f"Two loggers write the {target[0]} {target[1]}: {type(taken[target]).__name__} and "
                             f"{type(logger).__name__} in loggers=[...] (or YAML loggers:). Give one of them.")
        same = [i for i, lg in enumerate(built) if target is not None and _file_target(lg) == target]
        if same:  # e.g. CSVLogger(log_dir): the user's object (its settings) writes the run's metrics.csv
            merged[same[0]] = logger
        else:
            merged.append(logger)
        if target is not None:
            taken[target] = logger
    return merged


def class_path(cls: type) -> str:
    """``package.module.Name`` of a class (of an object's class, for anything else)."""
    cls = cls if isinstance(cls, type) else type(cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def to_yaml_safe(value: Any) -> Any:
    """Plain YAML data: tuples become lists, numpy scalars floats/ints, numpy and JAX arrays (of
    numbers, booleans or strings) nested lists of their values, dtypes their name (``bfloat16``),
    classes and functions their path, anything else its ``repr``.

    Examples:
        >>> to_yaml_safe({"mean": np.array([37.52751, 49.972755], np.float32), "dims": (8, 8), "dtype": jnp.bfloat16})
        {'mean': [37.52751, 49.972755], 'dims': [8, 8], 'dtype': 'bfloat16'}
    """
    if isinstance(value, Mapping):
        return {str(k): to_yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_yaml_safe(v) for v in value]
    if (array := _plain_array(value)) is not None:
        return _array_values(array)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, _TextOnly):  # a model hparam a loaded run holds as text only: that text
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if (name := _dtype_name(value)) is not None:
        return name
    if isinstance(value, type):
        return class_path(value)
    if callable(value) and isinstance(getattr(value, "__qualname__", None), str) and getattr(value, "__module__", None):
        return f"{value.__module__}.{value.__qualname__}"  # a function (an activation): its path, as a class's
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))  # the same for the same object in the next process


_JAX_SCALAR_TYPE = type(jnp.float32)  # jnp.float32, jnp.bfloat16, ...: JAX's scalar types, which name dtypes


def _dtype_name(value: Any) -> str | None:
    """The name of a dtype of numbers or booleans given as one (``jnp.bfloat16``, ``np.float32``,
    ``np.dtype("int8")``), which :func:`with_arrays` makes a ``np.dtype`` again; None for anything else.

    Examples:
        >>> _dtype_name(jnp.bfloat16), _dtype_name(np.dtype("int8")), _dtype_name(float), _dtype_name("float32")
        ('bfloat16', 'int8', None, None)
    """
    scalar_type = isinstance(value, type) and issubclass(value, np.generic)
    if not (scalar_type or isinstance(value, (np.dtype, _JAX_SCALAR_TYPE))):
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:  # an abstract type, np.floating
        return None
    return dtype.name if dtype.kind in "biufc" or jax.dtypes.issubdtype(dtype, np.floating) else None


def _by_name_kind(value: Any) -> str | None:
    """What a value :func:`to_yaml_safe` writes by its name or ``repr`` is (``"function"``, ``"class"``,
    ``"module"``, ``"object"``): it cannot come back from the file; None for data (and arrays: the large
    ones are warned of as such)."""
    if isinstance(value, _TextOnly):  # a loaded run's, still text: what it was
        return value.kind
    if value is None or isinstance(value, (str, int, float, bool, np.generic, np.ndarray, jax.Array)) \
            or _dtype_name(value) is not None:
        return None
    if isinstance(value, type):
        return "class"
    if isinstance(value, (nn.Module, nnx.Module)):
        return "module"
    return "function" if callable(value) and hasattr(value, "__qualname__") else "object"


def _plain_array(value: Any) -> np.ndarray | None:
    """``value`` as a numpy array when it is a numpy or JAX array that YAML can hold as lists (numbers,
    booleans, strings); None for anything else (a PRNG key, an array of objects: written by repr)."""
    if not isinstance(value, (np.ndarray, jax.Array)) or jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key) \
            or value.size > ARRAY_SIZE_LIMIT:  # data, not a setting: not written (warned: hparams_record)
        return None
    array = np.asarray(value)
    floating = jax.dtypes.issubdtype(array.dtype, np.floating)  # bfloat16 too (its numpy kind is "V")
    return array if floating or array.dtype.kind in "biuU" else None


def _array_values(array: np.ndarray) -> Any:
    """An array's values as nested lists (a 0-d array: one value). Floats narrower than 64 bits are
    written by their shortest form that reads back as the same value (``37.52751``, not
    ``37.52751190185547``)."""
    if not jax.dtypes.issubdtype(array.dtype, np.floating) or array.dtype.itemsize >= 8:
        return array.tolist()
    return np.array([float(str(v)) for v in array.ravel()], dtype=object).reshape(array.shape).tolist()


def _with_paths(value: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` of every value in nested mappings, lists and tuples; a path holds the
    mapping keys (as strings) and list positions leading to it."""
    if isinstance(value, Mapping):
        return [found for k, v in value.items() for found in _with_paths(v, (*path, str(k)))]
    if isinstance(value, (list, tuple)):
        return [found for i, v in enumerate(value) for found in _with_paths(v, (*path, i))]
    return [(path, value)]


def _records(leaves: list[tuple[tuple, Any]]) -> dict[str, list[dict]]:
    """The records :func:`hparams_record` adds for ``leaves`` (:func:`_with_paths` of the settings):
    each array written as lists (path, dtype, shape), each dtype (path, name), and each model hparam
    written by name only (path, kind)."""
    arrays = [(path, array) for path, leaf in leaves if (array := _plain_array(leaf)) is not None]
    return {ARRAYS_KEY: [{"path": list(path), "dtype": "str" if array.dtype.kind == "U" else array.dtype.name,
                          "shape": list(array.shape)} for path, array in arrays],  # "str", not "str96"
            DTYPES_KEY: [{"path": list(path), "dtype": name} for path, leaf in leaves
                         if (name := _dtype_name(leaf)) is not None],
            BY_NAME_KEY: [{"path": list(path), "kind": kind} for path, leaf in leaves
                          if path[:1] == ("model_hparams",) and len(path) > 1 and (kind := _by_name_kind(leaf))]}


def _large_arrays(leaves: list[tuple[tuple, Any]]) -> list[tuple[tuple, int, Any]]:
    """``(path, size, array)`` of the arrays over :data:`ARRAY_SIZE_LIMIT` elements among ``leaves``."""
    return [(path, int(leaf.size), leaf) for path, leaf in leaves
            if isinstance(leaf, (np.ndarray, jax.Array)) and leaf.size > ARRAY_SIZE_LIMIT]


class _FlowList(list):
    """A list ``hparams.yaml`` writes on one line, ``[37.52751, 49.972755]``: an array's values."""


class _HparamsDumper(yaml.SafeDumper):
    """``yaml.safe_dump``'s dumper, writing :class:`_FlowList` in flow style."""


_HparamsDumper.add_representer(_FlowList, lambda dumper, data: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=True))


def hparams_record(config: Mapping[str, Any]) -> dict:
    """``config`` as ``hparams.yaml`` holds it: :func:`to_yaml_safe`, plus, when it holds arrays,
    :data:`ARRAYS_KEY` listing each one's path, dtype and shape, from which :func:`with_arrays`
    makes them arrays again; likewise :data:`DTYPES_KEY` for dtypes, and :data:`BY_NAME_KEY` listing
    the ``model_hparams`` written by name only (a function, a class, a module), which
    ``load_from_checkpoint`` needs passed again. An array of more than :data:`ARRAY_SIZE_LIMIT` elements is written as
    its summary only (numpy's shortened repr), with a warning: such data belongs in the state or a
    file, not in the settings (writing it whole took seconds per million values, at every save).

    Examples:
        >>> hparams_record({"seed": 1, "mean": np.zeros(2, np.float32)})["array_hparams"]
        [{'path': ['mean'], 'dtype': 'float32', 'shape': [2]}]
    """
    config = {key: value for key, value in config.items() if key not in NOT_RECORDED}
    hparams, leaves = to_yaml_safe(config), _with_paths(config)
    for path, size, array in _large_arrays(leaves):
        warn_at_user(f"{HPARAMS_FILE}: {'.'.join(map(str, path))} is an array of {size:,} elements "
                     f"{array.dtype}{list(array.shape)}, more than {ARRAY_SIZE_LIMIT:,}: its values are not written "
                     f"(only its summary) and do not come back with load_from_checkpoint. Keep large arrays out of the "
                     f"hyperparameters: in a field of a flaxlight.TrainState subclass (saved in each checkpoint) or in "
                     f"a file of your own whose path is the hyperparameter (docs/models.md, \"State that travels with "
                     f"the run\").")
    records = {key: listed for key, listed in _records(leaves).items() if listed}
    taken = next((key for key in records if key in hparams), None)
    if taken is not None:
        raise ValueError(f"{taken!r} is a key under which {HPARAMS_FILE} describes hyperparameters (which are arrays, "
                         f"dtypes, written by name); a hyperparameter of yours has that name: rename it.")
    return {**hparams, **records}


def _for_file(hparams: dict) -> dict:
    """``hparams`` with its arrays' lists, and its records' paths (and shapes), as :class:`_FlowList`."""
    for record in hparams.get(ARRAYS_KEY) or ():
        hparams = _at_path(hparams, record["path"], _flowing)
    return {**hparams, **{key: [{name: _flowing(value) for name, value in record.items()} for record in hparams[key]]
                          for key in RECORD_KEYS if hparams.get(key)}}


def _flowing(value: Any) -> Any:
    return _FlowList(value) if isinstance(value, list) else value


def _at_path(tree: Any, path: list, change: Callable[[Any], Any]) -> Any:
    """``tree`` (plain dicts and lists) with ``change`` applied at ``path`` (keys and list positions),
    copied along the path, not in place; a path that leads nowhere (a file edited by hand): as it is."""
    if not path:
        return change(tree)
    key, rest = path[0], path[1:]
    if isinstance(tree, dict) and key in tree:
        return {**tree, key: _at_path(tree[key], rest, change)}
    if isinstance(tree, list) and isinstance(key, int) and 0 <= key < len(tree):
        return [*tree[:key], _at_path(tree[key], rest, change), *tree[key + 1:]]
    return tree


def _value_at(tree: Any, path: list, default: Any = None) -> Any:
    """The value at ``path`` in ``tree`` (see :func:`_at_path`), or ``default`` where it leads nowhere."""
    found = []
    _at_path(tree, path, lambda value: found.append(value) or value)
    return found[0] if found else default


def with_arrays(hparams: dict) -> dict:
    """``hparams`` read from ``hparams.yaml`` with the values its :data:`ARRAYS_KEY` record names made
    numpy arrays of their dtype and shape again, those its :data:`DTYPES_KEY` record names ``np.dtype``
    again (``bfloat16`` too), and the records left out (what a trainer is rebuilt from). A record
    that is not flaxlight's shape is left as it is (and out).

    Examples:
        >>> with_arrays({"m": [1.5, 2.0], "array_hparams": [{"path": ["m"], "dtype": "float32", "shape": [2]}]})
        {'m': array([1.5, 2. ], dtype=float32)}
        >>> with_arrays({"dt": "bfloat16", "dtype_hparams": [{"path": ["dt"], "dtype": "bfloat16"}]})
        {'dt': dtype(bfloat16)}
    """
    rest = _without_records(hparams)
    for key, fields, restore in ((ARRAYS_KEY, {"path", "dtype", "shape"}, _as_array),
                                 (DTYPES_KEY, {"path", "dtype"}, _as_dtype)):
        for record in _valid_records(hparams.get(key), fields):
            rest = _at_path(rest, record["path"], functools.partial(restore, record=record))
    return rest


def _valid_records(records: Any, fields: set[str]) -> list[dict]:
    """``records`` (one of :data:`RECORD_KEYS` as a file holds it) when each is flaxlight's shape, with
    ``fields`` and a path; else none (a file edited by hand: its values are left as they are)."""
    valid = isinstance(records, list) and all(isinstance(record, dict) and fields <= set(record)
                                              and isinstance(record["path"], list) for record in records)
    return records if valid else []


def _as_array(value: Any, record: Mapping[str, Any]) -> Any:
    """The list ``value`` as the array ``record`` describes (its values as the file gives them)."""
    try:
        array = np.asarray(value, dtype=np.dtype(record["dtype"]))
    except (TypeError, ValueError):  # a dtype this numpy does not know, values edited into another shape
        return value
    shape = tuple(record["shape"]) if isinstance(record["shape"], list) else array.shape
    return array.reshape(shape) if array.shape != shape and array.size == int(np.prod(shape)) else array


def _as_dtype(value: Any, record: Mapping[str, Any]) -> Any:
    """The dtype ``record`` names, where the file still holds its name (one edited by hand: as it is)."""
    try:
        return np.dtype(record["dtype"]) if value == record["dtype"] else value
    except TypeError:  # a dtype this numpy does not know
        return value


def check_shared_log_dir(logger_params: Mapping[str, Any] | None, fast_dev_run: bool) -> None:
    """Several processes must be told one folder they all reach (for the checkpoints)."""
    if jax.process_count() > 1 and not (logger_params or {}).get("log_dir") and not fast_dev_run:
        raise ValueError("Training with several processes needs logger_params={'log_dir': ...}: one folder that "
                         "every process can reach, for the checkpoints.")


_LOCATION_KEYS = ("log_dir", "base_log_dir", "logger_name")  # logger_params that say where a run is, not how it trains


#: Settings whose change only makes a resumed run train longer (or shorter).
_RUN_LENGTH = ("max_steps", "num_epochs", "max_epochs")


def write_hparams(log_dir: str, config: Mapping[str, Any], resumed_from: int | None = None) -> dict:
    """Write ``config`` as ``<log_dir>/hparams.yaml`` (plain YAML) and return what was written (less
    its records, :data:`RECORD_KEYS`: the loggers get the settings). An
    earlier file that says otherwise (a resume with changed settings) is kept as
    ``hparams.1.yaml`` (``.2``, ...), and the changes are said; an equal one is left as it is.
    Where the run is (``logger_params``' ``log_dir``, ``base_log_dir``, ``logger_name``: a
    ``version_N`` run resumed by its folder, a moved run) is no setting: it alone changes nothing;
    nor are the records, which describe the settings, nor a dtype's spelling (``jax.numpy.float32``,
    as the code before ``dtype_hparams`` wrote it, is ``float32``), nor ``enable_model_summary``
    (:data:`NOT_RECORDED`, which acts when a trainer is built only): such a file, of a run written
    before, is brought up to date in place. ``resumed_from``: the step of the run's checkpoint the
    trainer's state was restored from (its random keys too; None: not restored), so a ``seed`` other
    than the run's changes none of them: the file keeps the run's, and that is said (:func:`_kept_seed`)."""
    hparams, path, earlier = hparams_record(config), os.path.join(log_dir, HPARAMS_FILE), {}
    if os.path.isfile(path):
        with open(path) as f:
            earlier = yaml.safe_load(f) or {}
        if resumed_from is not None:
            hparams = _kept_seed(earlier, hparams, resumed_from)
        changes = _changes(_without_location(_as_settings(earlier, hparams)), _without_location(_as_settings(hparams)))
        if not changes and _without_location(earlier) == _without_location(hparams):  # else: only spelled otherwise
            return _without_records(hparams)
        if changes:
            kept = next(name for name in (f"hparams.{n}.yaml" for n in itertools.count(1))
                        if not os.path.exists(os.path.join(log_dir, name)))
            os.replace(path, os.path.join(log_dir, kept))
            # Training on for longer is what a resume is for: said as information; other changes as a warning.
            say = messages.info if all(change.split(":")[0] in _RUN_LENGTH for change in changes) else messages.warning
            say(f"This run's settings differ from the ones {HPARAMS_FILE} recorded ({'; '.join(changes[:5])}"
                f"{'; ...' if len(changes) > 5 else ''}): they apply from now on; the earlier file is kept as {kept}.")
    said = (earlier.get(BY_NAME_KEY) if isinstance(earlier, dict) else None) or ()
    new = [record for record in hparams.get(BY_NAME_KEY) or () if record not in said]
    if new:  # said when the file first lists it: the run's first write (a run from before the record: its first here)
        described, passed, them = _by_name_text(new, hparams)
        warn_at_user(f"{HPARAMS_FILE}: model_hparams {described} kept there as text only: a run's files are data, "
                     f"and loading a run imports and calls nothing they name. Pass {them} again when loading the run: "
                     f"load_from_checkpoint(run, exmp_input=..., {passed}) (not needed where your trainer's __init__ "
                     f"sets {them} itself).")
    with open(path, "w") as f:
        yaml.dump(_for_file(hparams), f, Dumper=_HparamsDumper, sort_keys=False)
    return _without_records(hparams)


def _kept_seed(earlier: Any, hparams: dict, step: int) -> dict:
    """``hparams`` with the ``seed`` of the run's ``earlier`` file, where a resume from its checkpoint
    ``step`` was given another (said): the run's random keys (its model's initialisation, dropout's)
    go on from the checkpoint whatever the seed given, so the record keeps the run's seed."""
    run_seed = earlier.get("seed") if isinstance(earlier, dict) else None
    if run_seed is None or "seed" not in hparams or hparams["seed"] == run_seed:
        return hparams
    given = hparams["seed"]
    messages.info(f"Resuming with seed={given!r}, the run's being seed={run_seed!r}: the run's random keys (its model's "
                  f"initialisation, dropout's) go on from its checkpoint {step}, so seed={given!r} changes none of them, "
                  f"and {HPARAMS_FILE} keeps the run's seed, {run_seed!r}. (Only training arrays given to train_model "
                  f"itself, not a loader, are shuffled by the trainer's seed: pass seed={run_seed!r} to go on in the "
                  f"run's order.)")
    return {**hparams, "seed": run_seed}


def _as_settings(hparams: Any, current: Mapping[str, Any] | None = None) -> Any:
    """``hparams`` (as a file holds them) as a resume compares them: less their records
    (:data:`RECORD_KEYS`), which describe the settings, and what is no setting of the run
    (:data:`NOT_RECORDED`, in a file written before), but with an array's dtype and shape (its
    record's, :data:`ARRAYS_KEY`) beside its values. Given the ``current`` ones, a dtype they list
    (:data:`DTYPES_KEY`) that ``hparams`` spell as the code before that record did
    (``jax.numpy.float32``, ``numpy.int8``, ``dtype('int8')``) is spelled by its name, as now: the same setting.

    Examples:
        >>> _as_settings({"dtype": "jax.numpy.float32"}, {"dtype": "float32",
        ...                                              "dtype_hparams": [{"path": ["dtype"], "dtype": "float32"}]})
        {'dtype': 'float32'}
        >>> _as_settings({"m": [1.5], "array_hparams": [{"path": ["m"], "dtype": "float32", "shape": [1]}]})
        {'m': {'array': 'float32[1]', 'values': [1.5]}}
    """
    if not isinstance(hparams, dict):
        return hparams
    for record in _valid_records(hparams.get(ARRAYS_KEY), {"path", "dtype", "shape"}):
        hparams = _at_path(hparams, record["path"], lambda values, record=record: {
            "array": f"{record['dtype']}{record['shape']}", "values": values})
    for record in _valid_records((current or {}).get(DTYPES_KEY), {"path", "dtype"}):
        hparams = _at_path(hparams, record["path"], functools.partial(_respelled_dtype, name=record["dtype"]))
    return {key: value for key, value in _without_records(hparams).items() if key not in NOT_RECORDED}


_OLD_DTYPE_SPELLING = re.compile(r"(?:jax\.numpy|numpy|ml_dtypes)\.(\w+)|dtype\('?(\w+)'?\)")


def _respelled_dtype(value: Any, name: str) -> Any:
    """``name`` where ``value`` is an older spelling of that dtype (see :func:`_as_settings`), else ``value``."""
    match = _OLD_DTYPE_SPELLING.fullmatch(value) if isinstance(value, str) else None
    try:
        return name if match and np.dtype(jnp.dtype(match.group(1) or match.group(2))).name == name else value
    except (TypeError, ValueError, AttributeError):  # no dtype numpy knows (a class of that module)
        return value


_KINDS = {"function": "a function", "class": "a class", "module": "a module", "object": "an object"}


def _by_name_text(records: list[dict], hparams: Mapping[str, Any]) -> tuple[str, str, str]:
    """What to say of the model hparams ``records`` (:data:`BY_NAME_KEY`) lists, ``hparams`` (as the
    file holds them) written as text: ``("act (a function: 'jax.nn.gelu') is", "act=gelu", "it")``.
    The keyword is the model hparam's name (a list of functions: the list's)."""
    described, keywords = [], {}
    for record in records:
        path = record["path"]
        written = str(_value_at(hparams, path, "?")).splitlines()[0]
        written = written if len(written) <= 60 else written[:40] + "..."
        described.append(f"{'.'.join(map(str, path[1:]))} ({_KINDS.get(record.get('kind'), 'an object')}: {written!r})")
        short = written.rsplit(".", 1)[-1] if record.get("kind") in ("function", "class") and len(path) == 2 else "..."
        keywords.setdefault(path[1], short)
    many = len(records) > 1
    return (f"{', '.join(described)} {'are' if many else 'is'}", ", ".join(f"{k}={v}" for k, v in keywords.items()),
            "them" if many else "it")


class ByNameHparamError(TypeError):
    """A run's model hparam that ``hparams.yaml`` holds as text only (a function, a class, a module:
    :data:`BY_NAME_KEY`) would reach its model when it is loaded: it must be passed again.
    ``command_line`` says it for the command line, which cannot pass one (``flaxlight test`` prints it).

    Examples:
        >>> str(ByNameHparamError("Pass it again: act=gelu.", command_line="Not from the command line."))
        'Pass it again: act=gelu.'
    """

    def __init__(self, message: str, command_line: str | None = None):
        super().__init__(message)
        self.command_line = command_line or message

    def add_note(self, note: str) -> None:
        if not note.startswith("flaxlight: "):  # not the note about exmp_input's shapes, which does not apply
            super().add_note(note)


class _TextOnly:
    """A model hparam a run wrote by name only (:data:`BY_NAME_KEY`), in place of the text its file
    holds (``str()`` gives it back), handed to a trainer whose ``__init__`` may set the value itself:
    the model calling it (the function it was) raises ``message`` as a :class:`ByNameHparamError`
    (the text itself was called, or looked up as a name: "'str' object is not callable")."""

    def __init__(self, text: str, kind: str, message: str = "", command_line: str = ""):
        self.text, self.kind, self.message, self.command_line = text, kind, message, command_line

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return repr(self.text)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ByNameHparamError(self.message or f"{self.text!r} is a model hparam kept in {HPARAMS_FILE} as text "
                                                f"only: pass it again when loading the run.", self.command_line)


def kept_as_text(value: Any) -> bool:
    """Whether ``value`` is a model hparam a loaded run holds as text only (a function it wrote by
    name), not given again."""
    return isinstance(value, _TextOnly)


def _by_name_records(saved: Mapping[str, Any]) -> list[dict]:
    """The records of :data:`BY_NAME_KEY` in ``saved`` (``hparams.yaml``) that name a model hparam."""
    records = saved.get(BY_NAME_KEY) if isinstance(saved, dict) else None
    return [record for record in records if isinstance(record, dict) and isinstance(record.get("path"), list)
            and len(record["path"]) > 1 and record["path"][0] == "model_hparams"] if isinstance(records, list) else []


def _marked(model_hparams: Any, records: list[dict]) -> Any:
    """``model_hparams`` (as read from the file) with each value ``records`` name, still the text, a
    :class:`_TextOnly`: whatever the caller passes instead is not one, and so is told from it
    (``act='gelu'`` too)."""
    for record in records:
        model_hparams = _at_path(model_hparams, record["path"][1:], lambda value, kind=record.get("kind", "object"):
                                 _TextOnly(value, kind) if isinstance(value, str) else value)
    return model_hparams


def _check_by_name(trainer_class: type, run: str, saved: Mapping[str, Any], kwargs: dict, nested: bool) -> dict:
    """``kwargs`` (rebuilding ``trainer_class``: ``nested``, with ``model_hparams``, else the seed's
    pattern, each by name) where no model hparam the run wrote by name only is left as its text
    (:func:`_marked`; one given again, in any spelling, is not). Else a :class:`ByNameHparamError`
    before anything is built where the text reaches the model for certain: a trainer whose
    ``__init__`` is flaxlight's (``model_hparams`` handed on as they are), or one that declares the
    hparam as its own keyword (the text is that argument). A trainer of the user's taking
    ``model_hparams`` decides: it may set the value itself (the seed's pattern, a model it picks); the
    text, handed on, raises the same error when the model calls it."""
    where = (lambda path: path) if nested else (lambda path: path[1:])
    missing = [record for record in _by_name_records(saved)
               if isinstance(_value_at(kwargs, where(record["path"])), _TextOnly)]
    if not missing:
        return kwargs
    owner, (described, passed, them) = trainer_class.__name__, _by_name_text(missing, saved)
    said = (f"the run's model_hparams {described} kept in {HPARAMS_FILE} as text only, and a run's files are data: "
            f"loading imports and calls nothing they name, so the model cannot be built from {them}")
    again = f"{owner}.load_from_checkpoint({run!r}, exmp_input=..., {passed})"
    message = f"{owner}.load_from_checkpoint: {said}. Pass {them} again: {again}."
    command_line = (f"{said}; the command line passes data only, so it cannot load this run. In Python, pass {them} "
                    f"again: {again}; then trainer.eval_model(loader), trainer.predict(x) or trainer.export(path).")
    init = trainer_class.__init__
    if not nested or (getattr(init, "__module__", "").split(".")[0] == "flaxlight"
                      and "model_hparams" in explicit_parameters(init)):
        raise ByNameHparamError(message, command_line)
    for record in missing:
        kwargs = _at_path(kwargs, where(record["path"]),
                          lambda marked: _TextOnly(marked.text, marked.kind, message, command_line))
    return kwargs


def _without_records(hparams: dict) -> dict:
    """The settings without the file's records of which are arrays, dtypes, by name (:data:`RECORD_KEYS`;
    what the loggers are given)."""
    return {key: value for key, value in hparams.items() if key not in RECORD_KEYS}


def _without_location(hparams: Any) -> Any:
    """``hparams`` less the ``logger_params`` keys that say where the run is (:data:`_LOCATION_KEYS`).

    Examples:
        >>> _without_location({"seed": 1, "logger_params": {"log_dir": "runs/a", "logger_type": "csv"}})
        {'seed': 1, 'logger_params': {'logger_type': 'csv'}}
    """
    if not isinstance(hparams, dict) or not isinstance(hparams.get("logger_params"), dict):
        return hparams
    params = {key: value for key, value in hparams["logger_params"].items() if key not in _LOCATION_KEYS}
    return {**hparams, "logger_params": params}


def _changes(before: Any, after: Any, key: str = "") -> list[str]:
    """``["optimizer_hparams.lr: 0.001 -> 0.01", ...]``: where two plain YAML values differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [change for name in dict.fromkeys([*before, *after])
                for change in _changes(before.get(name), after.get(name), f"{key}.{name}" if key else str(name))]
    return [] if before == after else [f"{key}: {before!r} -> {after!r}"]


def read_hparams(log_dir: str) -> dict:
    """``<log_dir>/hparams.yaml`` as a dict; a clear error when ``log_dir`` is not a run's folder."""
    path = os.path.join(log_dir, HPARAMS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"No {HPARAMS_FILE} in {log_dir}. load_from_checkpoint expects a run's log dir, the folder that "
            f"holds {HPARAMS_FILE} and {CHECKPOINT_DIR}/ (e.g. checkpoints/MLP/version_0).")
    with open(path) as f:
        return yaml.safe_load(f) or {}


def trainer_kwargs(trainer_class: type, run: str | os.PathLike, which: str,
                   overrides: Mapping[str, Any], need_checkpoint: bool = True) -> dict[str, Any]:
    """Constructor arguments that rebuild the trainer of the run folder ``run`` from its
    ``hparams.yaml``, after checking that the folder holds a run with a checkpoint (of flaxlight's;
    ``need_checkpoint=False``: a run whose ``save_model`` wrote checkpoints of its own).

    Works for trainers taking ``model_class``/``model_hparams`` and for the seed's pattern of a
    constructor taking the model hyperparameters by name. The model class named in the file is
    imported only when ``overrides`` does not give one. Loading prints no model table.
    """
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}.")
    log_dir = os.path.abspath(os.fspath(run))
    saved = read_hparams(log_dir)
    hparams, ckpt_dir = with_arrays(saved), os.path.join(log_dir, CHECKPOINT_DIR)
    check_folders(log_dir)
    if need_checkpoint and (not os.path.isdir(ckpt_dir) or not Checkpointer(ckpt_dir, read_only=True).all_steps()):
        if hparams.get("enable_checkpointing") is False:  # not "yet": it never will
            raise FileNotFoundError(
                f"No checkpoint in {ckpt_dir}: the run was trained with enable_checkpointing=False, so it saved no "
                f"model to load. Train it with checkpointing on (enable_checkpointing=True, or "
                f"callbacks=[ModelCheckpoint(...)]), or use the trainer that trained it (predict, export).")
        raise FileNotFoundError(f"No checkpoint in {ckpt_dir}: this run saved no model yet.")
    model_class_path = hparams.pop("model_class")
    model_hparams = _marked(hparams.pop("model_hparams", {}) or {}, _by_name_records(saved))
    # logger_params given are merged over the saved ones; a log_dir given logs there (the checkpoint is still this run's)
    hparams["logger_params"] = {**(hparams.get("logger_params") or {}), "log_dir": log_dir,
                                **(overrides.get("logger_params") or {})}
    hparams["enable_model_summary"] = False  # an override can ask for the table
    if "optimizer_hparams" in overrides:  # they replace the run's whole: what of the run's that leaves out is said
        _say_optimizer_left_out(trainer_class.__name__, log_dir, hparams.get("optimizer_hparams"),
                                overrides["optimizer_hparams"])
    if "mesh" in hparams:  # the run's mesh, fitted to the devices here, unless mesh= or distributed= is given
        hparams["mesh"] = None if {"mesh", "distributed"} & set(overrides) else fit_mesh(hparams["mesh"])
        if hparams["mesh"] is None and not {"mesh", "distributed"} & set(overrides):
            hparams["distributed"] = None
            messages.info(f"The run's mesh does not fit the {jax.device_count()} device(s) here: the model loads on "
                          f"one device (pass mesh=... to load_from_checkpoint to place it).")
    hparams = _without_unread(hparams, declared_keywords(trainer_class))
    nested = _takes_model_hparams(trainer_class, model_hparams)
    if nested:
        hparams["model_hparams"] = model_hparams
        if "model_class" not in overrides:
            hparams["model_class"] = _import_model_class(model_class_path)
    else:  # the seed's pattern: MyTrainer(hidden_dims, output_dim, **kwargs)
        hparams.update(model_hparams)
    kwargs = {**hparams, **{key: value for key, value in overrides.items() if key != "logger_params"}}
    return _check_by_name(trainer_class, os.fspath(run), saved, kwargs, nested)


#: The run's optimizer settings that its train step applies, which an optimizer function or transformation cannot carry.
_STEP_SETTINGS = {"precision": "fp32", "freeze": []}


def _say_optimizer_left_out(owner: str, log_dir: str, saved: Any, given: Any) -> None:
    """Say (info) which of the run's optimizer settings (``saved``, as its ``hparams.yaml`` records
    them) the ``optimizer_hparams`` given to ``load_from_checkpoint`` leave out, as they replace the
    run's whole (Keras' ``compile(optimizer=...)``): each key of the run's that ``given`` does not
    name and whose value differs from what ``given`` resolves to, with both values, and how to keep
    them. An optimizer function or transformation given: the run's ``precision`` and ``freeze``
    (:data:`_STEP_SETTINGS`), which only the dict form sets."""
    if not isinstance(saved, Mapping) or "ready_optax" in saved:  # the run's optimizer was no dict either
        return
    config = optim.as_optimizer_config(given)
    if config is None:
        dropped = [f"{key}={saved[key]!r}" for key, default in _STEP_SETTINGS.items()
                   if saved.get(key, default) != default]
        if dropped:
            messages.info(f"{owner}.load_from_checkpoint: optimizer_hparams={to_yaml_safe(given)!r}, an optimizer of "
                          f"yours, replace the run's optimizer settings whole: its {', '.join(dropped)} do not carry "
                          f"over (only the dict form sets them: this run computes in float32 and freezes only what "
                          f"your optimizer does, e.g. a group of optax.set_to_zero()).")
        return
    named, now = optim.named_settings(given), optim.recorded_optimizer(config)
    left_out = [key for key, value in saved.items() if key not in named and now.get(key, _STEP_SETTINGS.get(key)) != value]
    if not left_out:
        return
    left_out.sort(key=lambda key: key not in _STEP_SETTINGS)  # precision and freeze first: a new dict drops them most
    now = {**_STEP_SETTINGS, **now}  # a record leaves an empty freeze out
    shown = ", ".join(f"{key}={saved[key]!r} (now {now[key]!r})" if key in now else f"{key}={saved[key]!r} (now not set)"
                      for key in left_out)
    again = ", ".join(f"{key!r}: {value!r}" for key, value in given.items()) if isinstance(given, Mapping) else "..."
    messages.info(f"{owner}.load_from_checkpoint: optimizer_hparams replace the run's optimizer settings whole, so "
                  f"these of the run's are left out: {shown}; this run's optimizer: {config.describe()}. To keep "
                  f"them, give them again, or start from the run's: old = yaml.safe_load(open("
                  f"{os.path.join(log_dir, HPARAMS_FILE)!r}))['optimizer_hparams']; optimizer_hparams={{**old, {again}}}.")


def _without_unread(hparams: dict, declared: set[str]) -> dict:
    """``hparams`` less the keywords a run from before they were refused was given and kept as extra
    hparams, doing nothing (said): Lightning's Trainer arguments, ``train_model``'s, an ``rngs``,
    ``optimizer`` / ``model`` / ``loss`` / ``metrics``;
    not the trainer class's own (``declared``, as ``TrainerOptions.split_kwargs`` takes them)."""
    for kinds, unread in (("Lightning's Trainer argument(s)", LIGHTNING_TRAINER_ARGUMENTS),
                          ("train_model keyword(s)", TRAIN_MODEL_ARGUMENTS),  # num_epochs, batch_size: kept, recorded
                          ("an nnx.Rngs (the model's keys came from seed)", ("rngs",)),
                          ("argument(s) of Keras' model.compile or a plain NNX loop", FOREIGN_TRAINER_ARGUMENTS)):
        ignored = sorted(key for key in hparams if key in unread and key not in declared)
        if ignored:
            messages.info(f"{HPARAMS_FILE} holds {', '.join(ignored)}, {kinds} that this run's trainer was given and "
                          f"that flaxlight never read: left out (flaxlight now refuses them).")
            hparams = {key: value for key, value in hparams.items() if key not in ignored}
    return hparams


def _takes_model_hparams(trainer_class: type, model_hparams: Mapping[str, Any]) -> bool:
    """Whether ``trainer_class`` is rebuilt with ``model_class`` / ``model_hparams`` (else: the seed's
    pattern, a constructor naming every model hyperparameter, ``MyTrainer(hidden_dims, ...)``)."""
    named = explicit_parameters(trainer_class.__init__)
    return "model_hparams" in named or not model_hparams or not set(model_hparams) <= set(named)


#: ``load_from_checkpoint`` keywords of other libraries that load part of a checkpoint, by whose they are.
PARTIAL_LOAD_ARGUMENTS = {"strict": "PyTorch Lightning's load_from_checkpoint", "skip_mismatch": "Keras' load_weights"}
_LIGHTNING_LOAD = "PyTorch Lightning's load_from_checkpoint"
# Other keywords of Lightning's load_from_checkpoint (and torch.load's): what flaxlight does instead
LIGHTNING_LOAD_ARGUMENTS = {
    "map_location": "flaxlight restores the arrays onto JAX's default device. To load onto the CPU (a model trained "
                    "on a GPU, on a machine without one or to keep the GPU's memory free): "
                    "with jax.default_device(jax.devices('cpu')[0]): trainer = {owner}.load_from_checkpoint(run, "
                    "exmp_input=...); onto several devices: mesh=...",
    "hparams_file": "flaxlight rebuilds the trainer from the run's own hparams.yaml; give the settings that should "
                    "differ as keywords instead, e.g. {owner}.load_from_checkpoint(run, exmp_input=..., "
                    "optimizer_hparams={{...}}) or a model hparam by its name (num_classes=5)",
    "weights_only": "flaxlight's checkpoints are orbax arrays and JSON, never pickles, so loading runs no code "
                    "whatever it is: drop it",
}


def load_overrides(trainer_class: type, run: str | os.PathLike, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``load_from_checkpoint``'s overrides, settled before the trainer of the run folder ``run`` is
    rebuilt. A keyword that names an argument of the run's model (a key of its saved
    ``model_hparams``, or an argument of its model class: Lightning's
    ``load_from_checkpoint(path, num_classes=5)``) and no argument of the trainer's replaces that
    model hyperparameter (unless the run saved it as a setting of its trainer, beside ``model_hparams``):
    it joins the saved ``model_hparams`` (said), the model is built with it
    and the new run records it (a checkpoint the new model does not fit is then a
    :class:`~flaxlight.checkpoint.ModelMismatchError` naming the parameters that differ). Given
    beside ``model_hparams=``, which replaces the saved dict whole, it is refused. Lightning's
    ``strict`` and Keras' ``skip_mismatch`` are refused, naming the partial load's recipe, and its
    ``map_location``, ``hparams_file`` and ``weights_only`` naming what to do instead
    (:data:`LIGHTNING_LOAD_ARGUMENTS`), unless the trainer's ``__init__`` declares one as its own.

    Examples:
        >>> load_overrides(Classifier, "runs/base", {"num_classes": 5})   # doctest: +SKIP
        {'model_hparams': {'hidden': 32, 'num_classes': 5}}
    """
    declared, name = declared_keywords(trainer_class), trainer_class.__name__
    for key, whose in PARTIAL_LOAD_ARGUMENTS.items():
        if key in overrides and key not in declared:
            raise TypeError(_partial_load_message(name, key, overrides[key], whose))
    for key, instead in LIGHTNING_LOAD_ARGUMENTS.items():
        if key in overrides and key not in declared:
            raise TypeError(f"{name}.load_from_checkpoint got {key}={overrides[key]!r} (a keyword of {_LIGHTNING_LOAD}"
                            f"): {instead.format(owner=name)}. (Kept as an extra hparam, as other unknown keywords "
                            f"are, {key} would do nothing; so it is refused.)")
    taken = declared | set(TRAINER_ARGUMENTS) | {field.name for field in dataclasses.fields(TrainerOptions)}
    unknown = [key for key in overrides if key not in taken | {"callbacks", "loggers", "mesh"}]
    raw = read_hparams(os.path.abspath(os.fspath(run))) if unknown else {}
    hparams = with_arrays(raw)
    saved = _marked(hparams.get("model_hparams") or {}, _by_name_records(raw))  # those not given again: told apart
    if not unknown or not _takes_model_hparams(trainer_class, saved):
        return dict(overrides)
    model_class = overrides.get("model_class") or _model_class_or_none(hparams.get("model_class"))
    extra = {key for key in hparams if key not in ("model_class", "model_hparams")}  # the trainer's own, saved top-level
    moved = {key: overrides[key] for key in unknown
             if key in set(saved) | _model_arguments(model_class) and not (key in extra and key not in saved)}
    if not moved:
        return dict(overrides)
    model = getattr(model_class, "__name__", "the run's model")
    given, argument = ", ".join(f"{key}={value!r}" for key, value in moved.items()), \
        "an argument" if len(moved) == 1 else "arguments"
    if "model_hparams" in overrides:
        raise TypeError(
            f"{name}.load_from_checkpoint got {given}, {argument} of the model {model}, and model_hparams="
            f"{overrides['model_hparams']!r}, which replaces the run's model hyperparameters whole: give them in one "
            f"place, model_hparams={ {**overrides['model_hparams'], **moved}!r}.")
    merged = {**saved, **moved}
    # not said when it gives back what the run wrote by name only (a function: act=nnx.gelu)
    if set(moved) - {record["path"][1] for record in _by_name_records(raw)}:
        messages.info(f"{name}.load_from_checkpoint: {given}, {argument} of the model {model}, replaces the run's "
                      f"(model_hparams {saved!r} -> {merged!r}): the model is built with it, and the checkpoint's "
                      f"parameters must fit it (a partial load, for a new head: docs/models.md, \"Fine-tuning\").")
    return {**{key: value for key, value in overrides.items() if key not in moved}, "model_hparams": merged}


def _partial_load_message(owner: str, key: str, value: Any, whose: str) -> str:
    """Why ``strict`` / ``skip_mismatch`` given to ``load_from_checkpoint`` are refused, and what to do."""
    what = (f"load_from_checkpoint always restores every parameter of the checkpoint, or fails (as {key}={value!r} "
            f"asks): drop {key}" if value is (key == "strict") else
            f"flaxlight has no partial load by keyword: load_from_checkpoint restores every parameter of the checkpoint "
            f"into the model built from the run's hparams.yaml (and your overrides), or fails with a "
            f"ModelMismatchError naming the parameters whose shapes differ")
    return (f"{owner}.load_from_checkpoint got {key}={value!r} (a keyword of {whose}): {what}. To restore only part of a "
            f"run (a backbone) and keep the rest as the new model initialised it (a new head for another number of "
            f"classes), build the new trainer, load the run, and put the parts that fit into the new trainer's state "
            f"before train_model: the recipe is in docs/models.md, section \"Fine-tuning\". (Kept as an extra hparam, "
            f"as other unknown keywords are, {key} would do nothing; so it is refused.)")


def _model_class_or_none(path: Any) -> type | None:
    """The model class ``hparams.yaml`` names, or None when it does not import."""
    try:
        return _import_model_class(path) if isinstance(path, str) else None
    except ImportError:
        return None


def _model_arguments(model_class: Any) -> set[str]:
    """The arguments ``model_class`` takes: a Linen module's fields, an NNX module's ``__init__``'s
    (less ``rngs``); empty when unknown."""
    if isinstance(model_class, type) and dataclasses.is_dataclass(model_class):  # Linen modules are dataclasses
        return {field.name for field in dataclasses.fields(model_class)} - {"parent", "name"}
    return set(explicit_parameters(getattr(model_class, "__init__", None))) - {"rngs"} if model_class else set()


def _import_model_class(path: str) -> type:
    try:
        return import_object(path)
    except RegistryError as exc:
        raise ImportError(f"Cannot import model class {path!r} named in {HPARAMS_FILE}: {exc} "
                          f"Pass it explicitly: load_from_checkpoint(..., model_class=MyModel).") from exc


def write_metrics(log_dir: str, name: str, metrics: Mapping[str, float]) -> None:
    """``<log_dir>/metrics/<name>.json``, written whole or not at all: a failed write (a full disk)
    leaves the file that was there, never a truncated one."""
    folder = os.path.join(log_dir, METRICS_DIR)
    os.makedirs(folder, exist_ok=True)
    text = json.dumps({key: np.asarray(value).tolist() for key, value in metrics.items()}, indent=4)  # arrays: lists
    path = os.path.join(folder, f"{name}.json")
    temporary = os.path.join(folder, f".{name}.json.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, path)  # atomic: readers see the old file or the new one
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


class MetricFiles:
    """A run's ``metrics/<name>.json`` files, each written whole by :func:`write_metrics` on one
    background thread: a validation's file costs the training thread a queue append instead of a
    file write (~0.3 ms). The files are written in batches, without waking the thread for each
    (within ``BackgroundWriter.idle_seconds``, with the next job that wakes it, or at :meth:`flush`,
    which waits until they are on disk), and a file asked for again before it was written
    (``best_eval.json`` at each new best) is written once, with the newest values: on the tiny
    MLP's 12 ms epochs, 0.42 ms of CPU per epoch that the steps had to share two cores with. A
    write's error (a full disk) is raised on the caller's thread at the next :meth:`write_soon` or
    :meth:`flush`; the files queued behind it are not written.

    Examples:
        >>> folder = tempfile.mkdtemp()
        >>> files = MetricFiles()
        >>> files.write_soon(folder, "eval_epoch_001", {"val/loss": 0.5})
        >>> files.flush()
        >>> os.listdir(os.path.join(folder, METRICS_DIR))
        ['eval_epoch_001.json']
    """

    batch = 16  # files queued that wake the writer (else it takes them within its idle time): what a flush may find left

    def __init__(self):
        self._writer = BackgroundWriter("metric-files")

    def write_soon(self, log_dir: str, name: str, metrics: Mapping[str, Any]) -> None:
        """Queue ``<log_dir>/metrics/<name>.json`` (a copy of ``metrics`` is written); the same
        file's earlier values, if still queued, are not written."""
        self._writer.raise_failure_as()
        file, queued = (log_dir, name), self._writer.pending()
        self._writer.withdraw([job for job in queued if job.tag == file])
        self._writer.submit(write_metrics, log_dir, name, dict(metrics), tag=file, lazy=len(queued) + 1 < self.batch)

    def flush(self) -> None:
        """Write every file asked for and not written yet, on this thread (the writer's thread
        finishes the one it is writing first); raise a failed write's error."""
        self._writer.run_here()


def enable_compilation_cache(setting: bool | str) -> str | None:
    """Turn on JAX's persistent compilation cache (see ``TrainerOptions.compilation_cache``). A
    folder's path that is a file, or lies under one, is a ``ValueError`` (JAX would only warn at
    each compile that it cannot read or write there)."""
    if isinstance(setting, str):  # named: checked even where JAX's own setting is kept
        _check_cache_folder(setting, f"compilation_cache={setting!r}", "Name a folder instead")
    if setting is False or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = setting if isinstance(setting, str) else os.environ.get(
        "FLAXLIGHT_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "flaxlight", "jax"))
    if setting is True and "FLAXLIGHT_CACHE_DIR" in os.environ:
        _check_cache_folder(folder, f"$FLAXLIGHT_CACHE_DIR={folder!r}", "Set it to a folder, or set compilation_cache")
    elif setting is True:
        _check_cache_folder(folder, f"The default cache folder {folder}", "Move the file, or set compilation_cache")
    jax.config.update("jax_compilation_cache_dir", folder)
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default skips small programs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return folder


def _check_cache_folder(folder: str, said: str, fix: str) -> None:
    """Refuse a compilation-cache folder whose path is a file or lies under one (``said``: the
    setting that gave it; ``fix``: the first way out)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.exists(path) and not os.path.isdir(path):
        what = "is a file" if path == os.path.abspath(folder) else f"lies under the file {path}"
        raise ValueError(f"{said} {what}, not a folder: JAX's persistent compilation cache is a folder of compiled "
                         f"programs (JAX would only warn at each compile that it cannot use it). {fix}: compilation_cache "
                         f"takes a folder's path (made if missing), True ($FLAXLIGHT_CACHE_DIR, else "
                         f"~/.cache/flaxlight/jax) or False (no cache).")
