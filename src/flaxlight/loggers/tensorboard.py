"""TensorBoard event files through tensorboardX (the ``tensorboard`` extra)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Any, Mapping

from flaxlight.loggers.base import Logger, as_image, flatten_params
from flaxlight.loggers.csv import epoch_logged_at, rows_logged_ahead

__all__ = ["TensorBoardLogger", "tensorboard_available"]


def tensorboard_available() -> bool:
    """True when tensorboardX is installed (``pip install 'flaxlight[tensorboard]'``)."""
    return importlib.util.find_spec("tensorboardX") is not None


def _tensorboardx(module: str):
    """A tensorboardX module, imported without torch: tensorboardX tries ``import torch`` (for
    torch tensors, which flaxlight never passes), and when torch is installed that import adds
    over a second to every start-up."""
    import importlib

    if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
        return importlib.import_module(module)
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        return importlib.import_module(module)
    finally:
        del sys.modules["torch"]


class TensorBoardLogger(Logger):
    """Writes scalars and images to TensorBoard event files in ``log_dir``.

    Hyperparameters appear as a YAML block in TensorBoard's Text tab (tag ``hparams``) and, with
    the run's best metrics (``best/val/acc``, ...; written at the end of a successful
    ``train_model``), in the HParams tab, where runs compare side by side. Hyperparameters logged
    again (``trainer.logger.log_hyperparams({"data": ...})`` in a callback) are added to the earlier
    ones, as in W&B, MLflow and Lightning; a key logged again takes its new value.
    Events are written straight to the file by the thread that logs (flaxlight's background log
    writer): one event per log call, holding all its scalars, with no queue or thread of its own.
    ``log_dir`` is one folder: Lightning's ``save_dir``/``name``/``version`` layout is the
    trainer's (``logger_params``: ``base_log_dir/<Model>/version_N``).

    Examples:
        >>> logger = TensorBoardLogger("/tmp/run")             # doctest: +SKIP
        >>> logger.log_metrics({"val/acc": 0.9}, step=100)       # doctest: +SKIP
        >>> logger.log_image("val/reconstruction", image_hwc, step=100)  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike):
        if not tensorboard_available():
            raise ImportError("TensorBoardLogger needs tensorboardX: pip install 'flaxlight[tensorboard]'.")
        self.log_dir = os.fspath(log_dir)
        self._writer = None
        self._opened = False  # whether this logger has written an event file
        self._purge_step: int | None = None
        self._logged_ahead: list[tuple[int, dict[str, float]]] = []  # written again after the purge
        self._hparams: dict[str, Any] = {}  # every hyperparameter logged so far, nested
        self._epoch_written: tuple[int, float] | None = None  # (step, epoch) of the latest `epoch` scalar

    @property
    def save_dir(self) -> str:
        """The folder this logger writes into (its ``log_dir``)."""
        return self.log_dir

    @property
    def writer(self):
        """The open event file (tensorboardX's ``EventsWriter``; opened on first use, and a new
        file after finalize: a file is never reopened or overwritten)."""
        if self._writer is None:
            event_file = _tensorboardx("tensorboardX.event_file_writer")
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = event_file.EventsWriter(os.path.join(self.log_dir, "events"),
                                                   # after the second in the name: the files of one second
                                                   # sort in the order they were made (a purge needs that)
                                                   filename_suffix=f".{time.time_ns()}.{os.getpid()}")
            self._opened = True
            if self._purge_step is not None:  # TensorBoard hides the earlier files' events from this step on
                event_pb2 = _tensorboardx("tensorboardX.proto.event_pb2")
                self._write_event(step=self._purge_step,
                                  session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
            self._purge_step, ahead, self._logged_ahead = None, self._logged_ahead, []
            for step, metrics in ahead:  # behind the purge, which hid them: shown again
                self.log_metrics(metrics, step)
        return self._writer

    def _write_event(self, step: int, **fields) -> None:
        event_pb2 = _tensorboardx("tensorboardX.proto.event_pb2")
        self.writer.write_event(event_pb2.Event(wall_time=time.time(), step=int(step), **fields))

    def start_run(self) -> None:
        """A training run writes a new event file (an open one may have been deleted by ``overwrite=True``).
        Event files another process left in the folder (a run killed before its first checkpoint,
        continued by ``resume=True`` as a fresh start) are hidden from step 0, unless a resume
        then says from which step (:meth:`resume_from_step`)."""
        self.finalize("start")
        if not self._opened and os.path.isdir(self.log_dir) and any(
                name.startswith("events.out.tfevents.") for name in os.listdir(self.log_dir)):
            self._purge_step = 0

    def resume_from_step(self, step: int) -> None:
        """TensorBoard drops events after ``step`` written by the interrupted run (purge_step).
        The purge goes by step, so it also hides scalars logged before the checkpoint with a later
        step of their own (``trainer.log_metrics(..., step=samples_seen)``): those the run's
        ``metrics.csv`` in ``log_dir`` holds are written again behind it (images are not)."""
        self.finalize("resumed")
        self._purge_step = int(step) + 1
        self._logged_ahead = rows_logged_ahead(os.path.join(self.log_dir, "metrics.csv"), int(step))
        epoch = epoch_logged_at(os.path.join(self.log_dir, "metrics.csv"), int(step))  # kept by the purge
        self._epoch_written = None if epoch is None else (int(step), epoch)

    def log_hyperparams(self, params: Mapping) -> None:
        import yaml

        self._hparams = _merged(self._hparams, params)  # added to the earlier ones (a key again: its new value)
        try:
            text = yaml.safe_dump(self._hparams, sort_keys=False, default_flow_style=False)
        except yaml.YAMLError:  # values that are not plain data: show their repr
            text = "\n".join(f"{key}: {value!r}" for key, value in self._hparams.items())
        # Indented: TensorBoard renders the text as markdown, and an indented block keeps YAML as is.
        summary = _tensorboardx("tensorboardX.summary")
        self._write_event(0, summary=summary.text("hparams", "".join(f"    {line}\n" for line in text.splitlines())))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        summary_pb2 = _tensorboardx("tensorboardX.proto.summary_pb2")
        if "epoch" in metrics:  # an epoch's train and val records both carry it: one point per step
            point = (int(step), float(metrics["epoch"]))
            if point == self._epoch_written:
                metrics = {key: value for key, value in metrics.items() if key != "epoch"}
            self._epoch_written = point
        values = [summary_pb2.Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
        if values:
            self._write_event(step, summary=summary_pb2.Summary(value=values))

    def log_best_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """The HParams plugin's records: the hyperparameters logged before and the best metrics,
        as scalars ``best/<name>`` at ``step``, which its table shows next to them."""
        best = {f"best/{key}": float(value) for key, value in metrics.items()}
        if not best:
            return
        hparams = {key: value if isinstance(value, (bool, int, float, str)) else str(value)
                   for key, value in flatten_params(self._hparams).items() if value is not None}
        summary = _tensorboardx("tensorboardX.summary")
        for record in summary.hparams(hparams or {"run": os.path.basename(self.log_dir)}, best):
            self._write_event(step, summary=record)
        self.log_metrics(best, step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        array = as_image(image)
        summary = _tensorboardx("tensorboardX.summary")
        self._write_event(step, summary=summary.image(tag, array, dataformats="HWC" if array.ndim == 3 else "HW"))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        self._epoch_written = None  # a new file (after a purge, too) gets its own
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _merged(old: Mapping, new: Mapping) -> dict:
    """``old`` updated with ``new``, nested mappings merged key by key.

    Examples:
        >>> _merged({"opt": {"lr": 1, "b": 2}}, {"opt": {"lr": 3}, "seed": 0})
        {'opt': {'lr': 3, 'b': 2}, 'seed': 0}
    """
    out = dict(old)
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out
