"""Loggers: a small interface, a fan-out, and writers for CSV and TensorBoard."""

from flaxlight.loggers.base import Logger, LoggerCollection
from flaxlight.loggers.csv import CSVLogger
from flaxlight.loggers.tensorboard import TensorBoardLogger, tensorboard_available

__all__ = ["Logger", "LoggerCollection", "CSVLogger", "TensorBoardLogger", "tensorboard_available"]
