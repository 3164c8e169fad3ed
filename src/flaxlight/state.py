"""The train state: Flax's `TrainState` plus batch statistics, RNG, epoch and metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

from flaxlight.messages import logger as messages

__all__ = ["TrainState", "pure_params"]


class TrainState(train_state.TrainState):
    """An immutable pytree holding everything a training run needs to continue.

    Extends :class:`flax.training.train_state.TrainState` with

    - ``batch_stats``: mutable model collections (BatchNorm running statistics), or None;
    - ``rng``: the run's PRNG key; step ``t`` uses ``fold_in(rng, t)`` (see :func:`step_key`);
    - ``epoch``: completed training epochs (an int32 array, so it can live inside ``jit``);
    - ``metrics``: free for on-device values that should flow through the step, or None.

    ``step`` and ``epoch`` are int32 arrays from the start, so the first jitted update does not
    recompile when a Python ``0`` turns into an array. An NNX model's params and batch stats are
    pure dicts (``nnx.to_pure_dict``): ones given as an ``nnx.State`` (``nnx.state(module, nnx.Param)``)
    are taken as that dict by :meth:`create` and :meth:`with_optimizer` (see :func:`pure_params`).

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> state = TrainState.create(apply_fn=lambda v, x: x @ v["params"]["w"],
        ...                           params={"w": jnp.ones((2, 1))}, tx=optax.sgd(0.1),
        ...                           rng=jax.random.PRNGKey(0))
        >>> state = state.apply_gradients(grads={"w": jnp.ones((2, 1))}, value=jnp.float32(1.0))
        >>> int(state.step)
        1
    """

    batch_stats: Any = None
    rng: Any = None
    epoch: Any = None
    metrics: Any = None

    @classmethod
    def create(cls, *, apply_fn, params, tx, **kwargs) -> "TrainState":
        """Build a state; ``tx`` may be None for inference-only states (no optimizer state)."""
        params, kwargs["batch_stats"] = pure_params(params), pure_params(kwargs.get("batch_stats"))
        opt_state = _own_buffers(tx.init(params), params) if tx is not None else None
        kwargs.setdefault("epoch", jnp.zeros((), jnp.int32))
        step = kwargs.pop("step", 0)
        return cls(
            step=jnp.asarray(step, jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            **kwargs,
        )

    def with_optimizer(self, tx) -> "TrainState":
        """This state with the optimizer ``tx`` and a fresh optimizer state for its params; every
        other field (a subclass's own ones, ``metrics``) is kept. A field that shares arrays with the
        params (an EMA started as ``ema=params``) gets copies: the train step donates the state,
        and XLA cannot donate one buffer twice.

        Examples:
            >>> state = state.with_optimizer(optax.adam(1e-3))   # doctest: +SKIP
        """
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                  if field.metadata.get("pytree_node", True) and field.name not in ("params", "opt_state")}
        params = pure_params(self.params)  # an nnx.State put in (state.replace(params=nnx.state(...))): its dict
        fields["batch_stats"] = pure_params(fields["batch_stats"])
        fields["opt_state"] = tx.init(params) if tx is not None else None
        return self.replace(tx=tx, params=params, **_own_buffers(fields, params))

    def apply_gradients(self, *, grads, value=None, value_fn=None, **replace) -> "TrainState":
        """One optimizer update; ``value`` (the loss) reaches optimizers that take extra args.

        Optax's extra-args convention is used: for any :class:`optax.GradientTransformationExtraArgs`
        (every ``optax.chain``, learned optimizers, ``optax.contrib.reduce_on_plateau``,
        ``optax.polyak_sgd``, ``optax.lbfgs``) the call is ``tx.update(grads, opt_state, params,
        value=loss, grad=grads, value_fn=value_fn)`` (``value_fn``, ``params -> loss`` on the same
        batch, when given: L-BFGS' line search needs it); a transformation whose ``update`` takes
        ``value`` but not ``**extra_args`` gets ``value`` only; plain transformations get none.
        Other keyword arguments replace fields of the state (``batch_stats=...``, ``rng=...``) in
        the same update. Without ``value``, an optimizer that needs the loss (``reduce_on_plateau``,
        ``polyak_sgd``, ``lbfgs``) raises a ``TypeError`` that names it and says to pass ``value=loss``.

        Examples:
            >>> state = state.apply_gradients(grads=grads, value=loss)   # doctest: +SKIP
        """
        if self.tx is None:
            raise ValueError(
                "This TrainState has no optimizer (tx=None), e.g. because it was loaded for "
                "inference. Call `trainer.init_optimizer(num_epochs, steps_per_epoch)` first."
            )
        if value is not None and isinstance(self.tx, optax.GradientTransformationExtraArgs):
            extra = {"value": value, "grad": grads} | ({"value_fn": value_fn} if value_fn is not None else {})
            try:
                updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params, **extra)
            except TypeError as exc:  # an update(..., *, value) without **extra_args
                if "unexpected keyword argument" not in str(exc):
                    raise
                updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params, value=value)
        else:
            try:
                updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params)
            except TypeError as exc:  # an optimizer that needs the loss, called the plain Flax way
                if value is not None or not re.search(r"missing \d+ required keyword-only argument.*'value'", str(exc)):
                    raise
                raise TypeError(_needs_the_loss_message(exc)) from exc
        new_params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **replace)

    def variables(self, params=None) -> dict:
        """The Flax variables dict for ``apply_fn``: params plus batch stats when there are any."""
        variables = {"params": self.params if params is None else params}
        if self.batch_stats is not None:
            variables["batch_stats"] = self.batch_stats
        return variables

    def apply_model(self, params, *inputs, train: bool, rng=None, mutable=None, **kwargs):
        """Run the model; returns ``(outputs, updates)`` with ``updates`` the changed collections.

        In training mode BatchNorm statistics are mutable and returned in ``updates``
        (``{"batch_stats": ...}``); ``rng`` becomes the ``dropout`` stream. In eval mode
        ``updates`` is an empty dict. ``rngs=`` adds Linen streams (a dict) or, for an NNX
        module whose ``__call__`` takes ``rngs``, is passed to it (an ``nnx.Rngs``).

        ``mutable=["intermediates"]`` also returns what the model sows, in training and in eval,
        as ``updates["intermediates"]`` (Linen: ``self.sow("intermediates", name, value)``; NNX:
        ``self.sow(nnx.Intermediate, name, value)``, collected with ``nnx.capture``), for the loss
        to read; the train step never keeps them. ``"batch_stats"`` may be listed too (Flax's
        spelling; returned in training as always). Any other collection is a ``ValueError``.

        Examples:
            >>> logits, updates = state.apply_model(params, x, train=True, rng=rng)  # doctest: +SKIP
            >>> logits, updates = state.apply_model(params, x, train=train, rng=rng,  # doctest: +SKIP
            ...                                     mutable=["intermediates"])
            >>> hidden = updates["intermediates"]["hidden"][0]                       # doctest: +SKIP
        """
        rngs = {"dropout": rng} if rng is not None else None
        extra = kwargs.pop("rngs", None)
        if isinstance(extra, Mapping):  # more Linen streams
            rngs = {**(rngs or {}), **extra}
        elif extra is not None:  # an nnx.Rngs for the module's own rngs argument
            kwargs["model_rngs"] = extra
        try:
            # In eval mode a Linen Dropout that still drops (deterministic=False whatever the mode) is
            # said, once: it is seen while the step traces, so the watch costs the step nothing.
            with nn.intercept_methods(_note_dropout_in_eval) if not train and rngs else contextlib.nullcontext():
                return self._apply(params, inputs, train, rngs, mutable, kwargs)
        except Exception as exc:  # raised while tracing: costs the step nothing
            note = _missing_stream_note(exc, rngs, kwargs.get("model_rngs"), train=train)
            if note is not None:
                exc.add_note(note)
            raise

    def _apply(self, params, inputs: tuple, train: bool, rngs, mutable, kwargs: dict):
        """:meth:`apply_model`'s call of the model, its streams resolved."""
        if mutable is not None and mutable is not False and _wants_intermediates(mutable):
            collections = (["batch_stats"] if train and self.batch_stats is not None else []) + ["intermediates"]
            outputs, updates = self.apply_fn(
                self.variables(params), *inputs, train=train, rngs=rngs, mutable=collections, **kwargs)
            return outputs, {**updates, "intermediates": updates.get("intermediates", {})}
        if train and self.batch_stats is not None:
            return self.apply_fn(
                self.variables(params), *inputs, train=True, rngs=rngs, mutable=["batch_stats"], **kwargs
            )
        return self.apply_fn(self.variables(params), *inputs, train=train, rngs=rngs, **kwargs), {}


_DROPOUT_SAID: set[str] = set()  # the Dropout layers said to drop in eval mode (once each per process)


def _note_dropout_in_eval(next_fun, args, kwargs, context):
    """``nn.intercept_methods`` interceptor for :meth:`TrainState.apply_model` in eval mode: a Linen
    ``nn.Dropout`` whose call drops units (its ``deterministic`` False, from the layer or the call)
    is said once: validation and test then score a thinned model, and ``predict`` (which gives no
    random stream) fails on it."""
    module = context.module
    if isinstance(module, nn.Dropout) and context.method_name == "__call__":
        given = kwargs.get("deterministic", args[1] if len(args) > 1 else None)
        deterministic = module.deterministic if given is None else given
        where = "/".join(str(part) for part in getattr(module, "path", ())) or module.name or "Dropout"
        drops = not (isinstance(module.rate, (int, float)) and module.rate == 0)
        if deterministic is False and drops and where not in _DROPOUT_SAID:
            _DROPOUT_SAID.add(where)
            messages.warning(
                f"The model's dropout layer {where} (rate {module.rate}) drops units with train=False: its "
                f"deterministic is False whatever the mode, so validation and test score a randomly thinned model "
                f"(with a fixed key), the best checkpoint is chosen on those scores, and predict() fails on it. Tie "
                f"it to the mode: nn.Dropout(rate, deterministic=not train) (Monte Carlo dropout, on purpose? Then "
                f"this is as meant; predict() gives the model no random stream).")
    return next_fun(*args, **kwargs)


#: Flax's errors for a random stream the model draws from and was not given: Linen's
#: ``InvalidRngError`` (``self.make_rng(name)``) and NNX's (``rngs.<name>()`` on an ``nnx.Rngs``).
_MISSING_STREAM = (re.compile(r'needs PRNG for "([^"]+)"'), re.compile(r"No RngStream named '([^']+)' found in Rngs"))


def _missing_stream_note(exc: Exception, rngs: Mapping | None, model_rngs: Any, *, train: bool) -> str | None:
    """The note for Flax's error about a random stream the model asked for and ``apply_model`` did
    not give (``rngs``: the Linen streams given; ``model_rngs``: an ``nnx.Rngs`` the loss passed):
    the trainer supplies ``dropout`` only, and how to pass another; None for any other error.

    Examples:
        >>> _missing_stream_note(ValueError('None needs PRNG for "noise"'), {"dropout": 0}, None, train=True)[:60]
        "flaxlight: the model draws from the random stream 'noise', a"
    """
    found = next((match for pattern in _MISSING_STREAM if (match := pattern.search(str(exc)))), None)
    if found is None:
        return None
    stream, nnx_rngs = found[1], found.re is _MISSING_STREAM[1]
    if stream == "dropout":  # the trainer's own stream: missing because no rng= reached the model
        return ("flaxlight: the model draws dropout masks, and apply_model gave it no 'dropout' stream"
                + (": loss_fn's call did not pass rng=rng (state.apply_model(params, x, train=train, rng=rng)), or a "
                   "step of yours called the model without it." if train else
                   " because it ran in eval mode (train=False: validation, test, predict), where dropout must be off: "
                   "the model's dropout should follow its mode flag, e.g. nn.Dropout(rate, deterministic=not train)."))
    if model_rngs is not None:
        given = "the nnx.Rngs the loss passed as rngs=, which has no such stream"
    elif nnx_rngs and rngs:
        given = "nnx.Rngs(dropout=<the step's key>), which flaxlight builds from rng= for a __call__ taking rngs"
    else:
        given = f"the streams {sorted(rngs)}" if rngs else "no random stream (no rng= was given)"
    where = "the step's key" if train else "a fixed key in evaluation; predict gives none"
    passed = f"rngs=nnx.Rngs(dropout=rng, {stream}={stream}_rng)" if nnx_rngs else f"rngs={{{stream!r}: {stream}_rng}}"
    return (f"flaxlight: the model draws from the random stream {stream!r}, and apply_model gave it {given}. The "
            f"trainer supplies only the 'dropout' stream, from loss_fn's rng ({where}); pass any other yourself, "
            f"from a split of that key: `{stream}_rng, rng = jax.random.split(rng)`, then "
            f"state.apply_model(params, x, train=train, rng=rng, {passed}). See docs/models.md, 'Dropout and other "
            f"randomness'.")


def _needs_the_loss_message(exc: TypeError) -> str:
    """What to say when ``apply_gradients(grads=...)`` reaches an optimizer that needs the loss."""
    found = re.search(r"(\w+)\.<locals>\.\w+\(\)", str(exc))
    name = {"scale_by_polyak": "polyak_sgd", "scale_by_zoom_linesearch": "lbfgs"}.get(found[1], found[1]) if found \
        else "update"
    line_search = (" L-BFGS' line search also needs value_fn=params -> loss on the same batch."
                   if "'value_fn'" in str(exc) else "")
    return (f"The optimizer needs the loss at every update (optax's {name} takes it as `value`), and "
            f"state.apply_gradients(grads=...) was called without it. Pass it: "
            f"state.apply_gradients(grads=grads, value=loss) (flaxlight's TrainState.apply_gradients hands it to the "
            f"optimizer).{line_search} Or let flaxlight build the step (override loss_fn instead of create_functions, "
            f"or use flaxlight.TrainStep): it passes the loss. optax said: {exc}")


_MUTABLE_EXAMPLE = ("outputs, updates = state.apply_model(params, x, train=train, rng=rng, mutable=['intermediates']), "
                    "then updates['intermediates'] (docs/models.md, 'Sown intermediates in the loss')")


def _wants_intermediates(mutable) -> bool:
    """Whether ``apply_model``'s ``mutable`` asks for the sown intermediates; a clear error for a
    collection the trainer cannot make mutable (only ``batch_stats`` is state, and it is already)."""
    names = [mutable] if isinstance(mutable, str) else mutable
    if mutable is True or not isinstance(names, (list, tuple, set, frozenset)) or \
            not all(isinstance(name, str) for name in names):
        raise ValueError(f"apply_model(mutable={mutable!r}): give a list of collection names; the one apply_model "
                         f"returns on request is 'intermediates' (what the model sows). To read it: "
                         f"{_MUTABLE_EXAMPLE}.")
    other = [name for name in names if name not in ("intermediates", "batch_stats")]
    if other:
        why = ("the params are changed by the optimizer, not by the forward pass" if other[0] == "params" else
               "the train state holds only 'params' and 'batch_stats', so it would not be kept (keep a model's "
               "mutable state in 'batch_stats'); to call the model with another mutable collection yourself, e.g. "
               "a decoding 'cache', use state.apply_fn(state.variables(params), x, mutable=[...]) directly")
        raise ValueError(f"apply_model(mutable={mutable!r}): the trainer cannot make {other[0]!r} mutable: {why}. "
                         f"apply_model returns 'intermediates' (what the model sows) on request, and 'batch_stats' "
                         f"in training without asking. To read sown values: {_MUTABLE_EXAMPLE}.")
    return "intermediates" in names


def pure_params(params: Any) -> Any:
    """``params`` with each ``nnx.State`` in it (``nnx.state(module, nnx.Param)``, also as one layer
    of a dict) as the pure dict :func:`flax.nnx.to_pure_dict` makes, the same arrays: the form an NNX
    model's params have in the train state, its checkpoints and the model's own ``init``. Kept as a
    ``State``, each array would be saved under an extra ``value`` level that no model built from the
    run's hparams loads. Anything else is returned as it is.

    Examples:
        >>> pure_params(nnx.state(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), nnx.Param))["kernel"].shape
        (2, 1)
    """
    if not any(isinstance(leaf, nnx.Variable) for leaf in jax.tree.leaves(params, is_leaf=_is_variable)):
        return params
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params)
    if isinstance(params, nnx.Variable):
        return params.value
    return {key: pure_params(value) for key, value in params.items()} if isinstance(params, Mapping) else params


def _is_variable(value: Any) -> bool:
    return isinstance(value, nnx.Variable)


def step_key(state: TrainState):
    """This step's PRNG key: ``fold_in(state.rng, state.step)``.

    A pure function of the saved seed key and step (so a resumed run draws the same dropout
    masks), and free when unused: a model without dropout never computes it.
    """
    if state.rng is None:
        raise ValueError("TrainState.rng is None; create the state with rng=jax.random.PRNGKey(seed).")
    return jax.random.fold_in(state.rng, state.step)


def _buffer_key(x) -> Any:
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - sharded or deleted arrays have no single buffer: their identity
        return id(x)


def _own_buffers(opt_state, params):
    """``opt_state`` with a buffer of its own for each array that is one of ``params`` or an
    earlier leaf (``optax.lbfgs``'s memories, an EMA started from the params): the train step
    donates the state, and XLA refuses to donate one buffer twice."""
    seen = {_buffer_key(x) for x in jax.tree.leaves(params) if isinstance(x, jax.Array)}

    def own(x):
        if not isinstance(x, jax.Array):
            return x
        key = _buffer_key(x)
        if key in seen:
            return jnp.copy(x)
        seen.add(key)
        return x

    return jax.tree.map(own, opt_state)
