"""``LearningRateMonitor``: log the learning rate at every train log point."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlight.callbacks.base import Callback
from flaxlight.metrics import deliberate_reads
from flaxlight.optim import INJECT_STATES, RATE_NAMES, LearningRateState, find_states, rate_after_one_more_update
from flaxlight.state import TrainState

__all__ = ["LearningRateMonitor", "rate_in_optimizer_state", "learning_rates"]


def _nodes(tree: Any, labels: tuple = ()) -> Iterator[tuple[Any, tuple]]:
    """Every node of an optax state tree (NamedTuples, tuples, lists, dicts), depth first, with
    the ``optax.multi_transform`` labels on the way to it."""
    yield tree, labels
    inner = getattr(tree, "inner_states", None)  # optax.multi_transform's state: {label: MaskedState}
    if isinstance(inner, Mapping) and type(tree).__name__ in ("PartitionState", "MultiTransformState"):
        for label, child in inner.items():
            yield from _nodes(child, labels + (str(label),))
        return
    children = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (tuple, list)) else ()
    for child in children:
        yield from _nodes(child, labels)


class _Rate(NamedTuple):
    """A learning rate an optimizer state holds: in ``field`` of the TrainState (``opt_state``:
    the one ``state.tx`` updates), under the ``multi_transform`` ``labels``, kept by ``node``."""

    field: str
    labels: tuple
    node: Any
    name: str | None  # the hyperparameter's name in an inject_hyperparams state (None: flaxlight's record)


def _rates_in(field: str, opt_state: Any) -> list[_Rate]:
    found = []
    for node, labels in _nodes(opt_state):
        if isinstance(node, LearningRateState):
            found.append(_Rate(field, labels, node, None))
        elif isinstance(node, INJECT_STATES) and isinstance(getattr(node, "hyperparams", None), Mapping):
            name = next((n for n in RATE_NAMES if n in node.hyperparams), None)
            if name is not None:
                found.append(_Rate(field, labels, node, name))
    return found


def _optimizer_states(state: Any) -> list[tuple[str, Any]]:
    """``(field, optimizer state)`` of a TrainState: ``opt_state``, then the fields of a subclass
    of yours that hold one (a second optimizer's state, a GAN's discriminator's); an optimizer
    state given alone is ``opt_state``."""
    if not isinstance(state, TrainState):
        return [("opt_state", getattr(state, "opt_state", state))]
    base = {f.name for f in dataclasses.fields(TrainState)}
    own = [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state) if f.name not in base]
    return [("opt_state", state.opt_state)] + [(name, value) for name, value in own if _rates_in(name, value)]


def _names(rates: list[_Rate]) -> list[str]:
    """``train/lr`` for one rate; for several, ``train/lr/<label>`` (one optimizer state,
    ``optax.multi_transform`` labels) or ``train/lr/<field>`` (``<field>/<label>`` where a field
    holds several); a name still shared gets ``/<position>``."""
    if len(rates) == 1:
        return ["train/lr"]
    fields = [rate.field for rate in rates]
    if set(fields) == {"opt_state"}:
        parts = ["/".join(rate.labels) for rate in rates]
    else:
        parts = [rate.field if fields.count(rate.field) == 1 else "/".join((rate.field,) + rate.labels)
                 for rate in rates]
    return [f"train/lr/{part}" if part and parts.count(part) == 1 else f"train/lr/{part + '/' if part else ''}{i}"
            for i, part in enumerate(parts)]


def _stored(rate: _Rate) -> Any:
    value = rate.node.learning_rate if rate.name is None else rate.node.hyperparams[rate.name]
    return jnp.asarray(value, jnp.float32)


def _scaled(rate: _Rate, value: Any, opt_state: Any) -> Any:
    """``value`` times the scale of each ``reduce_on_plateau`` on the rate's way (its labels)."""
    for node, labels in _nodes(opt_state):
        if type(node).__name__ == "ReduceLROnPlateauState" and rate.labels[:len(labels)] == labels:
            value = value * node.scale
    return value


def learning_rates(state: Any) -> dict[str, Any]:
    """The learning rate of each optimizer a TrainState holds, named as
    :class:`LearningRateMonitor` logs them: one rate is ``train/lr``; several are
    ``train/lr/<label>`` when they are groups of one ``optax.multi_transform`` (of
    ``optax.inject_hyperparams`` optimizers) in ``state.opt_state``, and ``train/lr/<field>``
    when optimizer states sit in fields of your TrainState subclass (``train/lr/opt_state`` for
    ``state.tx``'s, ``train/lr/d_opt_state`` for a second optimizer's; ``<field>/<label>`` where a
    field holds several). Each is the rate of the next update (as
    :func:`flaxlight.current_learning_rate`) times any ``reduce_on_plateau`` scale on its way;
    for a schedule in ``optax.inject_hyperparams`` in a field of yours, which flaxlight has no
    transformation to ask, the rate of its last update. Works inside ``jit``; values stay on the device.

    Examples:
        >>> import optax, jax.numpy as jnp, flaxlight
        >>> tx = optax.multi_transform({"body": optax.inject_hyperparams(optax.sgd)(learning_rate=0.5),
        ...                             "head": optax.inject_hyperparams(optax.sgd)(learning_rate=0.25)},
        ...                            {"w": "body", "b": "head"})
        >>> params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
        >>> state = flaxlight.TrainState.create(apply_fn=None, params=params, tx=tx)
        >>> {name: float(rate) for name, rate in learning_rates(state).items()}
        {'train/lr/body': 0.5, 'train/lr/head': 0.25}
    """
    holders = _optimizer_states(state)
    rates = [rate for field, opt_state in holders for rate in _rates_in(field, opt_state)]
    tx, opt_state = getattr(state, "tx", None), getattr(state, "opt_state", None)
    injected = find_states(opt_state, INJECT_STATES) if tx is not None else []  # in the order jit sees
    values = {}
    for name, rate in zip(_names(rates), rates):
        value = _stored(rate)
        index = next((i for i, node in enumerate(injected) if node is rate.node), None)
        schedule_state = (getattr(rate.node, "hyperparams_states", None) or {}).get(rate.name)
        if rate.field == "opt_state" and index is not None and type(schedule_state).__name__ == "WrappedScheduleState":
            value = rate_after_one_more_update(tx, opt_state, state.params, index, rate.name)  # the next update's
        values[name] = _scaled(rate, value, dict(holders)[rate.field])
    return values


def rate_in_optimizer_state(opt_state: Any) -> dict[str, Any]:
    """The rates an optax state exposes, as stored there: ``{"train/lr": ...}`` from
    ``optax.inject_hyperparams`` (its ``learning_rate``: for a schedule, the rate of the last
    update; :func:`learning_rates` of the TrainState gives the next one's; several, the groups of
    an ``optax.multi_transform``: ``train/lr/<label>``), ``{"train/lr_scale": ...}`` from
    ``optax.contrib.reduce_on_plateau`` (the factor it applies); empty when it exposes none.
    Values stay on the device.

    Examples:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.125)
        >>> float(rate_in_optimizer_state(tx.init(jnp.zeros(2)))["train/lr"])
        0.125
    """
    rates = [rate for rate in _rates_in("opt_state", opt_state) if rate.name is not None]
    found: dict[str, Any] = {name: _stored(rate) for name, rate in zip(_names(rates), rates)}
    scale = next((node.scale for node, _ in _nodes(opt_state) if type(node).__name__ == "ReduceLROnPlateauState"), None)
    if scale is not None:
        found["train/lr_scale"] = scale
    return found


class LearningRateMonitor(Callback):
    """Logs ``train/lr`` next to the running train metrics: at step ``s``, the rate of the next
    update (the one after the ``s`` steps made), as Lightning's monitor does.

    For the optimizers flaxlight builds, trained by flaxlight's step (one update per batch), the
    rate comes from their schedule evaluated on the host at that step (no device read); with
    ``reduce_on_plateau`` it is multiplied by the factor the plateau reached by step ``s``
    (``train/lr_scale`` is logged too). For a ready-made optax transformation, and for a train
    step of yours (``create_functions``, which may update more than once per batch: the rate is
    then the one at the optimizer's own count), it is read from the optimizer state: a flaxlight
    optimizer's record of its rate, an ``optax.inject_hyperparams`` one's (the same rate as
    :func:`flaxlight.current_learning_rate` of the state), times the factor of an
    ``optax.contrib.reduce_on_plateau`` (``train/lr_scale``). Several rates (groups of an
    ``optax.multi_transform``, a second optimizer's state in a field of your TrainState) are
    logged one series each, named by :func:`learning_rates`: ``train/lr/<label>``,
    ``train/lr/<field>``. Values read from the device are taken at step ``s`` itself
    (``on_step``, every ``log_every_n_steps``) and copied to the host in the background, to be
    logged when the running metrics of ``s`` arrive, a log point later: the loop never waits for
    them. When neither is known, it says so once and logs nothing.

    Lightning's ``logging_interval``: ``None`` or ``"step"`` is what is said above (every train
    log point, ``log_every_n_steps``); ``"epoch"`` logs the rates once per epoch instead, at its
    start (the rates of the epoch's first update, at the step before it, as Lightning's
    ``on_train_epoch_start``). ``log_momentum=True`` and ``log_weight_decay=True`` are refused,
    naming what to do instead.

    Examples:
        >>> trainer = MyTrainer(..., callbacks=[LearningRateMonitor()])  # doctest: +SKIP
    """

    on_log_may_lag = True  # it shows / logs the values: the loop need not stop for it

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False):
        _refuse_lightning_only(logging_interval, log_momentum, log_weight_decay)
        self.logging_interval = logging_interval
        self._warned = False
        self._source: str | None = None  # "schedule", "schedule+scale", "state" or "none" (set per run)
        self._taken: dict[int, dict[str, Any]] = {}  # step -> device values on their way to the host

    def on_fit_start(self, trainer) -> None:
        """Decide where the rate comes from; read the device only at log points, when it must."""
        self._taken.clear()
        self._rate_count = len(learning_rates(trainer.state))  # once per run: walking the optimizer state is not free
        self._choose_source(trainer)

    def _choose_source(self, trainer) -> None:
        """The host schedule (nothing read at log points) when it is the one rate and counts what
        ``global_step`` counts (one update per batch); else the optimizer state, read at log points
        (a step of yours until its first epoch's end has counted its updates per batch)."""
        plan = getattr(trainer, "optimizer_plan", None)
        config = getattr(plan, "config", None)
        counts_batches = getattr(trainer, "one_update_per_batch", True) is True
        if getattr(plan, "schedule", None) is not None and counts_batches and self._rate_count <= 1:
            self._source = "schedule" if getattr(config, "reduce_on_plateau", None) is None else "schedule+scale"
        else:
            self._source = "state" if self._rate_count else "none"
        self.every_n_steps = trainer.options.log_every_n_steps \
            if self._source in ("schedule+scale", "state") and self.logging_interval != "epoch" else None

    def on_train_epoch_start(self, trainer, epoch: int) -> None:
        """``logging_interval="epoch"``: the rates of the epoch's first update, at the step before it
        (one device read per epoch for rates the optimizer state holds)."""
        if self.logging_interval != "epoch":
            return
        if self._source is None:
            self.on_fit_start(trainer)
        step = trainer.global_step
        if self._source == "none":
            self._warn_once()
            return
        values = {"train/lr": trainer.learning_rate(step)} if self._source == "schedule" else \
            {key: float(np.mean(value)) for key, value in jax.device_get(self._device_values(trainer)).items()}
        if self._source == "schedule+scale":
            scale = values.get("train/lr_scale", 1.0)
            values = {"train/lr": trainer.learning_rate(step) * scale, "train/lr_scale": scale}
        trainer.log_metrics(values, step=step)

    def on_train_epoch_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        """After a step of yours has counted its updates per batch (its first epoch): one per batch
        goes on with the host schedule, which reads nothing at log points."""
        if self._source is not None:
            self._choose_source(trainer)

    def on_step(self, trainer, step: int) -> None:
        """At a log point: start copying this step's rate (or plateau scale) to the host."""
        # Copies on the device first: the next step donates the state's buffers (and so would free them).
        taken = {key: jnp.copy(value) for key, value in self._device_values(trainer).items()}
        with deliberate_reads():
            for value in taken.values():
                value.copy_to_host_async()
        self._taken[step] = taken

    def _device_values(self, trainer) -> dict[str, Any]:
        """The rate and the plateau scale in the state now (device arrays; nothing waits)."""
        state = trainer.state
        values = {key: value for key, value in rate_in_optimizer_state(state.opt_state).items()
                  if key == "train/lr_scale"}
        if self._source == "state":
            values.update(learning_rates(state))  # the rates of the next updates (an inject schedule asked)
        return values

    def on_log(self, trainer, step: int, metrics: Mapping[str, float]) -> None:
        if self.logging_interval == "epoch" or not any(key.endswith("_step") for key in metrics):
            return
        if self._source is None:  # logged outside train_model's loop (no on_fit_start)
            self.on_fit_start(trainer)
        if self._source == "schedule":
            trainer.log_metrics({"train/lr": trainer.learning_rate(step)}, step=step)
            return
        if self._source == "none":
            self._warn_once()
            return
        values = self._values_at(trainer, step)
        if values is None:
            return
        if self._source == "schedule+scale":
            scale = values.get("train/lr_scale", 1.0)
            values = {"train/lr": trainer.learning_rate(step) * scale, "train/lr_scale": scale}
        if values:
            trainer.log_metrics(values, step=step)

    def _values_at(self, trainer, step: int) -> dict[str, float] | None:
        """The values taken at ``step``, on the host; None when none were (never a later step's)."""
        taken = self._taken.pop(step, None)
        for old in [s for s in self._taken if s < step]:
            del self._taken[old]
        if taken is None and step == trainer.global_step:  # delivered before this step's on_step ran (a
            taken = self._device_values(trainer)  # checkpoint flushed the log): the state is still step's
        if taken is None:
            return None
        return {key: float(np.mean(value)) for key, value in jax.device_get(taken).items()}

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn("LearningRateMonitor: the optimizer is a ready optax transformation whose learning rate "
                          "flaxlight cannot read; build it with optax.inject_hyperparams(optax.adam)(learning_rate=...) "
                          "to have train/lr logged, or give optimizer_hparams instead.", RuntimeWarning, stacklevel=3)


def _refuse_lightning_only(logging_interval: Any, log_momentum: bool, log_weight_decay: bool) -> None:
    """Lightning's ``LearningRateMonitor`` arguments: what flaxlight's does is accepted, the rest
    refused naming the way to get it."""
    if logging_interval not in (None, "step", "epoch"):
        raise ValueError(
            f"LearningRateMonitor(logging_interval={logging_interval!r}): expected None or 'step' (the rate at every "
            f"train log point, log_every_n_steps) or 'epoch' (once per epoch, at its start), as in Lightning.")
    if log_momentum or log_weight_decay:
        what = "log_momentum" if log_momentum else "log_weight_decay"
        raise ValueError(
            f"LearningRateMonitor({what}=True) is Lightning's: flaxlight's monitor logs learning rates only. Log "
            f"the value from your step's metrics (e.g. read it from the optax state's hyperparams with "
            f"optax.inject_hyperparams), or from a Callback with trainer.log_metrics.")
