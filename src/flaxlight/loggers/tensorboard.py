"""TensorBoard event files through tensorboardX (the ``tensorboard`` extra)."""

from __future__ import annotations

import os
from typing import Mapping

from flaxlight.loggers.base import Logger

__all__ = ["TensorBoardLogger", "tensorboard_available"]


def tensorboard_available() -> bool:
    """True when tensorboardX can be imported (``pip install 'flaxlight[tensorboard]'``)."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLogger(Logger):
    """Writes scalars to TensorBoard event files in ``log_dir``.

    Example:
        >>> logger = TensorBoardLogger("/tmp/run")             # doctest: +SKIP
        >>> logger.log_metrics({"val/acc": 0.9}, step=100)       # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike):
        if not tensorboard_available():
            raise ImportError("TensorBoardLogger needs tensorboardX: pip install 'flaxlight[tensorboard]'.")
        self.log_dir = os.fspath(log_dir)
        self._writer = None

    @property
    def writer(self):
        """The tensorboardX ``SummaryWriter`` (opened on first use, reopened after finalize)."""
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=self.log_dir)
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), global_step=int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
