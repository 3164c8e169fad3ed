"""TensorBoard event files through tensorboardX (the ``tensorboard`` extra)."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Mapping

from flaxlight.loggers.base import Logger, as_image

__all__ = ["TensorBoardLogger", "tensorboard_available"]


def tensorboard_available() -> bool:
    """True when tensorboardX is installed (``pip install 'flaxlight[tensorboard]'``)."""
    return importlib.util.find_spec("tensorboardX") is not None


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without torch: tensorboardX tries
    ``import torch`` (for torch tensors, which flaxlight never passes), and when torch is
    installed that import adds over a second to every start-up."""
    if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardLogger(Logger):
    """Writes scalars and images to TensorBoard event files in ``log_dir``.

    Hyperparameters appear as a YAML block in TensorBoard's Text tab (tag ``hparams``).

    Example:
        >>> logger = TensorBoardLogger("/tmp/run")             # doctest: +SKIP
        >>> logger.log_metrics({"val/acc": 0.9}, step=100)       # doctest: +SKIP
        >>> logger.log_image("val/reconstruction", image_hwc, step=100)  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike):
        if not tensorboard_available():
            raise ImportError("TensorBoardLogger needs tensorboardX: pip install 'flaxlight[tensorboard]'.")
        self.log_dir = os.fspath(log_dir)
        self._writer = None
        self._purge_step: int | None = None

    @property
    def writer(self):
        """The tensorboardX ``SummaryWriter`` (opened on first use, reopened after finalize)."""
        if self._writer is None:
            self._writer = _summary_writer_class()(logdir=self.log_dir, purge_step=self._purge_step)
            self._purge_step = None
        return self._writer

    def resume_from_step(self, step: int) -> None:
        """TensorBoard drops events after ``step`` written by the interrupted run (purge_step)."""
        self.finalize("resumed")
        self._purge_step = int(step) + 1

    def log_hyperparams(self, params: Mapping) -> None:
        import yaml

        try:
            text = yaml.safe_dump(dict(params), sort_keys=False, default_flow_style=False)
        except yaml.YAMLError:  # values that are not plain data: show their repr
            text = "\n".join(f"{key}: {value!r}" for key, value in params.items())
        # Indented: TensorBoard renders the text as markdown, and an indented block keeps YAML as is.
        self.writer.add_text("hparams", "".join(f"    {line}\n" for line in text.splitlines()), global_step=0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), global_step=int(step))

    def log_image(self, tag: str, image: Any, step: int) -> None:
        array = as_image(image)
        self.writer.add_image(tag, array, global_step=int(step), dataformats="HWC" if array.ndim == 3 else "HW")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
