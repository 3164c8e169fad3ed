"""Typed run configs: YAML in, checked dataclasses out, dotted overrides, and building a run from one.

A config has the sections ``trainer``, ``model``, ``optimizer``, ``data``, ``callbacks``,
``loggers`` (plus ``imports`` and the free-form ``tune``); every default is declared once, on the
dataclass fields below. See docs/cli.md for a full config with comments.

    >>> cfg = load_config({"trainer": {"name": "regression", "max_epochs": 3},
    ...                    "model": {"name": "mlp_regressor", "hparams": {"hidden_dims": [32], "output_dim": 1}},
    ...                    "data": {"name": "sine"}}, overrides=["optimizer.lr=3e-4"])
    >>> cfg.optimizer.lr, cfg.trainer.max_epochs, cfg.data.batch_size
    (0.0003, 3, 64)

Strictness: an unknown key fails with its full path and the closest valid name; a value of the
wrong type fails with the expected type; a missing required key is named; names that do not
resolve (registered short names or import paths) say which part failed; free-form dicts
(``model.hparams``, ``data.kwargs``, ``callbacks[i].args``, ``loggers[i].args``) are checked
against the signature of what they configure. YAML is read with a safe loader only.

Trust: a config is data. Its ``name:`` keys resolve through the registry (flaxlight's names and
whatever your code registered before the call); an import path (``mypkg.models.ResNet``) or an
``imports:`` entry is refused unless the caller opts in, with ``trust_config=True`` (any module)
or ``allow_imports=["mypkg"]`` (modules under those prefixes). Whatever a name resolves to is
checked to be the expected kind (a TrainerModule subclass, a flax Module class, a Callback or
Logger subclass, a dataset factory) before anything is called.
"""

from __future__ import annotations

import collections.abc
import contextvars
import dataclasses
import datetime
import difflib
import inspect
import itertools
import os
import re
import traceback
import types
import typing
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, Union

import numpy as np
import yaml

from flaxlight import configyaml, registry
from flaxlight.callbacks import Callback
from flaxlight.callbacks.timer import parse_duration
from flaxlight.checkpoint import ModelMismatchError
from flaxlight.messages import logger as messages
from flaxlight.models import ModelHparamsError
from flaxlight.optim import OptimizerConfig, suggest_key
from flaxlight.options import MetricNotLoggedError, TrainerOptions, declared_keywords, fraction_of_an_epoch_message
from flaxlight.runfiles import HPARAMS_FILE, NOT_RECORDED, LoggerParams, class_path, read_hparams, run_dir, to_yaml_safe
from flaxlight.trainer import TrainerModule

__all__ = [
    "CONFIG_FILE",
    "CallbackConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "FitResult",
    "LoggerConfig",
    "LoggerParams",
    "ModelConfig",
    "OptimizerConfig",
    "Resolved",
    "SaveConfig",
    "TrainerConfig",
    "apply_overrides",
    "build_callbacks",
    "build_data",
    "build_loggers",
    "build_run",
    "build_trainer",
    "check_config",
    "config_to_dict",
    "dump_config",
    "example_input",
    "fit",
    "load_config",
    "load_trainer",
    "parse_override",
    "resolve_config",
    "save_config",
]

CONFIG_FILE = "config.yaml"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key's path and the fix.

    Attributes:
        key: the setting at fault, as the message writes it (``trainer.max_epochs``,
            ``callbacks[0].args.patience``), where there is one; else None.

    Examples:
        >>> ConfigError("trainer.max_epochs: expected int, got str 'ten'.", key="trainer.max_epochs").key
        'trainer.max_epochs'
    """

    def __init__(self, message: str = "", key: str | None = None):
        super().__init__(message)
        self.key = key


# ---------------------------------------------------------------------------------------- trust
@dataclasses.dataclass(frozen=True)
class _ImportPolicy:
    """What a config may import: nothing (the default), modules under ``allow`` prefixes, or
    anything (``trust``). Built once per public call from ``trust_config``/``allow_imports``."""

    trust: bool = False
    allow: tuple[str, ...] = ()

    @classmethod
    def of(cls, trust_config: bool = False, allow_imports: Iterable[str] | str | None = ()) -> "_ImportPolicy":
        if not isinstance(trust_config, bool):
            raise TypeError(f"trust_config must be True or False, got {trust_config!r}.")
        if isinstance(allow_imports, str):
            allow_imports = [allow_imports]
        prefixes = []
        for prefix in allow_imports or ():  # a package's folder (tab completion: mypkg/models/) is its name
            text = prefix.strip().rstrip("/" + os.sep).replace(os.sep, ".").replace("/", ".") \
                if isinstance(prefix, str) else prefix
            if not isinstance(text, str) or not _MODULE_NAME.fullmatch(text):
                raise ConfigError(f"allow_imports (--allow-import): {prefix!r} is not a module prefix; give dotted "
                                  f"module names such as 'mypkg' or 'mypkg.models' (every module under it may then "
                                  f"be imported).")
            prefixes.append(text)
        return cls(trust_config, tuple(prefixes))

    def allows(self, dotted: str) -> bool:
        """Whether the module or import path ``dotted`` (``pkg.mod``, ``pkg.mod.Name``, ``pkg.mod:Name``)
        lies under an allowed prefix (at a dot: ``mypkg`` allows ``mypkg.x``, not ``mypkg_x``)."""
        if self.trust:
            return True
        target = dotted.replace(":", ".")
        return any(target == p or target.startswith(p + ".") for p in self.allow)


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _top_package(path: str) -> str:
    return path.replace(":", ".").split(".")[0]


def _refused_import(path: str, value: str, kind: str, policy: _ImportPolicy) -> ConfigError:
    """The error for an import path (or ``imports:`` entry) the caller did not opt in to."""
    package = _top_package(value)
    if policy.allow:
        why = (f"it is not under the allowed import prefixes ({', '.join(map(repr, policy.allow))}), and a config "
               f"imports nothing else")
    else:
        why = ("a config is data, so it imports nothing unless you opt in (importing a module runs its code, and "
               "a config or a run folder may come from someone else)")
    if kind == "module":
        fix = (f"if you trust this config, pass --allow-import {package} (or --trust-config; Python: "
               f"allow_imports=[{package!r}] or trust_config=True), or import the module yourself before the call")
    else:
        fix = (f"register it in your own code (flaxlight.registry.register_{kind}('my_name')) and write its "
               f"registered name here, or, if you trust this config, pass --allow-import {package} (or "
               f"--trust-config; Python: allow_imports=[{package!r}] or trust_config=True)")
    if (name := registry.REGISTRIES[kind].name_of(value) if kind in registry.REGISTRIES else None) is not None:
        fix = f"it is registered as {name!r}: use `{name}` ({path}: {name}), which needs no opt-in"
    what = "was not imported" if kind == "module" else "is an import path, which was not imported"
    return ConfigError(f"{path}: {value!r} {what}: {why}. Fix: {fix}.", key=path)


def _import_paths(cfg: "Config") -> list[tuple[str, str, str]]:
    """``(key, value, kind)`` of every import the config asks for: ``imports:`` and import-path names."""
    found = [(f"imports[{i}]", module, "module") for i, module in enumerate(cfg.imports)]
    names = [("trainer.name", cfg.trainer.name, "trainer"), ("model.name", cfg.model.name, "model"),
             ("data.name", cfg.data.name, "dataset")]
    names += [(f"callbacks[{i}].name", item.name, "callback") for i, item in enumerate(cfg.callbacks)]
    names += [(f"loggers[{i}].name", item.name, "logger") for i, item in enumerate(cfg.loggers)]
    found += [(key, value, kind) for key, value, kind in names
              if value is not None and registry.is_import_path(value) and not _is_own_class(value, kind)]
    return found


def _is_own_class(name: str, kind: str) -> bool:
    """flaxlight's own trainer / model / callback / logger classes named by import path, as
    LightningCLI's ``class_path: lightning.pytorch.callbacks.EarlyStopping``: no opt-in needed
    (flaxlight is imported already; the resolved object is still checked to be of the kind)."""
    return kind in ("trainer", "model", "callback", "logger") and name.replace(":", ".").startswith("flaxlight.")


def _check_import_policy(cfg: "Config", policy: _ImportPolicy) -> list[tuple[str, str, str]]:
    """Refuse, before anything is imported, every import the caller did not opt in to."""
    wanted = _import_paths(cfg)
    for key, value, kind in wanted:
        if kind == "module" and not (isinstance(value, str) and _MODULE_NAME.fullmatch(value)):
            raise ConfigError(f"{key}: {value!r} is not a module name; write it as 'package.module'.")
        if not policy.allows(value):
            raise _refused_import(key, value, kind, policy)
    return wanted


# ---------------------------------------------------------------------------------------- YAML
def _yaml_dump(data: Any) -> str:
    return configyaml.dump(data)


def _yaml_load(text: str, where: str) -> Any:
    try:
        return configyaml.load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {configyaml.problem(exc)}") from None


# ---------------------------------------------------------------------------------------- schema
class _Settings:
    """A config section whose attributes are its settings only: assigning any other name (a typo,
    ``cfg.trainer.max_epoch = 1``) fails as an unknown key of a config file does, with the closest
    valid name or the place where that key belongs, instead of being ignored."""

    def __setattr__(self, name: str, value: Any) -> None:
        fields = [name for name, f in _ordered_fields(type(self)).items() if f.init or f.metadata.get("inline")]
        if name not in fields and not name.startswith("__"):
            raise AttributeError(_unknown_attribute(self, name, fields))
        object.__setattr__(self, name, value)


def _section_of(obj: Any) -> str:
    """The section's path in a config, as errors write it (``trainer``, ``callbacks[i]``)."""
    return {"Config": "", "TrainerConfig": "trainer", "ModelConfig": "model", "DataConfig": "data",
            "CallbackConfig": "callbacks[i]", "LoggerConfig": "loggers[i]", "OptimizerConfig": "optimizer",
            "LoggerParams": "trainer.logger_params"}.get(type(obj).__name__, type(obj).__name__)


def _unknown_attribute(obj: Any, name: str, fields: Sequence[str]) -> str:
    """The refusal of a setting ``name`` that ``obj`` (a config section) does not have."""
    path, fields = _section_of(obj), [f for f in fields if f != "own_args"]
    free_form, kind, ignore = _FREE_FORM.get(type(obj).__name__, (None, None, ()))
    hint = _lightning_hint(name, path)
    if not hint and kind is not None and name in _takes(kind, obj.name, ignore):
        hint = f" It is an argument of {obj.name!r}: it belongs in {free_form}: .{free_form}[{name!r}] = ..."
    hint = hint or _elsewhere_hint(name, path) or _suggest(name, fields, path)
    if not hint and isinstance(obj, TrainerConfig):
        hint = f" A trainer class's own arguments go in own_args: .own_args[{name!r}] = ..."
    return (f"{type(obj).__name__} has no setting {name!r} ({_join(path, name)} in a config).{hint} "
            f"Its settings: {', '.join(fields)}.")


# A section's free-form mapping of its target's arguments: (field, registry kind, keys it takes not).
_FREE_FORM = {"ModelConfig": ("hparams", "model", ("parent", "name", "rngs")),
              "DataConfig": ("kwargs", "dataset", ("batch_size", "eval_batch_size", "seed")),
              "CallbackConfig": ("args", "callback", ()), "LoggerConfig": ("args", "logger", ())}


@dataclasses.dataclass(kw_only=True)
class TrainerConfig(_Settings, TrainerOptions):
    """The trainer class and its settings: the constructor's arguments and every
    :class:`~flaxlight.TrainerOptions` field (``monitor``, ``mode``, ``max_steps``, ...).

    Attributes:
        name: the trainer class (it defines the loss): a registered name (``regression``,
            ``classification``) or an import path to a :class:`TrainerModule` subclass.
        seed: model initialisation and dropout seed.
        max_epochs: epochs to train (``train_model(num_epochs=...)``; ``num_epochs`` is accepted too).
        enable_progress_bar, debug, check_val_every_n_epoch: as the constructor's arguments.
        mesh: the device mesh's shape, e.g. ``{data: 2, model: 2}`` (the constructor's ``mesh=``).
        logger_params: see :class:`LoggerParams`.
        own_args: the trainer class's own arguments, the keywords its ``__init__`` (or a base's)
            declares beyond TrainerModule's (``def __init__(self, w_target=1.0, **kwargs)``). In the
            YAML they stand in the section itself (``trainer: {name: multitask, w_target: 3.0}``,
            ``trainer.w_target=3.0``); they are checked against the class when it is resolved.
    """

    name: str
    own_args: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, metadata={"inline": True})
    seed: int = 42
    max_epochs: int = 500
    enable_progress_bar: bool = True
    debug: bool = False
    check_val_every_n_epoch: int | None = 1
    mesh: dict[str, int] | None = None
    logger_params: LoggerParams = dataclasses.field(default_factory=LoggerParams)

    def __post_init__(self):
        super().__post_init__()
        for key in ("max_epochs", "check_val_every_n_epoch"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive int, got {getattr(self, key)!r}.")
        if self.max_time is not None:
            parse_duration(self.max_time)


@dataclasses.dataclass(kw_only=True)
class ModelConfig(_Settings):
    """The model: ``name`` is a registered name (``mlp_classifier``) or an import path
    (``mypkg.models.ResNet``); ``hparams`` are its constructor arguments (checked against it).
    ``name: null`` for a trainer that picks its model itself and takes the hparams by name
    (the seed's ``MyTrainer(hidden_dims, output_dim, **kwargs)`` pattern)."""

    name: str | None
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class DataConfig(_Settings):
    """The data: ``name`` is a dataset factory (registered name or import path) returning
    ``(train_loader, val_loader, test_loader)``; it is called with ``batch_size``,
    ``eval_batch_size`` (None: ``batch_size``), ``seed`` and ``kwargs``."""

    name: str
    batch_size: int = 64
    eval_batch_size: int | None = None
    seed: int = 0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for key, least in (("batch_size", 1), ("eval_batch_size", 1), ("seed", 0)):
            value = getattr(self, key)
            if isinstance(value, int) and value < least:
                raise ValueError(f"{key} must be an int >= {least}{' or null' * (key == 'eval_batch_size')}, "
                                 f"got {value!r}.")


@dataclasses.dataclass(kw_only=True)
class CallbackConfig(_Settings):
    """One callback: ``name`` (registered, e.g. ``early_stopping``, or an import path) and the
    constructor's keyword ``args``. In YAML a bare name is short for ``{name: ...}``."""

    name: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class LoggerConfig(_Settings):
    """One extra logger object: ``name`` (``tensorboard``, ``wandb``, ``mlflow``, ``csv`` or an import
    path to a :class:`flaxlight.loggers.Logger`) and constructor ``args``. Its ``log_dir`` /
    ``save_dir`` default to the run's log dir, its project / run name to ``logger_params``'."""

    name: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class Config(_Settings):
    """A whole run. ``imports``: modules imported first (to register your components);
    ``tune``: the search settings of ``flaxlight tune`` (free-form here, read by flaxlight.tune)."""

    imports: list[str] = dataclasses.field(default_factory=list)
    trainer: TrainerConfig
    model: ModelConfig
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig
    callbacks: list[CallbackConfig] = dataclasses.field(default_factory=list)
    loggers: list[LoggerConfig] = dataclasses.field(default_factory=list)
    tune: dict[str, Any] | None = None


# Other spellings accepted on load (key -> field); the saved config uses the field's name.
# ``class_path`` / ``init_args`` are LightningCLI's; a trainer's ``init_args`` are its section's own keys.
_ALIASES: dict[type, dict[str, str]] = {
    TrainerConfig: {"num_epochs": "max_epochs", "class_path": "name"},
    ModelConfig: {"class_path": "name", "init_args": "hparams"},
    DataConfig: {"class_path": "name", "init_args": "kwargs"},
    CallbackConfig: {"class_path": "name", "init_args": "args"},
    LoggerConfig: {"class_path": "name", "init_args": "args"},
}
_OPTIMIZER_ALIASES = {"warmup": "warmup_steps"}  # the seed's key, resolved by OptimizerConfig.from_dict
# A bare string stands for {"name": ...} in these list items.
_NAME_SHORTHAND = (CallbackConfig, LoggerConfig)
_SECTIONS = {"trainer": TrainerConfig, "model": ModelConfig, "data": DataConfig}
_LIST_SECTIONS = {"callbacks": CallbackConfig, "loggers": LoggerConfig}
# ``init_args`` keys that are the section's own settings (None: all of them; a trainer has no other).
_LIFTED_INIT_ARGS: dict[type, tuple[str, ...] | None] = {
    TrainerConfig: None, DataConfig: ("batch_size", "eval_batch_size", "seed")}


def _renamed(data: Mapping, aliases: Mapping[str, str], path: str, section_keys: Iterable[str] | None = ()) -> dict:
    """``data`` with each alias key spelled as its field; the ``init_args`` keys among
    ``section_keys`` (all of them when None) are moved into the section (a trainer's settings, a
    datamodule's ``batch_size``). A key set both ways in ``data`` is an error that names both."""
    data = dict(data)
    if section_keys != () and isinstance(data.get("init_args"), Mapping):
        init_args = dict(data.pop("init_args"))
        lifted = {k: init_args.pop(k) for k in list(init_args) if section_keys is None or k in section_keys}
        both = sorted(set(data) & set(lifted))
        if both:
            raise ConfigError(f"{_join(path, both[0])!r} is set both in {path} and in {_join(path, 'init_args')}; "
                              f"keep one.")
        data.update(lifted)
        if section_keys is not None:
            data["init_args"] = init_args
    for alias, key in aliases.items():
        if alias in data:
            if key in data:
                raise ConfigError(f"{_join(path, alias)!r} and {_join(path, key)!r} are the same setting; keep "
                                  f"{_join(path, key)!r}.")
            data[key] = data.pop(alias)
    return data


def _canonical(data: Mapping[str, Any]) -> dict[str, Any]:
    """One source's sections with every key in its saved spelling (``class_path`` -> ``name``,
    ``init_args`` -> ``hparams`` / ``kwargs`` / ``args``, ``num_epochs`` -> ``max_epochs``,
    ``warmup`` -> ``warmup_steps``), so that later files and overrides replace earlier values
    whichever way each spelled them."""
    out = dict(data)
    for section, cls in _SECTIONS.items():
        if isinstance(out.get(section), Mapping):
            out[section] = _renamed(out[section], _ALIASES[cls], section, _LIFTED_INIT_ARGS.get(cls, ()))
    for section, cls in _LIST_SECTIONS.items():
        if isinstance(out.get(section), list):
            out[section] = [_renamed(item, _ALIASES[cls], f"{section}[{i}]") if isinstance(item, Mapping) else item
                             for i, item in enumerate(out[section])]
    if isinstance(out.get("optimizer"), Mapping):
        out["optimizer"] = _renamed(out["optimizer"], _OPTIMIZER_ALIASES, "optimizer")
    return out


def _canonical_override(key: str, value: Any) -> list[tuple[str, Any]]:
    """An override in its saved spelling, read as a file's section would be (see :func:`_canonical`):
    the dotted key's aliases renamed, a whole section, list or list item as value canonicalised, and
    the trainer's or data's ``init_args`` (a mapping, or one of its keys) set as the section keys it
    stands for (``data.init_args={batch_size: 16, num_val: 100}``: ``data.batch_size``, ``data.kwargs``)."""
    parts = key.split(".")
    at = 2 if parts[0] in _LIST_SECTIONS and len(parts) > 1 and parts[1].isdigit() else 1
    cls = _SECTIONS.get(parts[0]) or _LIST_SECTIONS.get(parts[0])
    aliases = _ALIASES[cls] if cls is not None else _OPTIMIZER_ALIASES if parts[0] == "optimizer" else {}
    if len(parts) == 1:
        return [(key, _canonical({key: value})[key])]
    if len(parts) == at:  # a list item: callbacks.0={class_path: ..., init_args: ...}
        return [(key, _renamed(value, aliases, f"{parts[0]}[{parts[1]}]") if isinstance(value, Mapping) else value)]
    lifted = _LIFTED_INIT_ARGS.get(cls, ())
    if parts[at] == "init_args" and lifted != ():
        if len(parts) == at + 1 and isinstance(value, Mapping):
            section = _renamed({"init_args": value}, aliases, parts[0], lifted)
            return [(f"{parts[0]}.{k}", v) for k, v in section.items()]
        if len(parts) > at + 1 and (lifted is None or parts[at + 1] in lifted):
            del parts[at]
    parts[at] = aliases.get(parts[at], parts[at])
    return [(".".join(parts), value)]


# ---------------------------------------------------------------------------------------- checking
def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _got(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "null"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, tuple, collections.abc.Sequence) or tp in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return f"a list of {_type_name(inner[0])}" if inner and inner[0] is not Any else "a list"
    if origin in (dict, collections.abc.Mapping) or tp in (dict, collections.abc.Mapping):
        return "a mapping"
    if origin is collections.abc.Callable or tp is collections.abc.Callable:
        return "a function"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _type_error(path: str, tp: Any, value: Any) -> ConfigError:
    hint = ""
    takes_text = tp is str or (typing.get_origin(tp) in (Union, types.UnionType) and str in typing.get_args(tp))
    if takes_text and isinstance(value, (bool, float, datetime.date)):  # a text that YAML read as something else
        kind = "a boolean" if isinstance(value, bool) else "a number" if isinstance(value, float) else "a date"
        hint = (f" YAML reads that value as {kind}: quote it to give it as text ({path.rsplit('.', 1)[-1]}: \"...\" "
                f"in a file, '{path}=\"...\"' as an override).")
    elif path.endswith("val_check_interval") and isinstance(value, float):  # Lightning's fraction of an epoch
        hint = " " + fraction_of_an_epoch_message(value).replace("val_check_interval=", f"{path}=")
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {_got(value)}.{hint}", key=path)


def _convert(value: Any, tp: Any, path: str, *, schema: bool = False) -> Any:
    """``value`` checked against the annotation ``tp`` (dataclasses built, lists of them too).
    ``schema``: a field of the config's own schema, where a whole number given for a ``str``
    field is its text (``run_name: 123`` is ``"123"``, as jsonargparse reads it); a free-form
    argument is passed as it is, so there it is an error."""
    if tp is Any or tp is object:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, str) and tp in _NAME_SHORTHAND:
            value = {"name": value}
        return _build(tp, value, path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _type_error(path, tp, value)
        arms = [a for a in args if a is not type(None)]
        for arm in arms:
            try:
                return _convert(value, arm, path, schema=schema and len(arms) == 1)  # str | None, not bool | str
            except ConfigError as exc:
                if len(arms) == 1 and not str(exc).startswith(f"{path}: expected"):
                    raise  # Optional[X] failing deeper (inside a list or section): that message
        raise _type_error(path, tp, value)
    if tp is type(None):
        if value is not None:
            raise _type_error(path, tp, value)
        return None
    if origin is Literal:
        if value not in args:
            raise _type_error(path, tp, value)
        return value
    if tp in (bool, int, float, str):
        return _convert_scalar(value, tp, path, schema)
    if origin in (list, tuple, collections.abc.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, tp, value)
        inner = [a for a in args if a is not Ellipsis]
        item_tp = inner[0] if len(inner) == 1 or (origin is tuple and Ellipsis in args) else Any
        items = [_convert(v, item_tp, _join(path, i), schema=schema) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin in (dict, collections.abc.Mapping) or tp in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise _type_error(path, tp, value)
        key_tp, value_tp = args if len(args) == 2 else (Any, Any)
        return {_convert_key(k, key_tp, path): _convert(v, value_tp, _join(path, k), schema=schema)
                for k, v in value.items()}
    if origin is collections.abc.Callable or tp is collections.abc.Callable:
        if not callable(value):
            raise _type_error(path, tp, value)
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise _type_error(path, tp, value)
    return value


def _convert_scalar(value: Any, tp: type, path: str, schema: bool) -> Any:
    """``value`` as a bool, int, float or str (see :func:`_convert`)."""
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if tp is bool and isinstance(value, (bool, np.bool_)):
        return bool(value)
    if tp is int and number and isinstance(value, (int, np.integer)):
        return int(value)
    if tp is float and number:
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    if tp is str and schema and number and isinstance(value, int):
        return str(value)  # a whole number for a str field of the schema is its text
    raise _type_error(path, tp, value)


def _convert_key(key: Any, tp: Any, path: str) -> Any:
    """A mapping's key checked against ``tp`` (``boundaries_and_scales`` keys are steps: int; a
    dotted override ``optimizer.boundaries_and_scales.200=0.5`` gives the key as the text "200")."""
    if tp is int and isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    try:
        return _convert(key, tp, path)
    except ConfigError:
        raise ConfigError(f"{path}: every key must be {_type_name(tp)}, got {_got(key)}.", key=path) from None


_HINTS: dict[Any, dict[str, Any]] = {}


def _hints(obj: Any) -> dict[str, Any]:
    """Evaluated annotations of a class or function ({} where they cannot be evaluated)."""
    if obj not in _HINTS:
        try:
            _HINTS[obj] = typing.get_type_hints(obj)
        except Exception:  # noqa: BLE001 - exotic or forward-referenced annotations: no type checks
            _HINTS[obj] = {}
    return _HINTS[obj]


def _suggest(key: str, valid: Iterable[str], path: str) -> str:
    valid = list(valid)
    same = [v for v in valid if v.lower() == str(key).lower()]
    close = same or difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    return f" Did you mean {_join(path, close[0])!r}?" if close else ""


# Lightning's and LightningCLI's keys that are spelled otherwise here (by their full path).
_LIGHTNING_KEYS = {
    "trainer.accumulate_grad_batches": "optimizer.accumulate_grad_batches",
    "trainer.gradient_clip_val": "optimizer.gradient_clip", "trainer.precision": "optimizer.precision",
    "trainer.callbacks": "the top-level callbacks: list",
    "trainer.logger": "trainer.logger_params.logger_type or the top-level loggers: list",
    "trainer.default_root_dir": "trainer.logger_params.base_log_dir",
    "seed_everything": "trainer.seed (initialisation, dropout) and data.seed (the data's order)",
    "optimizer.class_path": "optimizer.optimizer, an optax optimizer's name (adamw, sgd, ...)",
    "optimizer.init_args": "the optimizer section's own keys (optimizer.lr, optimizer.weight_decay, optax's b1, "
                           "b2, ...)",
}


def _unknown_key(key: Any, valid: Sequence[str], path: str, what: str) -> ConfigError:
    hint = _lightning_hint(key, path) or _elsewhere_hint(key, path) or _suggest(str(key), valid, path)
    return ConfigError(f"Unknown key {_join(path, key)!r}.{hint} Valid keys of {what}: {', '.join(valid)}.",
                       key=_join(path, key))


def _lightning_hint(key: Any, path: str) -> str:
    elsewhere = _LIGHTNING_KEYS.get(_join(path, key))
    return f" In flaxlight that is {elsewhere}." if elsewhere else ""


# The config being loaded or resolved (its raw data or the Config), for hints that need its names:
# which model, dataset and callbacks take a misplaced key (``model.hidden_dims``).
_ROOT: contextvars.ContextVar[Any] = contextvars.ContextVar("flaxlight_config_root", default=None)

# TrainerModule's constructor arguments, which a config gives in other sections.
_CONSTRUCTOR_KEYS = {"model_hparams": "model.hparams", "model_class": "model.name",
                     "optimizer_hparams": "optimizer", "exmp_input": "data (the first batch's input)"}
_SAID_TOO = {"trainer.logger_params.log_dir": " (--log-dir on the command line)"}


def _schema_paths(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config schema (``optimizer.lr``, ``trainer.logger_params.log_dir``,
    ``callbacks[i].args``), sections and their keys."""
    paths = []
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init or field.name == "optimizer_kwargs":
            continue
        path = _join(prefix, field.name)
        paths.append(path)
        tp = hints.get(field.name)
        arms = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (
            Union, types.UnionType) else [tp]
        for arm in arms:
            if dataclasses.is_dataclass(arm):
                paths += _schema_paths(arm, path)
            elif typing.get_origin(arm) is list and dataclasses.is_dataclass(typing.get_args(arm)[0]):
                paths += _schema_paths(typing.get_args(arm)[0], path + "[i]")
    return paths


def _names_of(root: Any) -> dict[str, Any]:
    """The names a config (its raw data or a Config) gives: ``{"trainer": ..., "model": ...,
    "data": ..., "optimizer": ..., "callbacks": [...], "loggers": [...]}`` (None where not given)."""
    def name(section: Any, key: str = "name") -> Any:
        if isinstance(section, str):
            return section if key == "name" else None
        return section.get(key) if isinstance(section, Mapping) else getattr(section, key, None)

    get = (lambda key: root.get(key)) if isinstance(root, Mapping) else (lambda key: getattr(root, key, None))
    items = lambda key: get(key) if isinstance(get(key), (list, tuple)) else []  # noqa: E731
    return {"trainer": name(get("trainer")), "model": name(get("model")), "data": name(get("data")),
            "optimizer": name(get("optimizer"), "optimizer") or "adam",
            "callbacks": [name(item) for item in items("callbacks")],
            "loggers": [name(item) for item in items("loggers")]}


def _takes(kind: str, name: Any, ignore: Iterable[str] = ()) -> set[str]:
    """The keywords the registered ``name`` of ``kind`` declares (nothing is imported for it)."""
    obj = registry.REGISTRIES[kind].loaded(name) if isinstance(name, str) else None
    return set(registry.explicit_parameters(obj)) - set(ignore) if callable(obj) else set()


def _belongs_at(key: Any, path: str) -> list[str]:
    """The other places of the config where ``key`` (unknown at ``path``) is a valid key: the
    schema's (``lr`` -> ``optimizer.lr``), then the arguments of what the config names (the model's
    ``model.hparams``, the dataset's ``data.kwargs``, a callback's ``callbacks[i].args``, the
    optimizer's and the trainer class's own)."""
    key, here = str(key), _join(path, key)
    if key in ("name", "args"):
        return []
    found = [p for p in _schema_paths() if p.rsplit(".", 1)[-1] == key]
    if key in _CONSTRUCTOR_KEYS:
        found.append(_CONSTRUCTOR_KEYS[key])
    root = _ROOT.get()
    if root is not None:
        names = _names_of(root)
        if key in _takes("trainer", names["trainer"]) - set(_TRAINER_OWN):
            found.append(_join("trainer", key))
        if key in _takes("model", names["model"], ("parent", "name", "rngs")):
            found.append(_join("model.hparams", key))
        if key in _takes("dataset", names["data"], _DATA_FIELDS):
            found.append(_join("data.kwargs", key))
        params = _optimizer_parameters(names["optimizer"]) or {}
        if key in params and key not in ("learning_rate", "weight_decay", "mask"):
            found.append(_join("optimizer", key))
        for section, kind in (("callbacks", "callback"), ("loggers", "logger")):
            found += [f"{section}[{i}].args.{key}" for i, name in enumerate(names[section])
                      if key in _takes(kind, name)]
    index = re.match(r"(callbacks|loggers)\[(\d+)\]", here)
    found = [p.replace("[i]", f"[{index.group(2)}]") if index and p.startswith(index.group(1)) else p for p in found]
    return list(dict.fromkeys(p for p in found if p != here))


def _elsewhere_hint(key: Any, path: str) -> str:
    """`` It belongs at 'optimizer.lr'.`` for a key that is valid at another place of the config ("" if none)."""
    places = _belongs_at(key, path)
    if not places:
        return ""
    said = [f"{p!r}{_SAID_TOO.get(p, '')}" for p in places[:3]]
    return f" It belongs at {' or '.join(said)}."


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _ordered_fields(cls: type) -> dict[str, dataclasses.Field]:
    """A config dataclass's fields; a subclass's own first (the trainer's, then TrainerOptions')."""
    fields = dataclasses.fields(cls)
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    ordered = [f for f in fields if f.name not in inherited] + [f for f in fields if f.name in inherited]
    return {f.name: f for f in ordered}


def _build(cls: type, data: Any, path: str) -> Any:
    """An instance of the config dataclass ``cls`` from ``data`` (a mapping), checked strictly."""
    if cls is Config and _ROOT.get() is None:  # the whole config: its names serve the hints of misplaced keys
        token = _ROOT.set(data)
        try:
            return _build(cls, data, path)
        finally:
            _ROOT.reset(token)
    what = path or "the config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what}: expected a mapping of keys to values ({cls.__name__}), got {_got(data)}.")
    if cls is OptimizerConfig:
        return _build_optimizer(data, path)
    fields = {name: f for name, f in _ordered_fields(cls).items() if f.init}
    inline = _inline_field(cls)
    data = _renamed(data, _ALIASES.get(cls, {}), path, _LIFTED_INIT_ARGS.get(cls, ()))
    for key in data:
        if key not in fields and inline is None:
            raise _unknown_key(key, list(fields), path, what)
    rest = {key: data[key] for key in data if key not in fields}  # checked when the class is resolved
    data = {key: value for key, value in data.items() if key in fields}
    missing = [name for name, f in fields.items() if _required(f) and name not in data]
    if missing:
        raise ConfigError(
            f"Missing required key {_join(path, missing[0])!r}"
            f"{' (also ' + ', '.join(repr(_join(path, m)) for m in missing[1:]) + ')' if missing[1:] else ''}: "
            f"{_REQUIRED_HELP.get(_join(path, missing[0]), 'add it to the config')}."
        )
    hints = _hints(cls)
    kwargs = {name: _convert(value, hints.get(name, Any), _join(path, name), schema=True)
              for name, value in data.items()}
    try:
        built = cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{what}: {exc}", key=_checked_key(path, exc, fields)) from None
    if inline is not None:
        setattr(built, inline, rest)
    return built


def _inline_field(cls: type) -> str | None:
    """The field of ``cls`` whose keys stand in the section itself (``TrainerConfig.own_args``), or None."""
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get("inline")), None)


def _checked_key(path: str, exc: Exception, fields: Iterable[str]) -> str:
    """The setting a section's own check names first (``mode must be 'min' or 'max'``: ``trainer.mode``), else the section."""
    first = str(exc).split(" ", 1)[0]
    return _join(path, first) if first in set(fields) else path


_REQUIRED_HELP = {
    "trainer": "the trainer section, at least `trainer: {name: ...}`",
    "model": "the model section, at least `model: {name: ...}`",
    "data": "the data section, at least `data: {name: ...}`",
    "trainer.name": "the trainer class that defines the loss, e.g. `regression`, `classification` or "
                    "`mypkg.trainers.MyTrainer`",
    "model.name": "the model, e.g. `mlp_classifier` or `mypkg.models.ResNet` (null when the trainer picks it)",
    "data.name": "the dataset factory, e.g. `digits`, `sine` or `mypkg.data.make_loaders`",
}


def _optimizer_parameters(name: Any) -> Mapping[str, inspect.Parameter] | None:
    import optax

    factory = getattr(optax, name.lower(), None) if isinstance(name, str) else None
    if not callable(factory):
        return None  # OptimizerConfig names the valid optimizers
    return inspect.signature(factory).parameters


def _optional_number(annotation: Any) -> bool:
    """Whether an optax annotation is a number or None only (``momentum: float | None``), not
    also a schedule, a dtype or anything else."""
    kinds = typing.get_args(annotation)
    return bool({int, float} & set(kinds)) and all(
        kind is type(None) or (isinstance(kind, type) and not issubclass(kind, str)) for kind in kinds)


def _optax_value(value: Any, parameter: inspect.Parameter, path: str) -> Any:
    """An optax argument's value, checked against the kind of its default (a number, a bool) or,
    for a default of None, its annotation (``momentum: float | None``)."""
    default = parameter.default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, bool):
        ok, wanted = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok, wanted = number, "a number"
    elif default is None and _optional_number(parameter.annotation):
        ok, wanted = value is None or number, "a number or null"
    else:
        return value
    if not ok:
        raise ConfigError(f"{path}: expected {wanted} (optax's default is {default!r}), got {_got(value)}.", key=path)
    return value


def _build_optimizer(data: Mapping, path: str) -> OptimizerConfig:
    """The optimizer section: ``OptimizerConfig`` keys, the seed's aliases, and the keyword
    arguments of the chosen optax optimizer (``b1``, ``momentum``, ...) in one mapping."""
    fields = {f.name: f for f in dataclasses.fields(OptimizerConfig) if f.init}
    own = [name for name in fields if name != "optimizer_kwargs"]
    hints = _hints(OptimizerConfig)
    name = data.get("optimizer", fields["optimizer"].default)
    optax_params = _optimizer_parameters(name)
    converted: dict[str, Any] = {}
    for key, value in data.items():
        field_name = _OPTIMIZER_ALIASES.get(key, key)
        if field_name in fields:
            converted[key] = _convert(value, hints.get(field_name, Any), _join(path, key), schema=True)
        elif optax_params is None or key in optax_params:
            converted[key] = value if optax_params is None else _optax_value(value, optax_params[key], _join(path, key))
        else:
            theirs = [k for k in optax_params if k not in ("learning_rate", "weight_decay", "mask")]
            hint = _lightning_hint(key, path) or _elsewhere_hint(key, path or "optimizer") or suggest_key(
                str(key), own + list(_OPTIMIZER_ALIASES) + theirs, value, path)
            raise ConfigError(
                f"Unknown key {_join(path, key)!r}.{hint} "
                f"Valid keys of {path or 'optimizer'}: {', '.join(own)}; optax.{name.lower()} also takes: "
                f"{', '.join(theirs) or '(nothing else)'}.", key=_join(path, key)
            )
    try:
        return OptimizerConfig.from_dict(converted)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path or 'optimizer'}: {exc}", key=_checked_key(path or "optimizer", exc, fields)) from None


# ---------------------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[str, Any]:
    """``"optimizer.lr=3e-4"`` -> ``("optimizer.lr", 0.0003)``; the value is read as YAML."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"Override {text!r} is not key=value (e.g. optimizer.lr=3e-4 or "
                          f"model.hparams.hidden_dims=[256,256]).")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"Override {text!r} has an empty key; write section.key=value.")
    return key, _yaml_load(raw, f"The value of override {text!r}")


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``dotted.key=value`` set (list items by index: ``callbacks.0.args.x=1``)."""
    return _apply_overrides(data, overrides, _Sources())


def _apply_overrides(data: Mapping[str, Any], overrides: Iterable[str], sources: "_Sources") -> dict[str, Any]:
    import copy

    data = _canonical(copy.deepcopy(dict(data or {})))
    for text in overrides:
        key, value = parse_override(text)
        try:
            pairs = _canonical_override(key, value)
        except ConfigError as exc:  # a key set both ways in the value
            raise ConfigError(f"Override {text!r}: {exc}") from None
        for key, value in pairs:
            _set_override(data, key, value, text)
            sources.replaced(key, value, f"by the override {text!r}")
    return data


class _Sources:
    """Which config file or override set each setting, for errors that name it (``It was set in
    b.yaml.``). ``by_path``: a setting's path (``("callbacks", 0, "args")``) -> where it was set;
    a mapping's keys are recorded one by one (later files merge into it), anything else whole."""

    def __init__(self):
        self.by_path: dict[tuple, str] = {}

    def merged(self, data: Mapping[str, Any], origin: str, at: tuple = ()) -> None:
        """A file's ``data`` merged over the earlier ones (:func:`_merged`)."""
        for key, value in data.items():
            if isinstance(value, Mapping) and value:
                self.by_path.pop(at + (key,), None)
                self.merged(value, origin, at + (key,))
            else:
                self.replaced(at + (key,), value, origin)

    def replaced(self, key: str | tuple, value: Any, origin: str) -> None:
        """``key`` set whole to ``value`` (an override, a file's list or scalar)."""
        at = key if isinstance(key, tuple) else _path_parts(key)
        self.by_path = {path: o for path, o in self.by_path.items() if path[:len(at)] != at}
        if isinstance(value, Mapping) and value:
            self.merged(value, origin, at)
        else:
            self.by_path[at] = origin

    def note(self, key: str | None) -> str:
        """`` It was set in b.yaml.`` for an error about ``key``, when more than one source set the config."""
        if key is None or len(set(self.by_path.values())) < 2:
            return ""
        at = _path_parts(key)
        for n in range(len(at), 0, -1):
            if at[:n] in self.by_path:
                return f" It was set {self.by_path[at[:n]]}."
        under = {origin for path, origin in self.by_path.items() if path[:len(at)] == at}
        return f" It was set {under.pop()}." if len(under) == 1 else ""


def _path_parts(key: str) -> tuple:
    """``"callbacks[0].args.x"`` or ``"callbacks.0.args.x"`` -> ``("callbacks", 0, "args", "x")``."""
    return tuple(int(part) if part.isdigit() else part for part in re.findall(r"[^.\[\]]+", key))


def _set_override(data: dict[str, Any], key: str, value: Any, text: str) -> None:
    """Set the canonical dotted ``key`` of the override ``text`` in ``data`` (list items by index)."""
    node: Any = data
    parts = key.split(".")
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[:depth]) or "the config"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise _not_an_index(text, where, node, part)
            index = int(part)
            if last:
                node[index:index + 1] = [value]
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    if parts[depth + 1].isdigit():
                        raise ConfigError(f"Override {text!r}: {'.'.join(parts[:depth + 1])} has no items to index; "
                                          f"give the whole list ({'.'.join(parts[:depth + 1])}=[...]) or add it "
                                          f"to the config file.")
                    node[part] = {}
                node = node[part]
        else:
            raise ConfigError(f"Override {text!r}: {where} is {_got(node)}, not a section with keys.")


def _not_an_index(text: str, where: str, items: list, part: str) -> ConfigError:
    """An override's list index out of range: the list's length, its indices, and how to change its length."""
    if items:
        valid = "index 0" if len(items) == 1 else f"indices 0 to {len(items) - 1}"
        what = f"a list of {len(items)} item{'s' * (len(items) != 1)} ({valid})"
    else:
        what = "an empty list"
    return ConfigError(f"Override {text!r}: {where} is {what}; {part!r} is not an index into it. To add or remove "
                       f"items, give the whole list: {where}=[...].")


# ---------------------------------------------------------------------------------------- load / save
def load_config(source: str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, Any] | Config | None,
                overrides: Iterable[str] = (), *, check: bool = True, trust_config: bool = False,
                allow_imports: Iterable[str] = ()) -> Config:
    """Read a YAML file (or take a dict / Config), apply ``key=value`` overrides, check, return a Config.

    A list of YAML files is merged in order (LightningCLI's repeated ``--config``): a later file's
    keys replace the earlier's, sections (mappings) merge key by key, lists are replaced whole.

    ``check=True`` also resolves every name and checks the free-form dicts against their targets'
    signatures (see :func:`resolve_config`); ``check=False`` only checks the schema (the trainer's
    own arguments against its class only when that is registered and at hand), and imports nothing
    whatever the opt-in. Import paths and ``imports:`` are refused unless
    ``allow_imports=["mypkg", ...]`` (module prefixes) or ``trust_config=True`` allows them.
    """
    policy = _ImportPolicy.of(trust_config, allow_imports)
    where, sources = "the config", _Sources()
    if isinstance(source, Config):
        data = config_to_dict(source)
    elif isinstance(source, Mapping):
        data = source  # apply_overrides reads it in the saved spelling
    elif source is None:
        data = {}
    else:
        paths = [os.fspath(p) for p in source] if isinstance(source, (list, tuple)) else [os.fspath(source)]
        where, data = " + ".join(paths), {}
        for path in paths:
            data = _merged(data, _read_config_file(path, sources))
    overrides = list(overrides)
    data = _apply_overrides(data, overrides, sources)
    if overrides and where != "the config":
        where += " with the overrides"
    try:
        cfg = _build(Config, data, "")
        if check:
            _resolve_config(cfg, policy)
        else:  # the trainer's own keys, where its class is at hand with no import (a registered one)
            trainer_class = registry.TRAINERS.loaded(cfg.trainer.name)
            if isinstance(trainer_class, type) and issubclass(trainer_class, TrainerModule):
                token = _ROOT.set(cfg)
                try:
                    _check_own_keys(trainer_class, cfg.trainer.own_args)
                finally:
                    _ROOT.reset(token)
    except ConfigError as exc:
        note = sources.note(exc.key)
        if where != "the config" or note:
            raise ConfigError(f"{where}: {exc}{note}" if where != "the config" else f"{exc}{note}",
                              key=exc.key) from None
        raise
    return cfg


def _read_config_file(path: str, sources: _Sources | None = None) -> dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"Config file {path!r} is a folder; give a YAML file (a run's folder holds its "
                          f"config.yaml).")
    if not os.path.isfile(path):
        raise ConfigError(f"Config file {path!r} does not exist.")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"Config file {path!r} cannot be read as UTF-8 text ({type(exc).__name__}: {exc}); "
                          f"give a YAML file.") from None
    data = _yaml_load(text, path)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of sections (trainer:, model:, ...), got {_got(data)}.")
    try:
        data = _canonical(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if sources is not None:
        sources.merged(data, f"in {path}")
    return data


def _merged(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys: mappings merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in top.items():
        both_sections = isinstance(out.get(key), Mapping) and isinstance(value, Mapping)
        out[key] = _merged(out[key], value) if both_sections else value
    return out


def config_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, type, default)`` for every field of the config schema, sections expanded
    (what ``flaxlight fit --help`` lists).

    Examples:
        >>> ("trainer.max_epochs", "int", "500") in config_fields()
        True
    """
    rows = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:  # the trainer's own arguments: its class's, not the schema's
            continue
        key, hint = prefix + field.name, hints[field.name]
        if dataclasses.is_dataclass(hint):
            rows += config_fields(hint, key + ".")
            continue
        if field.default is not dataclasses.MISSING:
            default = repr(field.default) if isinstance(field.default, str) else str(field.default)
        elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = str(field.default_factory())  # type: ignore[misc]
        else:
            default = "required"
        rows.append((key, hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", ""), default))
    return rows


def _plain(value: Any, objects: bool = False) -> Any:
    """Plain YAML data: dataclasses and mappings to dicts, tuples to lists, numpy scalars to numbers;
    anything else (a function) as its name, or as it is with ``objects`` (to check a Config's values)."""
    if isinstance(value, OptimizerConfig):
        return _plain(value.to_dict(), objects)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for name, field in _ordered_fields(type(value)).items():
            plain = _plain(getattr(value, name), objects)
            out.update(plain if field.metadata.get("inline") else {name: plain})  # inline: its keys in the section
        return out
    if isinstance(value, Mapping):
        return {str(k) if not isinstance(k, (int, float, bool)) else k: _plain(v, objects) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, objects) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (str, int, float, bool)) or objects:
        return value
    if isinstance(value, type) or callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return repr(value)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (every default filled in), ``load_config``'s input form."""
    return _plain(cfg)


def check_config(cfg: Config) -> Config:
    """``cfg`` checked as :func:`load_config` checks a file (types, ranges, unknown keys): a Config
    built or changed in Python (``cfg.optimizer.lr = "3e-4"``) is refused with the key's path, so
    that the ``config.yaml`` a run saves always reads back. Returns ``cfg``. Names are resolved
    later (:func:`resolve_config`).

    Examples:
        >>> cfg = load_config({"trainer": {"name": "regression"}, "model": {"name": "mlp_regressor"},
        ...                    "data": {"name": "sine"}}, check=False)
        >>> cfg.optimizer.lr = "3e-4"
        >>> check_config(cfg)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        flaxlight.config.ConfigError: optimizer.lr: expected float or null, got str '3e-4'. ...
    """
    _refuse_stray_attributes(cfg)
    try:
        _build(Config, _plain(cfg, objects=True), "")  # objects: a schedule function stays one
    except ConfigError as exc:
        raise ConfigError(f"{exc} (A Config changed in Python is checked as a config file is: set each value "
                          f"with the type its key takes.)", key=exc.key) from None
    return cfg


def _refuse_stray_attributes(value: Any) -> None:
    """Refuse an attribute set on a config section that is not one of its settings (on the sections
    that do not refuse it themselves: the optimizer's, ``logger_params``)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            _refuse_stray_attributes(item)
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return
    fields = [name for name, f in _ordered_fields(type(value)).items() if f.init or f.metadata.get("inline")]
    for name in vars(value):
        if name not in fields:
            raise ConfigError(_unknown_attribute(value, name, fields), key=_join(_section_of(value), name))
    for name in fields:
        _refuse_stray_attributes(getattr(value, name))


def save_config(cfg: Config | Mapping[str, Any], path: str | os.PathLike) -> str:
    """Write the config as YAML (safe dump) to ``path``; returns the path. A :class:`Config` is
    checked first (:func:`check_config`), so that the file reads back."""
    path, text = os.fspath(path), _config_text(cfg)  # a Config checked before anything is written
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def _config_text(cfg: Config | Mapping[str, Any]) -> str:
    data = config_to_dict(check_config(cfg)) if isinstance(cfg, Config) else _plain(cfg)
    return ("# flaxlight run config, every default filled in. Continue this run: flaxlight fit --resume <its folder> "
            "(reads this file);\n# train it again elsewhere: flaxlight fit --config <this file> --log-dir NEW_DIR (or "
            "trainer.logger_params.log_dir=null for a new version_N folder).\n") + _yaml_dump(data)


def dump_config(cfg: Config) -> str:
    """The config as a YAML string."""
    return _yaml_dump(config_to_dict(cfg))


class SaveConfig(Callback):
    """Write the run's config as ``<log_dir>/config.yaml`` when training starts: after the run's
    folder is claimed and a resume matched its checkpoint, so a run that fails to start rewrites
    no other run's config. A resume keeps a config with other settings as ``config.1.yaml``
    (``.2``, ...), says the changes hparams.yaml's do not (a trainer's own argument it does not pass on,
    ``max_epochs``, the data's), and writes nothing when only the log_dir it filled in differs; a run from step 0
    (a new one, or one that replaced the folder's run) removes the ``config.N.yaml`` left there.
    :func:`build_run` adds one to every trainer it builds.

    Examples:
        >>> trainer = build_trainer(cfg, x0, callbacks=[SaveConfig(cfg)])  # doctest: +SKIP
    """

    def __init__(self, cfg: Config):
        self.text, self.data = _config_text(cfg), config_to_dict(cfg)
        self.started = False  # whether training started (the run's checks passed)

    def on_fit_start(self, trainer) -> None:
        self.started = True
        if not trainer.log_dir:
            return
        path = os.path.join(trainer.log_dir, CONFIG_FILE)
        stem = os.path.splitext(path)[0]
        if trainer.global_step == 0:  # not a resume: the configs there were another run's
            for name in os.listdir(trainer.log_dir):
                if re.fullmatch(re.escape(os.path.basename(stem)) + r"\.[0-9]+\.yaml", name):
                    os.remove(os.path.join(trainer.log_dir, name))
        elif os.path.isfile(path):
            changes = self._changes(path, trainer.log_dir)
            if changes == []:
                return
            kept = next(f"{stem}.{k}.yaml" for k in itertools.count(1) if not os.path.exists(f"{stem}.{k}.yaml"))
            os.rename(path, kept)
            _announce_config_changes(changes, trainer.config, os.path.basename(kept))
        with open(path, "w") as f:
            f.write(self.text)

    def _changes(self, path: str, log_dir: str) -> list[str] | None:
        """Where the config saved at ``path`` differs from these settings (its log_dir aside, see
        :func:`_settings`): ``["trainer.w_aux: 2.0 -> 3.0", ...]``; None: it is no YAML (edited by hand)."""
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                saved = _yaml_load(f.read(), path)
            except ConfigError:  # edited by hand into invalid YAML: kept as config.N.yaml
                return None
        return _config_changes(_settings(saved, log_dir), _settings(self.data, log_dir))


def _config_changes(before: Any, after: Any, key: str = "") -> list[str]:
    """``["optimizer.lr: 0.001 -> 0.01", ...]``: where two configs' plain YAML data differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [change for name in dict.fromkeys([*before, *after])
                for change in _config_changes(before.get(name), after.get(name), f"{key}.{name}" if key else str(name))]
    return [] if before == after else [f"{key}: {before!r} -> {after!r}"]


def _announce_config_changes(changes: list[str] | None, hparams: Mapping[str, Any], kept: str) -> None:
    """Say a resume's config differs from the run's: each change ``hparams.yaml`` does not record
    (a trainer's own argument it does not pass on to TrainerModule, ``max_epochs``, the data's), as
    the run's hparams changes are said (:func:`flaxlight.runfiles.write_hparams` said those already)."""
    if changes is None:
        messages.warning(f"The run's {CONFIG_FILE} is no YAML this version reads (edited by hand?): it is kept as {kept}, "
                         f"and {CONFIG_FILE} now holds this resume's settings.")
        return
    unsaid = [change for change in changes if not _recorded_in_hparams(change.split(":")[0], hparams)]
    if not unsaid:  # each one said with hparams.yaml's changes, or where the run is (a moved run's log_dir)
        messages.info(f"{CONFIG_FILE} now holds this resume's settings; the earlier config is kept as {kept}.")
        return
    # Training on for longer is what a resume is for: said as information; other changes as a warning.
    say = messages.info if all(change.split(":")[0] in _RUN_LENGTH for change in unsaid) else messages.warning
    say(f"This run's settings differ from the ones {CONFIG_FILE} recorded ({'; '.join(unsaid[:5])}"
        f"{'; ...' if len(unsaid) > 5 else ''}): they apply from now on; the earlier file is kept as {kept}.")


_RUN_LENGTH = ("trainer.max_epochs", "trainer.max_steps")


def _recorded_in_hparams(key: str, hparams: Mapping[str, Any]) -> bool:
    """Whether the config key ``key`` (``trainer.w_aux``) is a setting ``hparams.yaml`` records
    (``hparams``: the trainer's ``config``), so that a change of it is said with that file's; or
    ``trainer.logger_params``, which that file records but for where the run is, no setting."""
    section, _, rest = key.partition(".")
    name, _, inner = rest.partition(".")
    if section == "optimizer":
        return "optimizer_hparams" in hparams
    if section == "model":
        return name == "name" or (name == "hparams" and ("model_hparams" in hparams or inner.split(".")[0] in hparams))
    if section != "trainer" or name in NOT_RECORDED:
        return False
    return name in hparams or name in {f.name for f in dataclasses.fields(TrainerOptions)}


def _settings(data: Any, log_dir: str) -> Any:
    """A saved config's data less ``trainer.logger_params.log_dir`` where that is null or
    ``log_dir``: a resume fills in the run's folder, which its first start may have left null."""
    import copy

    data = copy.deepcopy(data)
    try:
        params = data["trainer"]["logger_params"]
        if params["log_dir"] is None or os.path.abspath(params["log_dir"]) == os.path.abspath(log_dir):
            del params["log_dir"]
    except (KeyError, TypeError):
        pass  # not a config flaxlight wrote: compared as it is
    return data


# ---------------------------------------------------------------------------------------- resolving
@dataclasses.dataclass
class Resolved:
    """What the config's names resolve to."""

    trainer_class: type
    model_class: type | None  # None: the trainer picks its model (the seed's pattern)
    dataset: Callable
    callbacks: list[type]
    loggers: list[type]


_TRAINER_OWN = {"model_class", "model_hparams", "optimizer_hparams", "exmp_input", "seed", "logger_params",
                "enable_progress_bar", "debug", "check_val_every_n_epoch"}


def _takes_model_class(trainer_class: type, cfg: Config) -> bool:
    """Whether the config gives the trainer ``model_class`` and ``model_hparams``: its ``__init__``
    declares ``model_class``, or takes ``**kwargs`` (passed on to its base, as docs/models.md's
    ``def __init__(self, smoothing=0.0, **kwargs)``) and the config names a model. Else the trainer
    picks its model itself (the seed's ``MyTrainer(hidden_dims, **kwargs)``: ``model.name: null``)."""
    init = trainer_class.__init__
    return "model_class" in registry.explicit_parameters(init) or (
        registry.takes_var_keyword(init) and cfg.model.name is not None)


# The trainer section's settings that are no TrainerModule argument (train_model's epochs; the alias
# num_epochs is the same setting): a trainer class that declares one (an LR schedule's length) is
# passed the section's value too, as LightningCLI would pass a model's own init argument.
_SECTION_VALUES = {"max_epochs": "max_epochs", "num_epochs": "max_epochs"}


def _own_arguments(trainer_class: type) -> dict[str, Any]:
    """The trainer section's keys that are ``trainer_class``'s own arguments: the keywords its
    ``__init__`` or a base's declares (as ``TrainerOptions.split_kwargs`` takes them), less
    TrainerModule's and the section's settings; each with the type its value is checked against
    (its annotation, else its default's type, a number for a number: ``w=1`` takes 0.5; ``Any``)."""
    settings = {f.name for f in dataclasses.fields(TrainerConfig)} | _TRAINER_OWN | {"callbacks", "loggers"}
    own: dict[str, Any] = {}
    for klass in trainer_class.__mro__:  # the subclass's declaration first
        init = vars(klass).get("__init__")
        if init is None:
            continue
        hints = _hints(init)
        for name, parameter in registry.explicit_parameters(init).items():
            if name not in settings and name not in _SECTION_VALUES and name not in own:
                default = type(parameter.default)
                inferred = int | float if default is int else default if default in (bool, float, str) else Any
                own[name] = hints.get(name, inferred)
    return own


def _section_values(trainer_class: type, trainer_cfg: TrainerConfig) -> dict[str, Any]:
    """The section's settings ``trainer_class``'s ``__init__`` (or a base's) declares as well
    (:data:`_SECTION_VALUES`: ``max_epochs``), to pass to it besides their use in the section."""
    declared = declared_keywords(trainer_class)
    return {name: getattr(trainer_cfg, field) for name, field in _SECTION_VALUES.items() if name in declared}


def _picks_its_model(trainer_class: type) -> str:
    return (f"trainer {_display(trainer_class)} picks its model itself (it passes model_class to TrainerModule itself "
            f"and takes the model's hyperparameters by name): set model.name: null and give its arguments in "
            f"model.hparams")


def _check_own_keys(trainer_class: type, given: Mapping[str, Any]) -> None:
    """Each of the trainer section's own arguments ``given`` is one ``trainer_class`` declares, of its type."""
    own = _own_arguments(trainer_class)
    for key, value in given.items():
        if key not in own:
            settings = [name for name, f in _ordered_fields(TrainerConfig).items() if f.init]
            hint = _lightning_hint(key, "trainer") or _elsewhere_hint(key, "trainer") or _suggest(
                str(key), [*settings, *own], "trainer")
            mine = f"; and {_display(trainer_class)}'s own arguments (its __init__ declares them): {', '.join(own)}" \
                if own else ""
            raise ConfigError(f"Unknown key {_join('trainer', key)!r}.{hint} Valid keys of trainer: "
                              f"{', '.join(settings)}{mine}.", key=_join("trainer", key))
        if _is_checkable(own[key]):
            _convert(value, own[key], _join("trainer", key))


def _check_own_arguments(trainer_class: type, cfg: Config, takes_model_class: bool) -> None:
    """The trainer section's own arguments (``cfg.trainer.own_args``) against ``trainer_class``:
    each one it declares, of its type, and (with a model_class) every one it requires."""
    given = cfg.trainer.own_args
    if "name" in declared_keywords(trainer_class):  # trainer.name is the class: nothing could set the argument
        raise ConfigError(f"trainer {_display(trainer_class)} declares an argument 'name', but trainer.name is the "
                          f"trainer class itself ({cfg.trainer.name!r}), so the config cannot set that argument. "
                          f"Rename it in {trainer_class.__name__}.__init__ (e.g. run_label), and set it as "
                          f"trainer.run_label.", key="trainer.name")
    _check_own_keys(trainer_class, given)
    if not takes_model_class:
        both = sorted(set(given) & set(cfg.model.hparams))
        if both:
            raise ConfigError(f"{_join('trainer', both[0])!r} and {_join('model.hparams', both[0])!r} both set "
                              f"{_display(trainer_class)}'s argument {both[0]!r}; keep one.",
                              key=_join("trainer", both[0]))
        return
    required = [n for n, p in registry.explicit_parameters(trainer_class.__init__).items()
                if p.default is p.empty and n not in _TRAINER_OWN and n not in _SECTION_VALUES and n not in given]
    if required:
        raise ConfigError(f"Missing required key {_join('trainer', required[0])!r}: trainer {_display(trainer_class)} "
                          f"needs {', '.join(map(repr, required))}; set {'them' if required[1:] else 'it'} in the "
                          f"trainer section. If instead {_picks_its_model(trainer_class)}.",
                          key=_join("trainer", required[0]))


def _is_checkable(tp: Any) -> bool:
    """Annotations simple enough to check config values against (others are left to the target)."""
    if tp in (int, float, bool, str, type(None)):
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return all(_is_checkable(a) for a in args)
    if origin in (list, tuple, collections.abc.Sequence):
        inner = [a for a in args if a is not Ellipsis]
        return len(inner) == 1 and _is_checkable(inner[0])
    return False


def _display(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"


def _check_kwargs(target: Callable, kwargs: Mapping[str, Any], path: str, what: str, *,
                  supplied: Iterable[str] = (), ignore: Iterable[str] = ()) -> None:
    """``kwargs`` against ``target``'s signature: unknown names (with the accepted ones), missing
    required ones (except ``supplied``, which flaxlight passes itself) and simple annotated types."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return
    ignore = set(ignore) | {"self"}
    params = {n: p for n, p in signature.parameters.items() if n not in ignore}
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key in kwargs:
        if key not in named and not accepts_any:
            accepted = [n for n in named if n not in set(supplied)]
            raise ConfigError(
                f"Unknown key {_join(path, key)!r}: {what} does not take {key!r}."
                f"{_elsewhere_hint(key, path) or _suggest(str(key), accepted, path)} It takes: "
                f"{', '.join(accepted) or '(no arguments)'}.",
                key=_join(path, key))
    missing = [n for n, p in named.items()
               if p.default is p.empty and n not in kwargs and n not in set(supplied)]
    if missing:
        raise ConfigError(f"Missing required key {_join(path, missing[0])!r}: {what} needs "
                          f"{', '.join(map(repr, missing))}.")
    hints = _hints(target.__init__ if isinstance(target, type) and not dataclasses.is_dataclass(target) else target)
    for key, value in kwargs.items():
        tp = hints.get(key)
        if tp is not None and _is_checkable(tp):
            _convert(value, tp, _join(path, key))


def _resolve(kind: str, name: str, path: str, policy: _ImportPolicy) -> Any:
    """A registered name, flaxlight's own class by import path, or an import path the policy
    allows (refused before any import otherwise)."""
    if registry.is_import_path(name) and not (_is_own_class(name, kind) or policy.allows(name)):
        raise _refused_import(path, name, kind, policy)
    try:
        return registry.resolve(kind, name)
    except registry.RegistryError as exc:
        raise ConfigError(f"{path}: {exc}", key=path) from None


def _model_ignored_parameters(model_class: type) -> set[str]:
    import flax.linen as nn

    return {"parent", "name"} if issubclass(model_class, nn.Module) else set()


def _is_flax_module_class(obj: Any) -> bool:
    import flax.linen as nn
    from flax import nnx

    return isinstance(obj, type) and issubclass(obj, (nn.Module, nnx.Module))


def _is_stdlib(module: Any) -> bool:
    import sys

    return isinstance(module, str) and module.split(".")[0] in sys.stdlib_module_names


_BUILTIN_TYPES = ("builtin_function_or_method", "method-wrapper", "wrapper_descriptor", "method_descriptor")


def _check_dataset_kind(dataset: Any, name: str, policy: _ImportPolicy) -> None:
    """A dataset factory is called with the config's values, so it is checked first: callable and
    not a builtin; named by an import path, a plain Python function in an allowed module and not
    in the standard library (``os.system``, ``subprocess.run``, ``shutil.rmtree`` are no datasets)."""
    what = f"data.name: {name!r} is {_display(dataset)}"
    if not callable(dataset) or inspect.isbuiltin(dataset) or type(dataset).__name__ in _BUILTIN_TYPES:
        raise ConfigError(f"{what}, not a dataset factory (a function returning (train_loader, val_loader, "
                          f"test_loader)); it was not called.")
    if not registry.is_import_path(name):
        return  # registered by your own code: trusted as a factory
    module = getattr(dataset, "__module__", None)
    if not inspect.isfunction(dataset):
        reason = f"a {type(dataset).__name__}, not a plain Python function"
    elif _is_stdlib(module):
        reason = f"a function of the standard library module {module!r}, not a dataset factory"
    elif not policy.allows(module or ""):
        reason = (f"defined in module {module!r}, which is not under the allowed import prefixes "
                  f"({', '.join(map(repr, policy.allow))})")
    else:
        return
    raise ConfigError(f"{what}: {reason}; it was not called. A dataset named by an import path must be a function "
                      f"(def) defined in your own code, under an allowed prefix; to use anything else, register it "
                      f"(@flaxlight.registry.register_dataset('my_data')) and write data.name: my_data.")


def resolve_config(cfg: Config, *, trust_config: bool = False,
                   allow_imports: Iterable[str] = ()) -> Resolved:
    """Resolve every name of ``cfg``, check each is the kind expected, and check the free-form
    dicts against their targets. Nothing named by the config is called here.

    Names resolve through the registry. Import paths (``mypkg.models.ResNet``) and ``imports:``
    need an opt-in: ``allow_imports=["mypkg"]`` (modules under those prefixes) or
    ``trust_config=True`` (any module). The current directory is then searched too, after the
    installed modules: for the allowed modules only with ``allow_imports``, for any with ``trust_config``.
    Without it they fail with a :class:`ConfigError` before anything is imported.
    """
    return _resolve_config(cfg, _ImportPolicy.of(trust_config, allow_imports))


def _resolve_config(cfg: Config, policy: _ImportPolicy) -> Resolved:
    token = _ROOT.set(cfg)  # the hints of misplaced keys read its names
    try:
        return _resolve_names(cfg, policy)
    finally:
        _ROOT.reset(token)


def _resolve_names(cfg: Config, policy: _ImportPolicy) -> Resolved:
    import importlib

    if _check_import_policy(cfg, policy):  # something to import, and the caller opted in to all of it
        _let_working_directory_serve(policy)
    for i, module in enumerate(cfg.imports):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            raise _import_failed(f"imports[{i}]", module, exc) from None

    trainer_class, model_class = _resolve_trainer(cfg, policy)
    dataset = _resolve("dataset", cfg.data.name, "data.name", policy)
    _check_dataset_kind(dataset, cfg.data.name, policy)
    _check_dataset(dataset, cfg.data)

    from flaxlight.loggers import Logger

    callback_classes = _resolve_classes(cfg.callbacks, "callbacks", "callback", Callback, "flaxlight.Callback",
                                        policy)
    logger_classes = _resolve_classes(cfg.loggers, "loggers", "logger", Logger, "flaxlight.loggers.Logger", policy,
                                      supplied=_LOGGER_SUPPLIED)
    return Resolved(trainer_class, model_class, dataset, callback_classes, logger_classes)


def _resolve_trainer(cfg: Config, policy: _ImportPolicy) -> tuple[type, type | None]:
    """The trainer class and the model class (None: the trainer picks its model) of ``cfg``, with
    ``model.hparams`` and the trainer's own arguments checked against them."""
    trainer_class = _resolve("trainer", cfg.trainer.name, "trainer.name", policy)
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, TrainerModule)):
        raise ConfigError(f"trainer.name: {cfg.trainer.name!r} is {_display(trainer_class)}, not a subclass of "
                          f"flaxlight.TrainerModule.", key="trainer.name")
    takes_model_class = _takes_model_class(trainer_class, cfg)
    _check_own_arguments(trainer_class, cfg, takes_model_class)
    if takes_model_class:
        if cfg.model.name is None:
            raise ConfigError(f"Missing required key 'model.name': {_REQUIRED_HELP['model.name']}.")
        model_class = _resolve("model", cfg.model.name, "model.name", policy)
        if not _is_flax_module_class(model_class):
            raise ConfigError(f"model.name: {cfg.model.name!r} is {_display(model_class)}, not a model class (a "
                              f"subclass of flax.linen.Module or flax.nnx.Module).", key="model.name")
        try:
            _check_kwargs(model_class, cfg.model.hparams, "model.hparams", f"model {_display(model_class)}",
                          ignore=_model_ignored_parameters(model_class), supplied={"rngs"})
        except ConfigError as exc:  # a hparam of the trainer's in model.hparams: written for the seed's pattern?
            key = (exc.key or "").rpartition(".")[2]
            if not str(exc).startswith("Unknown key") or key not in _own_arguments(trainer_class):
                raise
            raise ConfigError(f"{exc} {key!r} is an argument of trainer {_display(trainer_class)}: set it as "
                              f"{_join('trainer', key)}; or, if {_picks_its_model(trainer_class)}.",
                              key=exc.key) from None
        return trainer_class, model_class
    # the seed's pattern: MyTrainer(hidden_dims, output_dim, **kwargs) picks its model
    if cfg.model.name is not None:  # and takes no **kwargs to pass model_class on
        raise ConfigError(f"model.name: {_picks_its_model(trainer_class)}.", key="model.name")
    params = {n for n in registry.explicit_parameters(trainer_class.__init__) if n not in _TRAINER_OWN}
    forwards = (" If it passes model_class on to its base through **kwargs, name the model instead (model.name: "
                "...) and give the model's arguments in model.hparams."
                if registry.takes_var_keyword(trainer_class.__init__) else "")
    for key in cfg.model.hparams:
        if key not in params:
            raise ConfigError(f"Unknown key {_join('model.hparams', key)!r}: trainer {_display(trainer_class)} "
                              f"does not take {key!r}.{_suggest(key, sorted(params), 'model.hparams')} "
                              f"It takes: {', '.join(sorted(params)) or '(no arguments)'}.{forwards}",
                              key=_join("model.hparams", key))
    return trainer_class, None


def _resolve_classes(items, section: str, kind: str, base: type, base_name: str, policy: _ImportPolicy,
                     **check) -> list[type]:
    """The classes named by ``callbacks:``/``loggers:`` entries, each a ``base`` subclass whose
    constructor takes the entry's ``args`` (errors name the entry, e.g. ``callbacks[1].name``)."""
    classes = []
    for i, item in enumerate(items):
        path = f"{section}[{i}]"
        cls = _resolve(kind, item.name, f"{path}.name", policy)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"{path}.name: {item.name!r} is {_display(cls)}, not a {base_name} subclass.",
                              key=f"{path}.name")
        _check_kwargs(cls, item.args, f"{path}.args", f"{kind} {cls.__name__}", **check)
        classes.append(cls)
    return classes


_DATA_FIELDS = ("batch_size", "eval_batch_size", "seed")
_LOGGER_DIR_ARGS = ("log_dir", "save_dir")
_LOGGER_PROJECT_ARGS = ("project", "experiment_name")
_LOGGER_RUN_ARGS = ("name", "run_name")
_LOGGER_SUPPLIED = _LOGGER_DIR_ARGS + _LOGGER_PROJECT_ARGS + _LOGGER_RUN_ARGS


def _dataset_arguments(dataset: Callable, data: DataConfig) -> dict[str, Any]:
    """The keyword arguments for the factory: the typed fields it takes, then ``kwargs``."""
    params = inspect.signature(dataset).parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    arguments = {}
    for name in _DATA_FIELDS:
        value = getattr(data, name)
        if name in params or accepts_any:
            arguments[name] = value
        elif value != defaults[name]:
            raise ConfigError(f"data.{name}: dataset {_display(dataset)} does not take {name!r}, so it cannot be set.",
                              key=f"data.{name}")
    return arguments


def _check_dataset(dataset: Callable, data: DataConfig) -> None:
    for key in data.kwargs:
        if key in _DATA_FIELDS or key == "name":
            raise ConfigError(f"data.kwargs.{key}: set data.{key} instead (it is a field of the data section).",
                              key=f"data.kwargs.{key}")
    supplied = _dataset_arguments(dataset, data)
    _check_kwargs(dataset, data.kwargs, "data.kwargs", f"dataset {_display(dataset)}", supplied=supplied)


def _let_working_directory_serve(policy: _ImportPolicy) -> None:
    """Let the opted-in imports find modules in the current directory, after the installed ones (the
    console script does not search it): ``--allow-import mypkg`` finds ``./mypkg`` only for modules
    under its prefixes (no other file there can be imported by this, and an installed ``mypkg`` wins);
    ``--trust-config`` (a config trusted as a script) appends the directory to ``sys.path``."""
    import sys

    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:  # python -m flaxlight: Python put it there already
        return
    if policy.trust:
        sys.path.append(cwd)
        return
    if _WORKING_DIRECTORY_FINDER not in sys.meta_path:
        sys.meta_path.append(_WORKING_DIRECTORY_FINDER)
    for prefix in policy.allow:
        folders = _WORKING_DIRECTORY_FINDER.folders.setdefault(prefix.split(".")[0], [])
        if cwd not in folders:
            folders.append(cwd)


class _AllowedModulesFinder:
    """The last finder on ``sys.meta_path``: a top-level module allowed by ``--allow-import``, in
    the folders it was allowed from (``folders``: name -> folders), and nothing else."""

    def __init__(self):
        self.folders: dict[str, list[str]] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        import importlib.machinery

        if path is not None or fullname not in self.folders:  # a submodule: its package's __path__ finds it
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, self.folders[fullname])


_WORKING_DIRECTORY_FINDER = _AllowedModulesFinder()


def _import_failed(key: str, module: str, exc: Exception) -> ConfigError:
    """``imports[i]`` failed; a module missing because ``--allow-import`` serves the current
    directory only for the allowed modules says which prefix to add."""
    text = f"{key}: importing {module!r} failed: {type(exc).__name__}: {exc}"
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing and "." not in missing and any(os.path.exists(os.path.join(os.getcwd(), missing + end))
                                               for end in (".py", os.sep + "__init__.py")):
        text += (f" (./{missing} is in the current directory, which --allow-import searches only for the modules "
                 f"it allows: add --allow-import {missing} if you trust it)")
    elif missing and missing == module.split(".")[0]:
        text += (f" (no {missing}.py or {missing}/ in the current directory, {os.getcwd()}: run flaxlight from the "
                 f"folder that holds it, or put that folder on PYTHONPATH; or install the package)")
    return ConfigError(text)


# ---------------------------------------------------------------------------------------- building
def build_data(cfg: Config, resolved: Resolved | None = None, *, trust_config: bool = False,
               allow_imports: Iterable[str] = ()) -> tuple[Any, Any, Any]:
    """``(train, val, test)`` loaders from the data section (val or test may be None); ``resolved``
    defaults to :func:`resolve_config` with the same opt-in."""
    resolved = resolved or resolve_config(cfg, trust_config=trust_config, allow_imports=allow_imports)
    splits = resolved.dataset(**_dataset_arguments(resolved.dataset, cfg.data), **cfg.data.kwargs)
    if not (isinstance(splits, (tuple, list)) and len(splits) == 3) or splits[0] is None:
        got = f"a {type(splits).__name__} of length {len(splits)}" if isinstance(splits, (tuple, list)) \
            else type(splits).__name__
        raise TypeError(f"Dataset {_display(resolved.dataset)} (data.name={cfg.data.name!r}) must return "
                        f"(train_loader, val_loader, test_loader) with val/test possibly None; got {got}.")
    return tuple(splits)


def example_input(loader: Iterable) -> Any:
    """The model input for initialisation: the first element of the first batch (the seed's
    ``(inputs, targets)`` convention; a batch that is not a tuple/list is the input), one example."""
    import jax

    try:
        batch = next(iter(loader))
    except StopIteration:
        raise ValueError("The train loader yielded no batches: check the dataset size and batch_size.") from None
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    return jax.tree.map(lambda a: np.asarray(a)[:1], inputs)


def build_callbacks(cfg: Config, resolved: Resolved | None = None, *, trust_config: bool = False,
                    allow_imports: Iterable[str] = ()) -> list:
    """The callbacks, in the config's order."""
    resolved = resolved or resolve_config(cfg, trust_config=trust_config, allow_imports=allow_imports)
    callbacks = []
    for i, (item, cls) in enumerate(zip(cfg.callbacks, resolved.callbacks)):
        try:
            callbacks.append(cls(**item.args))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"callbacks[{i}] ({cls.__name__}): {exc}") from None
    return callbacks


def _fill_first(params: Mapping[str, inspect.Parameter], names: Sequence[str], args: dict, value: Any) -> None:
    if value is None or any(n in args for n in names):
        return
    for name in names:
        if name in params:
            args[name] = value
            return


def build_loggers(cfg: Config, log_dir: str, resolved: Resolved | None = None, *, trust_config: bool = False,
                  allow_imports: Iterable[str] = ()) -> list:
    """The extra logger objects, writing under ``log_dir`` unless their args say otherwise."""
    from flaxlight.loggers.base import run_display_name

    resolved = resolved or resolve_config(cfg, trust_config=trust_config, allow_imports=allow_imports)
    params_cfg = cfg.trainer.logger_params
    loggers = []
    for i, (item, cls) in enumerate(zip(cfg.loggers, resolved.loggers)):
        params = inspect.signature(cls).parameters
        args = dict(item.args)
        _fill_first(params, _LOGGER_DIR_ARGS, args, log_dir)
        _fill_first(params, _LOGGER_PROJECT_ARGS, args, params_cfg.project_name)
        _fill_first(params, _LOGGER_RUN_ARGS, args, params_cfg.run_name or run_display_name(log_dir))
        try:
            loggers.append(cls(**args))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"loggers[{i}] ({cls.__name__}): {exc}") from None
    return loggers


def _logger_params(cfg: Config, resolved: Resolved) -> dict[str, Any]:
    params = {k: v for k, v in config_to_dict(cfg)["trainer"]["logger_params"].items() if v is not None}
    if cfg.loggers and "log_dir" not in params:  # the loggers need the run's folder before the trainer exists
        owner = resolved.model_class or resolved.trainer_class
        params["log_dir"] = run_dir(LoggerParams.from_mapping(params), owner.__name__)  # logger_name's folder too
    return params


def _is_default(field: dataclasses.Field, value: Any) -> bool:
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        return False
    return type(value) is type(default) and value == default


def build_trainer(cfg: Config, exmp_input: Any, *, resolved: Resolved | None = None,
                  callbacks: Sequence = (), loggers: Sequence = (), trust_config: bool = False,
                  allow_imports: Iterable[str] = (), **overrides: Any) -> TrainerModule:
    """The trainer the config describes (``callbacks``/``loggers`` are appended to the config's)."""
    resolved = resolved or resolve_config(cfg, trust_config=trust_config, allow_imports=allow_imports)
    trainer_cfg = cfg.trainer
    logger_params = _logger_params(cfg, resolved)
    # The options the config changes (the trainer's defaults are TrainerOptions' own, the same fields).
    kwargs: dict[str, Any] = {f.name: getattr(trainer_cfg, f.name) for f in dataclasses.fields(TrainerOptions)
                              if not _is_default(f, getattr(trainer_cfg, f.name))}
    kwargs.update(
        optimizer_hparams=cfg.optimizer,
        exmp_input=exmp_input,
        seed=trainer_cfg.seed,
        logger_params=logger_params,
        enable_progress_bar=trainer_cfg.enable_progress_bar,
        debug=trainer_cfg.debug,
        check_val_every_n_epoch=trainer_cfg.check_val_every_n_epoch,
    )
    if trainer_cfg.mesh is not None:
        kwargs["mesh"] = dict(trainer_cfg.mesh)
    all_callbacks = build_callbacks(cfg, resolved) + list(callbacks)
    if all_callbacks:
        kwargs["callbacks"] = all_callbacks
    all_loggers = (build_loggers(cfg, logger_params["log_dir"], resolved) if cfg.loggers else []) + list(loggers)
    if all_loggers:
        kwargs["loggers"] = all_loggers
    kwargs.update(trainer_cfg.own_args)  # the trainer class's own arguments (w_target=3.0)
    kwargs.update(_section_values(resolved.trainer_class, trainer_cfg))  # max_epochs, when the class declares it
    if resolved.model_class is not None:
        kwargs.update(model_class=resolved.model_class, model_hparams=dict(cfg.model.hparams))
    else:
        kwargs.update(cfg.model.hparams)
    kwargs.update(overrides)
    try:
        return resolved.trainer_class(**kwargs)
    except TypeError as exc:  # a **kwargs trainer that sets model_class itself, given the config's model
        if resolved.model_class is None or "multiple values for keyword argument 'model_" not in str(exc):
            raise
        raise ConfigError(f"model.name: {_picks_its_model(resolved.trainer_class)}.", key="model.name") from exc
    except (ValueError, ModelHparamsError) as exc:  # flaxlight's checks of the settings: a config error
        if isinstance(exc, ConfigError) or not raised_by_flaxlight(exc):
            raise  # an error in the user's own code keeps its traceback
        raise ConfigError(f"the trainer cannot be built from this config: {exc}") from exc


def raised_by_flaxlight(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside flaxlight's own code (a check of settings or data), not in
    the user's model or loss, whose errors keep their traceback.

    Examples:
        >>> raised_by_flaxlight(ValueError("x"))   # never raised: no traceback
        False
    """
    frames = traceback.extract_tb(exc.__traceback__)
    package = os.path.dirname(os.path.abspath(__file__))
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(package + os.sep)


def load_trainer(cfg: Config, run_dir: str | os.PathLike, exmp_input: Any, *, which: str = "best",
                 resolved: Resolved | None = None, trust_config: bool = False, allow_imports: Iterable[str] = (),
                 **overrides: Any) -> TrainerModule:
    """The trainer class of ``cfg`` loaded from a run's log dir (``load_from_checkpoint``).

    The model class is the config's (resolved as :func:`resolve_config` does, with the same
    opt-in), never an import path read from the run's ``hparams.yaml``. The run's own model class
    loads with the run's saved hyperparameters (a ``model.hparams`` value that differs from them is
    a :class:`ConfigError`); another class (a module renamed, a model of your own that should take
    the run's weights) is built from the config's ``model.hparams``, said in a log line, and a
    checkpoint whose parameters do not fit it is a :class:`ConfigError` naming both classes. The
    trainer's own arguments are the run's ``config.yaml``'s (``hparams.yaml`` lacks those a class
    keeps without passing them up), said in a log line where ``cfg`` sets one otherwise.

    Examples:
        >>> cfg = load_config("runs/base/config.yaml")                              # doctest: +SKIP
        >>> train, val, test = build_data(cfg)                                      # doctest: +SKIP
        >>> trainer = load_trainer(cfg, "runs/base", example_input(train))          # doctest: +SKIP
    """
    policy = _ImportPolicy.of(trust_config, allow_imports)
    resolved = resolved or _resolve_config(cfg, policy)
    run_class = None
    if resolved.model_class is not None:
        run_class = _check_same_model_hparams(cfg, resolved.model_class, run_dir)
        overrides.setdefault("model_class", resolved.model_class)
        if run_class is not None:  # another class than the run's: the config's hparams are the ones it takes
            overrides.setdefault("model_hparams", dict(cfg.model.hparams))
    else:
        _check_saved_model_class(resolved.trainer_class, run_dir, policy)
    for key, value in _run_own_arguments(cfg, resolved.trainer_class, run_dir).items():
        overrides.setdefault(key, value)  # hparams.yaml lacks those the class keeps without passing them up
    overrides.setdefault("enable_progress_bar", False)
    try:
        return resolved.trainer_class.load_from_checkpoint(run_dir, exmp_input=exmp_input, which=which, **overrides)
    except (ModelHparamsError, ModelMismatchError) as exc:  # the run's checkpoint and the config's model disagree
        model = "" if resolved.model_class is None else f" {class_path(resolved.model_class)}"
        theirs = f" (the run's is {run_class})" if run_class else \
            " (a config for another model?)" if isinstance(exc, ModelHparamsError) else ""
        raise ConfigError(f"the run in {os.fspath(run_dir)} does not fit this config's model{model}{theirs}: "
                          f"{' '.join(str(exc).split())}") from exc


def _run_own_arguments(cfg: Config, trainer_class: type, run_dir: str | os.PathLike) -> dict[str, Any]:
    """The trainer's own arguments as the run had them: its ``config.yaml``'s (the record; else, a run
    without one or of another trainer class, ``cfg``'s), with ``max_epochs`` where the class declares
    it. Where ``cfg`` (``--config``) sets one otherwise, the run's is used, said in a log line."""
    where = os.path.join(os.fspath(run_dir), CONFIG_FILE)
    try:
        record = load_config(where, check=False).trainer if os.path.isfile(where) else None
    except ConfigError:  # a config.yaml this flaxlight cannot read: the one given stands in
        record = None
    if record is None or record.name != cfg.trainer.name:
        return {**cfg.trainer.own_args, **_section_values(trainer_class, cfg.trainer)}
    saved = to_yaml_safe(dict(record.own_args))
    differ = [f"trainer.{key}: {value!r} here, {repr(saved[key]) if key in saved else 'not set'} in the run"
              for key, value in to_yaml_safe(dict(cfg.trainer.own_args)).items() if saved.get(key, ...) != value]
    if differ:
        messages.info(f"The config's trainer arguments differ from the run's ({'; '.join(differ)}): the trainer is "
                      f"built with the run's ({where}), as it was trained.")
    return {**record.own_args, **_section_values(trainer_class, record)}


def _check_same_model_hparams(cfg: Config, model_class: type, run_dir: str | os.PathLike) -> str | None:
    """The run's model is loaded with its saved hparams: refuse a config for that model whose
    ``model.hparams`` set other values, which would be ignored (as ``model.*`` overrides are).
    Returns the class the run recorded when it is not ``model_class`` (said in a log line), else None."""
    hparams = read_hparams(os.fspath(run_dir))
    where = os.path.join(os.fspath(run_dir), HPARAMS_FILE)
    recorded, given = hparams.get("model_class"), to_yaml_safe(dict(cfg.model.hparams))  # (8, 8) as saved: [8, 8]
    if recorded != class_path(model_class):
        messages.info(f"The config's model {class_path(model_class)} is not the class the run recorded ({recorded} "
                      f"in {where}): it is built from the config's model.hparams {given!r}, and the run's checkpoint "
                      f"loads into it if its parameters fit.")
        return str(recorded)
    saved = hparams.get("model_hparams") or {}
    differ = [f"model.hparams.{key}: {value!r} here, {repr(saved[key]) if key in saved else 'not set'} in the run"
              for key, value in given.items() if key not in saved or saved[key] != value]
    if differ:
        raise ConfigError(f"the config's model differs from the run's ({'; '.join(differ)}). The run's model loads "
                          f"with its saved settings ({where}), so the config's would be ignored: evaluate with the "
                          f"run's own {CONFIG_FILE} (the default without --config), or fit a new run to change the "
                          f"model.")
    return None


def _check_saved_model_class(trainer_class: type, run_dir: str | os.PathLike, policy: _ImportPolicy) -> None:
    """A trainer that picks its model itself takes no model_class to pass; loading imports the
    class named in ``hparams.yaml`` when the saved model hparams are not all its arguments (a
    file edited by hand): refuse that unless the caller opted in to importing it."""
    hparams = read_hparams(os.fspath(run_dir))
    named = registry.explicit_parameters(trainer_class.__init__)
    model_hparams = hparams.get("model_hparams") or {}
    path = hparams.get("model_class")
    would_import = "model_hparams" in named or not set(model_hparams) <= set(named)
    if would_import and isinstance(path, str) and not policy.allows(path):
        where = os.path.join(os.fspath(run_dir), HPARAMS_FILE)
        raise _refused_import(f"{where}: model_class", path, "model", policy)


def build_run(config: str | os.PathLike | Mapping[str, Any] | Config, *, log_dir: str | os.PathLike | None = None,
              callbacks: Sequence = (), loggers: Sequence = (), monitor: str | None = None,
              mode: str | None = None, trust_config: bool = False,
              allow_imports: Iterable[str] = ()) -> dict[str, Any]:
    """Everything a run needs, built from a config: ``{"trainer", "train_loader", "val_loader",
    "test_loader", "num_epochs", "config"}``; the resolved config is saved in the trainer's log dir when
    training starts (:class:`SaveConfig`).

    ``log_dir`` replaces ``trainer.logger_params.log_dir``; ``callbacks``/``loggers`` (objects) are
    added after the config's; ``monitor``/``mode`` apply unless the config's trainer sets a monitor
    (what :func:`flaxlight.tune.tune_from_config` uses for each trial). ``trust_config`` /
    ``allow_imports``: the opt-in for import paths, as for :func:`resolve_config`.
    """
    import copy

    policy = _ImportPolicy.of(trust_config, allow_imports)
    cfg = check_config(copy.deepcopy(config)) if isinstance(config, Config) else \
        load_config(config, trust_config=policy.trust, allow_imports=policy.allow)
    if log_dir is not None:
        cfg.trainer.logger_params.log_dir = os.fspath(log_dir)
    _check_run_folder(cfg.trainer.logger_params)
    if monitor is not None and cfg.trainer.monitor is None:
        cfg.trainer.monitor = monitor
        cfg.trainer.mode = mode or cfg.trainer.mode
        try:
            TrainerOptions.__post_init__(cfg.trainer)
        except ValueError as exc:
            raise ConfigError(f"trainer: {exc}") from None
    resolved = _resolve_config(cfg, policy)
    train, val, test = build_data(cfg, resolved)
    trainer = build_trainer(cfg, example_input(train), resolved=resolved,
                            callbacks=[*callbacks, SaveConfig(cfg)], loggers=loggers)
    return {"trainer": trainer, "train_loader": train, "val_loader": val, "test_loader": test,
            "num_epochs": cfg.trainer.max_epochs, "config": cfg}


def _check_run_folder(params: LoggerParams) -> None:
    """The run's folder (``log_dir``, else a version under ``base_log_dir``) can be made there:
    no file stands on its path."""
    key = "log_dir" if params.log_dir is not None else "base_log_dir"
    folder = path = os.path.abspath(getattr(params, key))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        what = "is a file" if path == folder else f"lies under the file {path}"
        raise ConfigError(f"trainer.logger_params.{key}: {getattr(params, key)} {what}, not a folder; move the file "
                          f"away or choose another {key}.")


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns: the trainer, its final metrics, the run's folder and its config."""

    trainer: TrainerModule
    metrics: dict[str, float]
    log_dir: str | None
    config: Config


def fit(config: str | os.PathLike | Mapping[str, Any] | Config, overrides: Iterable[str] = (), *,
        callbacks: Sequence = (), loggers: Sequence = (), resume: bool = False, overwrite: bool = False,
        trust_config: bool = False, allow_imports: Iterable[str] = ()) -> FitResult:
    """Train (and test, when the data has a test split) the run a config describes.

    The resolved config is saved as ``config.yaml`` in the run's log dir when training starts.
    ``callbacks``/``loggers`` are objects added after the config's (e.g. a pruning callback).
    ``resume=True`` continues from the newest checkpoint in ``trainer.logger_params.log_dir``;
    ``overwrite=True`` replaces the run already there (else that is an error). Import paths in
    the config run only with ``allow_imports=["mypkg"]`` or ``trust_config=True`` (see
    :func:`resolve_config`); registered names need neither. A ``ValueError`` from the run's checks
    before training (validation never due, a warmup longer than the run) comes as a :class:`ConfigError`.

    Examples:
        >>> result = fit("examples/configs/sine_regression.yaml", ["trainer.max_epochs=5"])  # doctest: +SKIP
        >>> result.metrics["test/loss"], result.log_dir                                        # doctest: +SKIP
    """
    opt_in = {"trust_config": trust_config, "allow_imports": allow_imports}
    cfg = config if isinstance(config, Config) and not overrides else load_config(config, overrides, **opt_in)
    run = build_run(cfg, callbacks=callbacks, loggers=loggers, **opt_in)
    trainer = run["trainer"]
    saver = next(callback for callback in trainer.callbacks if isinstance(callback, SaveConfig))
    try:
        metrics = trainer.train_model(run["train_loader"], run["val_loader"], test_loader=run["test_loader"],
                                      num_epochs=run["num_epochs"], resume=resume, overwrite=overwrite)
    except FileExistsError as exc:  # a run in the log_dir: the advice in this function's terms
        raise FileExistsError(str(exc).replace("train_model(..., ", "fit(config, ")) from None
    except (SystemExit, KeyboardInterrupt):  # SIGTERM / SIGINT (interactive: KeyboardInterrupt): how to continue
        if trainer.log_dir:
            messages.info(f"With a config: flaxlight fit --config CONFIG --resume {trainer.log_dir} (Python: "
                          f"flaxlight.config.fit(config, resume=True) with trainer.logger_params.log_dir set to it).")
        raise
    except (ValueError, MetricNotLoggedError) as exc:
        if saver.started or isinstance(exc, ConfigError):
            raise
        # The run's own checks before training (its length against the loaders, the schedule, a
        # resume's checkpoint, a monitor the eval step does not return): the settings are wrong.
        raise ConfigError(f"the run cannot start: {exc.args[0] if exc.args else exc}") from exc
    return FitResult(trainer=trainer, metrics=metrics, log_dir=trainer.log_dir, config=run["config"])
