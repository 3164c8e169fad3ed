"""The logger interface and the fan-out that sends every record to several loggers."""

from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["Logger", "LoggerCollection"]


class Logger:
    """Receives scalar metrics at log points; subclasses write them somewhere.

    Values arrive as Python floats (already on the host). ``step`` counts optimizer updates.

    Example:
        >>> class PrintLogger(Logger):
        ...     def log_metrics(self, metrics, step):
        ...         print(step, metrics)
    """

    def log_hyperparams(self, params: Mapping) -> None:
        """Record the run's hyperparameters (called once)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalars at ``step``."""

    def flush(self) -> None:
        """Make everything logged so far readable by other processes."""

    def finalize(self, status: str) -> None:
        """End of the run (``status``: ``"success"``, ``"failed"``, ``"interrupted"``)."""


class LoggerCollection(Logger):
    """Fan-out: forwards each call to every logger, in order.

    Example:
        >>> logger = LoggerCollection([CSVLogger(log_dir)])   # doctest: +SKIP
    """

    def __init__(self, loggers: Sequence[Logger]):
        self.loggers = list(loggers)

    def log_hyperparams(self, params: Mapping) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def flush(self) -> None:
        for logger in self.loggers:
            logger.flush()

    def finalize(self, status: str) -> None:
        for logger in self.loggers:
            logger.finalize(status)
