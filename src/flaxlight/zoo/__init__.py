"""Ready-made models, datasets and trainers, registered by short name for configs and the CLI.

Every module of this package is imported on the first registry look-up, so adding an entry is one
decorated definition in any module here (or a new module)::

    @register_model("my_cnn")
    class MyCNN(nn.Module): ...

Built-ins: models ``mlp_regressor``, ``mlp_classifier``; datasets ``sine``, ``digits``;
trainers ``regression`` (MSE), ``classification`` (cross-entropy + accuracy).
"""

import importlib
import pkgutil

from flaxlight.zoo.datasets import digits, digits_splits, sine, sine_data
from flaxlight.zoo.models import MLPClassifier, MLPRegressor
from flaxlight.zoo.trainers import ClassificationTrainer, RegressionTrainer

__all__ = [
    "ClassificationTrainer",
    "MLPClassifier",
    "MLPRegressor",
    "RegressionTrainer",
    "digits",
    "digits_splits",
    "sine",
    "sine_data",
]

for _module in pkgutil.iter_modules(__path__):  # entries added in new modules register themselves
    importlib.import_module(f"{__name__}.{_module.name}")
del _module
