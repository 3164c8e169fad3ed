"""flaxlight: a Lightning-like trainer for JAX/Flax — write the model and the loss, get the loop.

Example:
    >>> import flaxlight
    >>> class Classifier(flaxlight.TrainerModule):
    ...     def loss_fn(self, params, batch, *, train, rng, state):
    ...         ...
"""

from flaxlight import loggers
from flaxlight.checkpoint import Checkpointer
from flaxlight.data import ArrayLoader
from flaxlight.optim import make_optimizer
from flaxlight.state import TrainState
from flaxlight.step import TrainStep, make_eval_step, make_train_step
from flaxlight.trainer import TrainerModule, TrainerOptions

__version__ = "0.1.0"

__all__ = [
    "ArrayLoader",
    "Checkpointer",
    "TrainState",
    "TrainStep",
    "TrainerModule",
    "TrainerOptions",
    "loggers",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "__version__",
]
