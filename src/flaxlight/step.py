"""One training step — forward, loss, backward, update — as a class and as pure functions.

A *loss function* has the signature::

    loss_fn(params, batch, *, train: bool, rng, state) -> (loss, metrics)
                                                        | (loss, (metrics, updates))
                                                        | loss

``metrics`` is a dict of scalars (the loss is added as ``"loss"`` unless given), ``updates`` a dict
of changed model collections (``{"batch_stats": ...}``, as returned by
:meth:`TrainState.apply_model`), which the step writes back into the state (a model with
``batch_stats`` whose loss returns none gets a warning: its statistics would never change). A bare
scalar loss means no metrics besides it.

The optimizer minimises ``loss + regularizer(params)`` (the regulariser is the L2 weight-decay term
in ``weight_decay_mode="l2"``, else absent). The metric ``"loss"`` is the loss function's value
*without* the penalty, so train and validation losses compare; the penalty is reported as
``"penalty"``. Optimizers that take extra arguments (``optax.GradientTransformationExtraArgs``:
every ``optax.chain``, ``reduce_on_plateau``, ``polyak_sgd``, ``lbfgs``, learned optimizers) get
``value=`` the minimised objective, ``grad=`` its gradient and ``value_fn=`` ``params -> objective``
on the same batch (what L-BFGS' line search needs).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
import jaxlib
import optax

from flaxlight.messages import logger as messages
from flaxlight.models import LinenAdapter, NNXAdapter
from flaxlight.optim import PRECISIONS, ema_params
from flaxlight.state import TrainState, step_key

__all__ = ["TrainStep", "apply_update", "computing_state", "make_train_step", "make_eval_step", "step_owner"]

LossFn = Callable[..., Any]

_EVAL_RNG_SEED = 0


def _split_loss(out, where: str):
    """``(loss, aux)`` from what a loss function returned (a bare scalar loss: no aux)."""
    if isinstance(out, (tuple, list)):
        if len(out) == 2 and getattr(out[0], "ndim", 0) != 0:
            raise TypeError(f"{where} returned a loss of shape {tuple(out[0].shape)}; the loss must be a scalar "
                            f"(a loss per example? take its mean: `return loss.mean(), (metrics, updates)`).")
        if len(out) == 2:
            return out[0], out[1]
        raise TypeError(f"{where} returned a {type(out).__name__} of {len(out)} items; it must return (loss, metrics) "
                        f"or (loss, (metrics, updates)): e.g. `return loss, (metrics, updates)`, not "
                        f"`return loss, metrics, updates`.")
    if getattr(out, "ndim", None) == 0 or isinstance(out, (int, float)):
        return out, None
    if isinstance(out, Mapping) and "loss" in out:  # Lightning's training_step habit: {"loss": loss, ...}
        rest = ", ".join(repr(key) for key in out if key != "loss")
        raise TypeError(f"{where} returned a dict with 'loss' (Lightning's training_step habit); flaxlight's loss_fn "
                        f"returns a tuple: `return loss, (metrics, updates)`"
                        + (f", with the dict's other entries ({rest}) as metrics." if rest else
                           " (metrics a dict of scalars, updates the model's batch-statistics updates, e.g. {})."))
    raise TypeError(f"{where} must return (loss, metrics) or (loss, (metrics, updates)) with a scalar loss; got "
                    f"{type(out).__name__}{f' of shape {tuple(out.shape)}' if hasattr(out, 'shape') else ''} (a "
                    f"loss per example? take its mean).")


def _call_loss(loss_fn: LossFn, params, batch, **kwargs):
    """``loss_fn(params, batch, **kwargs)``; an error from using ``params`` as the model (NNX's
    ``nnx.value_and_grad(loss_fn)(model)`` habit: ``model(x)``, ``model.layer``) gets a note."""
    try:
        return loss_fn(params, batch, **kwargs)
    except (TypeError, AttributeError) as exc:
        kind = type(params).__name__
        if isinstance(params, Mapping) and (f"'{kind}' object is not callable" in str(exc)
                                            or f"'{kind}' object has no attribute" in str(exc)):
            exc.add_note(_PARAMS_NOT_MODULE)
        raise


_PARAMS_NOT_MODULE = (
    "flaxlight: loss_fn's first argument is the model's parameters, a dict (what the trainer differentiates), not "
    "the model. If this error comes from using it as the model (model(x), as in an nnx.value_and_grad(loss_fn)(model) "
    "loop), call the model through the state, for Linen and NNX models alike: logits, updates = "
    "state.apply_model(params, x, train=train, rng=rng) (an NNX module is rebuilt from params inside it, in train or "
    "eval mode as train says), and return loss, (metrics, updates). See docs/models.md, 'Coming from a plain NNX "
    "training loop'.")


def _checked_updates(updates: dict, state: TrainState, where: str, *, warn: bool = True) -> dict:
    """``updates`` when each key is a field of the state (``batch_stats``), else a clear error."""
    fields = {field.name for field in dataclasses.fields(state)}
    if "intermediates" not in fields:  # sown values (apply_model(mutable=["intermediates"])): read, never kept
        updates = {key: value for key, value in updates.items() if key != "intermediates"}
    unknown = sorted(str(key) for key in updates if key not in fields)
    if unknown:
        raise TypeError(f"{where} returned updates with keys {unknown}, which are not model collections of the "
                        f"state (such as 'batch_stats'). Did you swap metrics and updates? Return "
                        f"(loss, (metrics, updates)), updates as state.apply_model(...) returns them.")
    if warn and "batch_stats" not in updates and _has_running_statistics(state.batch_stats):
        messages.warning(
            "The model has batch_stats (e.g. BatchNorm running statistics), but %s returned no updated "
            "'batch_stats', so they keep their initial values and evaluation uses those. Return "
            "(loss, (metrics, updates)) with the updates from state.apply_model(params, x, train=train, rng=rng) "
            "(ignore this if you keep them frozen on purpose).", where)
    elif warn and _passes_no_mode(state) and _statistics_untouched(updates.get("batch_stats"), state.batch_stats):
        messages.warning(
            "The model has BatchNorm running statistics, but the train step's forward pass left every one of them "
            "unchanged, and flaxlight hands the model no mode: %s. Its BatchNorm layers ran with "
            "use_running_average=True in training, so the statistics keep their values and evaluation uses those; "
            "its Dropout layers, if any, get no mode either. Take the mode in __call__ (`train: bool = False`, or "
            "`training`; `deterministic` is the inverse) and hand it on to every BatchNorm and Dropout: "
            "BatchNorm(use_running_average=not train), Dropout(rate, deterministic=not train) (ignore this if "
            "you keep the statistics frozen on purpose).",
            _mode_description(state))
    return updates


def _statistics_untouched(new, old) -> bool:
    """Whether the updated ``batch_stats`` hold each BatchNorm running statistic (``mean``, ``var``)
    as the very array the state gave the model: no BatchNorm updated its statistics. Decided while
    tracing, from the arrays' identity (no value is read)."""
    def statistics(tree) -> dict:
        return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
                if path and str(getattr(path[-1], "key", path[-1])) in ("mean", "var")}

    if new is None or old is None:
        return False
    before, after = statistics(old), statistics(new)
    return bool(before) and before.keys() == after.keys() and all(after[key] is before[key] for key in before)


def _passes_no_mode(state: TrainState) -> bool:
    """Whether flaxlight calls the state's model without a mode argument: its ``__call__`` takes
    none of ``train``, ``training``, ``deterministic`` (a model handed the mode that keeps its
    statistics froze them on purpose, e.g. to fine-tune)."""
    adapter = getattr(state.apply_fn, "__self__", None)
    return isinstance(adapter, (LinenAdapter, NNXAdapter)) and adapter.mode_argument is None


def _mode_description(state: TrainState) -> str:
    """What flaxlight passes to the state's model to put it in training mode (its adapter says)."""
    adapter = getattr(state.apply_fn, "__self__", None)
    if isinstance(adapter, (LinenAdapter, NNXAdapter)):
        return adapter.mode_description()
    return "The model is called by the state's own apply_fn, with what loss_fn passes it"


def _has_running_statistics(batch_stats) -> bool:
    """Whether ``batch_stats`` holds BatchNorm-style running statistics (leaves named ``mean`` and
    ``var``, as Linen's and NNX's BatchNorm name them), not only other model state (an NNX buffer)."""
    names = {str(getattr(path[-1], "key", path[-1])) for path, _ in jax.tree_util.tree_flatten_with_path(
        batch_stats if batch_stats is not None else {})[0] if path}
    return {"mean", "var"} <= names


def _split_aux(aux, where: str) -> tuple[dict, dict]:
    """Normalise a loss function's auxiliary output into ``(metrics, updates)``."""
    if aux is None:
        return {}, {}
    if isinstance(aux, Mapping):
        return dict(aux), {}
    if isinstance(aux, (tuple, list)) and len(aux) == 2:
        metrics, updates = aux
        if isinstance(metrics, Mapping) and (updates is None or isinstance(updates, Mapping)):
            return dict(metrics), dict(updates or {})
    raise TypeError(
        f"{where} must return (loss, metrics) or (loss, (metrics, updates)), with metrics a dict of "
        f"scalars and updates a dict of model collections such as {{'batch_stats': ...}}; "
        f"got aux of type {type(aux).__name__}."
    )


def _with_loss(metrics: dict, loss) -> dict:
    out = {"loss": loss}
    out.update(metrics)
    return out


def cast_floating(tree, dtype):
    """Floating-point arrays of ``tree`` cast to ``dtype``; integers and the rest unchanged.

    Examples:
        >>> cast_floating({"w": jnp.ones(2), "n": jnp.arange(2)}, jnp.bfloat16)["w"].dtype
        dtype(bfloat16)
    """

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def _as_float32(tree, dtype):
    """Floating leaves of ``tree`` in ``dtype`` as float32, rounded to ``dtype``'s precision by an
    explicit ``reduce_precision``: XLA may keep a low-precision result in float32 where a
    ``convert`` to float32 follows it (``xla_allow_excess_precision``), and does so differently
    in different programs; the explicit rounding gives every program (train step, eval step,
    ``predict``, an exported artifact) the same outputs."""
    info = jnp.finfo(dtype)

    def widen(x):
        if hasattr(x, "dtype") and x.dtype == dtype:
            return jax.lax.reduce_precision(jnp.asarray(x).astype(jnp.float32), exponent_bits=info.nexp,
                                            mantissa_bits=info.nmant)
        return x

    return jax.tree.map(widen, tree)


class _ComputingIn:
    """An ``apply_fn`` that runs the model in ``dtype`` (bfloat16): the floating inputs it is
    given (positional arrays and pytrees of them, keyword arrays) are cast to ``dtype``, and its
    outputs in ``dtype`` come back as float32 (rounded to ``dtype``), as Keras' mixed-precision
    policies and Lightning's autocast return them to the loss. Returned updates
    (``batch_stats``) are left as they are. An NNX model's ``nnx.BatchNorm`` layers return
    ``dtype`` as Linen's do (:meth:`NNXAdapter.apply`'s ``computing_in``), not the float32 of
    their statistics."""

    def __init__(self, apply_fn: Callable, dtype):
        self.apply_fn, self.dtype = apply_fn, dtype

    def __call__(self, variables, *inputs, **kwargs):
        kwargs = {key: jnp.asarray(value).astype(self.dtype)  # a floating input given by keyword (mask=m)
                  if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating) else value
                  for key, value in kwargs.items()}
        if isinstance(getattr(self.apply_fn, "__self__", None), NNXAdapter):
            kwargs["computing_in"] = self.dtype
        out = self.apply_fn(variables, *cast_floating(inputs, self.dtype), **kwargs)
        if kwargs.get("mutable"):  # (outputs, updates)
            return _as_float32(out[0], self.dtype), out[1]
        return _as_float32(out, self.dtype)

    def __eq__(self, other) -> bool:  # one static apply_fn for jit, however often it is made
        return isinstance(other, _ComputingIn) and (other.apply_fn, other.dtype) == (self.apply_fn, self.dtype)

    def __hash__(self) -> int:
        return hash((self.apply_fn, self.dtype))


def computing_state(state: TrainState, precision: str = "fp32") -> tuple[TrainState, Any]:
    """``(state, params)`` as the model computes with them under ``precision``: for ``"bf16"``,
    bfloat16 copies of ``state.params`` and a state whose model casts its floating inputs to
    bfloat16 and returns its bfloat16 outputs as float32; for ``"fp32"``, ``state`` and its
    params. The train step, the eval step, ``predict`` and ``export`` all compute through it.

    Examples:
        >>> state, params = computing_state(trainer.state, "bf16")          # doctest: +SKIP
        >>> outputs, _ = state.apply_model(params, x, train=False)          # doctest: +SKIP
        >>> outputs.dtype                                                    # doctest: +SKIP
        dtype('float32')
    """
    if precision != "bf16":
        return state, state.params
    return _in_bfloat16(state), cast_floating(state.params, jnp.bfloat16)


def _in_bfloat16(state: TrainState) -> TrainState:
    """``state`` whose model computes in bfloat16 (see :class:`_ComputingIn`)."""
    return state.replace(apply_fn=_ComputingIn(state.apply_fn, jnp.bfloat16))


def _matmul_dtypes(jaxpr) -> set[str]:
    """The operand dtypes of the matrix multiplications and convolutions in ``jaxpr`` (a jaxpr or
    closed jaxpr), nested calls, scans and branches included."""
    found: set[str] = set()
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            found.update(str(var.aval.dtype) for var in eqn.invars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found |= _matmul_dtypes(sub)
    return found


def _warn_if_computing_in_float32(forward: Callable, params) -> None:
    """With ``precision="bf16"``: warn when ``forward`` (params -> loss, traced once more here,
    forward only) multiplies matrices but never in bfloat16: something in the model made float32
    arrays that took the computation back to float32; else when a float32 value the model makes
    promotes part of it to float32 (:func:`_warn_if_partly_float32`)."""
    jaxpr = jax.make_jaxpr(forward)(params)
    dtypes = _matmul_dtypes(jaxpr)
    if "bfloat16" in dtypes:
        _warn_if_partly_float32(jaxpr)
        return
    if not dtypes:
        return
    messages.warning(
        "precision='bf16', but every matrix multiplication and convolution of the train step runs in %s: the "
        "run rounds its weights to bfloat16 without bfloat16's speed or memory savings. Likely cause: the model makes "
        "a float32 array, which promotes the bfloat16 weights back to float32, e.g. `x.astype(jnp.float32) / 255` on "
        "integer images (the Flax MNIST example), a jnp.float32 constant or table; or loss_fn calls the model other "
        "than through state.apply_model (which casts floating inputs to bfloat16). Fix: convert without naming "
        "float32 (`x / 255.0` stays bfloat16 in the model), give the data float inputs (apply_model casts them), or "
        "give the layers dtype=jnp.bfloat16; or use precision='fp32'.", " and ".join(sorted(dtypes)))


# Where the float32 values of a bf16 forward pass come from: "up", a bfloat16 value widened (an
# explicit `.astype(jnp.float32)`, a layer given dtype=jnp.float32); "native", a float32 value
# made as such (a constant or table, a float32 statistic, random numbers, an integer converted);
# or the equation where the two met: a promotion, from which the layers after it compute in float32.
_UP, _NATIVE = "up", "native"
_MATMULS = ("dot_general", "conv_general_dilated")


def _is_float32(var) -> bool:
    """A float32 variable that is no literal and not weakly typed (a Python float keeps bfloat16)."""
    aval = getattr(var, "aval", None)
    return not hasattr(var, "val") and getattr(aval, "dtype", None) == jnp.float32 and not aval.weak_type


def _joined(labels: list, eqn, widens: bool):
    """The label of a float32 result of ``eqn`` from its float32 inputs' ``labels`` (``widens``:
    it has bfloat16 inputs, e.g. a convert or a matrix multiplication to float32)."""
    sites = [label for label in labels if label is not None and not isinstance(label, str)]
    if sites:
        return sites[0]
    if _UP in labels and _NATIVE in labels:
        return eqn
    return _UP if widens or _UP in labels else _NATIVE


def _either(a, b):
    """One label for an output two branches (a cond's) give: a promotion in either, else the wider."""
    if a is None or b is None or a == b:
        return b if a is None else a
    return a if not isinstance(a, str) else b if not isinstance(b, str) else _UP


def _label_sub_jaxprs(eqn, inputs: list, top, found: list):
    """The labels of ``eqn``'s outputs from its sub-jaxprs (a jit, custom_jvp, scan, cond...), or None."""
    outputs = None
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            inner = sub.jaxpr if hasattr(getattr(sub, "jaxpr", None), "eqns") else sub  # a closed jaxpr's, or one
            if not hasattr(inner, "eqns") or not hasattr(inner, "invars"):
                continue
            count = len(inner.invars)  # a jit's or scan's inputs are the equation's; a cond's or while's its last
            env = dict(zip(inner.invars, inputs[len(inputs) - count:])) if count <= len(inputs) else \
                dict.fromkeys(inner.invars)
            labels = _label_float32(inner, env, top, found)
            if len(labels) == len(eqn.outvars):
                outputs = labels if outputs is None else [_either(a, b) for a, b in zip(outputs, labels)]
    return outputs


def _label_float32(jaxpr, env: dict, top, found: list) -> list:
    """Label the float32 values of ``jaxpr`` (see ``_UP``) and append ``(top-level equation,
    promotion)`` to ``found`` for each matrix multiplication or convolution, the promotion being
    the equation where a float32 value promoted its operands, ``"bfloat16"`` where it computes in
    bfloat16, or None (float32 on purpose); returns the labels of ``jaxpr``'s outputs."""
    def label(var):
        return env.get(var, _NATIVE) if _is_float32(var) else None

    for eqn in jaxpr.eqns:
        where = eqn if top is None else top
        inputs = [label(var) for var in eqn.invars]
        outputs = _label_sub_jaxprs(eqn, inputs, where, found)
        if outputs is None:
            low = any(str(getattr(var.aval, "dtype", "")) in ("bfloat16", "float16") for var in eqn.invars)
            result = _joined([value for value in inputs if value is not None], eqn, low)
            outputs = [result] * len(eqn.outvars)
            if eqn.primitive.name in _MATMULS:
                found.append((where, "bfloat16" if low else None if isinstance(result, str) else result))
        env.update((var, value) for var, value in zip(eqn.outvars, outputs) if _is_float32(var))
    return [label(var) for var in jaxpr.outvars]


_JAX_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (jax, jaxlib))
_LIBRARY_DIRS = _JAX_DIRS + tuple(os.path.dirname(module.__file__) + os.sep for module in (flax, optax)) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _frame_text(frame) -> str:
    """``"model.py:12 (Net.__call__)"``; a library's file from its package (``flax/linen/linear.py``)."""
    name = frame.file_name
    library = next((d for d in _LIBRARY_DIRS if name.startswith(d)), None)
    if library is not None:
        name = os.path.join(os.path.basename(library.rstrip(os.sep)), name[len(library):])
    elif name.startswith(os.getcwd() + os.sep):
        name = os.path.relpath(name)
    return f"{name}:{frame.line_num} ({frame.function_name})"


def _where(eqn) -> str:
    """Where in the user's code ``eqn`` was made, ``"model.py:12 (Net.__call__)"``, with the
    library layer that made it when one did (``"...; in flax/linen/linear.py:287 (Dense.__call__)"``)."""
    frames = [frame for frame in eqn.source_info.traceback.frames if not frame.file_name.startswith(_JAX_DIRS)]
    user = next((frame for frame in frames if not frame.file_name.startswith(_LIBRARY_DIRS)), None)
    if user is None:
        return _frame_text(frames[0]) if frames else "an unknown place"
    return _frame_text(user) + (f"; in {_frame_text(frames[0])}" if frames[0] is not user else "")


def _in_model(eqn) -> bool:
    """Whether ``eqn`` was made inside the model's call (:class:`_ComputingIn`), not in the loss."""
    codes, _ = eqn.source_info.traceback.raw_frames()
    return _ComputingIn.__call__.__code__ in codes


def _warn_if_partly_float32(jaxpr) -> None:
    """Warn when some of the model's matrix multiplications and convolutions compute in float32
    because a float32 value it makes (a constant or table, random numbers, a float32 statistic)
    met the bfloat16 activations and promoted them: a deliberate float32 part (an
    ``.astype(jnp.float32)`` head, a layer given ``dtype=jnp.float32``) is no promotion."""
    found: list = []
    try:
        _label_float32(jaxpr.jaxpr, {}, None, found)
        found = [(top, site) for top, site in found if _in_model(top)]
        promoted = [(top, site) for top, site in found if site not in (None, "bfloat16")]
        if not promoted:
            return
        places = list(dict.fromkeys(_where(site) for _, site in promoted))
        layers = list(dict.fromkeys(_where(top).split(";")[0] for top, _ in promoted))
    except Exception:  # noqa: BLE001 - a hint must never stop training (no tracebacks kept, a new jax)
        return
    messages.warning(
        "precision='bf16', but %d of the model's %d matrix multiplications and convolutions run in float32 (at %s): "
        "a float32 value meets the bfloat16 activations at %s and promotes them, and the layers after it, to float32 "
        "(a jnp.float32 constant or table, jax.random.normal(key, shape) without a dtype, a float32 statistic, an "
        "integer converted with .astype(jnp.float32)). The run rounds those layers' weights to bfloat16 without "
        "bfloat16's savings. Fix: make that value bfloat16 (`value.astype(x.dtype)`, `jax.random.normal(key, shape, "
        "x.dtype)`) or use Python floats (they keep bfloat16); if float32 there is on purpose, ignore this.",
        len(promoted), len(found), ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else ""),
        ", ".join(places[:3]) + (", ..." if len(places) > 3 else ""))


def _cast_like(new, old):
    """Changed model collections back to the dtypes the state holds (no recompiles, no drift)."""
    if old is None:
        return new
    return jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new, old)


def _global_norm(tree) -> jax.Array:
    """The L2 norm of all the leaves of ``tree`` together (``optax.global_norm``, stable across optax versions)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32))) for leaf in jax.tree.leaves(tree)))


def apply_update(state: TrainState, grads, *, value, value_fn=None, **replace) -> TrainState:
    """One optimizer update, handing the loss to optimizers that take extra arguments.

    ``tx.update(grads, opt_state, params, value=value, grad=grads, value_fn=value_fn)`` for an
    ``optax.GradientTransformationExtraArgs`` (a transformation that accepts only ``value`` gets
    only that); plain transformations get no extras. ``replace`` sets other state fields.
    """
    return state.apply_gradients(grads=grads, value=value, value_fn=value_fn, **replace)


class TrainStep:
    """A training step built from a loss function; jitted once on first use.

    Pure form (what the trainer uses)::

        step = TrainStep(loss_fn)
        state, metrics = step(state, batch)        # == step.step(state, batch), jit it yourself
        metrics = step.eval_step(state, batch)

    Stateful form (the seed's class: keeps ``self.state`` and a jitted, donated step)::

        step = TrainStep(loss_fn, state=state)
        (loss, aux), grads = step.backward(batch)
        metrics = step.train_step(batch)           # updates step.state; `state` is donated

    ``train_step`` donates the state it was given: ``state``'s arrays are deleted, so keep using
    ``step.state`` (or pass ``jax.tree.map(jnp.copy, state)`` to keep ``state``). A trainer's state
    (``TrainStep(trainer.loss_fn, state=trainer.state)``) is copied once instead, so the trainer
    still trains, evaluates and predicts afterwards.

    Subclasses may override :meth:`loss_fn` instead of passing one.

    Options: ``regularizer`` (``params -> scalar`` added to the minimised loss, e.g.
    :func:`flaxlight.optim.make_l2_regularizer`; reported as the metric ``"penalty"``, not in
    ``"loss"``), ``precision`` (``"bf16"``: the loss function gets bf16 copies of the parameters
    and a state whose ``apply_model`` casts the model's floating inputs to bf16 and returns its
    bf16 outputs as float32, so the loss is computed in float32 against the batch as given;
    gradients, parameters and the optimizer stay fp32; see :func:`computing_state`),
    ``eval_with_ema`` (evaluate with the
    parameters' moving average when the optimizer keeps one, ``ema_decay``), ``log_grad_norm``
    (add the metric ``"grad_norm"``: the global L2 norm of the step's gradients, before any
    clipping in the optimizer), ``frozen`` (``params -> pytree of bools``, True for parameters the
    optimizer keeps fixed, :func:`flaxlight.optim.make_freeze_mask`: their gradients are left out
    of ``"grad_norm"``, as Lightning's norms leave out parameters without gradients).

    Examples:
        >>> def loss_fn(params, batch, *, train, rng, state):
        ...     x, y = batch
        ...     pred, updates = state.apply_model(params, x, train=train, rng=rng)
        ...     return ((pred - y) ** 2).mean(), {}
        >>> step = TrainStep(loss_fn)               # doctest: +SKIP
    """

    def __init__(self, loss_fn: LossFn | None = None, state: TrainState | None = None, *, jit: bool = True,
                 regularizer: Callable[[Any], Any] | None = None, precision: str = "fp32",
                 eval_with_ema: bool = True, log_grad_norm: bool = False,
                 frozen: Callable[[Any], Any] | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"TrainStep precision must be one of {PRECISIONS}, got {precision!r}.")
        if regularizer is not None and not callable(regularizer):
            raise TypeError(f"TrainStep regularizer must be a function params -> scalar, got {type(regularizer).__name__}.")
        self.regularizer = regularizer
        self.precision = precision
        self.eval_with_ema = eval_with_ema
        self.log_grad_norm, self.frozen = log_grad_norm, frozen
        if loss_fn is not None:
            self.loss_fn = loss_fn  # type: ignore[method-assign]
        elif type(self).loss_fn is TrainStep.loss_fn:
            raise TypeError("TrainStep needs a loss function: TrainStep(loss_fn) or override `loss_fn`.")
        if type(self).backward is not TrainStep.backward and type(self).compute_gradients is TrainStep.compute_gradients:
            raise TypeError(f"{type(self).__name__} overrides backward, which only the stateful form calls: the "
                            f"step the trainer runs would not use it. Override compute_gradients(state, batch, rng) "
                            f"instead (step and backward both get their gradients from it).")
        self.state = state
        self._jit = jit
        self._compiled_train_step = None
        self._stepped_state = None

    def loss_fn(self, params, batch, *, train: bool, rng, state: TrainState):  # pragma: no cover
        """Return ``(loss, metrics)`` or ``(loss, (metrics, updates))``; see the module docstring."""
        raise NotImplementedError

    # --- pure functions -------------------------------------------------------------------------
    def _compute_dtype(self):
        return jnp.bfloat16 if self.precision == "bf16" else None

    def objective(self, state: TrainState, batch, rng, *, train: bool = True):
        """``params -> (loss + penalty, (loss, penalty, aux))``: what the optimizer minimises.

        With ``precision="bf16"`` the loss function gets bfloat16 copies of the parameters and
        a state whose ``apply_model`` computes in bfloat16 (see :func:`computing_state`); the
        batch is passed as it is (targets, weights and masks keep their precision)."""
        dtype = self._compute_dtype()
        model_state = state if dtype is None else _in_bfloat16(state)

        def objective(params):
            compute_params = params if dtype is None else cast_floating(params, dtype)
            loss, aux = _split_loss(_call_loss(self.loss_fn, compute_params, batch, train=train, rng=rng,
                                               state=model_state), "loss_fn")
            if dtype is not None:
                loss = jnp.asarray(loss, jnp.float32)
            if self.regularizer is None:
                return loss, (loss, None, aux)
            penalty = self.regularizer(params)
            return loss + penalty, (loss, penalty, aux)

        return objective

    def compute_gradients(self, state: TrainState, batch, rng):
        """``((loss, aux), grads)`` for one batch, via a single ``jax.value_and_grad``: the backward
        pass of :meth:`step` and of :meth:`backward`. Override it to change the gradients (a custom
        transformation, a frozen part); the optimizer then applies what it returns.

        ``grads`` is the gradient of ``loss + penalty`` when there is a regulariser; ``loss`` is
        the loss function's own value.
        """
        (_, (loss, _, aux)), grads = jax.value_and_grad(self.objective(state, batch, rng), has_aux=True)(state.params)
        return (loss, aux), grads

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """Pure ``(state, batch) -> (state, metrics)``: this step's key, :meth:`compute_gradients`, update."""
        step_rng = step_key(state)
        objective = self.objective(state, batch, step_rng)
        if self.precision == "bf16" and not getattr(self, "_checked_compute", False):
            self._checked_compute = True  # once per step object, while tracing
            _warn_if_computing_in_float32(lambda params: objective(params)[0], state.params)
        (loss, aux), grads = self.compute_gradients(state, batch, step_rng)
        penalty = self.regularizer(state.params) if self.regularizer is not None else None  # as in the objective
        total = loss if penalty is None else loss + penalty
        metrics, updates = _split_aux(aux, "loss_fn")
        updates = _checked_updates(updates, state, "loss_fn", warn=not getattr(self, "_said_statistics", False))
        self._said_statistics = True  # once per step object (debug=True runs this every step)
        if "batch_stats" in updates:
            updates["batch_stats"] = _cast_like(updates["batch_stats"], state.batch_stats)
        state = apply_update(state, grads, value=total, value_fn=lambda p: objective(p)[0], **updates)
        metrics = _with_loss(metrics, loss)
        if penalty is not None:
            metrics.setdefault("penalty", penalty)
        if self.log_grad_norm:
            trained = grads if self.frozen is None else jax.tree.map(  # a frozen parameter's gradient: left out
                lambda grad, is_frozen: None if is_frozen else grad, grads, self.frozen(state.params))
            metrics.setdefault("grad_norm", _global_norm(trained))
        return state, metrics

    __call__ = step

    def eval_step(self, state: TrainState, batch) -> dict:
        """Pure ``(state, batch) -> metrics`` in eval mode (no dropout, running statistics).

        Uses the parameters' moving average when the optimizer keeps one and ``eval_with_ema``;
        ``"loss"`` never includes the regulariser.
        """
        rng = jax.random.PRNGKey(_EVAL_RNG_SEED)
        params = state.params
        if self.eval_with_ema and state.opt_state is not None:
            averaged = ema_params(state)
            params = params if averaged is None else averaged
        model_state = state
        if self.precision == "bf16":  # as computing_state(state with these params, "bf16")
            model_state, params = _in_bfloat16(state), cast_floating(params, jnp.bfloat16)
        loss, aux = _split_loss(_call_loss(self.loss_fn, params, batch, train=False, rng=rng, state=model_state),
                                "loss_fn")
        metrics, _ = _split_aux(aux, "loss_fn")
        if self.precision == "bf16":
            loss = jnp.asarray(loss, jnp.float32)
        return _with_loss(metrics, loss)

    # --- the seed's stateful interface ----------------------------------------------------------
    def _require_state(self) -> TrainState:
        if self.state is None:
            raise ValueError("This TrainStep holds no state: create it as TrainStep(loss_fn, state=state).")
        return self.state

    def backward(self, batch, rng=None):
        """``((loss, aux), grads)`` at ``self.state`` (rng defaults to the next step's key):
        :meth:`compute_gradients`, which is what to override."""
        state = self._require_state()
        if rng is None:
            rng = step_key(state)
        return self.compute_gradients(state, batch, rng)

    def train_step(self, batch) -> dict:
        """Update ``self.state`` with one jitted, donated step; returns the step's metrics.

        The step donates the state it is given (its arrays are reused for the new one, and deleted
        for anyone else holding them), except a trainer's: a state a ``TrainerModule`` made (its
        ``apply_fn`` is the trainer's model adapter, as ``trainer.state``'s) is copied once first,
        so the trainer goes on working. To keep a state of your own, pass a copy:
        ``TrainStep(loss_fn, state=jax.tree.map(jnp.copy, state))``.
        """
        state = self._require_state()
        if state is not self._stepped_state and _a_trainers_state(state):
            state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
        if self._compiled_train_step is None:
            self._compiled_train_step = jax.jit(self.step, donate_argnums=0) if self._jit else self.step
        self.state, metrics = self._compiled_train_step(state, batch)
        self._stepped_state = self.state  # this step's own: donated by the next call
        return metrics


def _a_trainers_state(state: TrainState) -> bool:
    """Whether ``state`` was made by a trainer (its ``apply_fn`` is a flaxlight model adapter's)."""
    return isinstance(getattr(state.apply_fn, "__self__", None), (LinenAdapter, NNXAdapter))


def make_train_step(loss_fn: LossFn, **options: Any) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """Pure ``(state, batch) -> (state, metrics)`` from a loss function (not yet jitted).

    ``options`` are :class:`TrainStep`'s (``regularizer``, ``precision``, ``eval_with_ema``).

    Examples:
        >>> train_step = jax.jit(make_train_step(loss_fn), donate_argnums=0)  # doctest: +SKIP
    """
    return TrainStep(loss_fn, **options).step


def make_eval_step(loss_fn: LossFn, **options: Any) -> Callable[[TrainState, Any], dict]:
    """Pure ``(state, batch) -> metrics`` from a loss function, in eval mode (not yet jitted)."""
    return TrainStep(loss_fn, **options).eval_step



def step_owner(fn: Callable, _depth: int = 0) -> "TrainStep | None":
    """The :class:`TrainStep` whose ``step`` (or ``eval_step``) ``fn`` is or wraps: through
    ``functools.wraps`` or a closure that calls it (``super().create_functions()``'s step wrapped
    to add a metric); None for a step function of the user's own.

    Examples:
        >>> step = TrainStep(lambda params, batch, **kw: (0.0, {}))
        >>> def wrap(inner):
        ...     def with_a_metric(state, batch):
        ...         return inner(state, batch)
        ...     return with_a_metric
        >>> step_owner(step.step) is step, step_owner(wrap(step.step)) is step, step_owner(print)
        (True, True, None)
    """
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, TrainStep) or _depth > 8:
        return owner if isinstance(owner, TrainStep) else None
    inner = [getattr(fn, "__wrapped__", None)] + [_cell_value(cell) for cell in getattr(fn, "__closure__", None) or ()]
    return next((found for f in inner if callable(f) and (found := step_owner(f, _depth + 1)) is not None), None)


def _cell_value(cell) -> Any:
    """A closure cell's value, or None for a cell not bound yet."""
    try:
        return cell.cell_contents
    except ValueError:
        return None
