"""Callbacks: the :class:`Callback` interface and the built-in callbacks."""

from flaxlight.callbacks.base import Callback, TrainerView
from flaxlight.callbacks.defaults import one_best, start_fresh, with_default_callbacks
from flaxlight.callbacks.early_stopping import EarlyStopping
from flaxlight.callbacks.history import FitResult, History
from flaxlight.callbacks.lr_monitor import LearningRateMonitor
from flaxlight.callbacks.model_checkpoint import ModelCheckpoint
from flaxlight.callbacks.nan_guard import NaNGuard
from flaxlight.callbacks.progress_bar import ProgressBar
from flaxlight.callbacks.pruning import PruningCallback
from flaxlight.callbacks.throughput import ThroughputMonitor
from flaxlight.callbacks.timer import Timer

__all__ = [
    "Callback",
    "EarlyStopping",
    "FitResult",
    "History",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "NaNGuard",
    "ProgressBar",
    "PruningCallback",
    "ThroughputMonitor",
    "Timer",
    "TrainerView",
    "one_best",
    "start_fresh",
    "with_default_callbacks",
]
