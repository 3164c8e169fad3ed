"""Short names for models, datasets, trainers, callbacks and loggers, and import paths for the rest.

Code names a component either by a registered short name (``mlp_classifier``, ``digits``,
``classification``, ``early_stopping``) or by an importable path (``mypkg.models.ResNet`` or
``mypkg.models:ResNet``), so user code plugs in without changing flaxlight. A *config* resolves
registered names only, unless its caller opts in to import paths (``flaxlight --allow-import
mypkg`` / ``--trust-config``; see :func:`flaxlight.config.resolve_config`): registering your
components in your own code, before loading the config, is the way that needs no trust in the
config. Registering is one line, a decorator:

    >>> from flaxlight.registry import register_model
    >>> @register_model("my_mlp")                       # doctest: +SKIP
    ... class MyMLP(nn.Module): ...

Short names are matched ignoring case, ``_`` and ``-`` (``EarlyStopping`` == ``early_stopping``).
The built-ins are the callbacks of :mod:`flaxlight.callbacks`, the loggers of
:mod:`flaxlight.loggers` and everything registered in :mod:`flaxlight.zoo` (imported on the first
look-up).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from typing import Any, Callable, Iterator

__all__ = [
    "CALLBACKS",
    "DATASETS",
    "LOGGERS",
    "MODELS",
    "REGISTRIES",
    "TRAINERS",
    "Registry",
    "RegistryError",
    "explicit_parameters",
    "import_object",
    "register_callback",
    "register_dataset",
    "register_logger",
    "register_model",
    "register_trainer",
    "resolve",
]


class RegistryError(LookupError):
    """A name that is not registered, or an import path that does not resolve."""


def _key(name: str) -> str:
    return re.sub(r"[_\-\s]", "", str(name)).lower()


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def is_import_path(name: str) -> bool:
    """``pkg.mod.Obj`` or ``pkg.mod:Obj`` (registered names contain neither ``.`` nor ``:``)."""
    return isinstance(name, str) and ("." in name or ":" in name)


def explicit_parameters(fn: Callable) -> dict[str, inspect.Parameter]:
    """The parameters ``fn`` takes by name (not ``*args``/``**kwargs``, not ``self``); ``{}``
    when Python cannot read its signature.

    Examples:
        >>> sorted(explicit_parameters(lambda self, a, *args, b=1, **kw: None))
        ['a', 'b']
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {n: p for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}


def takes_var_keyword(fn: Callable) -> bool:
    """Whether ``fn`` takes ``**kwargs`` (True when its signature cannot be read)."""
    try:
        return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True


def import_object(path: str) -> Any:
    """The object at ``mypkg.models.ResNet`` or ``mypkg.models:ResNet``.

    The error says which part failed: the module that cannot be imported (and why), or the
    attribute the module does not have (with the closest name it has).

    Examples:
        >>> import_object("flaxlight.data:ArrayLoader").__name__
        'ArrayLoader'
    """
    if not isinstance(path, str) or not path or path.startswith((".", ":")) or path.count(":") > 1:
        raise RegistryError(f"{path!r} is not an import path; write it as 'package.module.Name' or "
                            f"'package.module:Name'.")
    if ":" in path:
        module_part, attr_path = path.split(":")
        module_parts, attrs = module_part.split("."), (attr_path.split(".") if attr_path else [])
        must_import = len(module_parts)
    else:  # the longest importable module prefix, then attributes
        module_parts, attrs = path.split("."), []
        must_import = 1
    module, module_name = None, ""
    for i in range(1, len(module_parts) + 1):
        name = ".".join(module_parts[:i])
        try:
            module = sys.modules.get(name) or importlib.import_module(name)
            module_name = name
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but imports something that does not
                raise RegistryError(f"Importing module {name!r} (from {path!r}) failed: {exc}") from exc
            if i <= must_import:
                where = f"module {module_name!r} has no submodule {module_parts[i - 1]!r}" if module_name else \
                    f"no module {name!r} can be imported"
                raise RegistryError(
                    f"Cannot resolve {path!r}: {where}. Check the spelling, that the package is installed, or that "
                    f"its folder is on PYTHONPATH (the flaxlight command adds the current directory when imports are "
                    f"allowed)."
                ) from None
            attrs = module_parts[i - 1:] + attrs
            break
        except Exception as exc:  # noqa: BLE001 - the module raised while being imported
            raise RegistryError(f"Importing module {name!r} (from {path!r}) failed: "
                                f"{type(exc).__name__}: {exc}") from exc
    obj, where = module, module_name
    for attr in attrs:
        if not hasattr(obj, attr):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(attr, names, n=1)
            hint = f" Did you mean {where}.{close[0]}?" if close else ""
            kind = "module" if where == module_name else "object"
            raise RegistryError(f"Cannot resolve {path!r}: {kind} {where!r} has no attribute {attr!r}.{hint}")
        obj, where = getattr(obj, attr), f"{where}.{attr}"
    return obj


class Registry:
    """Named components of one kind; values may be objects or lazy ``"module:attr"`` strings."""

    def __init__(self, kind: str, builtin_modules: tuple[str, ...] = ()):
        self.kind = kind
        self._entries: dict[str, tuple[str, Any]] = {}  # key -> (name as registered, object or lazy path)
        self._builtin_modules = builtin_modules
        self._builtins_loaded = not builtin_modules

    def register(self, name: str | None = None, obj: Any = None, *, replace: bool = False):
        """Register ``obj`` under ``name`` (default: its ``__name__``); without ``obj``, a decorator.

        ``obj`` may be a lazy ``"module:attr"`` string, imported on first use. A name registered
        for another object fails unless ``replace=True``.
        """
        if obj is None and not isinstance(name, str) and name is not None:  # @register (no parentheses)
            return self.register(None, name, replace=replace)
        if obj is None:
            return lambda target: self.register(name, target, replace=replace)
        name = name or obj.__name__
        if not isinstance(name, str) or not name or is_import_path(name):
            raise ValueError(f"A {self.kind} name must be a non-empty string without '.' or ':'; got {name!r}.")
        key = _key(name)
        if key in self._entries and not replace:
            old_name, old = self._entries[key]
            if _identity(old) != _identity(obj):
                raise ValueError(f"{self.kind} name {name!r} is already registered for {_identity(old)} "
                                 f"(as {old_name!r}); pick another name or pass replace=True.")
        self._entries[key] = (name, obj)
        return obj

    def _load_builtins(self) -> None:
        if not self._builtins_loaded:
            self._builtins_loaded = True
            for module in self._builtin_modules:
                importlib.import_module(module)

    def names(self) -> list[str]:
        """The registered names, as registered."""
        self._load_builtins()
        return sorted(name for name, _ in self._entries.values())

    def __contains__(self, name: str) -> bool:
        self._load_builtins()
        return _key(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> Any:
        """The object registered as ``name``, or the one at the import path ``name``."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"A {self.kind} must be named by a registered name or an import path; got {name!r}.")
        if is_import_path(name):
            return import_object(name)
        self._load_builtins()
        key = _key(name)
        if key not in self._entries:
            names = self.names()
            by_key = {_key(n): n for n in names}
            close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.6)
            hint = f" Did you mean {by_key[close[0]]!r}?" if close else ""
            raise RegistryError(
                f"Unknown {self.kind} {name!r}.{hint} Registered {self.kind}s: {', '.join(names) or '(none)'}. "
                f"Register yours with {self._register_hint()} in your code, or give an import "
                f"path such as 'mypkg.module.Name' (in a config: with --allow-import mypkg or --trust-config)."
            )
        registered_name, obj = self._entries[key]
        if isinstance(obj, str):  # lazy
            obj = import_object(obj)
            self._entries[key] = (registered_name, obj)
        return obj

    def loaded(self, name: str) -> Any:
        """The object registered as ``name`` when it is at hand, else None: nothing is imported for
        it (a lazy ``"module:attr"`` entry whose module is not imported yet is None), beyond the
        built-in registrations.

        Examples:
            >>> TRAINERS.loaded("classification").__name__, TRAINERS.loaded("mypkg.Trainer")
            ('ClassificationTrainer', None)
        """
        if not isinstance(name, str) or not name or is_import_path(name):
            return None
        self._load_builtins()
        obj = self._entries.get(_key(name), (None, None))[1]
        if isinstance(obj, str):  # lazy: at hand once its module is imported (flaxlight's own callbacks)
            return self.get(name) if obj.partition(":")[0] in sys.modules else None
        return obj

    def name_of(self, path: str) -> str | None:
        """The name registered for the object at the import path ``path`` (``pkg.mod.Name`` or
        ``pkg.mod:Name``), or None; nothing is imported for it beyond the built-in registrations
        (a module not imported yet is compared by the path alone).

        Examples:
            >>> DATASETS.name_of("flaxlight.zoo.datasets.digits")
            'digits'
            >>> CALLBACKS.name_of("flaxlight.callbacks:EarlyStopping")
            'early_stopping'
        """
        if not is_import_path(path):
            return None
        self._load_builtins()
        dotted = path.replace(":", ".")
        module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
        target = getattr(sys.modules.get(module), attr, None)  # a re-export (flaxlight.zoo.digits) too
        for name, obj in self._entries.values():
            seen = obj.replace(":", ".") if isinstance(obj, str) else _describe(obj)
            if seen == dotted or (target is not None and not isinstance(obj, str) and obj is target):
                return name
        return None

    def _register_hint(self) -> str:
        if REGISTRIES.get(self.kind) is self:
            return f"flaxlight.registry.register_{self.kind}(...)"
        return "register(...)"

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _identity(obj: Any) -> str:
    return obj if isinstance(obj, str) else _describe(obj)


_ZOO = ("flaxlight.zoo",)
MODELS = Registry("model", _ZOO)
DATASETS = Registry("dataset", _ZOO)
TRAINERS = Registry("trainer", _ZOO)
CALLBACKS = Registry("callback", _ZOO)
LOGGERS = Registry("logger", _ZOO)
REGISTRIES = {"model": MODELS, "dataset": DATASETS, "trainer": TRAINERS, "callback": CALLBACKS, "logger": LOGGERS}

register_model: Callable = MODELS.register
register_dataset: Callable = DATASETS.register
register_trainer: Callable = TRAINERS.register
register_callback: Callable = CALLBACKS.register
register_logger: Callable = LOGGERS.register


def resolve(kind: str, name: str) -> Any:
    """``resolve("model", "mlp_classifier")`` or ``resolve("model", "mypkg.models:ResNet")``."""
    if kind not in REGISTRIES:
        raise ValueError(f"Unknown registry {kind!r}; valid: {', '.join(REGISTRIES)}.")
    return REGISTRIES[kind].get(name)


# Built-in callbacks and loggers: lazy paths, so importing the registry imports nothing heavy.
for _name, _path in {
    "early_stopping": "flaxlight.callbacks:EarlyStopping",
    "learning_rate_monitor": "flaxlight.callbacks:LearningRateMonitor",
    "model_checkpoint": "flaxlight.callbacks:ModelCheckpoint",
    "nan_guard": "flaxlight.callbacks:NaNGuard",
    "progress_bar": "flaxlight.callbacks:ProgressBar",
    "throughput_monitor": "flaxlight.callbacks:ThroughputMonitor",
    "timer": "flaxlight.callbacks:Timer",
}.items():
    CALLBACKS.register(_name, _path)
for _name, _path in {
    "csv": "flaxlight.loggers:CSVLogger",
    "tensorboard": "flaxlight.loggers:TensorBoardLogger",
    "wandb": "flaxlight.loggers:WandbLogger",
    "mlflow": "flaxlight.loggers:MLflowLogger",
}.items():
    LOGGERS.register(_name, _path)
del _name, _path
