"""The optimizer interface: ``optimizer_hparams`` -> one optax transformation (+ what the step needs).

``optimizer_hparams`` is one of

- a dict (the seed's way) or an :class:`OptimizerConfig` (typed; the same keys, defaults declared
  once on its fields). Keys: ``optimizer`` (any optax optimizer by name, default ``"adamw"``),
  ``lr``, ``schedule`` + ``warmup_steps`` (the seed's ``warmup`` is accepted as an alias),
  ``gradient_clip`` (global norm, default 1.0) / ``gradient_clip_value``, ``weight_decay`` +
  ``weight_decay_mode`` (``"decoupled"`` or ``"l2"``) + ``weight_decay_exclude`` /
  ``weight_decay_mask``, ``reduce_on_plateau``, ``accumulate_grad_batches``, ``ema_decay``,
  ``freeze`` (parameters kept fixed), ``precision``; every other key is passed to the optax
  optimizer (``b1``, ``momentum``, ...) and must be one it takes;
- a ready :class:`optax.GradientTransformation`: used unchanged;
- an :data:`OptimizerFactory`, ``total_steps -> GradientTransformation``: the interface of
  learned optimizers such as VeLO, which need the run's length at construction; the result is
  used unchanged and receives the loss every step as ``value=``. An optax optimizer function
  passed uncalled (``optax.adam``: its first argument is ``learning_rate``) is refused.

Weight decay is applied exactly once: ``"decoupled"`` puts it in the optax chain (the optimizer's
own decay where optax has one, e.g. ``adamw``; otherwise ``-lr * weight_decay * param`` after the
optimizer's update), ``"l2"`` leaves it out of the chain and the train step adds
``0.5 * weight_decay * sum(param ** 2)`` to the loss (:func:`make_l2_regularizer`).

Examples:
    >>> tx = make_optimizer({"optimizer": "adam", "lr": 1e-3, "warmup": 10}, total_steps=100)
    >>> plan = make_optimizer_plan(OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=1e-4,
    ...                                            weight_decay_mode="l2"), total_steps=100)
    >>> plan.regularizer is not None
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import inspect
import logging
import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "OPTIMIZER_NAMES",
    "PRECISIONS",
    "RATE_NAMES",
    "SCHEDULES",
    "WEIGHT_DECAY_MODES",
    "OptimizerConfig",
    "OptimizerFactory",
    "OptimizerPlan",
    "accumulate_gradients",
    "accumulated_updates",
    "apply_accumulated",
    "updates_at_epoch_end",
    "as_optimizer_config",
    "describe_optimizer",
    "recorded_optimizer",
    "current_learning_rate",
    "decoupled_weight_decay",
    "ema_params",
    "make_freeze_mask",
    "make_l2_regularizer",
    "make_optimizer",
    "make_optimizer_plan",
    "make_schedule",
    "make_weight_decay_mask",
    "record_learning_rate",
    "suggest_key",
    "track_params_ema",
]

logger = logging.getLogger("flaxlight")

OPTIMIZER_NAMES = tuple(
    name
    for name in (
        "adabelief", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw",
        "adan", "amsgrad", "fromage", "lamb", "lars", "lbfgs", "lion", "nadam", "nadamw",
        "noisy_sgd", "novograd", "optimistic_adam", "optimistic_gradient_descent", "polyak_sgd",
        "radam", "rmsprop", "rprop", "sgd", "sign_sgd", "signum", "sm3", "yogi",
    )
    if hasattr(optax, name)
)
SCHEDULES = ("constant", "warmup_cosine", "linear", "exponential", "piecewise", "one_cycle")
WEIGHT_DECAY_MODES = ("decoupled", "l2")
PRECISIONS = ("fp32", "bf16")
DEFAULT_WEIGHT_DECAY_EXCLUDE = ("bias", "scale")
DEFAULT_LR = 1e-3

#: A learned-optimizer factory (VeLO's shape): ``factory(total_steps) -> GradientTransformation``.
#: Its ``update`` receives the loss every step as ``value=`` (plus ``grad=`` and ``value_fn=``).
OptimizerFactory = Callable[[int], optax.GradientTransformation]

# Optimizers whose step size is a fixed number (optax does not take a schedule there).
_FIXED_RATE = {"polyak_sgd": "max_learning_rate", "rprop": "learning_rate", "sm3": "learning_rate",
               "optimistic_adam": "learning_rate"}
# Optimizers whose step is computed from the raw gradient (Polyak's f / |g|^2, L-BFGS' curvature
# pairs): clipping it changes the method, so gradient_clip defaults to None for them.
_RAW_GRADIENT = ("polyak_sgd", "lbfgs")
# Keys of the optax factories that flaxlight sets itself, and the flaxlight key to use instead.
_RESERVED = {"learning_rate": "lr", "max_learning_rate": "lr", "weight_decay": "weight_decay",
             "weight_decay_rate": "weight_decay", "mask": "weight_decay_mask",
             "weight_decay_mask": "weight_decay_mask"}
# Common spellings from other trainers -> our key (a tuple: the keys it splits into).
_HINTS = {"learning_rate": "lr", "warmup_epochs": "warmup_steps", "grad_clip": "gradient_clip",
          "gradient_clip_val": "gradient_clip", "clip_grad_norm": "gradient_clip",
          "accumulate_grad_steps": "accumulate_grad_batches", "ema": "ema_decay", "wd": "weight_decay",
          "clipnorm": "gradient_clip", "global_clipnorm": "gradient_clip", "clipvalue": "gradient_clip_value",
          "betas": ("b1", "b2"), "decay": "weight_decay"}
_ALIASES = {"warmup": "warmup_steps"}  # the seed's key
# Other trainers' precision values (Lightning's Trainer(precision=...), Keras' mixed-precision
# policies, PyTorch dtypes), lower-cased -> what flaxlight offers instead.
_BF16 = "'bf16' (the model computes in bfloat16; parameters, gradients, optimizer state and the loss stay float32)"
_PRECISION_HINTS = {
    **dict.fromkeys(("bf16-mixed", "bf16_mixed", "mixed_bfloat16", "mixed-bfloat16", "bfloat16", "torch.bfloat16"),
                    f" flaxlight spells it {_BF16}."),
    **dict.fromkeys(("bf16-true", "bf16_true"), f" flaxlight offers bfloat16 as mixed precision only: {_BF16}."),
    **dict.fromkeys(("16", "16-mixed", "16_mixed", "16-true", "fp16", "float16", "half", "mixed_float16",
                     "mixed-float16", "torch.float16"),
                    " float16 (fp16, Lightning's 16 / '16-mixed', Keras' 'mixed_float16') is not offered: use "
                    f"{_BF16}, which has float32's range and so needs no loss scaling."),
    **dict.fromkeys(("32", "32-true", "float32", "single", "torch.float32"),
                    " flaxlight spells it 'fp32' (the default)."),
    **dict.fromkeys(("64", "64-true", "fp64", "float64", "double", "torch.float64"),
                    " float64 is not offered: 'precision' picks the dtype float32 parameters compute in, 'fp32' or "
                    "'bf16'."),
}


def _precision_hint(value: Any) -> str:
    """A hint for a precision flaxlight does not know: Lightning's and Keras' spellings named
    (``'bf16-mixed'`` is ``'bf16'``; fp16 is not offered), else the closest valid one.

    Examples:
        >>> print(_precision_hint("bf16-mixed")[:29])
         flaxlight spells it 'bf16' (
        >>> print(_precision_hint(16)[:36])
         float16 (fp16, Lightning's 16 / '16
    """
    hint = _PRECISION_HINTS.get(str(value).strip().lower())
    return hint if hint is not None else suggest_key(value, PRECISIONS)

_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    """Log ``message`` on the ``flaxlight`` logger the first time it comes up in this process."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def suggest_key(key: str, candidates, value: Any = None, path: str = "") -> str:
    """`` Did you mean ...?`` for a wrong key or name, or ``""``: another trainer's spelling
    (Lightning's ``gradient_clip_val``, Keras' ``clipnorm``, PyTorch's ``betas``; ``value``, the
    one given with it, tells a weight decay from an EMA's ``decay``), else the closest of
    ``candidates``. ``path``: the config section the names are shown in (``optimizer.lr``).

    Examples:
        >>> suggest_key("clipnorm", ["gradient_clip", "lr"])
        " Did you mean 'gradient_clip'?"
    """
    def shown(name: str) -> str:
        return repr(f"{path}.{name}" if path else name)

    hint = _HINTS.get(key)
    if key == "decay" and isinstance(value, (int, float)) and 0.9 <= value < 1:  # TF's EMA spelling, likely
        return f" Did you mean {shown('ema_decay')} (a moving average of the parameters) or {shown('weight_decay')}?"
    if isinstance(hint, tuple) and all(name in candidates for name in hint):
        return f" Did you mean {' and '.join(map(shown, hint))} (one key each)?"
    if isinstance(hint, str):
        return f" Did you mean {shown(hint)}?"
    same = [c for c in candidates if str(c).lower() == str(key).lower()]
    close = same or difflib.get_close_matches(str(key), list(candidates), n=1, cutoff=0.6)
    return f" Did you mean {shown(close[0])}?" if close else ""


def _is_nnx_optimizer(value) -> bool:
    """Whether ``value`` is an ``nnx.Optimizer`` (without importing flax here)."""
    return any(klass.__name__ == "Optimizer" and klass.__module__.startswith("flax.nnx")
               for klass in type(value).__mro__)


def nnx_optimizer_message(where: str) -> str:
    """Why an ``nnx.Optimizer`` given as ``where`` is refused, and what to pass instead.

    Examples:
        >>> print(nnx_optimizer_message("optimizer_hparams"))  # doctest: +ELLIPSIS
        optimizer_hparams is an nnx.Optimizer, ... optimizer_hparams=optax.adamw(1e-3) ...
    """
    return (f"{where} is an nnx.Optimizer, which holds a model and its optimizer state for a training loop of your "
            f"own. The trainer keeps the optimizer state itself (trainer.state.opt_state) and takes only the optax "
            f"transformation inside it: optimizer_hparams=optax.adamw(1e-3) (the one you built the nnx.Optimizer "
            f"with; nnx.Optimizer(model, tx, wrt=nnx.Param) -> optimizer_hparams=tx), or flaxlight's dict form "
            f"optimizer_hparams={{'optimizer': 'adamw', 'lr': 1e-3}} (with a schedule fitted to the run and clipping). "
            f"See docs/models.md, 'Coming from a plain NNX training loop'.")


def _optimizer_factory(name: str):
    if _is_nnx_optimizer(name):
        raise TypeError(nnx_optimizer_message("optimizer_hparams['optimizer']"))
    if isinstance(name, optax.GradientTransformation) or callable(name):
        raise TypeError(f"optimizer_hparams['optimizer'] must be an optax optimizer's name (e.g. 'adam'), got "
                        f"{_ready_name(name)}: pass a ready transformation as optimizer_hparams itself "
                        f"(optimizer_hparams=optax.adam(1e-3)), or name the optimizer "
                        f"({{'optimizer': 'adam', 'lr': 1e-3}}).")
    if not isinstance(name, str) or name.lower() not in OPTIMIZER_NAMES:
        close = difflib.get_close_matches(str(name).lower(), OPTIMIZER_NAMES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown optimizer {name!r} in optimizer_hparams['optimizer'].{hint} "
            f"Valid names: {', '.join(OPTIMIZER_NAMES)}. Or pass a ready optax.GradientTransformation."
        )
    return getattr(optax, name.lower())


def _factory_parameters(name: str) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(_optimizer_factory(name)).parameters)


def _native_decay(name: str) -> tuple[str, str] | None:
    """``(weight-decay argument, mask argument)`` when optax's optimizer applies decay itself."""
    params = _factory_parameters(name)
    decay = next((k for k in ("weight_decay", "weight_decay_rate") if k in params), None)
    mask = next((k for k in ("mask", "weight_decay_mask") if k in params), None)
    return (decay, mask) if decay and mask else None


def _is_whole(value) -> bool:
    """An int, or a float with no fraction (``5.0`` from a YAML file or a search space)."""
    return isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer())


def _positive_int(value, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not _is_whole(value):
        raise ValueError(f"optimizer_hparams[{key!r}] must be an integer >= {minimum}, got {value!r}.")
    if int(value) < minimum:
        raise ValueError(f"optimizer_hparams[{key!r}] must be >= {minimum}, got {value!r}.")
    return int(value)


def _optional_positive(value, key: str, *, allow_zero: bool = False, none_means: str = "off") -> float | None:
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"optimizer_hparams[{key!r}] must be a number or None, got {value!r}.") from None
    if not value >= 0 or (value == 0 and not allow_zero) or math.isinf(value):  # also catches NaN
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"optimizer_hparams[{key!r}] must be {bound} and finite (None: {none_means}), got {value!r}.")
    return value


def _unexpected_argument_message(key: str, kwargs: Mapping[str, Any]) -> str:
    """What to say about ``OptimizerConfig(key=...)`` when ``key`` is not one of its fields."""
    name = str(kwargs.get("optimizer", OptimizerConfig.optimizer)).lower()
    theirs = [k for k in _factory_parameters(name) if k not in _RESERVED] if name in OPTIMIZER_NAMES else []
    value = kwargs[key]
    if key in theirs:
        return (f"OptimizerConfig() got {key}={value!r}, an argument of optax.{name}: put it in optimizer_kwargs: "
                f"OptimizerConfig(optimizer={name!r}, ..., optimizer_kwargs={{{key!r}: {value!r}}}) (the dict form "
                f"takes it as a key of its own: {{'optimizer': {name!r}, {key!r}: {value!r}}}).")
    ours = [f.name for f in dataclasses.fields(OptimizerConfig)]
    where = f"; optax.{name} takes in optimizer_kwargs: {', '.join(theirs)}" if theirs else ""
    return (f"OptimizerConfig() got an unexpected keyword argument {key!r}.{suggest_key(key, ours + theirs, value)} "
            f"Its fields: {', '.join(ours)}{where}.")


@dataclasses.dataclass
class OptimizerConfig(Mapping):
    """Typed optimizer settings; a dict with the same keys works everywhere this does.

    It is also a read-only mapping of its dict form (``dict(config)``), so it is saved to
    ``hparams.yaml`` as plain data and loads back as a dict. ``OptimizerConfig.from_dict(d)``
    turns a dict into a config (aliases resolved, pass-through keys checked).

    Attributes:
        optimizer: optax optimizer name (see ``OPTIMIZER_NAMES``).
        lr: peak learning rate; None lets optimizers that choose their own step (``lbfgs``'s line
            search, ``adafactor``) do so. Not taken with a schedule function (that is the rate): an
            ``lr`` other than the default is refused then, and the config's ``lr`` becomes None.
        schedule: one of ``SCHEDULES`` or an optax schedule ``step -> lr`` (a function, used as
            given: no ``warmup_steps`` with it; build a warmup into it). ``warmup_cosine`` (the
            seed's): linear warmup from 0, then cosine to ``end_lr_factor * lr`` at the end of the
            run; ``constant``; ``linear`` and ``exponential`` decay to ``end_lr_factor * lr``;
            ``piecewise`` scales ``lr`` at ``boundaries_and_scales`` (steps counted after warmup);
            ``one_cycle``: optax's cosine one-cycle, rising for ``warmup_steps`` (or 30% of the run).
        warmup_steps: optimizer updates of linear warmup from 0 (the seed's key ``warmup``).
        end_lr_factor: final learning rate as a fraction of ``lr`` (warmup_cosine, linear, exponential).
        boundaries_and_scales: ``{step: scale}`` for ``schedule="piecewise"``.
        gradient_clip: clip gradients by global norm (None: off; the dict form's default is None
            for ``polyak_sgd`` and ``lbfgs``, whose steps are computed from the raw gradient).
        gradient_clip_value: clip each gradient entry to ``[-v, v]`` (None: off); applied first.
        weight_decay: decay strength; None: the optax optimizer's own default (0.0001 for
            ``adamw``, logged), 0 for optimizers without one.
        weight_decay_mode: ``"decoupled"`` (in the optimizer, AdamW-style) or ``"l2"`` (in the loss).
        weight_decay_exclude: parameter names that are never decayed (biases, norm scales).
        weight_decay_mask: instead of ``weight_decay_exclude``: ``params -> pytree of bools`` (True:
            decay) or such a pytree.
        reduce_on_plateau: keyword arguments of ``optax.contrib.reduce_on_plateau`` (which watches
            the loss), or None.
        accumulate_grad_batches: average the gradients of N batches per update (``optax.MultiSteps``,
            see :func:`accumulate_gradients`); the trainer also updates at each epoch's end from the
            batches accumulated since the last update (their mean), so an epoch of B batches makes
            ``ceil(B / N)`` updates and no update mixes two epochs. Not with ``lbfgs``.
        ema_decay: keep an exponential moving average of the parameters (evaluation uses it).
        freeze: parameters that stay fixed (Lightning's ``freeze()``, Keras' ``trainable = False``):
            layer or parameter paths such as ``"body"``, ``"encoder/layers_0"``, ``"head/bias"``
            (``.`` separates too; ``*`` and ``?`` match within one part); a parameter whose path
            holds a name's parts in a row is frozen. Frozen parameters get zero updates, so they
            stay bitwise unchanged whatever the decay, momentum, schedule, accumulation or EMA;
            their gradients are left out of ``gradient_clip``'s global norm and the optimizer
            keeps no state for them (see :func:`make_freeze_mask`). Not with ``lbfgs``.
        precision: ``"fp32"`` or ``"bf16"`` (bf16 compute, fp32 master weights and optimizer state).
        optimizer_kwargs: further keyword arguments of the optax optimizer (``b1``, ``momentum``...).
    """

    optimizer: str = "adamw"
    lr: Optional[float] = DEFAULT_LR
    schedule: Union[str, Callable[[Any], Any]] = "warmup_cosine"
    warmup_steps: int = 0
    end_lr_factor: float = 0.01
    boundaries_and_scales: Optional[Mapping[int, float]] = None
    gradient_clip: Optional[float] = 1.0
    gradient_clip_value: Optional[float] = None
    weight_decay: Optional[float] = None
    weight_decay_mode: str = "decoupled"
    weight_decay_exclude: Union[tuple, str] = DEFAULT_WEIGHT_DECAY_EXCLUDE  # a str: one name
    weight_decay_mask: Any = None
    reduce_on_plateau: Optional[Mapping[str, Any]] = None
    accumulate_grad_batches: int = 1
    ema_decay: Optional[float] = None
    freeze: Union[tuple, str] = ()  # a str: one path
    precision: str = "fp32"
    optimizer_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __new__(cls, *args, **kwargs):
        # Only to name a wrong keyword argument (the dataclass __init__ would say just "unexpected"):
        # an optax optimizer's argument belongs in optimizer_kwargs.
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in fields:
                raise TypeError(_unexpected_argument_message(key, kwargs))
        return super().__new__(cls)

    def __post_init__(self):
        _optimizer_factory(self.optimizer)  # unknown name: the list and a suggestion
        self.optimizer = self.optimizer.lower()
        self._check_rate()
        self.end_lr_factor = float(self.end_lr_factor)
        if not 0 <= self.end_lr_factor <= 1 or (self.schedule == "exponential" and self.end_lr_factor == 0):
            raise ValueError(f"optimizer_hparams['end_lr_factor'] must be in [0, 1] (> 0 for exponential), "
                             f"got {self.end_lr_factor!r}.")
        if self.schedule == "piecewise":
            if not isinstance(self.boundaries_and_scales, Mapping) or not self.boundaries_and_scales:
                raise ValueError("schedule='piecewise' needs optimizer_hparams['boundaries_and_scales'], e.g. "
                                 "{1000: 0.1, 2000: 0.1} (multiply lr by 0.1 at step 1000 and again at 2000).")
            self.boundaries_and_scales = {int(k): float(v) for k, v in self.boundaries_and_scales.items()}
        self.gradient_clip = _optional_positive(self.gradient_clip, "gradient_clip")
        self.gradient_clip_value = _optional_positive(self.gradient_clip_value, "gradient_clip_value")
        self._check_weight_decay()
        self._check_reduce_on_plateau()
        self.accumulate_grad_batches = _positive_int(self.accumulate_grad_batches, "accumulate_grad_batches", 1)
        if self.accumulate_grad_batches > 1 and self.optimizer == "lbfgs":
            raise ValueError(
                f"optimizer_hparams: 'lbfgs' cannot accumulate gradients (accumulate_grad_batches="
                f"{self.accumulate_grad_batches}): its line search evaluates the loss of the batch it steps on "
                f"(value_fn), and the update that ends an epoch from the batches accumulated so far has no batch "
                f"to evaluate. Use accumulate_grad_batches=1 (a larger batch_size gives each update more examples).")
        if self.ema_decay is not None:
            self.ema_decay = float(self.ema_decay)
            if not 0 < self.ema_decay < 1:
                raise ValueError(f"optimizer_hparams['ema_decay'] must be in (0, 1) (e.g. 0.999) or None, "
                                 f"got {self.ema_decay!r}.")
        self._check_freeze()
        if self.precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {self.precision!r} in optimizer_hparams."
                             f"{_precision_hint(self.precision)} Valid: {', '.join(PRECISIONS)}.")
        self.optimizer_kwargs = dict(self.optimizer_kwargs or {})
        accepted = _factory_parameters(self.optimizer)
        for key in self.optimizer_kwargs:
            if key in _RESERVED:
                raise ValueError(f"optimizer_hparams key {key!r} is set by flaxlight: use {_RESERVED[key]!r} instead.")
            if key not in accepted:
                raise ValueError(self._unknown_key_message(key))

    def _check_rate(self) -> None:
        """``lr``, ``schedule`` and ``warmup_steps``, which together give the rate of every update."""
        if callable(self.lr):  # Keras' and optax's habit: a schedule as the learning rate
            raise ValueError(_schedule_as_lr_message(self.optimizer, self.lr))
        if self.lr is not None:
            self.lr = _optional_positive(self.lr, "lr", none_means="the optimizer picks its step, e.g. lbfgs")
        if not callable(self.schedule) and self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown schedule {self.schedule!r} in optimizer_hparams['schedule']."
                f"{suggest_key(self.schedule, SCHEDULES)} Valid: {', '.join(SCHEDULES)}, or an optax schedule (a "
                f"function step -> lr)."
            )
        self.warmup_steps = _positive_int(self.warmup_steps, "warmup_steps", 0)
        if self.optimizer in _FIXED_RATE and (self.schedule != "constant" or self.warmup_steps):
            raise ValueError(
                f"optax.{self.optimizer} takes a fixed step size ({_FIXED_RATE[self.optimizer]}), not a schedule: "
                f"set schedule='constant' and warmup_steps=0 in optimizer_hparams."
            )
        if callable(self.schedule):
            self._check_schedule_function()
        elif self.lr is None and _factory_parameters(self.optimizer)[_rate_argument(self.optimizer)].default \
                is inspect.Parameter.empty:
            raise ValueError(f"optimizer_hparams['lr'] is None, but optax.{self.optimizer} needs a learning rate.")
        elif self.lr is None and (self.schedule != "constant" or self.warmup_steps):
            raise ValueError("optimizer_hparams['lr'] is None (the optimizer picks its step), so a schedule cannot "
                             "scale it: set schedule='constant' and warmup_steps=0, or give lr.")

    def _check_schedule_function(self) -> None:
        """A schedule function is the rate itself: ``lr`` and ``warmup_steps`` would not be used, so
        they are refused (``lr`` left at its default becomes None: nothing reports an unused rate)."""
        unused = ([f"lr={self.lr:g}"] if self.lr is not None and self.lr != DEFAULT_LR else []) + \
                 ([f"warmup_steps={self.warmup_steps}"] if self.warmup_steps else [])
        if unused:
            keys = " and ".join(repr(item.split("=")[0]) for item in unused)
            raise ValueError(
                f"optimizer_hparams['schedule'] is a function, which gives the learning rate of every update, so "
                f"{' and '.join(unused)} would not be used. Remove {keys}, and build the peak rate and any warmup into "
                f"the function (e.g. optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup_steps, decay_steps)), "
                f"or name a schedule ({', '.join(SCHEDULES)}) to have lr and warmup_steps used."
            )
        self.lr = None

    def _check_freeze(self) -> None:
        """``freeze``: a list of layer or parameter paths (a single one may be a string)."""
        names = (self.freeze,) if isinstance(self.freeze, str) else (self.freeze or ())
        if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) and _name_parts(name)
                                                           for name in names):
            raise ValueError(f"optimizer_hparams['freeze'] must be a list of layer or parameter paths, e.g. ['body'] "
                             f"or ['encoder/layers_0', 'embed'], got {self.freeze!r}.")
        self.freeze = tuple(names)
        if self.freeze and self.optimizer == "lbfgs":
            raise ValueError(f"optimizer_hparams: 'lbfgs' cannot freeze parameters (freeze={list(self.freeze)}): its "
                             f"line search evaluates the loss (value_fn) at points it moves every parameter to, and "
                             f"would see only the trained ones. Train every parameter with lbfgs, or fine-tune with "
                             f"another optimizer (e.g. 'adam').")

    def _check_reduce_on_plateau(self) -> None:
        """Its keys and values, checked now by building it (optax checks factor, rtol and atol)."""
        if self.reduce_on_plateau is None:
            return
        if not isinstance(self.reduce_on_plateau, Mapping):
            raise ValueError("optimizer_hparams['reduce_on_plateau'] must be a dict of "
                             "optax.contrib.reduce_on_plateau arguments (e.g. {'patience': 5, 'factor': 0.5}).")
        accepted = inspect.signature(optax.contrib.reduce_on_plateau).parameters
        for key in self.reduce_on_plateau:
            if key not in accepted:
                raise ValueError(f"optimizer_hparams['reduce_on_plateau'] has key {key!r}, which "
                                 f"optax.contrib.reduce_on_plateau does not take.{suggest_key(key, accepted)} "
                                 f"Valid: {', '.join(accepted)}.")
        arguments = dict(self.reduce_on_plateau)
        for key, minimum in (("patience", 0), ("cooldown", 0), ("accumulation_size", 1)):
            value = arguments.get(key, minimum)
            if isinstance(value, bool) or not _is_whole(value) or value < minimum:
                raise ValueError(f"optimizer_hparams['reduce_on_plateau']['{key}'] must be an integer >= {minimum}, "
                                 f"got {value!r}.")
        try:
            optax.contrib.reduce_on_plateau(**arguments)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"optimizer_hparams['reduce_on_plateau']={arguments!r} is refused by "
                             f"optax.contrib.reduce_on_plateau: {exc}") from None
        self.reduce_on_plateau = arguments

    # --- dict form ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, hparams: Mapping[str, Any]) -> "OptimizerConfig":
        """A config from the dict form: aliases (``warmup``) resolved, other keys passed to optax."""
        hparams = dict(hparams or {})
        for alias, key in _ALIASES.items():
            if alias in hparams:
                if key in hparams:
                    raise ValueError(f"optimizer_hparams has both {alias!r} and {key!r}: they are the same setting; "
                                     f"keep {key!r}.")
                hparams[key] = hparams.pop(alias)
        fields = {f.name for f in dataclasses.fields(cls)} - {"optimizer_kwargs"}
        kwargs = {k: hparams.pop(k) for k in list(hparams) if k in fields}
        name = str(kwargs.get("optimizer", cls.optimizer)).lower()
        if name in _FIXED_RATE and "schedule" not in kwargs:
            kwargs["schedule"] = "constant"  # it sets its own step size: no schedule unless one is asked for
        if name in _RAW_GRADIENT and "gradient_clip" not in kwargs:
            kwargs["gradient_clip"] = None  # its step is the raw gradient's: no clipping unless asked for
        extra = dict(hparams.pop("optimizer_kwargs", None) or {})
        extra.update(hparams)
        return cls(**kwargs, optimizer_kwargs=extra)

    def to_dict(self) -> dict[str, Any]:
        """The dict form (optimizer keyword arguments flattened in), ``from_dict``'s inverse."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "optimizer_kwargs"}
        out["weight_decay_exclude"] = list(self.weight_decay_exclude)
        out["freeze"] = list(self.freeze)
        out.update(self.optimizer_kwargs)
        return out

    def __getitem__(self, key):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self):
        return len(self.to_dict())

    def _check_weight_decay(self) -> None:
        self.weight_decay = _optional_positive(self.weight_decay, "weight_decay", allow_zero=True,
                                               none_means="the optax optimizer's default")
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(
                f"Unknown weight_decay_mode {self.weight_decay_mode!r} in optimizer_hparams."
                f"{suggest_key(self.weight_decay_mode, WEIGHT_DECAY_MODES)} Valid: {', '.join(WEIGHT_DECAY_MODES)} "
                f"('decoupled': AdamW-style, in the optimizer; 'l2': 0.5 * weight_decay * |param|^2 in the loss)."
            )
        if isinstance(self.weight_decay_exclude, str):
            self.weight_decay_exclude = (self.weight_decay_exclude,)
        self.weight_decay_exclude = tuple(str(name) for name in self.weight_decay_exclude)
        if isinstance(self.weight_decay_mask, str):  # a string leaf would be True: every parameter decayed
            raise ValueError(f"optimizer_hparams['weight_decay_mask'] must be a function params -> pytree of bools "
                             f"(True: decayed) or such a pytree, got the string {self.weight_decay_mask!r}.")

    def _unknown_key_message(self, key: str) -> str:
        ours = sorted({f.name for f in dataclasses.fields(self)} - {"optimizer_kwargs"} | set(_ALIASES))
        theirs = sorted(k for k in _factory_parameters(self.optimizer) if k not in _RESERVED)
        return (
            f"Unknown key {key!r} in optimizer_hparams for optimizer {self.optimizer!r}."
            f"{suggest_key(key, ours + theirs, self.optimizer_kwargs.get(key))} flaxlight keys: {', '.join(ours)}; "
            f"optax.{self.optimizer} also takes: {', '.join(theirs) or '(nothing else)'}."
        )

    # --- what the pieces resolve to -------------------------------------------------------------
    def resolved_weight_decay(self) -> float:
        """The decay strength actually used (None resolves to the optax optimizer's own default)."""
        if self.weight_decay is not None:
            return self.weight_decay
        native = _native_decay(self.optimizer)
        if self.weight_decay_mode == "decoupled" and native:
            default = _factory_parameters(self.optimizer)[native[0]].default
            if isinstance(default, (int, float)) and default > 0:
                return float(default)
        return 0.0

    def describe(self) -> str:
        """The optimizer in effect, defaults included, in one line.

        Examples:
            >>> OptimizerConfig.from_dict({"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}).describe()
            'sgd(lr=0.1, momentum=0.9) + warmup_cosine(warmup_steps=0, end_lr=0.001) + clip_by_global_norm(1)'
        """
        if callable(self.schedule):
            args = [f"lr=schedule {getattr(self.schedule, '__name__', type(self.schedule).__name__)}"]
        else:
            args = [f"lr={self.lr:g}" if self.lr is not None else "lr=chosen by the optimizer"]
        args += [f"{key}={value!r}" for key, value in self.optimizer_kwargs.items()]
        parts = [f"{self.optimizer}({', '.join(args)})"]
        if not callable(self.schedule) and (self.schedule != "constant" or self.warmup_steps):
            detail = [f"warmup_steps={self.warmup_steps}"]
            if self.schedule in ("warmup_cosine", "linear", "exponential") and self.lr is not None:
                detail.append(f"end_lr={self.lr * self.end_lr_factor:g}")
            parts.append(f"{self.schedule}({', '.join(detail)})")
        if self.gradient_clip_value is not None:
            parts.append(f"clip({self.gradient_clip_value:g})")
        if self.gradient_clip is not None:
            parts.append(f"clip_by_global_norm({self.gradient_clip:g})")
        decay = self.resolved_weight_decay()
        if decay > 0:
            masked = "a custom mask" if self.weight_decay_mask is not None else f"not on {list(self.weight_decay_exclude)}"
            parts.append(f"weight_decay({decay:g}, {self.weight_decay_mode}, {masked})")
        if self.freeze:
            parts.append(f"freeze({list(self.freeze)})")
        for name, value in (("accumulate_grad_batches", self.accumulate_grad_batches), ("ema_decay", self.ema_decay),
                            ("reduce_on_plateau", self.reduce_on_plateau)):
            if value not in (None, 1, {}):
                parts.append(f"{name}({value})")
        return " + ".join(parts) + (f" in {self.precision}" if self.precision != "fp32" else "")

    def decay_mask(self, check: bool = True) -> Any:
        """The weight-decay mask: ``weight_decay_mask`` if given, else by name (``weight_decay_exclude``;
        ``check=False``: names that match no parameter are not refused, for a mask applied to a part
        of the parameters, the trained ones beside frozen ones)."""
        if self.weight_decay_mask is not None:
            return _covering_mask(self.weight_decay_mask)
        return _weight_decay_mask(self.weight_decay_exclude, check)

    def l2_regularizer(self) -> Callable[[Any], jax.Array] | None:
        """``params -> penalty`` for ``weight_decay_mode="l2"`` (None when there is nothing to add);
        frozen parameters (``freeze``) are left out of it."""
        if self.weight_decay_mode != "l2" or not self.weight_decay:
            return None
        mask = self.decay_mask()
        if self.freeze:
            mask = _unless_frozen(mask, make_freeze_mask(self.freeze))
        return make_l2_regularizer(self.weight_decay, mask)


def _schedule_as_lr_message(name: str, function: Callable) -> str:
    """What to say about ``optimizer_hparams['lr']`` given a function (a schedule, as Keras and optax take it)."""
    shown = getattr(function, "__qualname__", type(function).__name__)
    if name in _FIXED_RATE:
        return (f"optimizer_hparams['lr'] is a function ({shown}), but optax.{name} takes a fixed step size "
                f"({_FIXED_RATE[name]}), not a schedule: give lr a number.")
    return (f"optimizer_hparams['lr'] is a function ({shown}): 'lr' takes a number, the peak rate of the named "
            f"schedules ({', '.join(SCHEDULES)}); a schedule function goes under 'schedule'. Pass it there, "
            f"without 'lr': {{'optimizer': {name!r}, 'schedule': your_schedule}} (it then gives the rate of every "
            f"update, so build any warmup into it), or pass a ready optax transformation: "
            f"optimizer_hparams=optax.{name}(your_schedule).")


def _rate_argument(name: str) -> str:
    return _FIXED_RATE.get(name, "learning_rate")


def as_optimizer_config(optimizer_hparams) -> OptimizerConfig | None:
    """Validate ``optimizer_hparams``: a config for dicts and configs, None for a ready
    transformation or an :data:`OptimizerFactory` (those are used unchanged) and for the record
    of one read back from ``hparams.yaml``."""
    if isinstance(optimizer_hparams, OptimizerConfig):
        return optimizer_hparams
    if isinstance(optimizer_hparams, optax.GradientTransformation) or _recorded_ready(optimizer_hparams) or \
            _recorded_function(optimizer_hparams):
        return None
    if optimizer_hparams is None or isinstance(optimizer_hparams, Mapping):
        return OptimizerConfig.from_dict(optimizer_hparams or {})
    if callable(optimizer_hparams):
        _refuse_uncalled_optimizer(optimizer_hparams)
        return None
    if _is_nnx_optimizer(optimizer_hparams):
        raise TypeError(nnx_optimizer_message("optimizer_hparams"))
    if isinstance(optimizer_hparams, optax.MultiSteps):  # the optax docs' accumulation recipe: not a transformation
        raise TypeError(
            "optimizer_hparams is an optax.MultiSteps object, which is not a GradientTransformation itself: pass its "
            "transformation, optimizer_hparams=optax.MultiSteps(opt, every_k_schedule=k).gradient_transformation(), "
            "or let flaxlight accumulate: {'optimizer': 'adam', 'lr': 1e-3, 'accumulate_grad_batches': k} (the "
            "gradients of k batches averaged per update, with flaxlight's schedule counting updates).")
    raise TypeError(
        f"optimizer_hparams must be a dict, a flaxlight.OptimizerConfig, an optax.GradientTransformation or a "
        f"function total_steps -> GradientTransformation; got {type(optimizer_hparams).__name__}."
    )


def named_settings(optimizer_hparams: Mapping[str, Any] | OptimizerConfig) -> set[str]:
    """The settings ``optimizer_hparams`` name, by their keys in the dict form: a dict's keys (an
    alias as its setting, ``warmup`` as ``warmup_steps``; ``optimizer_kwargs``' keys too); a
    config's settings other than their defaults (the others it may or may not have been given).

    Examples:
        >>> sorted(named_settings({"lr": 1e-3, "warmup": 10}))
        ['lr', 'warmup_steps']
        >>> sorted(named_settings(OptimizerConfig(precision="bf16")))
        ['precision']
    """
    if isinstance(optimizer_hparams, OptimizerConfig):
        defaults = OptimizerConfig().to_dict()
        return {key for key, value in optimizer_hparams.to_dict().items() if key not in defaults or defaults[key] != value}
    return {_ALIASES.get(key, key) for key in optimizer_hparams if key != "optimizer_kwargs"} | \
        set(optimizer_hparams.get("optimizer_kwargs") or {})


def _refuse_uncalled_optimizer(function: Callable) -> None:
    """A TypeError for an optimizer function given uncalled (``optax.adam``): as an
    :data:`OptimizerFactory` it would be called with the run's length as its learning rate."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin): taken as a factory
        return
    if not parameters or parameters[0] not in ("learning_rate", "max_learning_rate"):
        return
    name = getattr(function, "__name__", type(function).__name__)
    module = getattr(function, "__module__", "") or ""
    shown = f"optax.{name}" if module.split(".")[0] == "optax" else name
    dict_form = f", or {{'optimizer': {name!r}, 'lr': 1e-3}} (flaxlight's schedule and clipping)" \
        if name in OPTIMIZER_NAMES else ""
    raise TypeError(
        f"optimizer_hparams={shown} is an optimizer function, not a transformation: its first argument is "
        f"{parameters[0]!r}, so flaxlight would call it as an optimizer factory with the run's length (total_steps) "
        f"as the learning rate. Call it: pass {shown}(1e-3) (a ready optax transformation){dict_form}."
    )


def describe_optimizer(optimizer_hparams) -> str:
    """One line naming the optimizer that will run (see :meth:`OptimizerConfig.describe`).

    Examples:
        >>> describe_optimizer({"optimizer": "polyak_sgd", "lr": 1.0})
        'polyak_sgd(lr=1)'
        >>> describe_optimizer({"optimizer": "polyak_sgd", "lr": 1.0, "gradient_clip": 1.0})
        'polyak_sgd(lr=1) + clip_by_global_norm(1)'
    """
    if _recorded_ready(optimizer_hparams):
        return f"a ready optax transformation ({optimizer_hparams['ready_optax']}), not saved with the run"
    if key := _recorded_function(optimizer_hparams):
        name = optimizer_hparams.get("optimizer", "the run's optimizer")
        return f"{name} with {key}={optimizer_hparams[key]} (a function, not saved with the run)"
    config = as_optimizer_config(optimizer_hparams)
    if config is not None:
        return config.describe()
    return f"a ready optax transformation ({_ready_name(optimizer_hparams)}), used as given"


def own_copy(hparams: Any) -> Any:
    """``optimizer_hparams`` as a trainer keeps them: its dicts and lists copied (a later edit of
    the caller's dict, for another trainer, changed this one's learning rate without a word);
    anything else (an optax transformation, a schedule) as it is.

    Examples:
        >>> given = {"optimizer": "adam", "lr": 1e-3}
        >>> kept = own_copy(given); given["lr"] = 0.5; kept["lr"]
        0.001
    """
    if type(hparams) is dict:  # a plain dict, as written; a class of its own (a config object) stays the caller's
        return {key: own_copy(value) for key, value in hparams.items()}
    if type(hparams) is list:
        return [own_copy(value) for value in hparams]
    return hparams


def recorded_optimizer(optimizer_hparams) -> Any:
    """What ``hparams.yaml`` records: every setting of a dict or config as resolved (defaults
    included; a function by its name), and for a ready transformation its name and a note."""
    if _recorded_ready(optimizer_hparams) or _recorded_function(optimizer_hparams):  # read back from hparams.yaml
        return dict(optimizer_hparams)
    config = as_optimizer_config(optimizer_hparams)
    if config is None:
        return {"ready_optax": _ready_name(optimizer_hparams),
                "note": "a ready optax object was given; pass it again as optimizer_hparams to train on"}
    record = config.to_dict()
    record["weight_decay"] = config.resolved_weight_decay()
    if not record["freeze"]:  # unused: the record stays that of the runs written before the key existed
        del record["freeze"]
    for key in ("schedule", "weight_decay_mask"):
        if callable(record.get(key)):
            record[key] = f"<function {getattr(record[key], '__qualname__', type(record[key]).__name__)}>"
    return record


def _recorded_function(optimizer_hparams) -> str | None:
    """The key (``schedule``, ``weight_decay_mask``) whose function a record read back from
    ``hparams.yaml`` holds by name only (``'<function f>'``, see :func:`recorded_optimizer`), if any."""
    if not isinstance(optimizer_hparams, Mapping):
        return None
    return next((key for key in ("schedule", "weight_decay_mask") if isinstance(optimizer_hparams.get(key), str)
                 and optimizer_hparams[key].startswith("<function ")), None)


def _recorded_ready(optimizer_hparams) -> bool:
    """Whether ``optimizer_hparams`` is the record of a ready transformation (see :func:`recorded_optimizer`)."""
    return isinstance(optimizer_hparams, Mapping) and "ready_optax" in optimizer_hparams


def _ready_name(transformation) -> str:
    init = getattr(transformation, "init", transformation)
    name = getattr(init, "__qualname__", type(transformation).__name__)
    return name.replace(".<locals>.init_fn", "").replace(".<locals>", "")


# --- schedules ----------------------------------------------------------------------------------
def make_schedule(lr: float, warmup: int, total_steps: int, schedule: str = "warmup_cosine", *,
                  end_lr_factor: float = 0.01, boundaries_and_scales: Mapping[int, float] | None = None
                  ) -> optax.Schedule:
    """The learning rate per optimizer update for a run of ``total_steps`` updates.

    ``warmup_cosine`` (the seed's default): linear warmup from 0 over ``warmup`` steps, then
    cosine decay to ``end_lr_factor * lr`` at ``total_steps``. The other schedules (see
    :class:`OptimizerConfig`) get the same linear warmup prepended.

    Examples:
        >>> float(make_schedule(1.0, 10, 100)(10))
        1.0
    """
    lr, warmup, total_steps = float(lr), int(warmup), int(total_steps)
    end = end_lr_factor * lr
    if schedule == "warmup_cosine" and warmup == 0:
        return optax.cosine_decay_schedule(lr, decay_steps=max(total_steps, 1), alpha=end_lr_factor)
    if schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup > 0 else lr, peak_value=lr, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=end,
        )
    if schedule == "one_cycle":
        pct_start = warmup / total_steps if warmup else 0.3
        return optax.cosine_onecycle_schedule(transition_steps=max(total_steps, 1), peak_value=lr,
                                              pct_start=min(pct_start, 1.0))
    decay_steps = max(total_steps - warmup, 1)
    if schedule == "constant":
        main = optax.constant_schedule(lr)
    elif schedule == "linear":
        main = optax.linear_schedule(lr, end, decay_steps)
    elif schedule == "exponential":
        main = optax.exponential_decay(lr, transition_steps=decay_steps, decay_rate=end_lr_factor)
    elif schedule == "piecewise":
        main = optax.piecewise_constant_schedule(lr, dict(boundaries_and_scales or {}))
    else:
        raise ValueError(f"Unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}.")
    if warmup == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])


# --- masks and the L2 term ----------------------------------------------------------------------
def _is_wrapper(entry) -> bool:
    """Whether a path entry is the attribute holding a box's array (an ``nnx.Variable``'s ``value``
    in an ``nnx.State``, a Linen ``Partitioned``'s): a ``GetAttrKey``, never a dict key, so a layer
    named ``value`` (attention's value projection, an actor-critic's value head) keeps its name."""
    return isinstance(entry, jax.tree_util.GetAttrKey) and entry.name in ("value", "raw_value")


def _entry_name(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", None))))


def _leaf_name(path) -> str:
    """The parameter's own name: the last path entry that is not a box's ``value`` (:func:`_is_wrapper`)."""
    return next((_entry_name(entry) for entry in reversed(path) if not _is_wrapper(entry)), "")


def make_weight_decay_mask(exclude=DEFAULT_WEIGHT_DECAY_EXCLUDE) -> Callable[[Any], Any]:
    """``params -> pytree of bools``: True (decay) unless the parameter's name is in ``exclude``.

    The default excludes ``bias`` (Dense, Conv, and norm layers' shift) and ``scale`` (BatchNorm,
    LayerNorm, GroupNorm, RMSNorm), as is standard for AdamW. A name of ``exclude`` that is no
    parameter's own name (a typo, a layer's name) would exclude nothing: applying the mask raises a
    ``ValueError`` listing the parameters' names (not for the defaults, which a model may lack).

    Examples:
        >>> make_weight_decay_mask()({"Dense_0": {"kernel": 1.0, "bias": 0.0}})
        {'Dense_0': {'bias': False, 'kernel': True}}
    """
    return _weight_decay_mask(exclude, check=True)


def _weight_decay_mask(exclude, check: bool) -> Callable[[Any], Any]:
    """:func:`make_weight_decay_mask`; ``check=False`` leaves names that match no parameter unrefused."""
    excluded = frozenset(exclude)

    def mask(params):
        if check:
            _refuse_unmatched_names(excluded - set(DEFAULT_WEIGHT_DECAY_EXCLUDE), params)
        return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path) not in excluded, params)

    return mask


def _unless_frozen(mask, frozen: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``mask`` (a decay mask, a function or a pytree) with the parameters ``frozen`` names set to False."""
    return lambda params: jax.tree.map(lambda keep, is_frozen: False if is_frozen else keep,
                                       _mask_tree(mask, params), frozen(params))


def _refuse_unmatched_names(names, params) -> None:
    """A ValueError for ``weight_decay_exclude`` names that are no parameter's name (a typo, a
    layer's name): those parameters would be decayed after all. The defaults (``bias``, ``scale``)
    are not refused: a model may have no biases or norm layers."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    leaves = sorted({_leaf_name(path) for path in paths})
    unmatched = sorted(name for name in names if name not in leaves)
    if not paths or not unmatched:
        return
    layers = {_leaf_name(path[:i + 1]) for path in paths for i in range(len(path) - 1)}
    hints = []
    for name in unmatched:
        close = difflib.get_close_matches(name, leaves, n=1, cutoff=0.6) or \
            [leaf for leaf in leaves if leaf.lower() == name.lower()]
        if close:
            hints.append(f"Did you mean {close[0]!r} for {name!r}?")
        elif name in layers:
            hints.append(f"{name!r} is a layer (module), not a parameter's name: to keep a whole layer from decay, "
                         f"pass weight_decay_mask, e.g. lambda params: jax.tree_util.tree_map_with_path("
                         f"lambda path, _: {name!r} not in [getattr(key, 'key', None) for key in path], params).")
    shown = ", ".join(repr(name) for name in leaves[:8]) + (", ..." if len(leaves) > 8 else "")
    raise ValueError(f"weight_decay_exclude names {', '.join(map(repr, unmatched))}, which match no parameter of this "
                     f"model, so they keep nothing from weight decay: the names are matched against each parameter's "
                     f"own (last) name, and this model's are {shown}. {' '.join(hints)}".rstrip())


def _name_parts(name: str) -> list[str]:
    """``"encoder/layers_0"`` (or ``"encoder.layers_0"``) -> ``["encoder", "layers_0"]``."""
    return [part for part in name.replace(".", "/").split("/") if part]


def _path_parts(path) -> list[str]:
    """A parameter's path as names, ``["encoder", "layers_0", "kernel"]`` (a box's ``value`` left out:
    :func:`_is_wrapper`; a dict key ``value`` is a layer's name and kept)."""
    return [_entry_name(entry) for entry in path if not _is_wrapper(entry)]


def _path_matches(parts: list[str], pattern: list[str]) -> bool:
    """Whether ``pattern``'s parts (fnmatch wildcards allowed) are parts of ``parts`` in a row."""
    return any(all(fnmatch.fnmatchcase(part, wanted) for part, wanted in zip(parts[start:], pattern))
               for start in range(len(parts) - len(pattern) + 1))


def step_options(config: "OptimizerConfig | None") -> dict[str, Any]:
    """What a :class:`~flaxlight.step.TrainStep` takes from the optimizer's settings: the ``"l2"``
    penalty, the precision, and the frozen parameters (left out of ``grad_norm``, as out of
    ``gradient_clip``'s norm); nothing for a ready transformation (``config`` None).

    Examples:
        >>> step_options(as_optimizer_config({"optimizer": "adam", "freeze": ["body"]}))["precision"]
        'fp32'
    """
    if config is None:
        return {}
    return {"regularizer": config.l2_regularizer(), "precision": config.precision,
            "frozen": make_freeze_mask(config.freeze) if config.freeze else None}


def make_freeze_mask(freeze) -> Callable[[Any], Any]:
    """``params -> pytree of bools``: True for the parameters that ``freeze`` names (the
    ``freeze`` setting of :class:`OptimizerConfig`). A name is a layer or parameter path, its parts
    separated by ``/`` or ``.`` (``"body"``, ``"encoder/layers_0"``, ``"head.bias"``; ``*`` and
    ``?`` match within one part, ``"layers_*"``); a parameter is named when its path holds the
    name's parts in a row. A name that matches no parameter would freeze nothing: applying the
    mask raises a ``ValueError`` listing the model's parameter paths.

    Examples:
        >>> make_freeze_mask(["body"])({"body": {"kernel": 1.0, "bias": 0.0}, "head": {"kernel": 1.0}})
        {'body': {'bias': True, 'kernel': True}, 'head': {'kernel': False}}
    """
    patterns = {name: _name_parts(name) for name in ((freeze,) if isinstance(freeze, str) else freeze)}

    def mask(params):
        paths = [_path_parts(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        unmatched = [name for name, pattern in patterns.items() if not any(_path_matches(p, pattern) for p in paths)]
        if paths and unmatched:
            raise ValueError(_unmatched_freeze_message(unmatched, paths))
        return jax.tree_util.tree_map_with_path(
            lambda path, _: any(_path_matches(_path_parts(path), pattern) for pattern in patterns.values()), params)

    return mask


def _unmatched_freeze_message(unmatched: list[str], paths: list[list[str]]) -> str:
    """What to say about ``freeze`` names that match no parameter: the model's paths, and the closest."""
    shown = ["/".join(path) for path in paths]
    prefixes = sorted({"/".join(path[:i]) for path in paths for i in range(1, len(path) + 1)})
    hints = []
    for name in unmatched:
        close = difflib.get_close_matches("/".join(_name_parts(name)), prefixes, n=1, cutoff=0.6)
        if close:
            hints.append(f"Did you mean {close[0]!r} for {name!r}?")
    listed = ", ".join(shown[:24]) + (f", ... ({len(shown) - 24} more)" if len(shown) > 24 else "")
    return (f"optimizer_hparams['freeze'] names {', '.join(map(repr, unmatched))}, which match no parameter of this "
            f"model, so they would freeze nothing. A name is a layer or parameter path ('body', 'encoder/layers_0', "
            f"'head/bias'; '*' matches within one part), matched against each parameter's path; this model's "
            f"parameters are {listed}. {' '.join(hints)}").rstrip()


def _covering_mask(mask) -> Callable[[Any], Any]:
    """``weight_decay_mask`` (a pytree of bools, or a function ``params -> pytree``) as a function
    ``params -> a bool per parameter``: its tree must cover every parameter (the parameters' tree, or
    a prefix of it: a bool for a whole layer, spread over the layer's parameters); one that leaves
    parameters out is refused by name, not with JAX's tree error."""
    def covering(params):
        tree = mask(params) if callable(mask) else mask
        try:
            return jax.tree.map(lambda flag, part: jax.tree.map(lambda _: flag, part), tree, params)
        except (ValueError, TypeError) as exc:
            raise ValueError(_partial_mask_message(tree, params, exc)) from None

    return covering


def _mask_gaps(tree, params, path: tuple = ()) -> tuple[list[str], list[str]]:
    """``(parameter paths the mask has no entry for, mask entries no parameter has)``, as ``a/b`` paths."""
    if not (isinstance(tree, Mapping) and isinstance(params, Mapping)):
        return [], []
    missing = ["/".join(map(str, (*path, key))) for key in params if key not in tree]
    unknown = ["/".join(map(str, (*path, key))) for key in tree if key not in params]
    for key in tree:
        if key in params:
            more_missing, more_unknown = _mask_gaps(tree[key], params[key], (*path, key))
            missing, unknown = missing + more_missing, unknown + more_unknown
    return missing, unknown


def _partial_mask_message(tree, params, exc: BaseException) -> str:
    """Why ``weight_decay_mask``'s tree does not fit the parameters, and the ways that work."""
    missing, unknown = _mask_gaps(tree, params)
    gaps = ([f"it has no entry for {', '.join(missing[:12])}{', ...' if len(missing) > 12 else ''}"] if missing
            else []) + ([f"it names {', '.join(unknown[:12])}, which no parameter has"] if unknown else [])
    detail = "; ".join(gaps) or f"its tree does not match the parameters' ({str(exc).splitlines()[0]})"
    example = ""
    if isinstance(tree, Mapping) and isinstance(params, Mapping) and all(isinstance(v, bool) for v in tree.values()):
        example = f" (here, e.g. {dict({key: tree.get(key, False) for key in params})})"
    return (f"optimizer_hparams['weight_decay_mask'] does not cover every parameter: {detail}. A mask must cover "
            f"every parameter: a bool for each layer or parameter{example}, one bool for all, or a function params "
            f"-> pytree of bools (True: decayed). To keep parameters from decay by name, weight_decay_exclude is "
            f"simpler (parameter names never decayed; the default is {list(DEFAULT_WEIGHT_DECAY_EXCLUDE)}).")


def _mask_tree(mask, params):
    if mask is None:
        return jax.tree.map(lambda _: True, params)
    return mask(params) if callable(mask) else mask


def make_l2_regularizer(weight_decay: float, mask=None) -> Callable[[Any], jax.Array]:
    """``params -> 0.5 * weight_decay * sum of squares`` of the masked parameters (fp32).

    Its gradient is ``weight_decay * param``: with plain SGD this equals decoupled decay.

    Examples:
        >>> float(make_l2_regularizer(0.1)({"kernel": jnp.ones(3), "bias": jnp.ones(2)}))
        0.25
    """
    weight_decay = float(weight_decay)

    def regularizer(params):
        masks = jax.tree.leaves(_mask_tree(mask, params))
        leaves = jax.tree.leaves(params)
        total = jnp.zeros((), jnp.float32)
        for keep, leaf in zip(masks, leaves, strict=True):
            square = jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32)))
            if isinstance(keep, (bool, np.bool_)):
                total = total + square if keep else total
            else:  # a traced mask value
                total = total + jnp.asarray(keep, jnp.float32) * square
        return 0.5 * weight_decay * total

    return regularizer


# --- small transformations ----------------------------------------------------------------------
_NO_PARAMS = "{} needs the parameters: call tx.update(updates, opt_state, params)."


class DecoupledWeightDecayState(NamedTuple):
    count: jax.Array


def decoupled_weight_decay(weight_decay: float, learning_rate, mask=None) -> optax.GradientTransformation:
    """Add ``-learning_rate(count) * weight_decay * param`` to the updates (put it after an optimizer).

    After ``optax.adam`` this is exactly ``optax.adamw``; after ``optax.sgd`` without momentum it
    equals ``optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr))``; with momentum it is
    SGDW (the decay does not go through the momentum).
    """

    def init_fn(params):
        del params
        return DecoupledWeightDecayState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(_NO_PARAMS.format("decoupled_weight_decay"))
        rate = learning_rate(state.count) if callable(learning_rate) else learning_rate
        step = rate * weight_decay
        updates = jax.tree.map(lambda u, p: (u - step * p).astype(u.dtype), updates, params)
        return updates, DecoupledWeightDecayState(count=optax.safe_increment(state.count))

    tx = optax.GradientTransformation(init_fn, update_fn)
    return optax.masked(tx, mask) if mask is not None else tx


class LearningRateState(NamedTuple):
    """``learning_rate``: the rate of the next update (read it with :func:`current_learning_rate`)."""

    count: jax.Array
    learning_rate: jax.Array


def record_learning_rate(schedule) -> optax.GradientTransformation:
    """Keep ``schedule(count)`` of the next update in the optimizer state; updates pass unchanged."""

    def rate(count):
        return jnp.asarray(schedule(count) if callable(schedule) else schedule, jnp.float32)

    def init_fn(params):
        del params
        count = jnp.zeros([], jnp.int32)
        return LearningRateState(count=count, learning_rate=rate(count))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        return updates, LearningRateState(count=count, learning_rate=rate(count))

    return optax.GradientTransformation(init_fn, update_fn)


class ParamsEmaState(NamedTuple):
    ema: Any


def track_params_ema(decay: float) -> optax.GradientTransformation:
    """Keep ``ema = decay * ema + (1 - decay) * new_params`` in the optimizer state (put it last).

    Read it with :func:`ema_params`; the updates pass unchanged.
    """

    def init_fn(params):
        return ParamsEmaState(ema=jax.tree.map(jnp.asarray, params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(_NO_PARAMS.format("track_params_ema"))
        new_params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: (decay * e + (1 - decay) * p).astype(e.dtype), state.ema, new_params)
        return updates, ParamsEmaState(ema=ema)

    return optax.GradientTransformation(init_fn, update_fn)


def find_states(tree, cls) -> list:
    """Every ``cls`` instance inside an optimizer state (namedtuples, tuples, lists, dicts), a
    dict's in the order of its sorted keys: jax's, so that the order is the same inside ``jit``
    (where a dict comes back sorted) as outside (``multi_transform``'s groups, in the user's order).

    Examples:
        >>> len(find_states(optax.chain(optax.adam(1e-3), optax.add_decayed_weights(1e-4)).init({"w": jnp.zeros(2)}),
        ...                 optax.ScaleByAdamState))
        1
    """
    if isinstance(tree, cls):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [found for item in tree for found in find_states(item, cls)]
    if isinstance(tree, Mapping):
        try:
            keys = sorted(tree)
        except TypeError:  # keys of mixed types: as given
            keys = list(tree)
        return [found for key in keys for found in find_states(tree[key], cls)]
    return []


#: The names an ``optax.inject_hyperparams`` state may give the learning rate (optax's own: the first).
RATE_NAMES = ("learning_rate", "lr", "step_size")
INJECT_STATES = tuple(getattr(optax, name) for name in ("InjectHyperparamsState", "InjectStatefulHyperparamsState")
                       if hasattr(optax, name))


def _opt_state(state_or_opt_state):
    return getattr(state_or_opt_state, "opt_state", state_or_opt_state)


def ema_params(state_or_opt_state, params: Any = None) -> Any | None:
    """The EMA of the parameters (``ema_decay``) from a TrainState or optimizer state, or None.

    An EMA kept for a part of the parameters only (``ema_decay`` with ``freeze``, or in a group
    of ``optax.multi_transform``, each group built with :func:`make_optimizer`) is put together:
    each parameter's average from the group that keeps one, and the parameter itself where no
    group does (a frozen one, a group without ``ema_decay``). Those come from the TrainState's
    ``params`` (or ``params``); given an optimizer state alone, a part no group averages is a
    ``ValueError``.

    Examples:
        >>> eval_params = ema_params(state)     # doctest: +SKIP
    """
    found = find_states(_opt_state(state_or_opt_state), ParamsEmaState)
    if not found:
        return None
    averages = [state.ema for state in found]
    if not any(_is_masked(leaf) for ema in averages for leaf in jax.tree.leaves(ema, is_leaf=_is_masked)):
        return averages[0]
    params = params if params is not None else getattr(state_or_opt_state, "params", None)
    merged = jax.tree.map(lambda *parts: next((part for part in parts if not _is_masked(part)), parts[0]),
                          *averages, is_leaf=_is_masked)
    if params is not None:
        return jax.tree.map(lambda param, average: param if _is_masked(average) else average, params, merged)
    if any(_is_masked(leaf) for leaf in jax.tree.leaves(merged, is_leaf=_is_masked)):
        raise ValueError("This optimizer state keeps a moving average (ema_decay) of a part of the parameters only "
                         "(ema_decay with freeze, or in a group of optax.multi_transform): pass the TrainState, "
                         "ema_params(state), or the parameters, ema_params(opt_state, params), for the others.")
    return merged


def _is_masked(node: Any) -> bool:
    """Whether ``node`` is optax's placeholder for a parameter outside a group (``optax.MaskedNode``)."""
    return isinstance(node, optax.MaskedNode)


def current_learning_rate(state_or_opt_state) -> jax.Array | None:
    """The learning rate of the next update, read from the optimizer state (works inside ``jit``).

    The schedule's value for the next update (flaxlight-built optimizers keep it in their state;
    for an ``optax.inject_hyperparams`` state, whose ``hyperparams`` hold the rate of the *last*
    update, the schedule is asked through ``state.tx``: pass the TrainState) times the scale of
    any ``optax.contrib.reduce_on_plateau`` (the scale of the last update: the next one depends on
    the next loss); None when the state holds no rate. Given only an inject state's optimizer
    state (no ``tx`` to ask), it is the last update's rate; inside ``optax.MultiSteps`` (TrainState
    given), it is the rate of the update the accumulation completes next. Of several rates (the
    groups of an ``optax.multi_transform``), the first by label order:
    :func:`flaxlight.callbacks.lr_monitor.learning_rates` gives each, named.

    Example (log it from a loss function):
        >>> metrics = {"lr": current_learning_rate(state)}     # doctest: +SKIP
    """
    opt_state = _opt_state(state_or_opt_state)
    recorded = find_states(opt_state, LearningRateState)
    rate = recorded[0].learning_rate if recorded else _next_injected_rate(state_or_opt_state)
    if rate is None:
        return None
    for plateau in find_states(opt_state, optax.contrib.ReduceLROnPlateauState):
        rate = rate * plateau.scale
    return rate


def _next_injected_rate(state_or_opt_state) -> jax.Array | None:
    """The rate of the next update from the first ``optax.inject_hyperparams`` state that holds one."""
    injected = find_states(_opt_state(state_or_opt_state), INJECT_STATES)
    found = next(((index, name) for index, state in enumerate(injected) for name in RATE_NAMES
                  if name in state.hyperparams), None)
    if found is None:
        return None
    index, name = found
    schedule_state = (getattr(injected[index], "hyperparams_states", None) or {}).get(name)
    tx = getattr(state_or_opt_state, "tx", None)
    if type(schedule_state).__name__ != "WrappedScheduleState" or tx is None:
        # a number (the same for every update), a stateful schedule (its next value needs the next
        # loss), or no transformation to ask: the value optax stored
        return jnp.asarray(injected[index].hyperparams[name], jnp.float32)
    return rate_after_one_more_update(tx, state_or_opt_state.opt_state, state_or_opt_state.params, index, name)


#: The most mini-steps :func:`rate_after_one_more_update` runs to reach an ``optax.MultiSteps``' next update.
_MAX_ACCUMULATION = 4096


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def rate_after_one_more_update(tx, opt_state, params, index: int, name: str) -> jax.Array:
    """The schedule's value for the next update as ``tx`` computes it: an update with zero
    gradients of which only that value is kept, so XLA drops the rest (no optimizer work). Inside
    ``optax.MultiSteps``, where a mini-step that completes no update leaves the inner state as
    it was, zero mini-steps are taken until the inner ``inject_hyperparams`` state counts one more
    update (a loop whose other values XLA drops too)."""
    zeros = jax.tree.map(jnp.zeros_like, params)

    def update(state):
        if isinstance(tx, optax.GradientTransformationExtraArgs):  # the extras the train step passes
            value = jnp.zeros((), jnp.float32)
            try:
                return tx.update(zeros, state, params, value=value, grad=zeros, value_fn=lambda p: value)[1]
            except TypeError as exc:  # an update(..., *, value) without **extra_args
                if "unexpected keyword argument" not in str(exc):
                    raise
                return tx.update(zeros, state, params, value=value)[1]
        return tx.update(zeros, state, params)[1]

    def injected(state):
        return find_states(state, INJECT_STATES)[index]

    new_state = update(opt_state)
    if find_states(opt_state, optax.MultiStepsState):
        counted = injected(opt_state).count
        new_state, _ = jax.lax.while_loop(
            lambda carry: (injected(carry[0]).count == counted) & (carry[1] < _MAX_ACCUMULATION),
            lambda carry: (update(carry[0]), carry[1] + 1), (new_state, jnp.ones((), jnp.int32)))
    return jnp.asarray(injected(new_state).hyperparams[name], jnp.float32)


# --- gradient accumulation ----------------------------------------------------------------------
class _EpochEndMultiSteps(optax.MultiSteps):
    """``optax.MultiSteps`` with a fixed group size whose partial group :func:`apply_accumulated`
    applies (what :func:`accumulate_gradients` builds; its state is ``optax.MultiStepsState``)."""

    def __init__(self, inner: optax.GradientTransformation, every: int):
        super().__init__(inner, every_k_schedule=every)
        self.every = every


def accumulate_gradients(tx: optax.GradientTransformation, every: int) -> optax.GradientTransformationExtraArgs:
    """``tx`` updating once per ``every`` batches from the mean of their gradients, as
    ``optax.MultiSteps`` does, and, at the end of each training epoch, from the mean of the
    batches accumulated since its last update (the trainer calls :func:`apply_accumulated`
    there): an epoch of B batches makes ``ceil(B / every)`` updates, none of them mixing two
    epochs, as Lightning's ``accumulate_grad_batches``. What ``optimizer_hparams``'
    ``accumulate_grad_batches`` builds; wrap a ready transformation of yours with it for the same
    behaviour (a plain ``optax.MultiSteps`` of yours is used as optax defines it: an update every
    k batches counted across epoch ends, and a run's last partial group is never applied).

    Examples:
        >>> tx = accumulate_gradients(optax.adam(1e-3), every=4)
        >>> trainer = MyTrainer(..., optimizer_hparams=tx)     # doctest: +SKIP
    """
    every = _positive_int(every, "accumulate_grad_batches", 1)
    multi = _EpochEndMultiSteps(tx, every)
    return optax.GradientTransformationExtraArgs(multi.init, multi.update)


def _epoch_end_accumulation(tx: Any) -> _EpochEndMultiSteps | None:
    """The accumulation of ``tx`` when it is one of :func:`accumulate_gradients`, else None."""
    owner = getattr(getattr(tx, "update", None), "__self__", None)
    return owner if isinstance(owner, _EpochEndMultiSteps) else None


def updates_at_epoch_end(tx: Any) -> bool:
    """Whether ``tx`` is one of :func:`accumulate_gradients` (the trainer then calls
    :func:`apply_accumulated` at each epoch's end).

    Examples:
        >>> updates_at_epoch_end(accumulate_gradients(optax.sgd(0.1), every=2))
        True
        >>> updates_at_epoch_end(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2).gradient_transformation())
        False
    """
    return _epoch_end_accumulation(tx) is not None


def apply_accumulated(state: Any, value: Any = None) -> Any:
    """``state`` with the gradients accumulated since its optimizer's last update applied as one
    update (their mean, through the same ``optax.MultiSteps`` code as a full group), when some are
    pending and ``state.tx`` is one of :func:`accumulate_gradients`; else ``state`` as it is. Pure
    (the trainer jits it once per epoch end); ``state.step`` is kept (it counts batches).
    ``value``: the loss handed to optimizers that take one (``reduce_on_plateau``,
    ``polyak_sgd``); the trainer gives the epoch's mean training loss.

    Examples:
        >>> state = jax.jit(apply_accumulated)(state)     # doctest: +SKIP
    """
    multi = _epoch_end_accumulation(getattr(state, "tx", None))
    if multi is None:
        return state

    def apply(operands):
        params, opt_state = operands
        mean = opt_state.acc_grads  # MultiSteps adds (g - mean) / (n + 1): the mean again, and emits
        last = opt_state._replace(mini_step=jnp.asarray(multi.every - 1, opt_state.mini_step.dtype))
        extra = {} if value is None else {"value": value, "grad": mean}
        updates, opt_state = multi.update(mean, last, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.lax.cond(state.opt_state.mini_step > 0, apply, lambda operands: operands,
                                     (state.params, state.opt_state))
    return state.replace(params=params, opt_state=opt_state)


def accumulated_updates(batches: int, every: int, epoch_length: int | None = None, earlier: tuple = ()) -> int:
    """Optimizer updates in ``batches`` train steps with an update every ``every`` batches and one
    at each epoch's end (epochs of ``epoch_length`` batches; the last one may be cut short, as
    ``max_steps`` cuts it: its partial group stays pending, as a resumed run goes on with it).
    None: no epoch ends (a loop of your own): ``batches // every``. ``earlier``: the first of the
    batches were trained in epochs of other lengths, ``((batches, epoch length), ...)`` (a run
    resumed with another batch size), counted with theirs.

    Examples:
        >>> accumulated_updates(38, every=4, epoch_length=19)    # 4+4+4+4+3 per epoch
        10
        >>> accumulated_updates(21, every=4, epoch_length=19)    # 5, then 2 batches of a group left pending
        5
        >>> accumulated_updates(76, every=4, epoch_length=38, earlier=((38, 19),))  # 2 x 5, then 10 per epoch
        20
    """
    if epoch_length is None:
        return batches // every
    updates = 0
    for trained, length in earlier:
        updates += accumulated_updates(min(trained, batches), every, length)
        batches = max(batches - trained, 0)
    epochs, rest = divmod(batches, epoch_length)
    return updates + epochs * -(-epoch_length // every) + rest // every


# --- building -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """What :func:`make_optimizer_plan` built.

    Attributes:
        tx: the optax transformation (its ``update`` takes ``value=`` etc. when it is a
            ``GradientTransformationExtraArgs``).
        config: the validated :class:`OptimizerConfig`, or None for a ready transformation/factory.
        schedule: learning rate per optimizer update, or None.
        regularizer: ``params -> penalty`` the train step must add to the loss (``"l2"`` mode), or None.
        total_steps: train steps (batches) of the run; ``num_updates`` optimizer updates.
        weight_decay: the decay strength in effect (0 when none).
        first_step: the model's step when the optimizer was built.
        epoch_length: batches per epoch, where the trainer applies a partial group of
            ``accumulate_grad_batches`` (see :func:`accumulated_updates`); None: no epoch ends.
        earlier: ``((batches, epoch length), ...)``: the run's first batches were trained in
            epochs of other lengths (a run resumed with another batch size).
    """

    tx: optax.GradientTransformation
    config: OptimizerConfig | None
    schedule: Callable[[Any], Any] | None
    regularizer: Callable[[Any], jax.Array] | None
    total_steps: int
    num_updates: int
    weight_decay: float
    first_step: int = 0
    epoch_length: int | None = None
    earlier: tuple = ()

    @functools.cached_property
    def step_schedule(self) -> Callable[[Any], Any] | None:
        """The learning rate after a number of train steps (batches): ``schedule`` at the updates
        this optimizer made by then (what a log point at ``step`` shows): with
        ``accumulate_grad_batches=N``, ``ceil(epoch_length / N)`` per whole epoch and one per N
        batches of the current one, counted from ``first_step`` (the model's step when the
        optimizer was built, e.g. a checkpoint's when a loaded model trains on)."""
        every = self.config.accumulate_grad_batches if self.config is not None else 1
        if self.schedule is None or (every == 1 and self.first_step == 0):
            return self.schedule
        schedule, first, length, earlier = self.schedule, self.first_step, self.epoch_length, self.earlier

        def at_step(step):
            batches = jnp.maximum(step - first, 0)
            if every == 1 or length is None:
                return schedule(batches // every)
            updates = 0
            for trained, earlier_length in earlier:  # epochs of other lengths first (a resume's)
                part = jnp.minimum(batches, trained)
                updates = updates + part // earlier_length * -(-earlier_length // every) + part % earlier_length // every
                batches = batches - part
            return schedule(updates + batches // length * -(-length // every) + batches % length // every)

        return at_step


def warn_settings_outside_step(trainer_name: str, plan: OptimizerPlan, step: Any) -> None:
    """Tell the user when a setting applied inside the train step (the ``"l2"`` penalty, bf16
    compute) is missing from the step their ``create_functions`` built (``step``: its
    :class:`~flaxlight.step.TrainStep`, or None for a step function of their own)."""
    if plan.regularizer is not None and getattr(step, "regularizer", None) is None:
        logger.warning(
            "weight_decay_mode='l2' adds its penalty inside the train step, but %s.create_functions() builds its own "
            "step, to which flaxlight adds nothing: no weight decay is applied unless your step adds it. Pass "
            "`regularizer=flaxlight.optim.as_optimizer_config(self.optimizer_hparams).l2_regularizer()` to your "
            "TrainStep (or add that function's value to the loss your step differentiates), or use "
            "weight_decay_mode='decoupled' (applied by the optimizer, whatever the step). The UvA guide's sgd decay "
            "(optax.add_decayed_weights before the optimizer): see docs/from-uva.md.", trainer_name)
    precision = plan.config.precision if plan.config is not None else "fp32"
    if precision != "fp32" and getattr(step, "precision", None) != precision:
        logger.warning(
            "precision=%r is applied inside the train step, but %s.create_functions() builds its own step without it, "
            "so the model computes in %s: pass `precision=%r` to your TrainStep (or cast in your loss).", precision,
            trainer_name, getattr(step, "precision", None) or "the dtypes of your own step", precision)


def make_optimizer_plan(optimizer_hparams, total_steps: int, first_step: int = 0,
                        epoch_length: int | None = None, earlier: tuple | None = None) -> OptimizerPlan:
    """Build the optimizer for a run of ``total_steps`` train steps and say what the step must add.
    ``epoch_length``: batches per epoch; with ``accumulate_grad_batches`` the schedule then spans
    :func:`accumulated_updates` updates (the trainer updates at each epoch's end too), the first
    ``earlier`` batches counted in epochs of their own lengths (a run resumed with another batch size).

    Examples:
        >>> plan = make_optimizer_plan({"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01}, 1000)
        >>> plan.regularizer is None      # decoupled: the decay is inside plan.tx
        True
    """
    total_steps = _positive_int(total_steps, "total_steps", 1)
    if _recorded_ready(optimizer_hparams):
        raise ValueError(f"This run was trained with a ready optax transformation ({optimizer_hparams['ready_optax']}), "
                         f"which hparams.yaml cannot hold: pass it again, e.g. load_from_checkpoint(run_dir, exmp_input, "
                         f"with_optimizer=True, optimizer_hparams=tx).")
    if key := _recorded_function(optimizer_hparams):
        raise ValueError(f"This run's optimizer_hparams[{key!r}] was a function ({optimizer_hparams[key]}), which "
                         f"hparams.yaml records by name only: pass the optimizer settings again, e.g. "
                         f"load_from_checkpoint(run_dir, exmp_input, with_optimizer=True, optimizer_hparams={{...}}).")
    config = as_optimizer_config(optimizer_hparams)
    if config is None:
        return _ready_plan(optimizer_hparams, total_steps)
    earlier = tuple(tuple(pair) for pair in earlier or ())
    num_updates = _num_updates(config, total_steps, epoch_length, earlier)
    schedule = _plan_schedule(config, num_updates)
    kwargs = _optimizer_kwargs(config, schedule)
    weight_decay = config.resolved_weight_decay()
    decay_kwargs, tail = _weight_decay_kwargs(config, schedule, weight_decay)
    kwargs.update(decay_kwargs)
    return OptimizerPlan(
        tx=_assemble_tx(config, kwargs, tail, schedule), config=config, schedule=schedule,
        regularizer=config.l2_regularizer() if weight_decay > 0 else None,
        total_steps=total_steps, num_updates=num_updates,
        weight_decay=weight_decay, first_step=int(first_step), epoch_length=epoch_length, earlier=earlier,
    )


def _ready_plan(optimizer_hparams: Any, total_steps: int) -> OptimizerPlan:
    """The plan of a ready transformation or an :data:`OptimizerFactory` (used unchanged)."""
    if isinstance(optimizer_hparams, optax.GradientTransformation):
        tx = optimizer_hparams
    else:  # an OptimizerFactory, e.g. a learned optimizer: it needs the run's length
        tx = optimizer_hparams(total_steps)
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"The optimizer factory {optimizer_hparams!r} must return an "
                            f"optax.GradientTransformation for total_steps={total_steps}; got {type(tx).__name__}.")
    return OptimizerPlan(tx=tx, config=None, schedule=None, regularizer=None, total_steps=total_steps,
                         num_updates=total_steps, weight_decay=0.0)


def _num_updates(config: OptimizerConfig, total_steps: int, epoch_length: int | None = None,
                 earlier: tuple = ()) -> int:
    """Optimizer updates in a run of ``total_steps`` train steps; the warmup must fit in them."""
    every = config.accumulate_grad_batches
    num_updates = max(accumulated_updates(total_steps, every, epoch_length, earlier), 1)
    if config.warmup_steps > num_updates:
        per_epoch = f", {epoch_length} per epoch" if every > 1 and epoch_length else ""
        raise ValueError(
            f"optimizer_hparams['warmup_steps']={config.warmup_steps} is longer than the run: {num_updates} optimizer "
            f"updates ({total_steps} train steps{per_epoch}, accumulate_grad_batches={every}). "
            f"Lower warmup_steps or train longer."
        )
    return num_updates


def _plan_schedule(config: OptimizerConfig, num_updates: int) -> optax.Schedule | None:
    """The learning rate per optimizer update (None when the optimizer picks its own step)."""
    if callable(config.schedule):
        return config.schedule
    if config.lr is None:
        return None
    if config.optimizer in _FIXED_RATE:
        return optax.constant_schedule(config.lr)
    return make_schedule(config.lr, config.warmup_steps, num_updates, config.schedule,
                         end_lr_factor=config.end_lr_factor, boundaries_and_scales=config.boundaries_and_scales)


def _optimizer_kwargs(config: OptimizerConfig, schedule: optax.Schedule | None) -> dict[str, Any]:
    """The optax optimizer's keyword arguments before weight decay: the passed-through ones and the rate."""
    kwargs = dict(config.optimizer_kwargs)
    if schedule is not None:
        name = config.optimizer
        kwargs[_rate_argument(name)] = config.lr if name in _FIXED_RATE else schedule
    return kwargs


def _weight_decay_kwargs(config: OptimizerConfig, schedule: optax.Schedule | None, weight_decay: float
                         ) -> tuple[dict[str, Any], optax.GradientTransformation | None]:
    """The optimizer's decay arguments and the decoupled-decay step to chain after it (or None)."""
    name = config.optimizer
    mask = config.decay_mask(check=not config.freeze)  # frozen: checked on every parameter (_freeze_parameters)
    native = _native_decay(name)
    params = _factory_parameters(name)
    decay_arg = next((k for k in ("weight_decay", "weight_decay_rate") if k in params), None)
    if config.weight_decay is None and weight_decay > 0:
        _log_once(logging.WARNING,
                  f"optimizer {name!r} with no weight_decay given: using optax.{name}'s default weight_decay="
                  f"{weight_decay:g} (decoupled, parameters named {list(config.weight_decay_exclude)} excluded). "
                  f"Set weight_decay explicitly (0 turns it off) to silence this.")
    if config.weight_decay_mode == "decoupled" and weight_decay > 0:
        if native:
            return {native[0]: weight_decay, native[1]: mask}, None
        # optax decays but cannot mask (novograd): do it here instead
        decay_kwargs = {decay_arg: 0.0} if decay_arg else {}
        tail = decoupled_weight_decay(weight_decay, schedule if schedule is not None else 1.0, mask)
        like = "AdamW (optax.adamw)" if name == "adam" else f"{name} with decoupled weight decay"
        _log_once(logging.INFO,
                  f"optimizer {name!r} + weight_decay={weight_decay:g} (decoupled) behaves like {like}: "
                  f"-lr * weight_decay * param is added after optax.{name}'s update.")
        return decay_kwargs, tail
    if decay_arg:  # l2 mode or no decay: the optimizer's own decay must stay off (never twice)
        return {decay_arg: None if decay_arg == "weight_decay_rate" else 0.0}, None
    return {}, None


def _assemble_tx(config: OptimizerConfig, kwargs: dict[str, Any], tail: optax.GradientTransformation | None,
                 schedule: optax.Schedule | None) -> optax.GradientTransformation:
    """Chain clipping, the optax optimizer, ``tail``, plateau scaling, the rate record and the EMA; accumulate."""
    chain = []
    if config.gradient_clip_value is not None:
        chain.append(optax.clip(config.gradient_clip_value))
    if config.gradient_clip is not None:
        chain.append(optax.clip_by_global_norm(config.gradient_clip))
    chain.append(_optimizer_factory(config.optimizer)(**kwargs))
    if tail is not None:
        chain.append(tail)
    if config.reduce_on_plateau is not None:
        chain.append(optax.contrib.reduce_on_plateau(**config.reduce_on_plateau))
    if schedule is not None:
        chain.append(record_learning_rate(schedule))
    if config.ema_decay is not None:
        chain.append(track_params_ema(config.ema_decay))
    tx = optax.chain(*chain)
    if config.weight_decay_mask is not None and config.resolved_weight_decay() > 0:
        tx = _mask_checked_at_init(tx, config.decay_mask())
    if config.freeze:
        tx = _freeze_parameters(tx, config)
    if config.accumulate_grad_batches > 1:
        tx = accumulate_gradients(tx, config.accumulate_grad_batches)
    return tx


def _mask_checked_at_init(tx: optax.GradientTransformation, mask: Callable[[Any], Any]
                          ) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``init`` first applies the weight-decay ``mask`` to the parameters, so that a mask
    that does not fit them is refused before training, whatever the mode (``l2`` applies it only in
    the train step)."""
    def init_fn(params):
        if _real_params(params):
            mask(params)
        return tx.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, optax.with_extra_args_support(tx).update)


def _freeze_parameters(tx: optax.GradientTransformation, config: OptimizerConfig
                       ) -> optax.GradientTransformationExtraArgs:
    """``tx`` for the parameters ``config.freeze`` does not name, zero updates for the named ones
    (``optax.multi_transform`` with ``optax.set_to_zero``): ``tx`` (clipping, decay, EMA) sees
    only the trained ones and keeps no state for the frozen ones. Its ``init`` checks the names
    (and the weight-decay names, which ``tx`` sees only in part) against every parameter."""
    frozen = make_freeze_mask(config.freeze)
    labels = lambda params: jax.tree.map(lambda is_frozen: "frozen" if is_frozen else "trained", frozen(params))
    partition = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
    decays = config.weight_decay_mode == "decoupled" and config.resolved_weight_decay() > 0

    def init_fn(params):
        mask = frozen(params)
        if decays and _real_params(params):
            _mask_tree(config.decay_mask(), params)
        _say_frozen(config.freeze, mask, params)
        return partition.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, partition.update)


def _real_params(params: Any) -> bool:
    """Whether ``params`` are parameters (arrays or shapes), not ``optax.tree_map_params``' placeholder
    (its ``init`` call, made to learn the optimizer state's layout, as sharding it does)."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(hasattr(leaf, "shape") for leaf in leaves)


def _say_frozen(freeze: tuple, mask: Any, params: Any) -> None:
    """Log (once) which parameters ``freeze`` holds fixed; warn when it names them all."""
    flags, leaves = jax.tree.leaves(mask), jax.tree.leaves(params)
    if not _real_params(params):
        return
    paths = ["/".join(_path_parts(path)) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    names = [path for path, flag in zip(paths, flags) if flag]
    sizes = [int(np.prod(leaf.shape)) for leaf, flag in zip(leaves, flags) if flag]
    total = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    if all(flags):
        _log_once(logging.WARNING, f"optimizer_hparams['freeze']={list(freeze)} names every parameter of the model: "
                                   f"training changes none of them (BatchNorm statistics still update).")
        return
    shown = ", ".join(names[:12]) + (f", ... ({len(names) - 12} more)" if len(names) > 12 else "")
    _log_once(logging.INFO, f"freeze {list(freeze)}: {len(names)} of {len(leaves)} parameter arrays stay fixed "
                            f"({sum(sizes):,} of {total:,} values): {shown}.")


def make_optimizer(optimizer_hparams, total_steps: int) -> optax.GradientTransformation:
    """Build the optax transformation for a run of ``total_steps`` train steps.

    With ``weight_decay_mode="l2"`` the transformation holds no decay: the train step adds the
    penalty (use :func:`make_optimizer_plan` to get it, or let ``TrainerModule`` wire it).

    Examples:
        >>> tx = make_optimizer({"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}, total_steps=1000)
    """
    return make_optimizer_plan(optimizer_hparams, total_steps).tx
