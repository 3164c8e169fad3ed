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
import warnings
from typing import Any, Mapping, Sequence

import flax
import flax.errors
import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from flaxlight.messages import warn_at_user

__all__ = ["LinenAdapter", "NNXAdapter", "make_adapter", "is_nnx_model", "ModelHparamsError", "rngs_given_message"]


def is_nnx_model(model_class) -> bool:
    return isinstance(model_class, type) and issubclass(model_class, nnx.Module)


def _call_parameters(fn) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


# The mode arguments flaxlight passes to a model's ``__call__`` (the first of these names it takes),
# each with its value in training: ``train`` (flaxlight's examples), ``training`` (Keras' and the
# Flax "Linen to NNX" guide's) and ``deterministic`` (Flax's own layers: the inverse).
MODE_ARGUMENTS = (("train", True), ("training", True), ("deterministic", False))

# Names that read as a mode switch but that flaxlight does not pass: a warning (an error when the
# argument has no default) says so when the trainer is built, instead of a model silently trained
# in eval mode (no dropout, BatchNorm statistics never updated).
_UNSET_MODE_NAMES = frozenset({
    "is_training", "is_train", "train_mode", "training_mode", "is_eval", "eval", "eval_mode", "evaluation",
    "is_evaluation", "inference", "is_inference", "is_test", "test_mode", "use_running_average",
    "is_deterministic"})

_MODE_NAMES_TEXT = ("train=True to __call__ (or training=True, or deterministic=False: the first of these names "
                    "__call__ takes)")


def mode_argument(parameters) -> str | None:
    """The mode argument flaxlight passes to a ``__call__`` taking ``parameters`` (names), or None.

    Examples:
        >>> mode_argument(["self", "x", "deterministic"]), mode_argument(["self", "x"])
        ('deterministic', None)
    """
    return next((name for name, _ in MODE_ARGUMENTS if name in parameters), None)


def mode_kwargs(argument: str | None, train: bool) -> dict:
    """The keyword arguments that put a model in training (``train=True``) or eval mode.

    Examples:
        >>> mode_kwargs("deterministic", True), mode_kwargs("training", False), mode_kwargs(None, True)
        ({'deterministic': False}, {'training': False}, {})
    """
    if argument is None:
        return {}
    return {argument: train if dict(MODE_ARGUMENTS)[argument] else not train}


def _check_unset_mode(model_name: str, parameters: Mapping[str, inspect.Parameter], argument: str | None,
                      nnx_mode: bool) -> None:
    """A warning for a mode-like ``__call__`` argument flaxlight does not pass (an error when it has
    no default: every call would fail); nothing when ``__call__`` takes one flaxlight passes."""
    unset = [parameter for name, parameter in parameters.items() if name in _UNSET_MODE_NAMES]
    if argument is not None or not unset:
        return
    flag = unset[0]
    also = " (and calls model.train() / model.eval(), which switch the NNX layers handed no argument)" \
        if nnx_mode else ""
    text = (f"{model_name}.__call__ takes `{flag.name}`, which flaxlight does not set: it runs a model in training "
            f"mode by passing {_MODE_NAMES_TEXT}, False in evaluation{also}, and {model_name}.__call__ takes none "
            f"of these. Rename `{flag.name}` to `train` (or `training`; `deterministic` means the inverse) and hand "
            f"it on, e.g. BatchNorm(use_running_average=not train), Dropout(rate, deterministic=not train).")
    if flag.default is inspect.Parameter.empty:
        raise TypeError(f"{text} (It has no default, so every call flaxlight makes would fail.)")
    if nnx_mode and flag.default is None:  # NNX's convention: None follows model.train() / model.eval()
        return
    warn_at_user(f"{text} As it is, `{flag.name}` keeps its default ({flag.default!r}) in training and evaluation "
                 f"alike, unless your loss_fn passes it (state.apply_model(params, x, {flag.name}=..., ...)): "
                 f"ignore this then.")


class ModelHparamsError(TypeError):
    """``model_hparams`` that the model class does not take (a setting, not a bug in the model)."""


def rngs_given_message(given: str, value: Any, model: str = "Model") -> str:
    """Why ``rngs`` handed to the trainer is refused (``given``: where, ``"MyTrainer got"``): the
    trainer builds the model with keys from its ``seed``, and would otherwise ignore it or fail.

    Examples:
        >>> text = rngs_given_message("MyTrainer got", nnx.Rngs(7))
        >>> text.startswith("MyTrainer got rngs=<an nnx.Rngs>, which flaxlight does not take"), "seed=7" in text
        (True, True)
    """
    what = "an nnx.Rngs" if isinstance(value, nnx.Rngs) else f"a {type(value).__name__}"
    return (f"{given} rngs=<{what}>, which flaxlight does not take: it makes the model's random keys from the "
            f"trainer's seed, building an NNX model as {model}(**model_hparams, rngs=nnx.Rngs(seed)) (a Linen model "
            f"is initialised from jax.random.PRNGKey(seed)), and draws the dropout keys from it at every step. Pass "
            f"the int as the trainer's seed= instead (for nnx.Rngs(7): seed=7, an int), and leave rngs out.")


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


def shapes_text(inputs: Sequence[Any]) -> str:
    """``"an array of shape (1, 8, 8)"``, or for several inputs (or a pytree) each one's shapes.

    Examples:
        >>> shapes_text([np.zeros((1, 8))]), shapes_text([np.zeros((1, 8)), np.zeros((1, 3))])
        ('an array of shape (1, 8)', 'inputs of shapes (1, 8), (1, 3)')
    """
    def shapes(value) -> str:
        leaves = jax.tree.leaves(value)
        if len(leaves) == 1 and leaves[0] is value:
            return str(tuple(np.shape(value)))
        return "{" + ", ".join(f"{jax.tree_util.keystr(path)}: {tuple(np.shape(leaf))}"
                               for path, leaf in jax.tree_util.tree_leaves_with_path(value)) + "}"

    if len(inputs) == 1 and hasattr(inputs[0], "shape"):
        return f"an array of shape {tuple(np.shape(inputs[0]))}"
    return f"input{'s' * (len(inputs) > 1)} of shape{'s' * (len(inputs) > 1)} {', '.join(map(shapes, inputs))}"


# What a model may raise when the example input does not fit it (a shape, a rank, a size): these get
# a note with what flaxlight knows (the model, its hparams, exmp_input); any other error is left as it is.
MODEL_FIT_ERRORS = (TypeError, ValueError, IndexError, AssertionError, flax.errors.FlaxError)


def note_unfit_example(exc: Exception, model_name: str, model_hparams: Mapping[str, Any], inputs: Sequence[Any],
                       how: str, advice: str) -> None:
    """Add flaxlight's note to ``exc``, the model's error when the trainer, as it is built, calls it
    on ``exmp_input`` (``inputs``): which model (and ``model_hparams``), the example's shapes, ``how``
    it was called, and ``advice``. The error itself is raised as it is (its type, the model's own
    message and traceback kept); one that is no shape error (a ``NameError`` in the model) gets none.

    Examples:
        >>> error = TypeError("dot_general requires contracting dimensions to have the same shape")
        >>> note_unfit_example(error, "MLP", {"din": 3}, [np.zeros((1, 4))], "model(*exmp_input)", "Fix din.")
        >>> error.__notes__[0][:80]
        'flaxlight: MLP(din=3) cannot be called on exmp_input (an array of shape (1, 4)),'
    """
    if not isinstance(exc, MODEL_FIT_ERRORS):
        return
    hparams = ", ".join(f"{key}={value!r:.60}" for key, value in model_hparams.items())
    exc.add_note(f"flaxlight: {model_name}({hparams}) cannot be called on exmp_input ({shapes_text(inputs)}), as the "
                 f"trainer does when it is built ({how}): the error above. If it is about a shape: {advice} exmp_input "
                 f"must be one batch of the model's inputs, batch axis first (x[:1], not x[0]).")


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
        return LinenAdapter(model_class(**model_hparams), model_hparams=model_hparams)
    if is_nnx_model(model_class):
        params = inspect.signature(model_class.__init__).parameters
        extra_ok = any(p.kind is p.VAR_KEYWORD for p in params.values())
        if isinstance(model_hparams, Mapping) and "rngs" in model_hparams:
            raise ModelHparamsError(rngs_given_message("model_hparams hold", model_hparams["rngs"],
                                                       model_class.__name__))
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
    """A ``flax.linen`` module: ``init``/``apply`` as Flax defines them, the mode passed when taken.

    ``mode_argument``: the argument of ``__call__`` that switches training and eval mode, the
    first of ``train``, ``training`` and ``deterministic`` it takes (``deterministic=not train``),
    or None (the model has no mode, e.g. no dropout and no BatchNorm).
    """

    kind = "linen"
    annotations = None  # Linen's partitioning boxes come with the initial params (see flaxlight.distributed)

    def __init__(self, module: nn.Module, model_hparams: Mapping[str, Any] | None = None):
        self.module = module
        self.model_hparams = dict(model_hparams) if model_hparams is not None else {
            f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.name not in ("parent", "name")}
        parameters = _call_parameters(type(module).__call__)
        self.mode_argument = mode_argument(parameters)
        _check_unset_mode(type(module).__name__, parameters, self.mode_argument, nnx_mode=False)

    def mode_description(self) -> str:
        """What flaxlight passes to the model to switch its mode, for messages."""
        name = type(self.module).__name__
        if self.mode_argument is None:
            return (f"{name}.__call__ takes none of `train`, `training`, `deterministic`, so flaxlight passes it no "
                    f"mode argument")
        value = mode_kwargs(self.mode_argument, True)[self.mode_argument]
        return f"flaxlight calls {name} with {self.mode_argument}={value} in training"

    def _train_kwargs(self, train: bool) -> dict:
        return mode_kwargs(self.mode_argument, train)

    def _explain(self, exc: Exception) -> None:
        """Name the usual cause of a Dropout or BatchNorm error: the layer is not handed the mode."""
        text, name, argument = str(exc), type(self.module).__name__, self.mode_argument
        if '"use_running_average" must be passed' in text:
            layer, fix = "BatchNorm", "nn.BatchNorm(use_running_average={})"
        elif '"deterministic" must be passed' in text or (argument is None and "deterministic" in text):
            layer, fix = "Dropout", "nn.Dropout(rate, deterministic={})"
        else:
            return
        if argument is None:
            raise TypeError(
                f"{name} uses {layer} but its __call__ takes no `train` argument (nor `training` or `deterministic`), "
                f"so its {layer} does not know the mode; add `train: bool = False` and use {fix.format('not train')}."
            ) from exc
        value = "deterministic" if argument == "deterministic" else f"not {argument}"
        raise TypeError(f"{name} uses {layer} without handing it the mode: flaxlight passes `{argument}` to "
                        f"{name}.__call__; hand it on, e.g. {fix.format(value)}.") from exc

    def init(self, rng, inputs: Sequence[Any]) -> dict:
        """``module.init`` in training mode, with ``params`` and ``dropout`` streams split from
        ``rng`` (the UvA guide passes ``rng`` itself as the params key: docs/from-uva.md)."""
        params_rng, dropout_rng = jax.random.split(rng)
        try:
            return self.module.init({"params": params_rng, "dropout": dropout_rng}, *inputs, **self._train_kwargs(True))
        except Exception as exc:
            self._explain(exc)
            self._note_unfit(exc, inputs, "model.init")
            raise

    def _note_unfit(self, exc: Exception, inputs: Sequence[Any], called: str) -> None:
        mode = ", ".join(f"{k}={v}" for k, v in self._train_kwargs(True).items())
        note_unfit_example(exc, type(self.module).__name__, self.model_hparams, inputs,
                           f"{called}(rngs, *exmp_input{', ' + mode if mode else ''})",
                           "A Linen model's layers take their input sizes from exmp_input; the sizes its "
                           "model_hparams fix must fit it.")

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
        except flax.errors.ScopeParamNotFoundError as exc:
            exc.add_note(self._uninitialised_note(exc, kwargs))
            raise

    def _uninitialised_note(self, exc: Exception, kwargs: Mapping[str, Any]) -> str:
        """Why a parameter may be missing: the layer sits on a branch the init call did not take."""
        found = re.search(r'parameter named "([^"]+)" in scope "([^"]+)"', str(exc))
        where = f"{found.group(2)}/{found.group(1)}" if found else "a parameter"
        name = type(self.module).__name__
        init_call = ", ".join(["*exmp_input", *(f"{k}={v}" for k, v in self._train_kwargs(True).items())])
        given = {key: f"{key}={value!r:.40}" for key, value in kwargs.items() if key not in ("rngs", "mutable")}
        this_call = f" This call passes {', '.join(given.values())}, which that one did not." if given else ""
        key, branch = next(iter(given.items()), ("project", "project=True"))
        return (f"flaxlight: {name} has no {where}: the trainer initialised the model by calling it once, "
                f"model.init(rngs, {init_call}) (run_model_init), which creates only the layers that call "
                f"reaches.{this_call} A layer used only on a branch init did not take (a head used only with "
                f"{branch}) has no parameters: create it at init too (`if {key} or self.is_initializing():`, its "
                f"output may be dropped there), or override run_model_init(self, exmp_input, init_rng) to initialise "
                f"with that branch on (model.init(..., {branch})). See docs/models.md.")

    def tabulate(self, inputs: Sequence[Any]) -> str:
        rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
        try:
            return self.module.tabulate(rngs, *inputs, **self._train_kwargs(True),
                                        console_kwargs={"width": 120, "force_terminal": sys.stdout.isatty()})
        except Exception as exc:
            self._explain(exc)
            self._note_unfit(exc, inputs, "model.tabulate")  # the summary is the first call, when on
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


_RESEED_TAKES_POLICY = "policy" in inspect.signature(nnx.reseed).parameters  # not in flax 0.10


def _reseed(model, stream_keys: Mapping[str, Any]) -> None:
    """``nnx.reseed`` of the streams in ``stream_keys``. A stream built with a key per layer
    (``nnx.split_rngs`` + ``nnx.vmap``, Flax's "scan over layers") has a key array; it gets
    ``jax.random.split(key, shape)`` (``policy="match_shape"``), a fresh key per layer. A scalar
    key is set as it always was (bitwise the same masks)."""
    if _RESEED_TAKES_POLICY:
        nnx.reseed(model, policy="match_shape", **stream_keys)
        return
    try:  # pragma: no cover - flax 0.10 sets scalar keys only
        nnx.reseed(model, **stream_keys)
    except ValueError as exc:  # pragma: no cover
        if "non-scalar key" not in str(exc):
            raise
        raise ValueError(f"{type(model).__name__} holds a key per layer (nnx.split_rngs + nnx.vmap), which this flax "
                         f"({flax.__version__}) cannot reseed from the step's key: upgrade flax (an nnx.reseed that "
                         f"takes policy='match_shape', as flax 0.12's does).") from exc


class _StackedKeysError(ValueError):
    """An NNX model drew one key from a stream that holds a key per stacked layer."""


def _stacked_keys_text(name: str, exc: Exception) -> str:
    return (f"{name} drew a single key from an RNG stream that holds a key per stacked layer ({exc}). That is flax "
            f"0.10's \"scan over layers\", `@nnx.split_rngs(splits=n)` on the `nnx.scan` in __call__: since flax 0.11 "
            f"the layers built by `nnx.split_rngs(splits=n)` + `nnx.vmap` keep a key each, and splitting them again "
            f"fails in flax itself (flax {flax.__version__}), with or without flaxlight. Remove the "
            f"`@nnx.split_rngs(...)` above the `nnx.scan` in {name}.__call__ (keep the one on the function that builds "
            f"the layers): each layer's Dropout then draws from its own key, which flaxlight reseeds every step "
            f"(flax's guide \"NNX 0.10 to NNX 0.11\", \"Using Rngs in NNX Transforms\").")


def _owner_call(model, key: str):
    """The ``__call__`` of the (sub)module holding the attribute at ``key`` (``"blocks/0/calls"``)."""
    parent = tuple(key.split("/")[:-1])
    owner = next((node for path, node in nnx.iter_graph(model) if tuple(map(str, path)) == parent), model)
    return type(owner).__call__


def _warn_at_call(call, message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn_explicit`` at the ``def`` line of ``call`` (the user's ``__call__``): a check
    that runs while jax traces a step has no user line on the stack (``warn_at_user`` would name
    jax's or the loss's line), so the warning names the code that made the change instead."""
    code = getattr(inspect.unwrap(call), "__code__", None)
    if code is None:  # pragma: no cover - a __call__ that is no Python function (a C extension)
        warn_at_user(message, category)
        return
    module = sys.modules.get(getattr(call, "__module__", None) or "")
    module_globals = vars(module) if module is not None else None
    registry = module_globals.setdefault("__warningregistry__", {}) if module_globals is not None else None
    warnings.warn_explicit(message, category, code.co_filename, code.co_firstlineno,
                           module=getattr(module, "__name__", None), registry=registry, module_globals=module_globals)


def _keyless_dropouts(module) -> list[str]:
    """Paths (``"blocks/drop"``) of the ``nnx.Dropout`` layers that drop (rate > 0) and were built
    without rngs: they need keys at call time."""
    return ["/".join(str(part) for part in path) for path, node in nnx.iter_graph(module)
            if isinstance(node, nnx.Dropout) and node.rate > 0 and "rngs" in vars(node) and node.rngs is None
            and node.deterministic is not True]


def _traced_on(fn, inputs: Sequence[Any]) -> Any:
    """``jax.eval_shape`` of ``fn(*inputs)``: the arrays in ``inputs`` go in as their shapes and
    dtypes (a large ``exmp_input`` is not copied to the device); other leaves (a Python number) as they are."""
    leaves, treedef = jax.tree.flatten(list(inputs))
    arrays = [i for i, leaf in enumerate(leaves) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]

    def call(values):
        full = list(leaves)
        for i, value in zip(arrays, values):
            full[i] = value
        return fn(*jax.tree.unflatten(treedef, full))

    return jax.eval_shape(call, [jax.ShapeDtypeStruct(np.shape(leaves[i]), jax.dtypes.canonicalize_dtype(leaves[i].dtype))
                                 for i in arrays])


def _plain_attributes(model) -> dict[str, tuple[Any, str | None]]:
    """``{"blocks/0/calls": (value, text)}``: the attributes of the module and its submodules that are
    no ``nnx.Variable`` and no graph node (a Python number, a bare jax array, a list), which flaxlight's
    steps do not carry from one call to the next. ``text``: a builtin container's ``repr``, to see it
    changed in place (an append); None for other values, compared by identity or equality."""
    found = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for name, value in vars(node).items():
            if name.startswith(("_pytree__", "_object__", "_graph_node__")) or nnx.graph.is_graph_node(value):
                continue
            found["/".join(map(str, (*path, name)))] = (value, _container_text(value))
    return found


def _container_text(value: Any) -> str | None:
    """A list's, dict's or set's ``repr`` (what an append changes in place); None for anything else."""
    if not isinstance(value, (list, dict, set)):
        return None
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a container of objects without a repr: by identity then
        return None


def _changed_attributes(before: Mapping[str, tuple[Any, str | None]], model) -> list[str]:
    """The plain attributes (:func:`_plain_attributes`) that ``model``'s call set or changed."""
    changed = []
    for key, (value, text) in _plain_attributes(model).items():
        if key not in before:
            changed.append(key)
            continue
        old, old_text = before[key]
        if text is not None or old_text is not None:
            same = text == old_text
        elif value is old or isinstance(value, (jax.Array, np.ndarray)):
            same = value is old
        else:
            try:
                same = type(value) is type(old) and bool(value == old)
            except Exception:  # noqa: BLE001 - an object without a plain equality: by identity (not the same)
                same = False
        if not same:
            changed.append(key)
    return changed


def _changed_again(model, inputs: Sequence[Any], kwargs: Mapping[str, Any], changed: list[str]) -> list[str]:
    """Those of the plain attributes ``changed`` by a call of ``model`` that a second call, from the
    values the first left, changes again: state that is lost (a counter, an appended list, an
    array). One that comes back the same (``self.features = x.shape[-1]``) is set alike by every
    call, so it loses nothing. The second call runs on a copy, traced for shapes only (nothing is
    computed, the model and ``kwargs``' graph nodes are not touched); if it fails, all are kept."""
    again: list[str] = []

    def call(*xs):
        copy = nnx.clone(model)
        copied = {key: nnx.clone(value) if nnx.graph.is_graph_node(value) else value for key, value in kwargs.items()}
        before = _plain_attributes(copy)
        copy(*xs, **copied)
        again.extend(_changed_attributes(before, copy))

    try:
        _traced_on(call, inputs)
    except Exception:  # noqa: BLE001 - a call that cannot run twice (or copied): warn of every change
        return changed
    return [key for key in changed if key in again]


try:  # flax's promotion: the default of nnx.BatchNorm's promote_dtype, where it has one (newer than flax 0.10,
    # whose nnx.BatchNorm promotes as Linen's does)
    from flax.nnx.nn.dtypes import promote_dtype as _NNX_PROMOTE_DTYPE
except ImportError:  # pragma: no cover - a flax without the module
    _NNX_PROMOTE_DTYPE = None


def _promote_leaving_statistics(args, /, *, dtype=None, inexact=True):
    """``nnx.BatchNorm``'s ``promote_dtype`` as Linen's BatchNorm promotes: the input, scale and
    bias set the dtype the layer returns; the running mean and variance (float32) stay as they are,
    so they no longer widen bfloat16 activations to float32 (the normalisation itself still runs
    in float32, as flax computes ``x - mean`` and the batch statistics in at least float32)."""
    if len(args) != 5:  # a subclass promoting other values: flax's promotion
        return _NNX_PROMOTE_DTYPE(args, dtype=dtype, inexact=inexact)
    x, mean, var, scale, bias = args
    x, scale, bias = _NNX_PROMOTE_DTYPE((x, scale, bias), dtype=dtype, inexact=inexact)
    return x, mean, var, scale, bias


def _batch_norms_as_linen(model) -> None:
    """Let ``model``'s ``nnx.BatchNorm`` layers built with flax's defaults (``dtype=None`` and its
    ``promote_dtype``) promote as Linen's (:func:`_promote_leaving_statistics`):
    under ``precision="bf16"`` flax would promote the activations to the float32 of the running
    statistics, and every layer after the BatchNorm would compute in float32. ``model`` is the
    module :meth:`NNXAdapter.merge` built for this call; the user's module is left as it is, and
    a BatchNorm given its own ``dtype`` or ``promote_dtype`` keeps it."""
    if _NNX_PROMOTE_DTYPE is None:  # pragma: no cover
        return
    for _, node in nnx.iter_graph(model):  # flax 0.10's BatchNorm has no promote_dtype: left as it is
        if (isinstance(node, nnx.BatchNorm) and getattr(node, "dtype", 0) is None
                and getattr(node, "promote_dtype", None) is _NNX_PROMOTE_DTYPE):
            node.promote_dtype = _promote_leaving_statistics


# An NNX module's state that training updates besides its params: BatchNorm's statistics and any
# variable type of the user's (``class Count(nnx.Variable)``); not RNG state or sown intermediates.
MODEL_STATE = nnx.All(nnx.Variable, nnx.Not(nnx.Any(nnx.Param, nnx.RngState, nnx.Intermediate)))


class NNXAdapter:
    """A ``flax.nnx`` module split once into graph definition + pure state.

    ``train``: the module is switched with ``model.train()`` / ``model.eval()``, which sets
    Dropout's ``deterministic`` and BatchNorm's ``use_running_average``, and the mode is also
    passed to ``__call__`` when it takes a mode argument (``mode_argument``: the first of
    ``train``, ``training``, ``deterministic=not train`` it takes). Variables other
    than params, RNG state and sown intermediates (``nnx.BatchStat``, a user's
    ``class Count(nnx.Variable)``) are the model's state: the train step updates them, they are
    checkpointed, and evaluation reads them without changing them. Dropout keys come from
    the trainer's RNG each step (``nnx.reseed``; a stream holding a key per layer, as stacked
    layers built with ``nnx.split_rngs`` + ``nnx.vmap`` do, gets one per layer), so the step
    stays a pure function. A module
    whose ``__call__`` takes ``rngs`` (the NNX tutorial's ``nnx.Dropout(rate)`` given its keys
    at call time) gets ``nnx.Rngs(dropout=<the step's key>)`` in training and ``None`` in
    evaluation, unless the loss passes its own (``state.apply_model(..., rngs=nnx.Rngs(...))``).
    An attribute that is no ``nnx.Variable`` (a Python counter, a bare jax array, a list) is not
    state: each call rebuilds the module from the split state, so a change ``__call__`` makes to it
    is lost (warned of once: the calls up to the first in training mode are watched; not a value
    every call sets alike, such as ``self.features = x.shape[-1]``).
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
        self.mode_argument = mode_argument(call)
        _check_unset_mode(model_class.__name__, call, self.mode_argument, nnx_mode=True)
        self.takes_rngs = "rngs" in call
        self.watch_attributes = True  # until a call in training mode was watched (each call is traced once)
        self.keyless_dropouts = [] if self.takes_rngs else _keyless_dropouts(self.module)
        if self.keyless_dropouts and not self.rng_streams:  # no key anywhere: the first train step would fail
            raise TypeError(self._keyless_dropout_text())

    def _keyless_dropout_text(self) -> str:
        name, where = self.model_class.__name__, self.keyless_dropouts[0]
        return (f"{name}'s nnx.Dropout at {where!r} was built without rngs, and {name}.__call__ takes no rngs, so in "
                f"training it has no key to draw its mask from (Flax: \"no `rngs` argument was provided to "
                f"Dropout\"). Build it with the module's keys, `nnx.Dropout(rate, rngs=rngs)` in __init__ "
                f"(flaxlight reseeds them from the step's key every step), or take `rngs: nnx.Rngs | None = None` in "
                f"{name}.__call__ and hand it on, `self.dropout(x, rngs=rngs)` (flaxlight then passes "
                f"nnx.Rngs(dropout=<the step's key>) in training).")

    def mode_description(self) -> str:
        """What flaxlight does to switch the model's mode, for messages."""
        name = self.model_class.__name__
        called = (f"passes {self.mode_argument}={mode_kwargs(self.mode_argument, True)[self.mode_argument]} to "
                  f"{name}.__call__" if self.mode_argument else
                  f"passes no mode argument ({name}.__call__ takes none of `train`, `training`, `deterministic`)")
        return f"In training flaxlight calls model.train() and {called}"

    def init(self, rng, inputs: Sequence[Any]) -> dict:
        """The module's initial state as pure dicts (NNX initialises at construction), once the
        module is seen to take ``inputs`` (traced in eval mode, shapes only): an NNX model's input
        sizes come from its hparams, and one that does not fit ``exmp_input`` fails here, naming them."""
        variables = self._variables()
        try:
            _traced_on(lambda *xs: self.apply(variables, *xs, train=False), inputs)
        except Exception as exc:
            if isinstance(exc, _StackedKeysError):
                raise  # no shape error: its own message says what to change
            if not isinstance(exc, MODEL_FIT_ERRORS) or not self._called_as_trained(inputs):
                return variables  # no shape error (call-time rngs it draws from), or called otherwise by the loss
            call = ", ".join(["*exmp_input", *(f"{k}={v}" for k, v in mode_kwargs(self.mode_argument, False).items())])
            note_unfit_example(exc, self.model_class.__name__, self.model_hparams, inputs,
                               f"model.eval(); model({call}), shapes only",
                               "An NNX model takes its input sizes from model_hparams (its layers are built in "
                               "__init__; nothing is inferred from exmp_input): make them fit exmp_input, e.g. "
                               "din = its number of features.")
            raise
        return variables

    def _called_as_trained(self, inputs: Sequence[Any]) -> bool:
        """Whether the module's ``__call__`` takes ``inputs`` and the mode argument alone, as the
        check at construction calls it: not when it needs keywords ``exmp_input`` cannot carry
        (``mask=``, which the loss passes)."""
        try:
            inspect.signature(type(self.module).__call__).bind(None, *inputs, **mode_kwargs(self.mode_argument, False))
        except TypeError:
            return False
        return True

    def _variables(self) -> dict:
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
        before = _plain_attributes(model) if self.watch_attributes else None
        try:
            outputs = model(*inputs, **mode_kwargs(self.mode_argument, train), **kwargs)
        except ValueError as exc:  # raised while tracing: costs the step nothing
            if self.keyless_dropouts and "no `rngs` argument was provided to Dropout" in str(exc):
                raise ValueError(self._keyless_dropout_text()) from exc
            if "but was given a key array" in str(exc):
                raise _StackedKeysError(_stacked_keys_text(self.model_class.__name__, exc)) from exc
            raise
        if before is not None:
            changed = _changed_attributes(before, model)
            if changed:  # a value each call sets the same (a shape read at trace time) is no state that is lost
                changed = _changed_again(model, inputs, {**mode_kwargs(self.mode_argument, train), **kwargs}, changed)
            self._warn_changed_attributes(changed, train, model)
        return outputs

    def _warn_changed_attributes(self, changed: list[str], train: bool, model) -> None:
        """Warn (once) of plain attributes a call changed: the trainer's steps rebuild the module from
        its split state at every call (``merge``), so the change is lost, unlike under ``nnx.jit``. Watched
        until the first call in training mode (the trace of the train step, or its first un-jitted
        call with ``debug=True``): no cost per step."""
        self.watch_attributes = not (train or changed)
        if not changed:
            return
        name, shown = self.model_class.__name__, ", ".join(changed[:6]) + (", ..." if len(changed) > 6 else "")
        _warn_at_call(
            _owner_call(model, changed[0]),
            f"{name}.__call__ changes {shown}: plain attribute(s), not nnx.Variable. flaxlight's steps are pure "
            f"functions that rebuild the model from its split state at every call, so such an attribute stays at its "
            f"construction value in training, evaluation, checkpoints and the loaded model (a list appended to "
            f"collects values of each trace instead), unlike under nnx.jit. Keep state that changes in an "
            f"nnx.Variable subclass, e.g. class Count(nnx.Variable): pass; self.calls = Count(jnp.zeros((), "
            f"jnp.int32)) in __init__, self.calls[...] += 1 in __call__: flaxlight updates it in training, "
            f"checkpoints it and restores it (docs/models.md, \"BatchNorm\").")

    def apply(self, variables, *inputs, train: bool = False, rngs=None, mutable=False, model_rngs=None,
              computing_in=None, **kwargs):
        """Linen-style apply: returns outputs, or ``(outputs, {"batch_stats": ...})`` if mutable
        (``True`` or a list naming ``"batch_stats"``); a list naming ``"intermediates"`` adds what
        the module sows (``self.sow(nnx.Intermediate, ...)``) as ``updates["intermediates"]``.
        ``rngs``: the trainer's streams (``{"dropout": key}``); ``model_rngs``: an ``nnx.Rngs``
        for a ``__call__`` that takes ``rngs``. ``computing_in`` (bfloat16, given by
        ``precision="bf16"``'s casts): the ``nnx.BatchNorm`` layers built with flax's defaults
        return that dtype, as Linen's do, instead of their float32 statistics' (which would take
        every layer after them to float32); the statistics stay float32."""
        if mutable is True:
            collections = {"batch_stats"}
        else:
            collections = {mutable} if isinstance(mutable, str) else set(mutable or ())
        unknown = sorted(collections - {"batch_stats", "intermediates"})
        if unknown:
            raise ValueError(f"{self.model_class.__name__}: mutable={mutable!r} names {unknown}; an NNX module's "
                             f"collections here are 'batch_stats' (its model state) and 'intermediates' (sown values).")
        model = self.merge(variables)
        if computing_in is not None:
            _batch_norms_as_linen(model)
        key = rngs.get("dropout") if rngs is not None else None
        if key is not None and self.rng_streams:
            keys = jax.random.split(key, len(self.rng_streams))
            _reseed(model, dict(zip(self.rng_streams, keys)))
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
        needs none), called as the eval step calls the model (``rngs=None`` to a ``__call__``
        that takes ``rngs``, also where it has no default). ``nnx.tabulate`` patches the model's classes and leaves them patched when the
        model fails; they are put back, so a failed table never breaks the training after it."""
        model = self.merge(self._variables())
        model.eval()
        classes = {type(node) for _, node in nnx.iter_graph(model)}
        saved = {cls: dict(vars(cls)) for cls in classes}
        mode = mode_kwargs(self.mode_argument, False)
        if self.takes_rngs:  # as the eval step calls it: a __call__ that requires rngs gets None
            mode["rngs"] = None
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
