"""One training step — forward, loss, backward, update — as a class and as pure functions.

A *loss function* has the signature::

    loss_fn(params, batch, *, train: bool, rng, state) -> (loss, metrics)
                                                        | (loss, (metrics, updates))

``metrics`` is a dict of scalars (the loss is added as ``"loss"`` unless given), ``updates`` a dict
of changed model collections (``{"batch_stats": ...}``, as returned by
:meth:`TrainState.apply_model`), which the step writes back into the state.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax

from flaxlight.state import TrainState, next_rng

__all__ = ["TrainStep", "make_train_step", "make_eval_step"]

LossFn = Callable[..., Any]

_EVAL_RNG_SEED = 0


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


class TrainStep:
    """A training step built from a loss function; jitted once on first use.

    Pure form (what the trainer uses)::

        step = TrainStep(loss_fn)
        state, metrics = step(state, batch)        # == step.step(state, batch), jit it yourself
        metrics = step.eval_step(state, batch)

    Stateful form (the seed's class: keeps ``self.state`` and a jitted, donated step)::

        step = TrainStep(loss_fn, state=state)
        (loss, aux), grads = step.backward(batch)
        metrics = step.train_step(batch)           # updates step.state

    Subclasses may override :meth:`loss_fn` instead of passing one.

    Example:
        >>> def loss_fn(params, batch, *, train, rng, state):
        ...     x, y = batch
        ...     pred, updates = state.apply_model(params, x, train=train, rng=rng)
        ...     return ((pred - y) ** 2).mean(), {}
        >>> step = TrainStep(loss_fn)               # doctest: +SKIP
    """

    def __init__(self, loss_fn: LossFn | None = None, state: TrainState | None = None, *, jit: bool = True):
        if loss_fn is not None:
            self.loss_fn = loss_fn  # type: ignore[method-assign]
        elif type(self).loss_fn is TrainStep.loss_fn:
            raise TypeError("TrainStep needs a loss function: TrainStep(loss_fn) or override `loss_fn`.")
        self.state = state
        self._jit = jit
        self._compiled_train_step = None

    def loss_fn(self, params, batch, *, train: bool, rng, state: TrainState):  # pragma: no cover
        """Return ``(loss, metrics)`` or ``(loss, (metrics, updates))``; see the module docstring."""
        raise NotImplementedError

    # --- pure functions -------------------------------------------------------------------------
    def compute_gradients(self, state: TrainState, batch, rng):
        """``((loss, aux), grads)`` for one batch, via a single ``jax.value_and_grad``."""

        def objective(params):
            return self.loss_fn(params, batch, train=True, rng=rng, state=state)

        return jax.value_and_grad(objective, has_aux=True)(state.params)

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """Pure ``(state, batch) -> (state, metrics)``: split the RNG, backward, update."""
        new_rng, step_rng = next_rng(state)
        (loss, aux), grads = self.compute_gradients(state, batch, step_rng)
        metrics, updates = _split_aux(aux, "loss_fn")
        state = state.apply_gradients(grads=grads, value=loss, rng=new_rng, **updates)
        return state, _with_loss(metrics, loss)

    __call__ = step

    def eval_step(self, state: TrainState, batch) -> dict:
        """Pure ``(state, batch) -> metrics`` in eval mode (no dropout, running statistics)."""
        rng = jax.random.PRNGKey(_EVAL_RNG_SEED)
        loss, aux = self.loss_fn(state.params, batch, train=False, rng=rng, state=state)
        metrics, _ = _split_aux(aux, "loss_fn")
        return _with_loss(metrics, loss)

    # --- the seed's stateful interface ----------------------------------------------------------
    def _require_state(self) -> TrainState:
        if self.state is None:
            raise ValueError("This TrainStep holds no state: create it as TrainStep(loss_fn, state=state).")
        return self.state

    def backward(self, batch, rng=None):
        """``((loss, aux), grads)`` at ``self.state`` (rng defaults to the next step's key)."""
        state = self._require_state()
        if rng is None:
            _, rng = next_rng(state)
        return self.compute_gradients(state, batch, rng)

    def train_step(self, batch) -> dict:
        """Update ``self.state`` with one jitted, donated step; returns the step's metrics."""
        state = self._require_state()
        if self._compiled_train_step is None:
            self._compiled_train_step = jax.jit(self.step, donate_argnums=0) if self._jit else self.step
        self.state, metrics = self._compiled_train_step(state, batch)
        return metrics


def make_train_step(loss_fn: LossFn) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """Pure ``(state, batch) -> (state, metrics)`` from a loss function (not yet jitted).

    Example:
        >>> train_step = jax.jit(make_train_step(loss_fn), donate_argnums=0)  # doctest: +SKIP
    """
    return TrainStep(loss_fn).step


def make_eval_step(loss_fn: LossFn) -> Callable[[TrainState, Any], dict]:
    """Pure ``(state, batch) -> metrics`` from a loss function, in eval mode (not yet jitted)."""
    return TrainStep(loss_fn).eval_step

