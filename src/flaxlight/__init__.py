"""flaxlight: a Lightning-like trainer for JAX/Flax — write the model and the loss, get the loop.

Examples:
    >>> import flaxlight
    >>> class Classifier(flaxlight.TrainerModule):
    ...     def loss_fn(self, params, batch, *, train, rng, state):
    ...         ...
"""

from flaxlight import callbacks, loggers
from flaxlight.callbacks import Callback, ModelCheckpoint
from flaxlight.checkpoint import Checkpointer
from flaxlight.data import ArrayLoader
from flaxlight.export import load_exported
from flaxlight.optim import (
    OptimizerConfig,
    OptimizerPlan,
    current_learning_rate,
    ema_params,
    make_l2_regularizer,
    make_optimizer,
    make_optimizer_plan,
    make_schedule,
    make_weight_decay_mask,
)
from flaxlight.state import TrainState
from flaxlight.step import TrainStep, make_eval_step, make_train_step
from flaxlight.trainer import TrainerModule, TrainerOptions
from flaxlight import registry
from flaxlight.config import Config, ConfigError, load_config, save_config

__version__ = "0.1.0"

__all__ = [
    "ArrayLoader",
    "Config",
    "ConfigError",
    "Callback",
    "Checkpointer",
    "ModelCheckpoint",
    "OptimizerConfig",
    "OptimizerPlan",
    "TrainState",
    "TrainStep",
    "TrainerModule",
    "TrainerOptions",
    "current_learning_rate",
    "ema_params",
    "load_exported",
    "load_config",
    "registry",
    "save_config",
    "callbacks",
    "loggers",
    "make_eval_step",
    "make_l2_regularizer",
    "make_optimizer",
    "make_optimizer_plan",
    "make_schedule",
    "make_train_step",
    "make_weight_decay_mask",
    "__version__",
]
