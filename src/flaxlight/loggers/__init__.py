"""Loggers: a small interface, a fan-out, and writers for CSV, TensorBoard, W&B and MLflow.

``WandbLogger`` and ``MLflowLogger`` are loaded on first access, so ``import flaxlight`` never
imports ``wandb`` or ``mlflow`` (they are extras: ``pip install 'flaxlight[wandb]'``,
``'flaxlight[mlflow]'``).
"""

from flaxlight.loggers.base import Logger, LoggerCollection, as_image
from flaxlight.loggers.csv import CSVLogger
from flaxlight.loggers.tensorboard import TensorBoardLogger, tensorboard_available

__all__ = [
    "Logger",
    "LoggerCollection",
    "CSVLogger",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "as_image",
    "tensorboard_available",
]

_LAZY = {"WandbLogger": "flaxlight.loggers.wandb", "MLflowLogger": "flaxlight.loggers.mlflow"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
