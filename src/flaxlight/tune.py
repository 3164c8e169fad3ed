"""Hyperparameter search with Optuna: search spaces, one log dir per trial, pruning, plots.

The ``tune`` extra installs what this needs (``pip install 'flaxlight[tune]'``: optuna and
matplotlib for the plots). Everything a study knows lives in its storage (by default an SQLite
file next to the trial dirs), so a study resumes after a crash, grows when run again, and is
shared by every process pointed at the same storage.

Examples:
    >>> from flaxlight.tune import Float, tune, load_best
    >>> study = tune(                                                               # doctest: +SKIP
    ...     MyTrainer,
    ...     {"optimizer_hparams.lr": Float(1e-4, 1e-2, log=True),
    ...      "model_hparams.dropout_prob": Float(0.0, 0.6)},
    ...     hparams=dict(model_class=MLP, model_hparams={"hidden_dims": [64]},
    ...                  optimizer_hparams={"optimizer": "adamw", "lr": 1e-3}, exmp_input=x[:1]),
    ...     train_loader=train, val_loader=val, num_epochs=20,
    ...     metric="val/acc", direction="maximize", n_trials=30, study_name="mlp")
    >>> trainer = load_best(study, MyTrainer, exmp_input=x[:1])                      # doctest: +SKIP

Layout on disk (``base_dir/study_name``)::

    studies/mlp/study.db            the study (default storage)
    studies/mlp/trial_0000/         trial 0's log dir: hparams.yaml, metrics.csv, checkpoints/
    studies/mlp/trial_0001/         ...

See docs/tuning.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import inspect
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import optax

from flaxlight import optim
from flaxlight.callbacks.pruning import MetricNotLoggedError, PruningCallback
from flaxlight.loop import RESUME_ADVICE
from flaxlight.messages import logger as messages, warn_at_user
from flaxlight.metrics import name_direction
from flaxlight.registry import explicit_parameters, takes_var_keyword

try:
    import optuna
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("flaxlight.tune needs optuna: pip install 'flaxlight[tune]' (or pip install optuna).") from _exc

__all__ = [
    "Categorical",
    "Float",
    "Int",
    "MetricNotLoggedError",
    "PruningCallback",
    "SearchSpace",
    "StorageError",
    "TuneError",
    "infer_direction",
    "load_best",
    "load_study",
    "make_pruner",
    "make_sampler",
    "make_storage",
    "param_importances",
    "parse_tune_config",
    "plot_study",
    "tune",
    "tune_from_config",
]

_log = logging.getLogger("flaxlight.tune")

STORAGE_FILE = "study.db"
JOURNAL_FILE = "journal.log"  # the journal storage docs/tuning.md suggests: base_dir/study_name/journal.log
TRIAL_DIR = "trial_{number:04d}"
DEFAULT_BASE_DIR = "studies"
DEFAULT_STUDY_NAME = "study"
SQLITE_TIMEOUT_S = 60  # seconds a worker waits for another one's write lock on the SQLite file
HEARTBEAT_INTERVAL_S = 60  # a trial whose process died is marked failed after GRACE_PERIOD_S
GRACE_PERIOD_S = 180


class TuneError(RuntimeError):
    """The study cannot go on (too many trials in a row failed, or its settings cannot give trial
    values), or a call's every trial failed."""


class StorageError(ConnectionError):
    """The study storage cannot be opened (bad URL, unreachable server, missing driver)."""


# --------------------------------------------------------------------------- search spaces
@dataclasses.dataclass(frozen=True)
class Float:
    """A float in ``[low, high]``; ``log=True`` samples log-uniformly; ``step`` discretises.

    YAML: ``{type: float, low: 1.0e-4, high: 1.0e-2, log: true}``.
    """

    low: float
    high: float
    log: bool = False
    step: float | None = None


@dataclasses.dataclass(frozen=True)
class Int:
    """An int in ``[low, high]`` (both included); ``log=True`` samples log-uniformly.

    YAML: ``{type: int, low: 1, high: 4}`` (``step: 2``, ``log: true`` optional).
    """

    low: int
    high: int
    log: bool = False
    step: int = 1


@dataclasses.dataclass(frozen=True)
class Categorical:
    """One of ``choices``. Choices that are not None/bool/int/float/str (lists such as
    ``[64, 64]``, dicts) are stored in the study as their JSON text and decoded for the trainer.

    YAML: ``{type: categorical, choices: [adam, adamw, sgd]}``.
    """

    choices: Sequence[Any]


Param = Float | Int | Categorical
_SPEC_KEYS = {"float": ("low", "high", "log", "step"), "int": ("low", "high", "log", "step"),
              "categorical": ("choices",)}
_TYPE_ALIASES = {"float": "float", "real": "float", "uniform": "float", "int": "int", "integer": "int",
                 "categorical": "categorical", "choice": "categorical"}
_PRIMITIVE = (type(None), bool, int, float, str)
_EXAMPLE = ("{'optimizer_hparams.lr': {'type': 'float', 'low': 1e-4, 'high': 1e-2, 'log': True}} "
            "or, in Python, {'optimizer_hparams.lr': Float(1e-4, 1e-2, log=True)}")


def _number(key: str, name: str, value: Any, integer: bool = False) -> float | int:
    """A YAML number (PyYAML reads ``1e-4`` without a dot as a string, so strings are parsed)."""
    if isinstance(value, str):
        try:
            value = float(value) if not integer else int(float(value))
        except ValueError:
            raise ValueError(f"search_space[{key!r}]: {name} must be a number, got {value!r}.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"search_space[{key!r}]: {name} must be a number, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"search_space[{key!r}]: {name} must be finite, got {value!r}.")
    if integer:
        if float(value) != int(value):
            raise ValueError(f"search_space[{key!r}]: {name} of an int range must be a whole number, got {value!r}.")
        return int(value)
    return float(value)


def _check_param(key: str, param: Param) -> Param:
    """Validate one parameter (numbers normalised); errors name the key and the fix."""
    if isinstance(param, Categorical):
        choices = param.choices
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or len(choices) == 0:
            raise ValueError(f"search_space[{key!r}]: categorical choices must be a non-empty list, got {choices!r}.")
        labels = [_choice_label(key, c) for c in choices]
        duplicated = sorted({label for label in labels if labels.count(label) > 1})
        if duplicated:
            raise ValueError(f"search_space[{key!r}]: categorical choices repeat {duplicated}.")
        return Categorical(tuple(choices))
    integer = isinstance(param, Int)
    low, high = _number(key, "low", param.low, integer), _number(key, "high", param.high, integer)
    if not isinstance(param.log, bool):
        raise ValueError(f"search_space[{key!r}]: log must be true or false, got {param.log!r}.")
    if low > high:
        raise ValueError(f"search_space[{key!r}]: low={low!r} > high={high!r}; give the range as low <= high.")
    if param.log and low <= 0:
        raise ValueError(f"search_space[{key!r}]: a log-scale range needs low > 0, got low={low!r} "
                         f"(use log: false for a range that includes 0, or start at a small positive value).")
    step = param.step
    if step is not None:
        step = _number(key, "step", step, integer)
        if step <= 0:
            raise ValueError(f"search_space[{key!r}]: step must be > 0, got {step!r}.")
        if param.log and (not integer or step != 1):
            raise ValueError(f"search_space[{key!r}]: log scale and step cannot be combined (optuna samples "
                             f"log-uniformly only without a step).")
    if integer:
        return Int(low, high, param.log, 1 if step is None else step)
    return Float(low, high, param.log, step)


def _choice_label(key: str, choice: Any) -> Any:
    """The value stored in the study for a categorical choice (JSON text for non-primitives)."""
    if isinstance(choice, _PRIMITIVE):
        return choice
    try:
        return json.dumps(_plain(choice), sort_keys=True)
    except TypeError:
        raise ValueError(f"search_space[{key!r}]: categorical choice {choice!r} is not plain data (numbers, "
                         f"strings, lists, dicts); a study stores its choices as JSON.") from None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _parse_spec(key: str, spec: Any) -> Param | None:
    """A parameter from a Python object or a YAML dict; None when ``spec`` is a nested section."""
    if isinstance(spec, (Float, Int, Categorical)):
        return spec
    distributions = optuna.distributions
    if isinstance(spec, distributions.FloatDistribution):
        return Float(spec.low, spec.high, spec.log, spec.step)
    if isinstance(spec, distributions.IntDistribution):
        return Int(spec.low, spec.high, spec.log, spec.step)
    if isinstance(spec, distributions.CategoricalDistribution):
        return Categorical(spec.choices)
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"search_space[{key!r}] = {spec!r} is not a parameter: give a range or choices, e.g. {_EXAMPLE}. "
            f"(A fixed value belongs in the trainer's hparams, not in the search space.)")
    if "type" not in spec:
        spec_like = {"low", "high", "log", "step", "choices"} & set(spec)
        if spec_like:
            raise ValueError(f"search_space[{key!r}] has {sorted(spec_like)} but no 'type': add "
                             f"type: float, int or categorical.")
        return None  # a nested section: {optimizer_hparams: {lr: {...}}}
    kind = _TYPE_ALIASES.get(str(spec["type"]).lower())
    if kind is None:
        name = str(spec["type"]).lower()
        close = difflib.get_close_matches(name, list(_TYPE_ALIASES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        if name.startswith("log") or name.endswith("log"):  # Optuna's old loguniform: a float on a log scale
            hint = " A log scale is {type: float, low: ..., high: ..., log: true} (or int with log: true)."
        raise ValueError(f"search_space[{key!r}]: unknown type {spec['type']!r}.{hint} Valid: float, int, categorical.")
    allowed = _SPEC_KEYS[kind]
    unknown = sorted(set(spec) - set(allowed) - {"type"})
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"search_space[{key!r}]: unknown key {unknown[0]!r} for type {kind}.{hint} "
                         f"Valid keys: type, {', '.join(allowed)}.")
    if kind == "categorical":
        if "choices" not in spec:
            raise ValueError(f"search_space[{key!r}]: type categorical needs 'choices: [...]'.")
        return Categorical(spec["choices"])
    missing = [name for name in ("low", "high") if name not in spec]
    if missing:
        raise ValueError(f"search_space[{key!r}]: type {kind} needs {' and '.join(missing)}.")
    cls = Float if kind == "float" else Int
    return cls(spec["low"], spec["high"], spec.get("log", False),
               spec.get("step", None if kind == "float" else 1))


class SearchSpace(Mapping):
    """Parameters to tune, keyed by dotted paths into the trainer's hparams.

    Built from a dict whose values are :class:`Float`, :class:`Int`, :class:`Categorical`,
    optuna distributions, or YAML-style dicts (``{type: float, low: ..., high: ..., log: true}``,
    ``{type: int, ...}``, ``{type: categorical, choices: [...]}``). Nested dicts are flattened
    (``{optimizer_hparams: {lr: {...}}}`` is ``optimizer_hparams.lr``). Validated on
    construction: every mistake raises a ``ValueError`` naming the key.

    Examples:
        >>> space = SearchSpace({"optimizer_hparams.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
        ...                      "model_hparams.dropout_prob": Float(0.0, 0.6)})
        >>> sorted(space)
        ['model_hparams.dropout_prob', 'optimizer_hparams.lr']
    """

    def __init__(self, space: Mapping[str, Any] | "SearchSpace"):
        if isinstance(space, SearchSpace):
            self._params: dict[str, Param] = dict(space._params)
            return
        if not isinstance(space, Mapping):
            raise ValueError(f"search_space must be a dict of dotted key -> range or choices, got "
                             f"{type(space).__name__}; e.g. {_EXAMPLE}.")
        self._params = {}
        self._flatten(space, prefix="")
        if not self._params:
            raise ValueError(f"search_space is empty: give at least one parameter to tune, e.g. {_EXAMPLE}.")

    def _flatten(self, space: Mapping, prefix: str) -> None:
        for raw_key, spec in space.items():
            if not isinstance(raw_key, str) or not raw_key or any(not part for part in raw_key.split(".")):
                raise ValueError(f"search_space key {prefix}{raw_key!r} must be a dotted name such as "
                                 f"'optimizer_hparams.lr' (no empty parts).")
            key = prefix + raw_key
            param = _parse_spec(key, spec)
            if param is None:
                if not spec:
                    raise ValueError(f"search_space[{key!r}] is an empty section.")
                self._flatten(spec, prefix=key + ".")
                continue
            if key in self._params:
                raise ValueError(f"search_space names {key!r} twice.")
            self._params[key] = _check_param(key, param)

    def __getitem__(self, key: str) -> Param:
        return self._params[key]

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def __repr__(self) -> str:
        return f"SearchSpace({self._params!r})"

    def suggest(self, trial) -> dict[str, Any]:
        """Sample every parameter from ``trial``: ``{dotted key: value}`` (categorical JSON decoded)."""
        values = {}
        for key, param in self._params.items():
            try:
                if isinstance(param, Float):
                    values[key] = trial.suggest_float(key, param.low, param.high, log=param.log, step=param.step)
                elif isinstance(param, Int):
                    values[key] = trial.suggest_int(key, param.low, param.high, log=param.log, step=param.step)
                else:
                    labels = [_choice_label(key, c) for c in param.choices]
                    values[key] = param.choices[labels.index(trial.suggest_categorical(key, labels))]
            except ValueError as exc:  # a study trial of another space (a worker's), or an enqueued value
                raise ValueError(f"search_space[{key!r}] is {_describe(_distribution(key, param))} here: {exc} Another "
                                 f"call on this study (a worker) gave it another type or choices, or a value given "
                                 f"by study.enqueue_trial is not in it (a list or dict choice is given as its JSON "
                                 f"text). Keep one search space per study (or use another study_name).") from None
        return values

    def decode(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Trial params as stored in the study -> values for the trainer (categorical JSON decoded)."""
        values = dict(params)
        for key, param in self._params.items():
            if isinstance(param, Categorical) and key in values:
                labels = [_choice_label(key, c) for c in param.choices]
                if values[key] in labels:
                    values[key] = param.choices[labels.index(values[key])]
        return values

    def to_config(self) -> dict[str, dict]:
        """The YAML form (plain dicts), e.g. to save beside the study."""
        out = {}
        for key, param in self._params.items():
            if isinstance(param, Categorical):
                out[key] = {"type": "categorical", "choices": _plain(list(param.choices))}
            else:
                spec = {"type": "float" if isinstance(param, Float) else "int", "low": param.low, "high": param.high}
                if param.log:
                    spec["log"] = True
                if param.step not in (None, 1) or (isinstance(param, Float) and param.step is not None):
                    spec["step"] = param.step
                out[key] = spec
        return out


def _distribution(key: str, param: Param) -> "optuna.distributions.BaseDistribution":
    """The optuna distribution a study records for ``param`` (categorical choices as their labels)."""
    if isinstance(param, Float):
        return optuna.distributions.FloatDistribution(param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, Int):
        return optuna.distributions.IntDistribution(param.low, param.high, log=param.log, step=param.step)
    return optuna.distributions.CategoricalDistribution([_choice_label(key, c) for c in param.choices])


def _describe(dist: "optuna.distributions.BaseDistribution") -> str:
    """A recorded distribution for people: ``float [0.0001, 0.01] (log)``, ``choices ['[32]', '[64]']``.

    Examples:
        >>> _describe(optuna.distributions.IntDistribution(1, 9, step=2))
        'int [1, 9] (step 2)'
    """
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return f"choices {list(dist.choices)}"
    kind = "float" if isinstance(dist, optuna.distributions.FloatDistribution) else "int"
    extra = " (log)" if dist.log else (f" (step {dist.step:g})" if dist.step not in (None, 1) else "")
    return f"{kind} [{dist.low:g}, {dist.high:g}]{extra}"


def _check_same_space(study: "optuna.Study", study_name: str, space: "SearchSpace") -> None:
    """Before a continued study's first new trial, compare ``space`` with the distributions its
    earlier trials recorded: another type, log scale or categorical choices is refused (Optuna
    would fail every new trial), a changed range is said (the best trial is picked across both)."""
    recorded: dict[str, list] = {}  # key -> its distinct distributions, the latest trial's last
    for trial in study.get_trials(deepcopy=False):
        for key, dist in trial.distributions.items():
            if key in space:
                recorded.setdefault(key, [])
                recorded[key] = [d for d in recorded[key] if d != dist] + [dist]
    for key, dists in recorded.items():
        new = _distribution(key, space[key])
        for old in reversed(dists):  # the latest first: the one to keep
            what = ("type" if type(old) is not type(new) else
                    ("choices" if old != new else None) if isinstance(new, optuna.distributions.CategoricalDistribution)
                    else "scale (log or not)" if old.log != new.log else None)
            if what:
                raise ValueError(f"search_space[{key!r}]: study {study_name!r} searched it as {_describe(old)} in "
                                 f"its earlier trials; this call gives {_describe(new)}. A study cannot change a "
                                 f"parameter's {what} (its trials are compared in one space): give this search space "
                                 f"another study_name, or keep {_describe(old)}.")
        if dists[-1] != new:
            messages.info("Study %r: search_space[%r] is %s now, %s in its earlier trials; its best trial is picked "
                          "among the trials of both ranges.", study_name, key, _describe(new), _describe(dists[-1]))


# --------------------------------------------------------------------------- dotted overrides
def _with_overrides(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with each dotted key set; dicts and lists on the way are copied, leaves (arrays) are
    not. A list is indexed by a number (``callbacks.0.args.patience``)."""
    result = dict(base)
    for key, value in overrides.items():
        parts = key.split(".")
        node: Any = result
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ValueError(f"search_space key {key!r}: {'.'.join(parts[:depth])!r} is a list of "
                                     f"{len(node)} items; {part!r} is not an index into it.")
                part = int(part)
            if last:
                node[part] = value
                break
            child = _settable_copy(key, parts, depth, node[part] if isinstance(node, list) else node.get(part))
            node[part] = child
            node = child
    return result


def _settable_copy(key: str, parts: list[str], depth: int, child: Any) -> dict | list:
    """A copy of ``child`` (the value at ``parts[:depth + 1]``) that ``parts[depth + 1]`` can be set in,
    or a ValueError saying why it cannot."""
    where, inner = ".".join(parts[:depth + 1]), parts[depth + 1]
    if child is None:
        return {}
    if isinstance(child, Mapping):
        return dict(child)
    if isinstance(child, optax.GradientTransformation):  # a NamedTuple of functions, not a list
        raise ValueError(
            f"search_space key {key!r}: {where!r} is an optax GradientTransformation, a ready optimizer whose "
            f"settings (its learning rate included) are fixed inside it, so {inner!r} cannot be set by key. To tune "
            f"it, give {where} in the dict form ({{'optimizer': 'adamw', 'lr': 1e-3}}) or as "
            f"flaxlight.OptimizerConfig(optimizer='adamw', lr=1e-3), which {key!r} sets (they add flaxlight's "
            f"defaults, such as gradient_clip=1.0 and the warmup_cosine schedule: see docs/optimizers.md); or keep "
            f"your optax chain and pass tune a trainer factory f(hparams) -> trainer that builds it from a sampled "
            f"value (search key 'lr', optimizer_hparams=optax.adamw(hparams['lr'])).")
    if isinstance(child, tuple) and hasattr(child, "_fields"):  # a NamedTuple: a record, not a list
        raise ValueError(f"search_space key {key!r}: {where!r} is a {type(child).__name__} (a NamedTuple), not a "
                         f"dict, so {inner!r} cannot be set inside it. Give {where} as a dict to tune its parts.")
    if isinstance(child, (list, tuple)):
        return list(child)
    if dataclasses.is_dataclass(child) and not isinstance(child, type):
        return dataclasses.asdict(child)
    raise ValueError(f"search_space key {key!r}: {where!r} is {type(child).__name__} ({child!r:.200}), not a dict, "
                     f"so {inner!r} cannot be set inside it.")


def _check_overrides(base: Mapping[str, Any], space: "SearchSpace") -> None:
    """Set every search-space key in ``base`` (each choice, both ends of each range) before the
    first trial: a key that cannot be set inside the hparams fails now, before the study has a
    trial, not once per trial."""
    for values in _sample_values(space):
        _with_overrides(base, values)


def _trainer_keywords(trainer_class) -> set[str]:
    """Keyword arguments a trainer class accepts: its own, TrainerModule's and TrainerOptions'."""
    from flaxlight.options import TrainerOptions
    from flaxlight.trainer import TrainerModule

    names = set(explicit_parameters(trainer_class.__init__))
    base = set(explicit_parameters(TrainerModule.__init__))
    return names | base | {f.name for f in dataclasses.fields(TrainerOptions)} | {"callbacks", "loggers"}


def _model_fields(model_class) -> set[str] | None:
    """Hyperparameters a model class takes (Linen dataclass fields or ``__init__`` args); None: any."""
    if isinstance(model_class, type) and dataclasses.is_dataclass(model_class):
        return {f.name for f in dataclasses.fields(model_class) if f.init} - {"parent", "name"}
    if isinstance(model_class, type):
        if takes_var_keyword(model_class.__init__):
            return None
        return set(explicit_parameters(model_class.__init__)) - {"rngs"}
    return None


def _check_keys(trainer_class, hparams: Mapping[str, Any], space: SearchSpace, data_key: str | None) -> None:
    """Fail before the first trial when a dotted key cannot reach the trainer (typos)."""
    accepted = _trainer_keywords(trainer_class) | set(hparams) | ({data_key} if data_key else set())
    model_fields = _model_fields(hparams.get("model_class"))
    for key in space:
        top, _, rest = key.partition(".")
        if top not in accepted:
            close = difflib.get_close_matches(top, sorted(accepted), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"search_space key {key!r}: {trainer_class.__name__} takes no argument {top!r}.{hint} "
                             f"Keys start with a constructor argument such as 'optimizer_hparams' or "
                             f"'model_hparams'" + (f", or {data_key!r} for the loaders." if data_key else "."))
        if top == "model_hparams" and rest and model_fields is not None:
            field = rest.split(".")[0]
            if field not in model_fields:
                close = difflib.get_close_matches(field, sorted(model_fields), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"search_space key {key!r}: {hparams['model_class'].__name__} has no "
                                 f"hyperparameter {field!r}.{hint} It takes: {sorted(model_fields)}.")


# --------------------------------------------------------------------------- samplers, pruners, storage
_SAMPLERS = {
    "tpe": "TPESampler", "random": "RandomSampler", "cmaes": "CmaEsSampler", "qmc": "QMCSampler",
    "gp": "GPSampler", "nsgaii": "NSGAIISampler", "bruteforce": "BruteForceSampler",
}
_PRUNERS = {
    "median": "MedianPruner", "percentile": "PercentilePruner", "hyperband": "HyperbandPruner",
    "successive_halving": "SuccessiveHalvingPruner", "threshold": "ThresholdPruner",
    "patient": "PatientPruner", "wilcoxon": "WilcoxonPruner", "none": "NopPruner", "nop": "NopPruner",
}


def _make_named(kind: str, table: Mapping[str, str], module, spec: Any, seed: int | None = None):
    if spec is None:
        spec = "tpe" if kind == "sampler" else "median"
    base = optuna.samplers.BaseSampler if kind == "sampler" else optuna.pruners.BasePruner
    if isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        name, kwargs = spec, {}
    elif isinstance(spec, Mapping) and "name" in spec:
        kwargs = dict(spec)
        name = kwargs.pop("name")
    else:
        raise ValueError(f"{kind} must be a name ({', '.join(sorted(table))}), a dict {{name: ..., <arguments>}} "
                         f"or an optuna {base.__name__}; got {spec!r}.")
    key = str(name).lower().replace("-", "_").removesuffix("sampler").removesuffix("pruner").rstrip("_")
    if key not in table:
        close = difflib.get_close_matches(key, list(table), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown {kind} {name!r}.{hint} Valid: {', '.join(sorted(table))}.")
    cls = getattr(module, table[key])
    if kind == "sampler" and seed is not None and "seed" in inspect.signature(cls).parameters:
        kwargs.setdefault("seed", seed)
    if key == "patient" and isinstance(kwargs.get("wrapped_pruner"), (str, Mapping)):
        kwargs["wrapped_pruner"] = make_pruner(kwargs["wrapped_pruner"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{kind} {name!r}: {exc}.{_argument_hint(cls, kwargs)}") from None


def _argument_hint(cls: type, kwargs: Mapping[str, Any]) -> str:
    """' Did you mean ...?' for the first argument ``cls`` does not take, with the ones it does."""
    takes = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    for key in kwargs:
        if key not in takes:
            close = difflib.get_close_matches(key, takes, n=1)
            return (f" Did you mean {close[0]!r}?" if close else "") + f" {cls.__name__} takes: {', '.join(takes)}."
    return ""


def make_sampler(spec: Any = None, seed: int | None = None) -> "optuna.samplers.BaseSampler":
    """A sampler from a name (``"tpe"``, ``"random"``, ``"cmaes"``, ``"qmc"``, ``"gp"``, ...), a
    dict ``{name: tpe, n_startup_trials: 5, ...}`` or an optuna sampler. Default: TPE."""
    return _make_named("sampler", _SAMPLERS, optuna.samplers, spec, seed)


def make_pruner(spec: Any = None) -> "optuna.pruners.BasePruner":
    """A pruner from a name (``"median"``, ``"percentile"``, ``"hyperband"``, ``"successive_halving"``,
    ``"threshold"``, ``"none"``, ...), a dict ``{name: median, n_startup_trials: 5, n_warmup_steps: 2}``
    or an optuna pruner. Default: ``MedianPruner()``."""
    return _make_named("pruner", _PRUNERS, optuna.pruners, spec)


def _redact(url: str) -> str:
    try:
        import sqlalchemy

        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - best effort only, for error messages
        return url


def make_storage(storage: Any = None, default_path: str | os.PathLike | None = None):
    """An optuna storage from a URL, a file path or a storage object.

    - None: SQLite at ``default_path`` (its folder is created).
    - ``"sqlite:///path.db"``, ``"postgresql://user:pw@host/db"``, ``"mysql+pymysql://..."``: an
      ``RDBStorage`` (SQLite waits up to 60 s for another worker's lock). Heartbeats are on, so a
      trial whose process died is marked failed when the study next runs (after 3 minutes).
    - a path ending in ``.db``/``.sqlite``/``.sqlite3``: that SQLite file.
    - a path ending in ``.log``/``.jsonl``: Optuna's ``JournalStorage`` on that file (works on
      network file systems without a database server).
    - an ``optuna.storages.BaseStorage``: used as is.

    Raises :class:`StorageError` when the storage cannot be opened, with the cause and a fix.
    """
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage
    if storage is None:
        if default_path is None:
            raise ValueError("make_storage needs a storage URL or a default_path for the SQLite file.")
        os.makedirs(os.path.dirname(os.path.abspath(default_path)), exist_ok=True)
        storage = default_path
    text = os.fspath(storage)
    if not isinstance(text, str) or not text:
        raise ValueError(f"storage must be a URL or a file path, got {storage!r}.")
    if "://" not in text:
        path = os.path.abspath(text)
        if path.endswith((".log", ".jsonl", ".journal")):
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)  # as for the default SQLite file
                backend = optuna.storages.journal.JournalFileBackend(path)
                return optuna.storages.JournalStorage(backend)
            except Exception as exc:  # noqa: BLE001 - reported with the path
                raise StorageError(f"Cannot open the journal file {path!r} as study storage: "
                                   f"{type(exc).__name__}: {exc}") from exc
        if not path.endswith((".db", ".sqlite", ".sqlite3")):
            raise ValueError(f"storage {text!r} is neither a database URL (sqlite:///study.db, "
                             f"postgresql://user:password@host/db) nor a file ending in .db/.sqlite (SQLite) or "
                             f".log/.jsonl (journal).")
        text = f"sqlite:///{path}"
    sqlite = text.startswith("sqlite")
    engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if sqlite else {}
    if sqlite:
        _check_sqlite_folder(text)
    last_exc: Exception | None = None
    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # heartbeat_interval is "experimental"
                return optuna.storages.RDBStorage(
                    text, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_INTERVAL_S,
                    grace_period=GRACE_PERIOD_S)
        except Exception as exc:  # noqa: BLE001 - turned into one clear error below
            last_exc = exc
            # Workers creating the tables of a new SQLite file at the same moment collide
            # (IntegrityError on alembic_version, "table already exists", "database is locked"): retry.
            if not (sqlite and type(exc).__module__.startswith("sqlalchemy")):
                break
            time.sleep(0.2 * (attempt + 1))
    shown = _redact(text)
    hint = ""
    if isinstance(last_exc, ImportError) or "Can't load plugin" in str(last_exc):
        hint = (" The database driver is missing or the URL's scheme is wrong: e.g. pip install psycopg2-binary "
                "for postgresql://, pymysql for mysql+pymysql://.")
    elif text.startswith("sqlite"):
        hint = " Check that the file's folder exists and is writable."
    else:
        hint = " Check the host, port, database name and credentials, and that the server is running."
    raise StorageError(f"Cannot open the study storage {shown!r}: {type(last_exc).__name__}: "
                       f"{str(last_exc).splitlines()[0] if str(last_exc) else ''}.{hint}") from last_exc


def _check_sqlite_folder(url: str) -> None:
    """Fail fast, and clearly, when an SQLite file's folder does not exist."""
    try:
        import sqlalchemy

        database = sqlalchemy.engine.make_url(url).database
    except Exception:  # noqa: BLE001 - sqlalchemy reports a malformed URL itself
        return
    if database and database != ":memory:" and not database.startswith("file:"):
        folder = os.path.dirname(os.path.abspath(database))
        if not os.path.isdir(folder):
            raise StorageError(f"Cannot open the study storage {url!r}: the folder {folder!r} does not exist. "
                               f"Create it, or leave storage=None to use an SQLite file in the study's run dir.")


def infer_direction(metric: str) -> str:
    """``"maximize"`` for accuracy-like names, ``"minimize"`` for loss-like ones; else a ValueError."""
    named = name_direction(metric)
    if named is None:
        raise ValueError(f"Cannot tell whether to maximize or minimize {metric!r}: pass direction='maximize' or "
                         f"direction='minimize'.")
    return {"max": "maximize", "min": "minimize"}[named]


def _check_direction(direction: str | None, metric: str) -> str:
    if direction is None:
        return infer_direction(metric)
    value = str(direction).lower()
    value = {"max": "maximize", "min": "minimize"}.get(value, value)
    if value not in ("maximize", "minimize"):
        raise ValueError(f"direction must be 'maximize' or 'minimize', got {direction!r}.")
    try:
        named = infer_direction(metric)
    except ValueError:
        named = value
    if named != value:  # a slip keeps each trial's worst model: said, not refused (the name may mislead)
        warnings.warn(f"direction={value!r} for {metric!r}, whose name reads as a metric to {named}: the study "
                      f"will keep each trial's {'lowest' if value == 'minimize' else 'highest'} {metric} as its best. "
                      f"If that is not meant, pass direction={named!r} (or leave direction out).",
                      UserWarning, stacklevel=3)
    return value


def _setup_summary(value: Any, searched: Iterable[str] = ()) -> Any:
    """A JSON summary of a study's fixed settings, to tell whether a later call changed them:
    numbers, strings and containers as they are, classes and functions by their import path,
    other objects (arrays, callbacks) by their type only; the ``searched`` dotted keys marked
    ``"(searched)"`` (their fixed value is overridden in every trial).

    Examples:
        >>> _setup_summary({"model_hparams": {"hidden": 8, "act": len}, "lr": 0.1}, searched=["lr"])
        {'model_hparams': {'hidden': 8, 'act': 'builtins.len'}, 'lr': '(searched)'}
    """
    if isinstance(value, Mapping):
        summary = {str(key): _setup_summary(item) for key, item in value.items()}
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return [_setup_summary(item) for item in value]
    elif value is None or isinstance(value, (bool, int, float, str)):
        return value if not isinstance(value, float) or math.isfinite(value) else str(value)
    elif isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    else:
        return f"<{type(value).__qualname__}>"
    for key in searched:
        parts = key.split(".")
        node = summary
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[parts[-1]] = _SEARCHED
    return summary


_SEARCHED, _NOT_SET = "(searched)", "(not set)"


def _setup_changes(before: Any, after: Any, prefix: str = "") -> list[str]:
    """``"key: old -> new"`` for each dotted key whose value differs between two summaries
    (``0.1 -> searched`` for a fixed value the search space now sets).

    Examples:
        >>> _setup_changes({"a": 0.1, "b": 1}, {"a": "(searched)", "b": 2})
        ['a: 0.1 -> searched', 'b: 1 -> 2']
    """
    if isinstance(before, dict) and isinstance(after, dict):
        return [change for key in sorted(set(before) | set(after), key=str)
                for change in _setup_changes(before.get(key, _NOT_SET), after.get(key, _NOT_SET), f"{prefix}{key}.")]
    if before == after or (before, after) in ((_SEARCHED, _NOT_SET), (_NOT_SET, _SEARCHED)):  # an older summary
        return []
    show = lambda v: ("searched" if v == _SEARCHED else "not set" if v == _NOT_SET else  # noqa: E731
                      repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "...")
    return [f"{prefix.rstrip('.')}: {show(before)} -> {show(after)}"]


def _check_same_setup(study, study_name: str, setup: Any) -> None:
    """Warn when a study is continued with other fixed settings than its last call (Optuna would
    mix the trials silently and pick the best across both set-ups); remember the new ones."""
    if setup is None:
        return
    before = study.user_attrs.get("setup")
    changes = _setup_changes(before, setup) if before is not None else []
    if changes and any(t.state.is_finished() for t in study.get_trials(deepcopy=False)):
        shown = "; ".join(changes[:6]) + ("; ..." if len(changes) > 6 else "")
        warn_at_user(f"Study {study_name!r} is continued with other fixed settings than its last call ({shown}). Its "
                      f"trials are compared across both set-ups and its best trial is picked among them all; to keep "
                      f"them apart, give this set-up another study_name.")
    if before != setup:
        study.set_user_attr("setup", setup)


def _open_study(storage, study_name: str, direction: str, metric: str, run_dir: str, sampler, pruner):
    """Create the study or load it (resume / another worker); check it optimises the same thing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(storage=storage, sampler=sampler, pruner=pruner, study_name=study_name,
                                        direction=direction, load_if_exists=True)
    except Exception as exc:  # noqa: BLE001 - the storage URL was accepted but using it failed
        if isinstance(exc, (ValueError, TypeError)):
            raise
        raise StorageError(f"Cannot create or load study {study_name!r}: {type(exc).__name__}: {exc}") from exc
    existing = study.direction.name.lower()
    if existing != direction:
        raise ValueError(f"Study {study_name!r} in this storage was created to {existing} its objective; this call "
                         f"asks to {direction}. Use another study_name (or the same direction).")
    attrs = study.user_attrs
    if attrs.get("metric") not in (None, metric):
        states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.RUNNING)
        valued = [t for t in study.get_trials(deepcopy=False) if t.state in states]
        if valued:
            raise ValueError(f"Study {study_name!r} optimises {attrs['metric']!r} ({len(valued)} trial(s) have values "
                             f"of it or are running); this call asks for {metric!r}. Use another study_name to "
                             f"optimise a different metric.")
        messages.info("Study %r had no trial with a value of %r (they failed): it optimises %r from now on.",
                      study_name, attrs["metric"], metric)  # e.g. a misspelt metric, fixed
        study.set_user_attr("metric", metric)
    for name, value in (("metric", metric), ("run_dir", run_dir)):
        if name not in attrs:
            study.set_user_attr(name, value)
    return study


def load_study(storage: Any = None, study_name: str | None = None, base_dir: str | os.PathLike = DEFAULT_BASE_DIR):
    """Open an existing study: by ``storage`` (URL, ``.db`` or ``.log`` file, or a study's run dir
    holding ``study.db`` or ``journal.log``) or, by default, ``base_dir/study_name/study.db``. ``study_name`` may be left
    out when the storage holds exactly one study."""
    if storage is None:
        if study_name is None:
            raise ValueError("load_study needs a storage or a study_name.")
        storage = os.path.join(os.fspath(base_dir), study_name, STORAGE_FILE)
    if isinstance(storage, (str, os.PathLike)) and os.path.isdir(storage):  # a run dir: its study.db or journal
        found = [os.path.join(os.fspath(storage), name) for name in (STORAGE_FILE, JOURNAL_FILE)]
        storage = next((path for path in found if os.path.exists(path)), found[0])
    if isinstance(storage, (str, os.PathLike)) and "://" not in os.fspath(storage) and not os.path.exists(storage):
        raise FileNotFoundError(f"No study storage at {os.fspath(storage)!r}.")
    storage = make_storage(storage)
    if study_name is None:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
        if len(names) != 1:
            raise ValueError(f"The storage holds {len(names)} studies {names}: pass study_name.")
        study_name = names[0]
    try:
        return optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
        raise KeyError(f"No study named {study_name!r} in this storage; it holds {names}.") from None


# --------------------------------------------------------------------------- the objective
class _TrialFailed(Exception):
    """A trial's error, already recorded in its user attrs; optuna marks the trial failed."""


class _TrialCouldNotStart(_TrialFailed):
    """A trial refused by flaxlight's checks of its settings before it trained (a warmup longer than a
    sampled run, a ``ConfigError``): its one-line message says everything, so optuna logs no traceback."""


class _TrialDiverged(_TrialFailed):
    """A trial whose loss or objective went NaN/Inf (flaxlight's own diagnosis, in its user attrs):
    optuna logs it in one line, without a traceback through flaxlight's code."""


def _refused_before_training(exc: BaseException, trainer: Any) -> bool:
    """Whether ``exc`` is flaxlight's refusal of the trial's settings (a ``ValueError`` raised in
    flaxlight's own code, not the user's) before the trial's first step."""
    from flaxlight.config import raised_by_flaxlight

    return isinstance(exc, ValueError) and raised_by_flaxlight(exc) and not getattr(trainer, "global_step", 0)


class _Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGINT during a trial: optuna marks it failed, then ``tune`` exits as the trainer asked."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


@contextlib.contextmanager
def _sigterm_ends_the_trial():
    """SIGTERM during a study, outside ``train_model`` (whose own handler saves the trial's
    checkpoint), raises ``SystemExit(143)`` as Ctrl-C raises ``KeyboardInterrupt``: the trial is
    marked failed and the study saved, instead of the process ending with the trial RUNNING. A
    handler of the user's own, or a thread other than the main one, is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def end(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is end:  # a handler the user set meanwhile stays
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _NoTracebackFor(logging.Filter):
    """Drops the traceback from optuna's "Trial N failed" log record for these exception types
    (flaxlight's own set-up errors, whose message says everything and which are raised anyway)."""

    def __init__(self, *types: type[BaseException]):
        super().__init__()
        self.types = types

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.types):
            record.exc_info, record.exc_text = None, None
        return True


class _SayOnce(logging.Filter):
    """Drops a ``flaxlight`` log line said already in this study that starts with one of ``prefixes``
    (each trial's trainer says which metric picks its best model: the study's, every time)."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes, self.said = prefixes, set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith(self.prefixes):
            return True
        if text in self.said:
            return False
        self.said.add(text)
        return True


class _FailureLimit:
    """Study callback: stop after ``limit`` trials in a row failed in this process; also counts this
    process's finished and failed trials and keeps the first failure (``all_failed``)."""

    def __init__(self, limit: int | None):
        self.limit, self.in_a_row, self.last_error, self.hit = limit, 0, None, False
        self.finished, self.failed = 0, 0
        self.first_failure: tuple[int, str] | None = None

    def __call__(self, study, trial) -> None:
        self.finished += 1
        if trial.state == optuna.trial.TrialState.FAIL:
            self.failed += 1
            self.in_a_row += 1
            self.last_error = trial.user_attrs.get("error", "see the log")
            if self.first_failure is None:
                self.first_failure = (trial.number, self.last_error)
            if self.limit is not None and self.in_a_row >= self.limit:
                self.hit = True
                study.stop()
        elif trial.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
            self.in_a_row = 0

    @property
    def all_failed(self) -> bool:
        """Whether this process ran trials and every one of them failed (none completed or was pruned)."""
        return self.finished > 0 and self.failed == self.finished


def _best_checkpoint(trainer) -> tuple[str | None, int | None]:
    """The trial's best checkpoint dir and step (the newest when no validation ranked one)."""
    from flaxlight.resume import pick_checkpoint

    checkpointer = getattr(trainer, "checkpointer", None)
    if checkpointer is None or getattr(trainer, "log_dir", None) is None:
        return None, None
    checkpointer.wait()
    if not checkpointer.all_steps():
        return None, None
    step = pick_checkpoint(checkpointer, which="best")
    return os.path.join(str(checkpointer.directory), str(step)), int(step)


_BOOKKEEPING = ("epoch", "epoch_time", "step")


def _closest_metric(metric: str, logged: Iterable[str]) -> tuple[str | None, bool]:
    """The logged metric nearest ``metric`` and whether it is a likely typo (``val/accuracy`` ->
    ``val/acc``) rather than only the nearest name of the same split (``val/accuracy`` -> ``val/loss``)."""
    names = [str(n) for n in logged if str(n) not in _BOOKKEEPING]
    close = difflib.get_close_matches(metric, names, n=1)
    if close:
        return close[0], True
    prefix = metric.rpartition("/")[0]
    same_split = [n for n in names if n.rpartition("/")[0] == prefix] or names
    if not same_split:
        return None, False
    ratio = lambda n: difflib.SequenceMatcher(None, metric, n).ratio()  # noqa: E731
    return max(same_split, key=ratio), False


def _metric_not_logged(metric: str, trainer: Any, number: int, stage: str, exc: BaseException) -> str:
    """The message for a ``metric`` the trial's trainer never logged: the metric, where it was
    noticed, the closest logged name, every logged name and the fix. ``stage``: ``"build"``
    (before training: ``exc`` says why), ``"train"`` (at a validation) or ``"trained"``."""
    logged = getattr(trainer, "callback_metrics", None)
    if stage == "build" or not isinstance(logged, Mapping):
        return str(exc)
    ahead = not logged and getattr(getattr(trainer, "engine", None), "eval_metric_names", None)
    if ahead:  # the trainer checked the metric against what its eval step returns, before training
        logged = {f"val/{name}": None for name in ahead}
    when = (f"found before trial {number} trained, among what its eval step returns" if ahead else
            f"checked after trial {number} trained" if stage == "trained" else
            f"found at trial {number}'s first validation, which stopped it")
    closest, typo = _closest_metric(metric, logged)
    hint = "" if closest is None else (f" Did you mean {closest!r}?" if typo else
                                       f" The closest logged name is {closest!r}.")
    return (f"the study optimises {metric!r}, which was never logged ({when}).{hint} Logged metrics: "
            f"{sorted(map(str, logged))}. Set metric= (tune.metric in a config) to a logged metric, or log "
            f"{metric!r} in the trainer (e.g. return it from the eval step).")


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _jsonable_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in (metrics or {}).items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def _interrupted(exc: BaseException, trial, trainer: Any, pruning: PruningCallback) -> str:
    """The error of a trial that SIGINT/SIGTERM stopped; a trainer that trained (``trainer``) leaves
    its best checkpoint and best value so far in the trial's user attrs (``best_checkpoint``,
    ``value_so_far``, ``epochs``), so that the trial's model can still be loaded."""
    code = exc.code if isinstance(exc, SystemExit) else 143 if str(exc).startswith("SIGTERM") else 130
    name = {130: "SIGINT", 143: "SIGTERM"}.get(code, f"{type(exc).__name__}({code})") if isinstance(code, int) \
        else type(exc).__name__
    if trainer is None:
        return f"interrupted by {name} before it trained"
    try:
        checkpoint, _ = _best_checkpoint(trainer)
    except Exception:  # noqa: BLE001 - the interrupt goes on; the folder is kept anyway
        checkpoint = None
    values = list(pruning.reported.values())
    best = (max if trial.study.direction == optuna.study.StudyDirection.MAXIMIZE else min)(values) if values else None
    epochs = int(getattr(trainer, "current_epoch", 0))
    trial.set_user_attr("best_checkpoint", checkpoint)
    trial.set_user_attr("value_so_far", best)
    trial.set_user_attr("epochs", epochs)
    said = f"interrupted by {name} at epoch {epochs}"
    if best is None:
        return f"{said}, before its first validation" + (f" (checkpoint {checkpoint})" if checkpoint else "")
    return f"{said} (best {pruning.monitor} {best:.6g} so far" + (f", at {checkpoint})" if checkpoint else ")")


class _Objective:
    """Build a trial's trainer in its own log dir, train it, record the trial, return the metric.

    ``build(values, log_dir, callbacks) -> (trainer, train_loader, val_loader, num_epochs)`` makes
    the run from the trial's sampled ``{dotted key: value}``; the trainer must log to ``log_dir``
    and run ``callbacks`` (the pruning callback is added when it does not).
    """

    def __init__(self, build: Callable[..., tuple], space: SearchSpace, metric: str, run_dir: str,
                 catch: tuple[type[BaseException], ...]):
        self.build, self.space, self.metric = build, space, metric
        self.run_dir, self.catch = run_dir, catch

    def _check_data(self, number: int, val_loader) -> None:
        """Before a trial trains: the metric can come from its data, and is what its value would be."""
        if val_loader is None and self.metric.startswith("val/"):  # it could only fail after the whole trial
            raise MetricNotLoggedError(
                f"trial {number} has no validation data (val_loader is None), so the trainer never logs "
                f"{self.metric!r}. Give validation data (val_loader=, loaders= returning one, or a dataset with "
                f"a val split), or optimise a metric logged without it.")
        if val_loader is not None and self.metric.startswith("train/"):  # its value would be another's pick
            raise TuneError(
                f"tune(metric={self.metric!r}) with validation data: a trial's value and best checkpoint come "
                f"from its best validation (ranked by the trainer's monitor), where {self.metric} is not what "
                f"was optimised. Optimise a validation metric (e.g. 'val/loss'), or give no validation data to "
                f"optimise the last epoch's {self.metric}.")

    def _value(self, trial, trainer, metrics, pruning: PruningCallback) -> float:
        """A trained trial's value (its best model's metric), its results recorded in its user attrs;
        pruned or damaged (NaN) trials raise."""
        checkpoint, _ = _best_checkpoint(trainer)
        trial.set_user_attr("best_checkpoint", checkpoint)
        trial.set_user_attr("metrics", _jsonable_metrics(metrics))
        trial.set_user_attr("epochs", int(trainer.current_epoch))
        if trainer.stop_reason:
            trial.set_user_attr("stop_reason", trainer.stop_reason)
        pruning.raise_if_pruned()
        if pruning.nonfinite:
            raise FloatingPointError(pruning.reason)
        if PruningCallback.damaged(trainer):  # NaN steps after the last validation
            raise FloatingPointError(f"after its last validation, {PruningCallback.nonfinite_account(trainer, self.metric)}.")
        value = metrics.get(self.metric) if isinstance(metrics, Mapping) else None
        if value is None:
            try:
                value = trainer.monitored_value(self.metric, owner="tune(metric=...)")
            except KeyError as exc:
                raise MetricNotLoggedError(exc.args[0] if exc.args else str(exc)) from None
        value = float(value)
        if not math.isfinite(value):
            raise FloatingPointError(f"The objective {self.metric} is {value}.")
        return value

    def __call__(self, trial) -> float:
        log_dir = os.path.join(self.run_dir, TRIAL_DIR.format(number=trial.number))
        trial.set_user_attr("log_dir", log_dir)
        trial.set_user_attr("host", socket.gethostname())
        pruning = PruningCallback(trial, monitor=self.metric)
        trainer, stage = None, "build"
        advice = RESUME_ADVICE.set(f"tune does not resume a trial: trial {trial.number} is marked failed (its best "
                                   f"checkpoint so far is kept in {log_dir}: load_from_checkpoint or flaxlight "
                                   f"validate --ckpt loads it), and the study is saved ({self.run_dir}): run tune "
                                   f"again to add trials.")
        try:
            trainer, train_loader, val_loader, num_epochs = self.build(self.space.suggest(trial), log_dir, [pruning])
            if not any(cb is pruning for cb in trainer.callbacks):
                trainer.callbacks.insert(0, pruning)  # a factory that did not pass hparams["callbacks"] on
            actual_dir = getattr(trainer, "log_dir", None)
            if actual_dir and os.path.abspath(actual_dir) != os.path.abspath(log_dir):
                trial.set_user_attr("log_dir", os.path.abspath(actual_dir))
            self._check_data(trial.number, val_loader)
            stage = "train"
            with warnings.catch_warnings():  # the trial's failure says it, once (PruningCallback stops it)
                for said in (r"Not saving checkpoint \d+: the parameters hold NaN/Inf", r"The loss was NaN/Inf in"):
                    warnings.filterwarnings("ignore", said, RuntimeWarning)
                metrics = trainer.train_model(train_loader, val_loader, num_epochs=num_epochs)
            stage = "trained"
            return self._value(trial, trainer, metrics, pruning)
        except optuna.TrialPruned:
            raise optuna.TrialPruned() from None  # the trainer said why (its stop reason): optuna says "pruned"
        except FloatingPointError as exc:
            trial.set_user_attr("error", _short_error(exc))
            if not isinstance(exc, self.catch):
                raise
            if stage != "trained":  # the user's code raised it, not flaxlight's diagnosis: its traceback helps
                raise _TrialFailed(_short_error(exc)) from exc
            said = pruning.nonfinite  # the trainer printed the reason when the callback stopped it
            raise _TrialDiverged(f"trial {trial.number} diverged (NaN/Inf): see the PruningCallback line above; "
                                 f"recorded in the trial's user_attrs['error']." if said else
                                 _short_error(exc)) from None
        except TuneError as exc:  # a setting of the study: every trial would fail alike
            trial.set_user_attr("error", _short_error(exc))
            raise
        except MetricNotLoggedError as exc:
            message = _metric_not_logged(self.metric, trainer, trial.number, stage, exc)
            trial.set_user_attr("error", _short_error(MetricNotLoggedError(message)))
            raise MetricNotLoggedError(f"tune(metric={self.metric!r}): {message}") from None
        except (SystemExit, KeyboardInterrupt) as exc:
            trial.set_user_attr("error", _interrupted(exc, trial, trainer if stage == "train" else None, pruning))
            if stage != "train":  # the trainer's own message covers an interrupt of its training
                messages.info("Interrupted while trial %d was %s: %s", trial.number,
                              "being built" if stage == "build" else "ending", RESUME_ADVICE.get())
            raise _Interrupted(exc) from exc
        except Exception as exc:  # noqa: BLE001 - recorded; the study goes on when `catch` allows it
            trial.set_user_attr("error", _short_error(exc))
            if isinstance(exc, self.catch) and _refused_before_training(exc, trainer):
                raise _TrialCouldNotStart(_short_error(exc)) from None
            if isinstance(exc, self.catch):
                raise _TrialFailed(_short_error(exc)) from exc
            raise
        finally:
            RESUME_ADVICE.reset(advice)
            close_loggers = getattr(getattr(trainer, "logger", None), "close", None)
            if close_loggers is not None:
                close_loggers()  # a W&B run stays open after a successful train_model until closed
            if trainer is not None and hasattr(trainer, "state"):
                trainer.state = None  # free the trial's arrays now (device memory), not at the next gc cycle
            del trainer


def tune(
    trainer: type | Callable[[dict], Any], search_space: Mapping[str, Any] | SearchSpace, *,
    hparams: Mapping[str, Any] | None = None, train_loader: Iterable | None = None,
    val_loader: Iterable | None = None, loaders: Callable[[dict], tuple] | None = None, num_epochs: int = 10,
    metric: str = "val/loss", direction: str | None = None, n_trials: int | None = 20, timeout: float | None = None,
    storage: Any = None, study_name: str = DEFAULT_STUDY_NAME, base_dir: str | os.PathLike = DEFAULT_BASE_DIR,
    sampler: Any = None, pruner: Any = None, seed: int | None = None,
    catch: tuple[type[BaseException], ...] = (Exception,), max_failed_in_a_row: int | None = 5,
) -> "optuna.Study":
    """Run ``n_trials`` trials of a study; returns the ``optuna.Study`` (stored, resumable).

    Args:
        trainer: a :class:`~flaxlight.TrainerModule` subclass, called as ``trainer(**hparams)``
            for each trial, or a factory ``f(hparams: dict) -> trainer``. The dict it receives is
            ``hparams`` with the trial's sampled values set at their dotted keys, plus
            ``logger_params={"log_dir": <trial dir>, ...}``, ``callbacks=[..., PruningCallback]``
            and ``monitor``/``mode`` (from ``metric``/``direction``; a different ``monitor`` or
            ``mode`` in ``hparams`` is refused) — pass those on to the trainer (a factory that
            drops the callbacks still gets the pruning callback added).
        search_space: ``{dotted key: Float(...) | Int(...) | Categorical(...) | YAML dict}``;
            see :class:`SearchSpace`. Keys index into ``hparams``: ``optimizer_hparams.lr``,
            ``model_hparams.dropout_prob``, ``seed``, ``data.batch_size`` (see ``loaders``); one
            that cannot be set in ``hparams`` (an optax transformation's ``lr``) fails at once.
        hparams: the fixed keyword arguments of every trial's trainer (``model_class``,
            ``model_hparams``, ``optimizer_hparams``, ``exmp_input``, trainer options...). Trial
            trainers default to no progress bar and no model table.
        train_loader: the training data of every trial; or ``loaders``.
        val_loader: the validation data of every trial.
        loaders: ``f(hparams) -> (train_loader, val_loader)`` per trial, for tuning data settings
            (the key ``data`` of ``hparams`` is then given to it, not to a trainer class).
        num_epochs: epochs per trial (pruning stops bad trials earlier).
        metric: what to optimise, e.g. ``"val/acc"``; the trial's value is the best model's
            (``train_model``'s return). A metric the trainer never logs stops the study at the
            first validation of its first trial with :class:`MetricNotLoggedError` naming the
            closest and all logged keys (a ``val/`` metric without ``val_loader``: before training).
        direction: ``"maximize"`` or ``"minimize"``; None infers it from the metric's name
            (``acc`` -> maximize, ``loss`` -> minimize) or asks for it.
        n_trials: trials this call runs (None: until ``timeout``); run ``tune`` again with the same
            storage and study name to add more; run it in several processes to share the work.
        timeout: stop starting new trials after this many seconds.
        storage: None (SQLite ``base_dir/study_name/study.db``), a database URL, a ``.db`` or
            ``.log`` file, or an optuna storage; see :func:`make_storage`.
        study_name: the study's name in the storage and its folder under ``base_dir``: a plain
            name (no ``/``, ``\\``, ``.`` or ``..``).
        base_dir: trial log dirs go to ``base_dir/study_name/trial_NNNN/``.
        sampler: an optuna sampler or a spec for :func:`make_sampler` (default: TPE seeded with ``seed``).
        pruner: an optuna pruner or a spec for :func:`make_pruner` (default: ``MedianPruner()``).
        seed: the default sampler's seed (give each parallel worker its own, or None).
        catch: exception types that fail a trial (recorded in ``user_attrs["error"]``) without
            stopping the study; others stop it after recording the trial as failed.
        max_failed_in_a_row: stop with :class:`TuneError` after this many consecutive failed
            trials in this process (a broken set-up, not an unlucky sample); None: never. A call
            whose every trial failed also raises :class:`TuneError` (naming the first failure),
            after the study is saved.

    Each trial's ``user_attrs``: ``log_dir``, ``best_checkpoint``, ``metrics``
    (the best validation metrics), ``epochs``, ``host``, ``stop_reason`` (when it stopped early), and ``error`` for a
    failed trial. Pruned and failed trials keep their files.
    """
    space = search_space if isinstance(search_space, SearchSpace) else SearchSpace(search_space)
    direction = _check_trial_settings(metric, direction, num_epochs)
    _check_data_arguments(train_loader, val_loader, loaders)
    base = _base_trial_hparams(hparams, metric, direction)
    make_trainer = _trainer_maker(trainer, base, space, data_key="data" if loaders is not None else None)
    _check_before_trials(trainer, base, space, train_loader, val_loader, loaders, num_epochs)
    build = _trial_builder(make_trainer, base, train_loader, val_loader, loaders, num_epochs)
    setup = _setup_summary({"trainer": trainer, "hparams": base, "num_epochs": num_epochs}, [f"hparams.{k}" for k in space])
    return _run_study(build, space, metric=metric, direction=direction, n_trials=n_trials, timeout=timeout,
                      storage=storage, study_name=study_name, base_dir=base_dir, sampler=sampler, pruner=pruner,
                      seed=seed, catch=tuple(catch), max_failed_in_a_row=max_failed_in_a_row, setup=setup)


def _check_trial_settings(metric: str, direction: str | None, num_epochs: int) -> str:
    """Check ``metric`` and ``num_epochs``; return the direction (given or inferred from the metric)."""
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric must be a logged metric's name such as 'val/acc', got {metric!r}.")
    direction = _check_direction(direction, metric)
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}.")
    return direction


def _check_before_trials(trainer: Any, base: Mapping[str, Any], space: SearchSpace, train_loader: Any,
                         val_loader: Any, loaders: Callable | None, num_epochs: int) -> None:
    """Every searched key can be set in ``base`` (:func:`_check_overrides`) and, for a trainer class
    training every trial on the same data, the trials' run length (:func:`_check_trials_can_start`)."""
    _check_overrides(base, space)
    if isinstance(trainer, type) and loaders is None:
        runs = [_trial_run(_with_overrides(base, values), trainer, num_epochs) for values in _sample_values(space)]
        _check_trials_can_start(runs, train_loader, val_loader, searched=[f"hparams.{key}" for key in space])


_LENGTH_OPTIONS = ("max_steps", "fast_dev_run", "limit_train_batches", "limit_val_batches", "val_check_interval")


def _trial_run(settings: Mapping[str, Any], trainer_class: type, num_epochs: int) -> tuple | None:
    """``(options, check_val_every_n_epoch, optimizer config, num_epochs)`` of a trial's ``hparams``:
    what decides its run's length and warmup besides the data; None when that cannot be read here
    (a ready optax transformation, a setting the trial itself refuses) or the trainer sizes its
    optimizer its own way (an ``init_optimizer`` override)."""
    from flaxlight.options import TrainerOptions
    from flaxlight.trainer import TrainerModule

    if trainer_class.init_optimizer is not TrainerModule.init_optimizer:
        return None
    try:
        with warnings.catch_warnings():  # the trials warn, once each
            warnings.simplefilter("ignore")
            options = TrainerOptions(**{f.name: settings[f.name] for f in dataclasses.fields(TrainerOptions)
                                        if f.name in settings})
            optimizer = optim.as_optimizer_config(settings.get("optimizer_hparams"))
    except Exception:  # noqa: BLE001 - a trial reports it, with its own message
        return None
    return None if optimizer is None else (options, settings.get("check_val_every_n_epoch", 1), optimizer, num_epochs)


def _same_run_lengths(runs: Sequence[tuple | None]) -> bool:
    """Whether every sampled trial (``runs``: see :func:`_check_trials_can_start`) has the same
    run-length settings (epochs, batch limits, validation interval, warmup, accumulation)."""
    def length(run: tuple) -> tuple:
        options, every, optimizer, num_epochs = run
        return (*(getattr(options, key) for key in _LENGTH_OPTIONS), every, num_epochs,
                optimizer.warmup_steps, optimizer.accumulate_grad_batches)

    return bool(runs) and all(run is not None for run in runs) and len({length(run) for run in runs}) == 1


def _check_trials_can_start(runs: Sequence[tuple | None], train_loader: Any, val_loader: Any,
                            searched: Sequence[str]) -> None:
    """Before the first trial, the trainer's own checks of the run's length (validation due, the
    train loader's batches, ``max_steps``, a warmup longer than the run) when every sampled trial
    (``runs``: one :func:`_trial_run` per :func:`_sample_values` sample) has the same run-length
    settings, so that a mistake there would fail every trial alike. A search that changes them
    (``warmup_steps``, ``max_steps``, the epochs...) is left to each trial. ``searched``: the
    search space's keys, for the message."""
    from flaxlight.loop import BatchLimits, RunPlan

    if not _same_run_lengths(runs):
        return
    options, every, optimizer, num_epochs = runs[0]
    try:
        plan = RunPlan.make(train_loader, val_loader, num_epochs=num_epochs, steps_per_epoch=None,
                            check_val_every_n_epoch=every, limits=BatchLimits.from_options(options),
                            max_steps=options.max_steps, val_check_interval=options.val_check_interval)
        optim.make_optimizer_plan(optimizer, total_steps=plan.schedule_epochs * plan.schedule_steps_per_epoch,
                                  epoch_length=plan.steps_per_epoch)
    except ValueError as exc:
        raise ValueError(f"no trial can start: {exc.args[0] if exc.args else exc} Nothing in the search "
                         f"space ({', '.join(searched)}) changes the run's length or warmup, so every trial would "
                         f"fail alike (checked before the first trial).") from None
    except Exception:  # noqa: BLE001 - a loader without len() and the like: each trial says it
        return


def _check_data_arguments(train_loader: Iterable | None, val_loader: Iterable | None,
                          loaders: Callable[[dict], tuple] | None) -> None:
    """The data comes either as train_loader (and val_loader) or as ``loaders``, exactly one way."""
    if loaders is None:
        if train_loader is None:
            raise ValueError("tune needs the data: train_loader= (and val_loader=), or loaders=f(hparams) -> "
                             "(train_loader, val_loader).")
    elif train_loader is not None or val_loader is not None:
        raise ValueError("Give either train_loader/val_loader or loaders=, not both.")


def _base_trial_hparams(hparams: Mapping[str, Any] | None, metric: str, direction: str) -> dict[str, Any]:
    """``hparams`` with the trial defaults: no progress bar or model table; ``monitor``/``mode`` the
    study's ``val/`` metric and direction. Refused: logger objects (every trial would write into the
    same one), and a ``monitor``/``mode`` in ``hparams`` or a ``ModelCheckpoint`` ranking by another
    metric or in the other direction (the trial's best checkpoint would not be its value's)."""
    base = dict(hparams or {})
    if base.get("loggers") or (base.get("logger_params") or {}).get("loggers"):
        raise ValueError("hparams['loggers'] holds logger objects, which every trial would share (all trials in one "
                         "file or run): pass logger_params={'logger_type': [...]} instead, so that each trial "
                         "logs in its own folder.")
    from flaxlight.callbacks import ModelCheckpoint

    mode = "max" if direction == "maximize" else "min"
    for callback in base.get("callbacks") or []:
        if isinstance(callback, ModelCheckpoint) and callback.monitor not in (None, metric):
            raise ValueError(f"ModelCheckpoint(monitor={callback.monitor!r}) ranks a trial's checkpoints by another "
                             f"metric than the study's {metric!r}, so a trial's best checkpoint would not be the one "
                             f"its value came from: give it monitor={metric!r} or no monitor.")
        if isinstance(callback, ModelCheckpoint) and callback.monitor == metric and callback.mode != mode \
                and metric.startswith("val/"):
            raise ValueError(f"ModelCheckpoint(monitor={metric!r}, mode={callback.mode!r}) keeps the opposite of the "
                             f"study's best (direction={direction!r}): give it mode={mode!r}, or no monitor.")
    if metric.startswith("val/"):
        _check_monitor_and_mode(base, metric, direction, mode)
        base.update(monitor=metric, mode=mode)  # both from the study, never one of each
    for key, value in {"enable_progress_bar": False, "enable_model_summary": False}.items():
        base.setdefault(key, value)
    return base


def _check_monitor_and_mode(settings: Mapping[str, Any], metric: str, direction: str, mode: str,
                            config: bool = False) -> None:
    """Refuse a ``monitor``/``mode`` in ``hparams`` (or a config's ``trainer:`` section) other than the
    study's: a trial's best checkpoint, and the value the study records, come from its best
    validation by the trainer's monitor."""
    monitor, given = settings.get("monitor"), settings.get("mode")
    name = (lambda key: f"trainer.{key}") if config else (lambda key: f"hparams[{key!r}]")  # noqa: E731
    where, source = ("the trainer section", "tune.metric and tune.direction") if config else \
        ("hparams", "metric= and direction=")
    if monitor not in (None, metric):
        raise ValueError(
            f"{name('monitor')}={monitor!r} would rank a trial's checkpoints by another metric than the study's "
            f"{metric!r}, so a trial's best checkpoint, and the value the study records for it, would not be its "
            f"best {metric}. tune sets monitor and mode from {source}: remove 'monitor' (and 'mode') from {where}, "
            f"or optimise that metric (metric={monitor!r}).")
    if given is not None and given != mode:
        if given not in ("min", "max"):
            raise ValueError(f"{name('mode')}={given!r} is neither 'min' nor 'max'; tune sets the mode from "
                             f"{source} (here {direction!r}: mode={mode!r}): remove 'mode' from {where}.")
        raise ValueError(
            f"{name('mode')}={given!r} is the opposite of the study's direction={direction!r} (mode={mode!r} for "
            f"{metric!r}), so each trial would keep its worst checkpoint by {metric}, and the study would record "
            f"that one's value. tune sets mode from {source}: remove 'mode' from {where}, or pass "
            f"direction={'maximize' if given == 'max' else 'minimize'!r} if that is what you mean.")


def _trainer_maker(trainer: type | Callable[[dict], Any], base: Mapping[str, Any], space: SearchSpace,
                   data_key: str | None) -> Callable[[dict], Any]:
    """``trial_hparams -> trainer`` from a TrainerModule subclass (keys checked first) or a factory."""
    if isinstance(trainer, type):
        from flaxlight.trainer import TrainerModule

        if not issubclass(trainer, TrainerModule):
            raise TypeError(f"trainer must be a TrainerModule subclass or a factory f(hparams) -> trainer; "
                            f"got the class {trainer.__name__}.")
        _check_keys(trainer, base, space, data_key=data_key)
        trainer_class = trainer

        def make_trainer(trial_hparams: dict):
            return trainer_class(**{k: v for k, v in trial_hparams.items() if k != "data"})

        return make_trainer
    if callable(trainer):
        return trainer
    raise TypeError(f"trainer must be a TrainerModule subclass or a factory f(hparams) -> trainer; "
                    f"got {type(trainer).__name__}.")


def _trial_builder(make_trainer: Callable[[dict], Any], base: Mapping[str, Any], train_loader: Iterable | None,
                   val_loader: Iterable | None, loaders: Callable[[dict], tuple] | None,
                   num_epochs: int) -> Callable[..., tuple]:
    """``build(values, log_dir, callbacks) -> (trainer, train_loader, val_loader, num_epochs)`` for a trial."""

    def build(values: dict, log_dir: str, callbacks: list) -> tuple:
        trial_hparams = _with_overrides(base, values)
        trial_hparams["logger_params"] = {**dict(trial_hparams.get("logger_params") or {}), "log_dir": log_dir}
        # Callbacks with state (EarlyStopping's best score) must not carry over from trial to trial.
        trial_hparams["callbacks"] = [copy.deepcopy(cb) for cb in trial_hparams.get("callbacks") or []] + callbacks
        trial_trainer = make_trainer(trial_hparams)
        if loaders is None:
            return trial_trainer, train_loader, val_loader, num_epochs
        made = loaders(trial_hparams)
        if not (isinstance(made, (tuple, list)) and len(made) == 2):
            raise TypeError(f"loaders(hparams) must return (train_loader, val_loader); got {type(made).__name__}.")
        return trial_trainer, made[0], made[1], num_epochs

    return build


def _run_study(build: Callable[..., tuple], space: SearchSpace, *, metric: str, direction: str,
               n_trials: int | None, timeout: float | None, storage: Any, study_name: str,
               base_dir: str | os.PathLike, sampler: Any, pruner: Any, seed: int | None,
               catch: tuple, max_failed_in_a_row: int | None, setup: Any = None) -> "optuna.Study":
    """Open (or create) the study, run the trials, report a stop for too many failures."""
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 0):
        raise ValueError(f"n_trials must be an int >= 0 (or None with a timeout), got {n_trials!r}.")
    if n_trials is None and timeout is None:
        raise ValueError("n_trials=None runs until timeout: give a timeout (seconds) too.")
    _check_study_name(study_name, base_dir)
    if max_failed_in_a_row is not None and (not isinstance(max_failed_in_a_row, int) or max_failed_in_a_row < 1):
        raise ValueError(f"max_failed_in_a_row must be a positive int or None, got {max_failed_in_a_row!r}.")
    _check_study_settings(timeout, seed, base_dir)
    sampler_spec, pruner = sampler, make_pruner(pruner)
    first_sampler = make_sampler(sampler_spec, seed)  # a bad spec fails before any file is made
    run_dir = os.path.abspath(os.path.join(os.fspath(base_dir), study_name))
    if storage is None and not os.path.exists(os.path.join(run_dir, STORAGE_FILE)):
        _check_trial_dirs_free(study_name, 0, run_dir)  # a new study: refused before its study.db is made
    storage_obj = make_storage(storage, default_path=os.path.join(run_dir, STORAGE_FILE))
    _check_trial_dirs_free(study_name, _stored_trials(storage_obj, study_name), run_dir)
    os.makedirs(run_dir, exist_ok=True)
    study = _open_study(storage_obj, study_name, direction, metric, run_dir, first_sampler, pruner)
    _check_same_setup(study, study_name, setup)
    if seed is not None and study.trials:  # a seeded sampler made again would replay the study's first trials
        study.sampler = make_sampler(sampler_spec, _sampler_seed(seed, len(study.trials)))
    if n_trials == 0:  # the study opened to look at: its space is not this call's to check
        return study
    _check_same_space(study, study_name, space)
    objective = _Objective(build, space, metric, run_dir, catch)
    limit = _FailureLimit(max_failed_in_a_row)
    quiet = _NoTracebackFor(MetricNotLoggedError, _Interrupted, _TrialCouldNotStart, _TrialDiverged)  # said in full
    optuna_log = logging.getLogger("optuna.study._optimize")
    optuna_log.addFilter(quiet)
    once = _SayOnce("The best model is picked by")
    messages.addFilter(once)
    try:
        with _sigterm_ends_the_trial():
            study.optimize(objective, n_trials=n_trials, timeout=timeout, catch=(_TrialFailed,), callbacks=[limit])
    except _Interrupted as interrupt:
        raise interrupt.original from None
    finally:
        optuna_log.removeFilter(quiet)
        messages.removeFilter(once)
    if limit.hit:
        raise TuneError(f"Stopped study {study_name!r}: {limit.in_a_row} trials in a row failed (last error: "
                        f"{limit.last_error}). Fix the set-up and run tune again: the study resumes "
                        f"(max_failed_in_a_row=None never stops).")
    if limit.all_failed:
        number, error = limit.first_failure
        raise TuneError(f"Every trial of study {study_name!r} failed ({limit.failed} of {limit.failed} run by this "
                        f"call); the first, trial {number}: {error.rstrip('.')}. The study is saved (each failed "
                        f"trial's user_attrs['error'], its files under {run_dir}); fix the set-up and run tune "
                        f"again: the study resumes.")
    return study


def _sampler_seed(seed: int, trials: int) -> int:
    """The seed of the sampler of a study that holds ``trials`` trials when this call opens it:
    ``seed`` itself for a new study, else a hash of both (numpy's ``SeedSequence``), so a rerun
    does not replay the study's first samples and workers given different seeds never draw alike,
    whenever each joins (``seed + trials`` made seed 1 joining at 1 trial seed 2 at 0).

    Examples:
        >>> _sampler_seed(2, 0), _sampler_seed(1, 1) == _sampler_seed(2, 0)
        (2, False)
    """
    if trials == 0:
        return seed
    return int(np.random.SeedSequence((seed, trials)).generate_state(1)[0])


def _check_study_settings(timeout: Any, seed: Any, base_dir: Any) -> None:
    """``timeout`` (seconds > 0 or None), ``seed`` (an int >= 0 or None) and ``base_dir`` (a path)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a number of seconds > 0 (or null), got {timeout!r}.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be an int >= 0 (or null), got {seed!r}.")
    if not isinstance(base_dir, (str, os.PathLike)) or not os.fspath(base_dir):
        raise ValueError(f"base_dir must be a folder's path, got {base_dir!r}.")


def _stored_trials(storage: Any, study_name: str) -> int:
    """How many trials the study ``study_name`` holds in ``storage`` (0: no such study yet)."""
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        return 0
    return len(storage.get_all_trials(study_id, deepcopy=False))


def _check_trial_dirs_free(study_name: str, trials: int, run_dir: str) -> None:
    """Refuse a study of ``trials`` trials whose next trials' folders hold runs of an earlier study
    (started over in the same place): those trials would fail one by one. A ``FileExistsError``
    (``flaxlight tune``: exit status 2), raised before the study is created or changed."""
    from flaxlight.runfiles import run_files_present

    if not os.path.isdir(run_dir):
        return
    taken = sorted(name for name in os.listdir(run_dir) if name.startswith("trial_") and name[6:].isdigit()
                   and int(name[6:]) >= trials and run_files_present(os.path.join(run_dir, name)))
    if taken:
        raise FileExistsError(f"{run_dir} holds the trial folders of an earlier study ({', '.join(taken[:3])}"
                              f"{', ...' if len(taken) > 3 else ''}), which study {study_name!r} in this storage "
                              f"({trials} trials) would write into. Move or delete them, or use another "
                              f"study_name or base_dir.")


def _check_study_name(study_name: Any, base_dir: str | os.PathLike) -> None:
    """The study's name is also its folder under ``base_dir``: a plain name, never a path."""
    if not isinstance(study_name, str) or not study_name.strip():
        raise ValueError(f"study_name must be a non-empty name such as 'digits_mlp', got {study_name!r}.")
    separators = [sep for sep in dict.fromkeys(("/", "\\", os.sep, os.altsep)) if sep and sep in study_name]
    if separators or study_name in (".", "..") or "\0" in study_name:
        what = f"contains {separators[0]!r}" if separators else f"is {study_name!r}"
        raise ValueError(f"study_name {study_name!r} is not a plain name: it is also the study's folder under "
                         f"base_dir ({os.fspath(base_dir)!r}), and it {what}, so the study would be written "
                         f"elsewhere. Use a name without '/', '\\' or '..', e.g. 'digits_mlp'; to put the study "
                         f"in another folder, set base_dir.")


def load_best(study: "optuna.Study", trainer_class: type, exmp_input: Any, which: str = "best", **overrides: Any):
    """The best trial's model: ``trainer_class.load_from_checkpoint(best_trial.user_attrs["log_dir"], ...)``.

    ``which="best"`` loads the trial's best checkpoint (the one its objective value came from).
    """
    try:
        best = study.best_trial
    except ValueError:
        states = [t.state.name for t in study.trials]
        raise ValueError(f"Study {study.study_name!r} has no completed trial yet (trial states: {states}).") from None
    log_dir = best.user_attrs.get("log_dir")
    if not log_dir:
        raise ValueError(f"Trial {best.number} of study {study.study_name!r} has no 'log_dir' user attr: it was not "
                         f"run by flaxlight.tune.")
    overrides.setdefault("enable_progress_bar", False)
    return trainer_class.load_from_checkpoint(log_dir, exmp_input, which=which, **overrides)


def param_importances(study: "optuna.Study") -> dict[str, float]:
    """``{param: importance}`` over the completed trials (optuna's default evaluator), most important first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return dict(optuna.importance.get_param_importances(study))


# --------------------------------------------------------------------------- plots
def plot_study(storage: Any, study_name: str | None = None, out_dir: str | os.PathLike | None = None) -> list[str]:
    """Write PNGs of a study: optimisation history, intermediate values, parameter importances and
    a contour of the two most important parameters; returns the paths written.

    ``storage`` is an ``optuna.Study``, a storage URL, a ``.db`` file or a study's run dir;
    ``out_dir`` defaults to ``<run dir>/plots``. A plot that needs more trials or parameters than
    the study has (importances: two completed trials; contour: two parameters) is skipped with a
    log message. Uses matplotlib's Agg backend unless pyplot was already imported.
    """
    study = storage if isinstance(storage, optuna.Study) else load_study(storage, study_name)
    if out_dir is None:
        out_dir = os.path.join(study.user_attrs.get("run_dir") or ".", "plots")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        import matplotlib

        if "matplotlib.pyplot" not in sys.modules:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as ovm
    except ImportError as exc:
        raise ImportError("plot_study needs matplotlib: pip install 'flaxlight[tune]'.") from exc

    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    importances: dict[str, float] = {}
    if len(complete) >= 2:
        try:
            importances = param_importances(study)
        except Exception as exc:  # noqa: BLE001 - the plot is skipped, the others are written
            _log.info("plot_study: no parameter importances (%s).", exc)
    plots: list[tuple[str, Callable[[], Any]]] = [
        ("optimization_history", lambda: ovm.plot_optimization_history(study)),
        ("intermediate_values", lambda: ovm.plot_intermediate_values(study)),
    ]
    if importances:
        plots.append(("param_importances", lambda: ovm.plot_param_importances(study)))
        top = list(importances)[:2]
        if len(top) == 2:
            plots.append(("contour", lambda: ovm.plot_contour(study, params=top)))
        else:
            _log.info("plot_study: the contour needs two parameters; the study has %s.", top)
    else:
        _log.info("plot_study: parameter importances and contour need >= 2 completed trials (%d).", len(complete))
    written = []
    for name, make in plots:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna's matplotlib plots are "experimental"
                result = make()
        except Exception as exc:  # noqa: BLE001 - skip this plot, keep the others
            _log.warning("plot_study: skipped %s: %s", name, exc)
            continue
        axes = result.flat[0] if hasattr(result, "flat") else result
        figure = axes.get_figure()
        figure.set_size_inches(max(figure.get_size_inches()[0], 7), max(figure.get_size_inches()[1], 5))
        figure.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


# --------------------------------------------------------------------------- configs (the CLI)
TUNE_CONFIG_KEYS = ("search_space", "metric", "direction", "n_trials", "timeout", "storage", "study_name",
                    "base_dir", "sampler", "pruner", "seed", "max_failed_in_a_row")
_SECTION_ALIASES = {"optimizer_hparams": "optimizer", "model_hparams": "model.hparams"}


def _config_key(key: str) -> str:
    """Trainer-argument spelling -> config spelling: ``optimizer_hparams.lr`` -> ``optimizer.lr``."""
    top, dot, rest = key.partition(".")
    if top in _SECTION_ALIASES:
        return _SECTION_ALIASES[top] + dot + rest
    return key


def _flat_keys(space: Any, prefix: str = "") -> Any:
    """Flatten nested sections of a YAML search space, so the aliases apply to whole dotted keys."""
    if not isinstance(space, Mapping):
        return space  # SearchSpace() reports the error
    flat: dict[str, Any] = {}
    for key, value in space.items():
        if isinstance(value, Mapping) and value and "type" not in value and \
                not ({"low", "high", "choices", "log", "step"} & set(value)):
            flat.update(_flat_keys(value, prefix=f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def parse_tune_config(section: Mapping[str, Any]) -> dict[str, Any]:
    """Check a config's ``tune:`` section; returns it with defaults and ``search_space`` a
    :class:`SearchSpace` over config keys (``optimizer.lr``, ``model.hparams.dropout_prob``)."""
    if not isinstance(section, Mapping):
        raise ValueError(f"The config's 'tune' section must be a mapping, got {type(section).__name__}.")
    unknown = sorted(set(section) - set(TUNE_CONFIG_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], TUNE_CONFIG_KEYS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown key tune.{unknown[0]}.{hint} Valid keys: {', '.join(TUNE_CONFIG_KEYS)}.")
    if "search_space" not in section:
        raise ValueError("The config's 'tune' section needs a search_space, e.g. search_space: {optimizer.lr: "
                         "{type: float, low: 1.0e-4, high: 1.0e-2, log: true}}.")
    out = dict(section)
    flat = _flat_keys(section["search_space"])
    if isinstance(flat, Mapping):
        flat = {_config_key(str(k)): v for k, v in flat.items()}
    out["search_space"] = SearchSpace(flat)
    out.setdefault("metric", "val/loss")
    if not isinstance(out["metric"], str) or not out["metric"]:
        raise ValueError(f"metric must be a logged metric's name such as val/acc, got {out['metric']!r}.")
    out.setdefault("n_trials", 20)
    out["direction"] = _check_direction(out.get("direction"), out["metric"])
    return out


def _sample_values(space: SearchSpace) -> list[dict[str, Any]]:
    """Value sets that, together, give every parameter each of its choices and both ends of its
    range (the others at their first choice / low end), to check them all before trial 0."""
    first = {key: (param.choices[0] if isinstance(param, Categorical) else param.low) for key, param in space.items()}
    samples = [first]
    for key, param in space.items():
        for value in (param.choices[1:] if isinstance(param, Categorical) else [_top(param)]):
            samples.append({**first, key: value})
    return samples


def _top(param: Float | Int) -> Any:
    """The highest value a range gives: ``high``, or the last point of its step grid below it."""
    step = getattr(param, "step", None)
    if not step:
        return param.high
    top = param.low + math.floor((param.high - param.low) / step + 1e-9) * step
    return int(round(top)) if isinstance(param, Int) else float(round(top, 12))


def tune_from_config(config: Mapping[str, Any], n_trials: int | None = None, *, trust_config: bool = False,
                     allow_imports: Iterable[str] = ()) -> "optuna.Study":
    """Run the study a config describes: ``flaxlight tune --config cfg.yaml [--n-trials N]``.

    ``config`` is a ``flaxlight fit`` config as a dict (sections ``trainer``, ``model``,
    ``optimizer``, ``data``, ``callbacks``, ``loggers``) plus a ``tune:`` section::

        tune:
          search_space:                      # dotted config keys -> range or choices
            optimizer.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
            model.hparams.dropout_prob: {type: float, low: 0.0, high: 0.6}
            data.batch_size: {type: categorical, choices: [32, 64, 128]}
          metric: val/acc                    # default val/loss
          direction: maximize                # default: from the metric's name
          n_trials: 20                       # --n-trials overrides it
          study_name: digits_mlp             # default "study"
          base_dir: studies                  # trial dirs: base_dir/study_name/trial_NNNN
          storage: null                      # default: SQLite base_dir/study_name/study.db
          sampler: tpe                       # or {name: tpe, n_startup_trials: 5}
          pruner: median                     # or {name: median, n_warmup_steps: 2}, none
          seed: null                         # the sampler's seed
          timeout: null                      # seconds
          max_failed_in_a_row: 5

    ``optimizer_hparams.*`` and ``model_hparams.*`` are accepted for ``optimizer.*`` and
    ``model.hparams.*``. Each trial trains ``trainer.max_epochs`` epochs (tunable too). Every key
    is checked against the config's schema before the first trial. Each trial is built with
    :func:`flaxlight.config.build_run` (its resolved config is saved in its log dir).
    ``trust_config``/``allow_imports``: the opt-in for import paths in the config, as for
    :func:`flaxlight.config.load_config` (registered names need none).

    Mistakes in the ``tune:`` section (search space, settings, study name) raise a
    :class:`flaxlight.config.ConfigError` naming the key before any trial runs; a study whose
    every trial failed raises :class:`TuneError` naming the first failure.
    """
    from flaxlight import config as config_module

    opt_in = {"trust_config": trust_config, "allow_imports": allow_imports}
    settings, base_config = _check_tune_config(config, opt_in)
    space: SearchSpace = settings["search_space"]
    metric, direction = settings["metric"], settings["direction"]
    mode = "max" if direction == "maximize" else "min"

    def build(values: dict, log_dir: str, callbacks: list) -> tuple:
        run = config_module.build_run(_with_overrides(base_config, values), log_dir=log_dir, callbacks=callbacks,
                                      monitor=metric if metric.startswith("val/") else None, mode=mode, **opt_in)
        return run["trainer"], run["train_loader"], run["val_loader"], run["num_epochs"]

    trials = settings["n_trials"] if n_trials is None else n_trials
    try:  # every trial's own errors are recorded in the study: what comes out here is the set-up's
        return _run_study(
            build, space, metric=metric, direction=direction, n_trials=trials, timeout=settings.get("timeout"),
            storage=settings.get("storage"), study_name=settings.get("study_name") or DEFAULT_STUDY_NAME,
            base_dir=settings.get("base_dir") or DEFAULT_BASE_DIR, sampler=settings.get("sampler"),
            pruner=settings.get("pruner"), seed=settings.get("seed"),
            catch=(Exception,), max_failed_in_a_row=settings.get("max_failed_in_a_row", 5),
            setup=_setup_summary(base_config, searched=list(space)),
        )
    except ValueError as exc:
        if isinstance(exc, config_module.ConfigError):
            raise
        raise config_module.ConfigError(_in_tune_section(exc)) from None


def _check_tune_config(config: Mapping[str, Any], opt_in: Mapping[str, Any]) -> tuple[dict, dict]:
    """``(settings, config without tune:)`` after checking the tune section and, with one sample of
    every parameter set, the whole config (its own strict errors), before any trial runs."""
    from flaxlight import config as config_module

    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a mapping (a parsed YAML file), got {type(config).__name__}.")
    if not config.get("tune"):
        raise config_module.ConfigError(
            "The config has no 'tune' section; add one with a search_space, e.g. tune: {search_space: "
            "{optimizer.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}}, metric: val/acc}.")
    try:
        settings = parse_tune_config(config["tune"])
    except ValueError as exc:
        raise config_module.ConfigError(_in_tune_section(exc)) from None
    base_config = {k: v for k, v in config.items() if k != "tune"}
    trainer = base_config.get("trainer") or {}
    if settings["metric"].startswith("val/") and isinstance(trainer, Mapping):  # monitor and mode: the study's
        mode = "max" if settings["direction"] == "maximize" else "min"
        try:  # its mode only follows: a dumped config (the CLI's) holds the default 'min' when none was given
            _check_monitor_and_mode({"monitor": trainer.get("monitor")}, settings["metric"], settings["direction"],
                                    mode, config=True)
        except ValueError as exc:
            raise config_module.ConfigError(str(exc)) from None
        base_config["trainer"] = {**trainer, "monitor": settings["metric"], "mode": mode}
    space: SearchSpace = settings["search_space"]
    try:
        configs = [config_module.load_config(_with_overrides(base_config, values), **opt_in)
                   for values in _sample_values(space)]
    except config_module.ConfigError as exc:
        if not any(key in str(exc) for key in space):
            raise  # the config's own mistake (an import path without the opt-in, ...), not the search space's
        raise config_module.ConfigError(f"tune.search_space {sorted(space)}: {exc}") from None
    except ValueError as exc:  # a key that indexes into a list or a value that is no section
        raise config_module.ConfigError(_in_tune_section(exc)) from None
    _check_config_trials_can_start(configs, space, opt_in)
    return settings, base_config


def _check_config_trials_can_start(configs: Sequence[Any], space: SearchSpace, opt_in: Mapping[str, Any]) -> None:
    """:func:`_check_trials_can_start` for the trials of a config (``configs``: one per sample of the
    search space), on its data built once, when no sample changes the data or the trainer; a
    failure to build them is left to the first trial, which reports it as it always does."""
    from flaxlight import config as config_module
    from flaxlight.trainer import TrainerModule

    first = configs[0]
    if any(repr(cfg.data) != repr(first.data) or cfg.trainer.name != first.trainer.name for cfg in configs[1:]):
        return
    runs = [(cfg.trainer, cfg.trainer.check_val_every_n_epoch, cfg.optimizer, cfg.trainer.max_epochs) for cfg in configs]
    if not _same_run_lengths(runs):  # each trial checks its own: the data are not built for nothing
        return
    try:
        resolved = config_module.resolve_config(first, **opt_in)
        if resolved.trainer_class.init_optimizer is not TrainerModule.init_optimizer:
            return
        train_loader, val_loader, _ = config_module.build_data(first, resolved)
    except Exception:  # noqa: BLE001 - the first trial builds them again and says what is wrong
        return
    try:
        _check_trials_can_start(runs, train_loader, val_loader, searched=list(space))
    except ValueError as exc:
        raise config_module.ConfigError(str(exc)) from None


def _in_tune_section(exc: BaseException) -> str:
    """A settings error of the ``tune:`` section, with the key's full path (``tune.study_name ...``)."""
    message = str(exc)
    if message.startswith(("tune.", "Unknown key tune.", "The config's 'tune'")):
        return message
    key = message.split("[", 1)[0].split(" ", 1)[0].rstrip(":")
    if key in TUNE_CONFIG_KEYS:
        return f"tune.{message}"
    return f"tune: {message}"
