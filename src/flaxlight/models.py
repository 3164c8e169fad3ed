"""Model adapters: Linen and NNX models behind one interface, so steps stay pure functions.

Both kinds end up as plain pytrees in the :class:`TrainState` (``params``, ``batch_stats``) and an
``apply_fn(variables, *inputs, train=..., rngs=..., mutable=...)`` with Linen's calling
convention, so a loss function is written once for both (``state.apply_model(...)``).

For NNX the module is split once at set-up (``nnx.split``) into its graph definition and state;
``apply_fn`` merges them back *inside* the jitted step, which costs nothing at run time
(unlike ``nnx.jit`` in graph mode). ``bind`` merges the trained state into a live module.

Examples:
    >>> adapter = make_adapter(MyNNXModel, {"din": 4}, seed=0)        # doctest: +SKIP
    >>> variables = adapter.init(jax.random.PRNGKey(0), [x])          # doctest: +SKIP
    >>> model = adapter.bind(variables)                               # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import re
import sys
from typing import Any, Mapping, Sequence

import flax.errors
import flax.linen as nn
import jax
import numpy as np
from flax import nnx

__all__ = ["LinenAdapter", "NNXAdapter", "make_adapter", "is_nnx_model", "ModelHparamsError"]


def is_nnx_model(model_class) -> bool:
    return isinstance(model_class, type) and issubclass(model_class, nnx.Module)


def _call_parameters(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


class ModelHparamsError(TypeError):
    """``model_hparams`` that the model class does not take (a setting, not a bug in the model)."""


def _check_hparams(model_class, model_hparams: Mapping[str, Any], accepted: Sequence[str], extra_ok: bool) -> None:
    if not isinstance(model_hparams, Mapping):
        raise ModelHparamsError(f"model_hparams must be a dict of {model_class.__name__}'s arguments, e.g. "
                        f"{{{', '.join(repr(a) + ': ...' for a in list(accepted)[:2])}}}; got {model_hparams!r:.80} "
                        f"({type(model_hparams).__name__}).")
    unknown = [key for key in model_hparams if key not in accepted]
    if unknown and not extra_ok:
        close = difflib.get_close_matches(str(unknown[0]), list(accepted), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ModelHparamsError(
            f"model_hparams key(s) {unknown} are not accepted by {model_class.__name__}.{hint} "
            f"It accepts: {sorted(accepted)}."
        )


def make_adapter(model_class, model_hparams: Mapping[str, Any], seed: int = 0):
    """The adapter for a ``flax.linen.Module`` or ``flax.nnx.Module`` class (else a clear error)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__}); e.g. seed=42.")
    if isinstance(model_class, (nn.Module, nnx.Module)):
        raise TypeError(f"model_class must be a class, got an instance of {type(model_class).__name__}: pass "
                        f"model_class={type(model_class).__name__} and its arguments in model_hparams.")
    if isinstance(model_class, type) and issubclass(model_class, nn.Module):
        fields = [f.name for f in dataclasses.fields(model_class) if f.name not in ("parent", "name")]
        _check_hparams(model_class, model_hparams, fields, extra_ok=False)
        return LinenAdapter(model_class(**model_hparams))
    if is_nnx_model(model_class):
        params = inspect.signature(model_class.__init__).parameters
        extra_ok = any(p.kind is p.VAR_KEYWORD for p in params.values())
        _check_hparams(model_class, model_hparams, [n for n in params if n not in ("self", "rngs")], extra_ok)
        if "rngs" not in params and not extra_ok:
            raise ModelHparamsError(
                f"{model_class.__name__}.__init__ takes no rngs argument: flaxlight builds an NNX model as "
                f"{model_class.__name__}(**model_hparams, rngs=nnx.Rngs(seed)), as NNX layers take their keys at "
                f"construction. Add `*, rngs: nnx.Rngs` to its __init__ and build its layers with it.")
        return NNXAdapter(model_class, dict(model_hparams), seed)
    what = (f"the class {model_class.__name__!r}, which is not a flax Module" if isinstance(model_class, type)
            else f"{model_class!r:.80} ({type(model_class).__name__})")
    raise TypeError(
        f"model_class must be a flax.linen.Module or flax.nnx.Module subclass; got {what}. Define the model as a "
        f"subclass of flax.linen.Module (or flax.nnx.Module) and pass the class itself, with its arguments in "
        f"model_hparams."
    )


class LinenAdapter:
    """A ``flax.linen`` module: ``init``/``apply`` as Flax defines them, ``train`` passed when taken."""

    kind = "linen"
    annotations = None  # Linen's partitioning boxes come with the initial params (see flaxlight.distributed)

    def __init__(self, module: nn.Module):
        self.module = module
        self.takes_train = "train" in _call_parameters(type(module).__call__)

    def _train_kwargs(self, train: bool) -> dict:
        return {"train": train} if self.takes_train else {}

    def _explain(self, exc: Exception) -> None:
        """Name the usual cause of a dropout error in a model without a `train` argument."""
        if not self.takes_train and "deterministic" in str(exc):
            raise TypeError(
                f"{type(self.module).__name__} uses Dropout but its __call__ takes no `train` argument; add "
                f"`train: bool = False` and use nn.Dropout(rate, deterministic=not train)."
            ) from exc

    def init(self, rng, inputs: Sequence[Any]) -> dict:
        params_rng, dropout_rng = jax.random.split(rng)
        try:
            return self.module.init({"params": params_rng, "dropout": dropout_rng}, *inputs, **self._train_kwargs(True))
        except Exception as exc:
            self._explain(exc)
            raise

    def apply(self, variables, *inputs, train: bool = False, **kwargs):
        try:
            return self.module.apply(variables, *inputs, **self._train_kwargs(train), **kwargs)
        except flax.errors.ScopeCollectionNotFound as exc:  # raised while tracing: costs the step nothing
            found = re.search(r'access "([^"]+)" from collection "([^"]+)"', str(exc))
            name, collection = found.groups() if found else ("...", "...")
            raise ValueError(
                f"{type(self.module).__name__} reads the variable collection {collection!r}, which flaxlight does not "
                f"keep: the train state holds 'params' and 'batch_stats' (the model's mutable state: train steps "
                f"update it through loss_fn's updates, checkpoints save it). Keep such state in 'batch_stats', e.g. "
                f"self.variable('batch_stats', {name!r}, ...).") from exc

    def tabulate(self, inputs: Sequence[Any]) -> str:
        rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
        try:
            return self.module.tabulate(rngs, *inputs, **self._train_kwargs(True),
                                        console_kwargs={"width": 120, "force_terminal": sys.stdout.isatty()})
        except Exception as exc:
            self._explain(exc)
            raise

    def bind(self, variables):
        """The module bound to ``variables``: call it like a function, ``model(x, train=False)``."""
        return self.module.bind(variables)


def _lazy_sharding():
    """Build NNX variables unsharded even when annotated (flax 0.12 otherwise wants a mesh here)."""
    use_eager_sharding = getattr(nnx, "use_eager_sharding", None)  # flax >= 0.12
    return use_eager_sharding(False) if use_eager_sharding is not None else contextlib.nullcontext()


def _nnx_annotations(params) -> Any:
    """Per parameter its ``PartitionSpec`` (``nnx.with_partitioning`` metadata) or ``"unannotated"``
    (a pure dict, as :func:`flaxlight.distributed.split_annotations` gives for Linen); None when none is."""
    def annotation(variable):
        metadata = variable.get_metadata()
        names = next((metadata[key] for key in ("out_sharding", "sharding_names", "sharding") if metadata.get(key)),
                     None)
        return jax.sharding.PartitionSpec(*names) if names else "unannotated"

    tree = nnx.to_pure_dict(jax.tree.map(annotation, params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    specs = jax.tree.leaves(tree)
    return tree if any(not isinstance(spec, str) for spec in specs) else None


# An NNX module's state that training updates besides its params: BatchNorm's statistics and any
# variable type of the user's (``class Count(nnx.Variable)``); not RNG state or sown intermediates.
MODEL_STATE = nnx.All(nnx.Variable, nnx.Not(nnx.Any(nnx.Param, nnx.RngState, nnx.Intermediate)))


class NNXAdapter:
    """A ``flax.nnx`` module split once into graph definition + pure state.

    ``train``: the module is switched with ``model.train()`` / ``model.eval()``, which sets
    Dropout's ``deterministic`` and BatchNorm's ``use_running_average``, and ``train`` is also
    passed to ``__call__`` when it takes it (or ``deterministic=not train``). Variables other
    than params, RNG state and sown intermediates (``nnx.BatchStat``, a user's
    ``class Count(nnx.Variable)``) are the model's state: the train step updates them, they are
    checkpointed, and evaluation reads them without changing them. Dropout keys come from
    the trainer's RNG each step (``nnx.reseed``), so the step stays a pure function. A module
    whose ``__call__`` takes ``rngs`` (the NNX tutorial's ``nnx.Dropout(rate)`` given its keys
    at call time) gets ``nnx.Rngs(dropout=<the step's key>)`` in training and ``None`` in
    evaluation, unless the loss passes its own (``state.apply_model(..., rngs=nnx.Rngs(...))``).
    """

    kind = "nnx"

    def __init__(self, model_class, model_hparams: dict, seed: int):
        self.model_class, self.model_hparams = model_class, model_hparams
        with _lazy_sharding():  # annotations stay metadata: the trainer places the params on its mesh
            self.module = model_class(**model_hparams, rngs=nnx.Rngs(seed))
        self.graphdef, params, batch_stats, self.rest = nnx.split(self.module, nnx.Param, MODEL_STATE, ...)
        self.annotations = _nnx_annotations(params)
        self.params_template, self.batch_stats_template = params, batch_stats
        self.has_batch_stats = bool(jax.tree.leaves(batch_stats))
        self.rng_streams = sorted({v.tag for v in jax.tree.leaves(self.rest, is_leaf=lambda v: isinstance(v, nnx.RngKey))
                                   if isinstance(v, nnx.RngKey)})
        call = _call_parameters(model_class.__call__)
        self.mode_argument = "train" if "train" in call else "deterministic" if "deterministic" in call else None
        self.takes_rngs = "rngs" in call

    def init(self, rng, inputs: Sequence[Any]) -> dict:
        """The module's initial state as pure dicts (NNX initialises at construction)."""
        variables = {"params": nnx.to_pure_dict(self.params_template)}
        if self.has_batch_stats:
            variables["batch_stats"] = nnx.to_pure_dict(self.batch_stats_template)
        return variables

    def merge(self, variables: Mapping[str, Any]):
        """A live module carrying ``variables`` (works inside ``jit`` too)."""
        params = jax.tree.map(lambda x: x, self.params_template)
        nnx.replace_by_pure_dict(params, variables["params"])
        batch_stats = jax.tree.map(lambda x: x, self.batch_stats_template)
        if self.has_batch_stats and variables.get("batch_stats") is not None:
            nnx.replace_by_pure_dict(batch_stats, variables["batch_stats"])
        rest = jax.tree.map(lambda x: x, self.rest)  # fresh Variables: reseeding them inside jit is allowed
        return nnx.merge(self.graphdef, params, batch_stats, rest)

    def _call(self, model, inputs, train: bool, kwargs):
        model.train() if train else model.eval()  # layers not handed the argument below follow the mode
        if self.mode_argument == "train":
            return model(*inputs, train=train, **kwargs)
        if self.mode_argument == "deterministic":
            return model(*inputs, deterministic=not train, **kwargs)
        return model(*inputs, **kwargs)

    def apply(self, variables, *inputs, train: bool = False, rngs=None, mutable=False, model_rngs=None, **kwargs):
        """Linen-style apply: returns outputs, or ``(outputs, {"batch_stats": ...})`` if mutable
        (``True`` or a list naming ``"batch_stats"``); a list naming ``"intermediates"`` adds what
        the module sows (``self.sow(nnx.Intermediate, ...)``) as ``updates["intermediates"]``.
        ``rngs``: the trainer's streams (``{"dropout": key}``); ``model_rngs``: an ``nnx.Rngs``
        for a ``__call__`` that takes ``rngs``."""
        if mutable is True:
            collections = {"batch_stats"}
        else:
            collections = {mutable} if isinstance(mutable, str) else set(mutable or ())
        unknown = sorted(collections - {"batch_stats", "intermediates"})
        if unknown:
            raise ValueError(f"{self.model_class.__name__}: mutable={mutable!r} names {unknown}; an NNX module's "
                             f"collections here are 'batch_stats' (its model state) and 'intermediates' (sown values).")
        model = self.merge(variables)
        key = rngs.get("dropout") if rngs is not None else None
        if key is not None and self.rng_streams:
            keys = jax.random.split(key, len(self.rng_streams))
            nnx.reseed(model, **dict(zip(self.rng_streams, keys)))
        if self.takes_rngs:
            if model_rngs is None and train and key is not None:
                model_rngs = nnx.Rngs(dropout=key)  # call-time keys, from the step's key: reproducible
            kwargs["rngs"] = model_rngs
        elif model_rngs is not None:
            raise TypeError(f"{self.model_class.__name__}.__call__ takes no rngs argument, but rngs= was passed to "
                            f"apply_model; give the module its rngs at construction instead.")
        unseeded = train and key is None and self.rng_streams  # the streams hold the keys they were built with
        counts = jax.tree.leaves(nnx.state(model, nnx.RngCount)) if unseeded else []
        if "intermediates" in collections:
            outputs, sown = self._call_capturing(model, inputs, train, kwargs)
        else:
            outputs = self._call(model, inputs, train, kwargs)
        if unseeded and any(now is not before
                            for now, before in zip(jax.tree.leaves(nnx.state(model, nnx.RngCount)), counts)):
            raise ValueError(
                f"{self.model_class.__name__} drew random numbers (e.g. a dropout mask) from its nnx RNG streams "
                f"{self.rng_streams} with train=True, but apply_model got no rng: every call would draw the same "
                f"numbers. Pass a key: state.apply_model(params, x, train=train, rng=rng) (in loss_fn, its rng "
                f"argument), or train=False for outputs without dropout.")
        if not mutable:
            return outputs
        updates = {}
        if self.has_batch_stats and "batch_stats" in collections:
            updates["batch_stats"] = nnx.to_pure_dict(nnx.state(model, MODEL_STATE))
        if "intermediates" in collections:
            updates["intermediates"] = sown
        return outputs, updates

    def _call_capturing(self, model, inputs, train: bool, kwargs) -> tuple[Any, dict]:
        """``(outputs, sown)``: the call, with what the module sows as ``nnx.Intermediate`` as a
        pure dict (``{"hidden": (value,)}``, nested by submodule). ``nnx.capture`` (flax >= 0.12)
        collects them; older flax stores them on the module, where ``nnx.pop`` takes them."""
        capture = getattr(nnx, "capture", None)
        if capture is not None:
            outputs, sown = capture(lambda module: self._call(module, inputs, train, kwargs), nnx.Intermediate)(model)
        else:  # pragma: no cover - flax < 0.12
            outputs = self._call(model, inputs, train, kwargs)
            sown = nnx.pop(model, nnx.Intermediate)
        return outputs, nnx.to_pure_dict(sown)

    def tabulate(self, inputs: Sequence[Any]) -> str:
        """``nnx.tabulate``'s table, in eval mode (same shapes; a dropout built without rngs
        needs none). ``nnx.tabulate`` patches the model's classes and leaves them patched when the
        model fails; they are put back, so a failed table never breaks the training after it."""
        model = self.merge(self.init(None, inputs))
        model.eval()
        classes = {type(node) for _, node in nnx.iter_graph(model)}
        saved = {cls: dict(vars(cls)) for cls in classes}
        mode = {"train": {"train": False}, "deterministic": {"deterministic": True}}.get(self.mode_argument, {})
        try:
            return nnx.tabulate(model, *inputs, **mode,
                                console_kwargs={"width": 120, "force_terminal": sys.stdout.isatty()})
        except Exception as exc:  # noqa: BLE001 - a summary must never stop training
            for cls, attributes in saved.items():
                for name in set(vars(cls)) - set(attributes):
                    delattr(cls, name)
                for name, value in attributes.items():
                    if vars(cls).get(name) is not value:
                        setattr(cls, name, value)
            return f"{self.model_class.__name__} (NNX): no table ({type(exc).__name__}: {exc})"

    def bind(self, variables):
        """A live NNX module carrying the trained weights, in eval mode."""
        model = self.merge(variables)
        model.eval()
        return model
