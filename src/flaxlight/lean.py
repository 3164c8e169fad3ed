"""Keep state fields that a train step never touches out of the hot loop's jitted calls.

Every array passed to (and returned from) a jitted call costs dispatch time, and for a small
model that cost is a visible share of a step: the trainer's ``TrainState`` carries ``rng`` and
``epoch`` leaves that a model without dropout never reads and that the step never changes
(the step key is ``fold_in(rng, step)``). :func:`idle_fields` finds such fields once, from the
step's jaxpr; :class:`LeanLoop` then runs the jitted step on the state without them and puts
them back whenever the trainer hands the state to anyone else.

Examples:
    >>> fields, single, fused = strip_idle_fields(train, train_block, state, acc, batch)  # doctest: +SKIP
    >>> lean = LeanLoop(fields, jax.jit(single), jax.jit(fused))            # doctest: +SKIP
    >>> core, kept = lean.split(state)                                       # doctest: +SKIP
    >>> core, acc = lean.single(core, acc, batch)                            # doctest: +SKIP
    >>> state = lean.join(core, kept)                                        # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Var

__all__ = ["idle_fields", "strip_idle_fields", "LeanLoop"]

CANDIDATES = ("rng", "epoch", "metrics")


def _live_inputs(jaxpr) -> list[bool]:
    """Which inputs of ``jaxpr`` any output (or side effect) depends on: a backward liveness
    pass over the top-level equations (a nested call counts as reading all of its inputs)."""
    live = {v for v in jaxpr.outvars if isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, Var))
    return [v in live for v in jaxpr.invars]


def _field_of(path) -> str | None:
    first = path[0] if path else None
    return getattr(first, "name", None)


def idle_fields(step_fn: Callable, state, acc, batch, candidates: Sequence[str] = CANDIDATES) -> tuple[str, ...]:
    """The fields of ``state`` among ``candidates`` that ``step_fn(state, acc, batch) ->
    (state, acc)`` returns unchanged (the very same values) and whose values nothing else
    it returns depends on. Fields holding no arrays are skipped; tracing happens once, here.
    """
    fields = [f for f in candidates if jax.tree.leaves(getattr(state, f, None))]
    if not fields:
        return ()
    unchanged: dict[str, bool] = {}

    def probe(state, acc, batch):
        new_state, new_acc = step_fn(state, acc, batch)
        for f in fields:
            old, new = jax.tree.leaves(getattr(state, f)), jax.tree.leaves(getattr(new_state, f))
            unchanged[f] = len(old) == len(new) and all(a is b for a, b in zip(old, new))
        return new_state.replace(**{f: None for f in fields}), new_acc

    jaxpr = jax.make_jaxpr(probe)(state, acc, batch).jaxpr
    live = _live_inputs(jaxpr)
    read = {f: False for f in fields}
    for (path, _), is_live in zip(jax.tree_util.tree_flatten_with_path(state)[0], live):
        name = _field_of(path)
        if name in read and is_live:
            read[name] = True
    return tuple(f for f in fields if unchanged.get(f) and not read[f])


def strip_idle_fields(single_fn: Callable, fused_fn: Callable, state, acc,
                      batch) -> tuple[tuple[str, ...], Callable, Callable]:
    """``(fields, single, fused)``: the idle fields of ``single_fn`` (``fused_fn`` scans it) and
    both functions taking and returning the state with those fields set to None (un-jitted;
    the caller jits them). With no idle fields, the functions are returned as given."""
    fields = idle_fields(single_fn, state, acc, batch)
    if not fields:
        return (), single_fn, fused_fn
    # Dead inputs still need values of the right type to trace: copies of those at hand (never
    # read; copies, so that a later donation of the full state cannot delete them).
    filler = {f: jax.tree.map(jnp.copy, getattr(state, f)) for f in fields}
    emptied = {f: None for f in fields}

    def lean(fn):
        def run(core, acc, data):
            new_state, acc = fn(core.replace(**filler), acc, data)
            return new_state.replace(**emptied), acc

        return run

    return fields, lean(single_fn), lean(fused_fn)


class LeanLoop:
    """The hot loop's jitted functions on the state without its idle fields.

    ``single(core, acc, batch)`` and ``fused(core, acc, block)`` take and return the state with
    the idle fields set to None; :meth:`split` / :meth:`join` go from the full state to
    ``(core, kept)`` and back. With no idle fields, ``split`` and ``join`` are identities.
    """

    def __init__(self, fields: tuple[str, ...], single: Callable, fused: Callable):
        self.fields, self.single, self.fused = fields, single, fused

    def split(self, state) -> tuple[Any, dict]:
        if not self.fields:
            return state, {}
        return state.replace(**{f: None for f in self.fields}), {f: getattr(state, f) for f in self.fields}

    def join(self, core, kept: dict):
        return core.replace(**kept) if kept else core
