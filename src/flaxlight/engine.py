"""All the performance machinery of the loop behind a small interface; the one place that jits.

The :class:`Engine` takes the user's pure ``train_step(state, batch) -> (state, metrics)`` and
``eval_step(state, batch) -> metrics`` and builds, jits and caches what the loop runs:

* single steps, fused blocks (``lax.scan`` over ``steps_per_execution`` stacked batches) and
  indexed steps (a batch picked on the device from a :class:`~flaxlight.data.DeviceEpoch`),
  each summing its metrics on the device, with the train state donated (the sums are not:
  a log point keeps the step's own sums and copies them to the host without launching work);
  the same functions with explicit shardings on a mesh;
* the feed: a loader turned into ``(steps, payload)`` items (a device epoch, stacked blocks,
  a background prefetcher);
* :meth:`Engine.train` / :meth:`Engine.run`: a span of steps, one comparison per step against the
  next event;
* evaluation, and the eval step compiled ahead in a background thread;
* the learning-rate table that log points read without waiting for the device;
* the update that ends an epoch's partial group of accumulated gradients (one jitted call).

It knows nothing of callbacks, loggers or the trainer: the trainer hands it an
:class:`~flaxlight.loop.EventSchedule`-like object (``next_step``, ``looks_up``) and an ``on_event`` function.

Examples:
    >>> engine = Engine(train_step, eval_step, steps_per_execution=4)               # doctest: +SKIP
    >>> span = Span(state, acc=None, step=0)                                        # doctest: +SKIP
    >>> engine.train(loader, span, stop=len(loader), schedule=schedule, on_event=on_event,
    ...              start_sums=lambda batch: engine.zero_sums("train", state, batch),
    ...              more_epochs=lambda: True)                                      # doctest: +SKIP
    >>> state, sums = span.state, span.acc                                          # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import statistics
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from flaxlight import distributed as dist
from flaxlight.messages import logger as messages
from flaxlight.data import (ArrayLoader, DeviceEpoch, FirstBatches, Prefetcher, ending_the_pass, ends_its_pass,
                            RestartCheck, group_batches, is_iterator, is_stream, later_batch_note, no_batches_error,
                            noting_loader_errors,
                            positioned_iterator, same_shapes, take_batches)
from flaxlight.lean import LeanLoop, strip_idle_fields
from flaxlight.metrics import (accumulate, batch_size, committed_device, deliberate_reads, fresh_zeros,
                               init_accumulator, placed_like, result_shapes, step_finite, tree_finite,
                               with_saved_objects, device_copy as device_copy_of)
from flaxlight.optim import apply_accumulated, updates_at_epoch_end
from flaxlight.resume import epoch_setter

__all__ = ["Engine", "Feed", "Span", "LearningRateTable", "check_step_pair", "block_length_for",
           "longer_block_pays"]

BLOCK_LENGTHS = (1, 2, 4, 8, 16, 32)  # what steps_per_execution="auto" chooses from


def block_length_for(single: float, fused: float, fused_length: int, max_share: float = 0.03) -> int:
    """The block length that ``steps_per_execution="auto"`` picks from the seconds per step of
    single steps (``single``) and of blocks of ``fused_length`` steps (``fused``): the cost of
    a dispatch, ``(single - fused) * L / (L - 1)``, is split over K steps until it is at most
    ``max_share`` of a step's own work. 1 when fusing saves nothing.

    Examples:
        >>> block_length_for(single=100e-6, fused=40e-6, fused_length=16)   # dispatch 64 us, work 36 us
        32
        >>> block_length_for(single=2e-3, fused=1.99e-3, fused_length=16)
        1
    """
    dispatch = (single - fused) * fused_length / (fused_length - 1)
    work = single - dispatch
    if dispatch <= max_share * single:
        return 1
    if work <= 0:  # all dispatch (timing noise): as many steps per dispatch as allowed
        return BLOCK_LENGTHS[-1]
    return next((k for k in BLOCK_LENGTHS if dispatch / k <= max_share * work), BLOCK_LENGTHS[-1])


def longer_block_pays(fused: float, longer: float, accelerator: bool) -> bool:
    """Whether ``steps_per_execution="auto"`` takes the longest block over blocks of 16, from
    their timed seconds per step (``longer``, ``fused``). On the CPU the longer block must be 2%
    faster. On an accelerator a tie within 2% goes to the longer block: the loop's own host work
    per block (taking the next batches, moving them), which the timing leaves out, runs while
    the device works through a block, and a longer block hides more of it.

    Examples:
        >>> longer_block_pays(fused=50e-6, longer=50.5e-6, accelerator=False)
        False
        >>> longer_block_pays(fused=50e-6, longer=50.5e-6, accelerator=True)
        True
    """
    return longer < (1.02 if accelerator else 0.98) * fused


@dataclasses.dataclass
class Span:
    """The moving parts of a run of steps: kept current by :meth:`Engine.run` at every event and
    when it returns or raises. ``batches``: batches of the epoch trained on so far."""

    state: Any
    acc: Any
    step: int
    batches: int = 0


class Feed:
    """A loader's batches as the engine consumes them: ``(steps, payload)`` items and the data
    path (``"batches"``, or ``"indexed"`` for a device epoch). ``head`` is the first item (None
    when there are none); ``first_batch`` (host arrays) is made only when asked. ``ends_pass``: its
    items end with the end of the loader's pass (:func:`~flaxlight.data.ending_the_pass`)."""

    def __init__(self, items: Iterable[tuple[int, Any]], path: str, first_batch: Callable[[Any], Any],
                 prefetcher: Prefetcher | None = None, ends_pass: bool = False):
        items = iter(items)
        self.head = next(items, None)
        self.items = items if self.head is None else itertools.chain([self.head], items)
        self.path, self.prefetcher, self._first_batch, self.ends_pass = path, prefetcher, first_batch, ends_pass

    def end_pass(self) -> None:
        """After its last item was trained on, but an event ended the span there (``max_steps`` or a
        ``stop()`` at the epoch's last batch): the loader's pass is ended all the same (a prefetcher's
        thread does it; this waits for it)."""
        if self.ends_pass:
            next(self.items, None)

    @property
    def empty(self) -> bool:
        return self.head is None

    @property
    def first_batch(self):
        return None if self.head is None else self._first_batch(self.head)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


@dataclasses.dataclass(frozen=True)
class _LoopFunctions:
    """The pure functions the loop runs, before jitting (sums of metrics threaded through)."""

    train: Callable  # (state, acc, batch) -> (state, acc)
    block: Callable  # (state, acc, stacked batches) -> (state, acc)
    train_at: Callable  # (state, acc, (device epoch arrays, index)) -> (state, acc)
    block_at: Callable
    evaluate: Callable  # (state, acc, batch) -> acc


def _loop_functions(train_step: Callable, eval_step: Callable, *, block_length: int,
                    guard: str | None) -> _LoopFunctions:
    """Wrap the user's steps: sum metrics per example; with a ``guard`` (a NaNGuard's action) a
    step is non-finite when its loss or its updated params are (a NaN gradient counts), and
    ``"skip"`` keeps the params and optimizer state of such steps and leaves their metrics out of
    the sums (a skipped step changed nothing)."""

    def train(state, acc, batch):
        if _no_rows(batch):  # known when tracing: a step that changes nothing and weighs nothing
            _say_empty_batch("training", batch)
            return state.replace(step=state.step + 1), acc
        new_state, metrics = train_step(state, batch)
        finite = step_finite(metrics) & tree_finite(new_state.params) if guard else None
        if guard == "skip":
            kept = state.replace(step=new_state.step)
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept)
        return new_state, accumulate(acc, metrics, batch_size(batch), finite, drop_nonfinite=guard == "skip")

    def block(state, acc, batches):
        return jax.lax.scan(lambda carry, batch: (train(*carry, batch), None), (state, acc), batches)[0]

    def block_at(state, acc, item):  # each step takes its batch from the epoch's arrays: no block copy
        batches, index = item
        steps = jnp.arange(block_length, dtype=jnp.asarray(index).dtype)
        return jax.lax.scan(lambda carry, i: (train(*carry, take_batches(batches, index + i)), None),
                            (state, acc), steps)[0]

    def evaluate(state, acc, batch):
        if _no_rows(batch):
            _say_empty_batch("evaluation", batch)
            return acc
        return accumulate(acc, eval_step(state, batch), batch_size(batch))

    return _LoopFunctions(
        train=train, block=block, evaluate=evaluate,
        train_at=lambda state, acc, item: train(state, acc, take_batches(*item)),
        block_at=block_at)


def _train_step_metrics(result: Any, state: Any) -> Any:
    """The metrics of a train step's ``(state, metrics)`` result (its shapes); a result of another
    form (the state alone, the pair swapped) is a ``TypeError`` saying what the step must return."""
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], Mapping):
        return result[1]
    got = f"({', '.join(type(item).__name__ for item in result)})" if isinstance(result, (tuple, list)) \
        else type(result).__name__
    raise TypeError(f"The train step must return (state, metrics): the new {type(state).__name__} (from "
                    f"state.apply_gradients(...) or state.replace(...)) and a dict of metrics, e.g. "
                    f"`return state, {{'loss': loss}}`; got {got}. A Lightning training_step under manual "
                    f"optimization returns nothing: here the step returns what it updated.")


def check_step_pair(functions: Any, rule: str) -> tuple[Callable, Callable]:
    """``(train_step, eval_step)``, or a clear error: ``rule`` says who must provide them."""
    if isinstance(functions, (tuple, list)) and len(functions) == 2 and all(map(callable, functions)):
        return functions[0], functions[1]
    got = f"{type(functions).__name__} of length {len(functions)}" if isinstance(functions, (tuple, list)) \
        else type(functions).__name__
    if isinstance(functions, tuple) and len(functions) == 2:
        got = f"({', '.join(type(f).__name__ for f in functions)})"
    raise TypeError(f"{rule} a pair (train_step, eval_step) of functions; got {got}.")


class Engine:
    """Builds and runs the jitted loop for one pair of steps (see the module docstring).

    ``debug=True`` runs everything un-jitted, one step per execution (prints and breakpoints work). ``nonfinite_guard``
    (``"stop"``/``"skip"``, a NaNGuard's action) also checks each step's updated params.
    """

    def __init__(self, train_step: Callable, eval_step: Callable, *, steps_per_execution: int | str = 1,
                 nonfinite_guard: str | None = None, prefetch: int = 0, debug: bool = False,
                 limit_train_batches: int | float | None = None):
        self.step_functions = {"train": train_step, "eval": eval_step}
        # "auto": single steps until the first epoch has been measured (see choose_block_length)
        self.choosing_block_length = steps_per_execution == "auto" and not debug
        self.auto_block_length = steps_per_execution == "auto"
        self.block_length = 1 if steps_per_execution == "auto" or debug else steps_per_execution
        if debug and steps_per_execution not in (1, "auto"):  # a block is a lax.scan: traced, never concrete
            messages.info("debug=True runs one step per execution (steps_per_execution=%s is ignored), so that "
                          "steps see concrete values.", steps_per_execution)
        self.prefetch, self.debug, self.guard = prefetch, debug, nonfinite_guard
        self.mesh = None
        self.compile_time: float | None = None  # the first step's wall time, compilation included
        self.learning_rates = LearningRateTable(self._jit)
        self._functions = _loop_functions(train_step, eval_step, block_length=self.block_length,
                                          guard=nonfinite_guard)
        self._templates: dict = {}
        self._eval_compiler: threading.Thread | None = None
        self._eval_lowered: list = []  # eval steps traced before the run, compiled once it trains
        self._eval_ahead: tuple = ((), None)  # the batches they were traced for, and the state's device if committed
        self.eval_metric_names: tuple[str, ...] | None = None  # what they return, known once traced
        self.eval_result_shapes: dict[str, tuple[int, ...]] = {}  # metric objects' results, known then too
        self._epoch_ahead: DeviceEpoch | None = None
        self._work_before_waiting: Callable[[], None] | None = None  # see work_before_waiting
        self._position: Callable[[], Any] | None = None
        self._updated_at: int | None = None  # the step of the last epoch-end update (see end_accumulation)
        self._served: weakref.WeakSet = weakref.WeakSet()  # loaders that yielded batches (see served_before)
        self._served_iterators: collections.deque = collections.deque(maxlen=4)  # ids of such, without weak
        # references (ids, not the iterators: a spent shard's data are not kept alive; an id reused by a new
        # iterator at most words its error as "ran dry")
        self._held: tuple[Any, Any] | None = None  # (a stream's iterator, its batch drawn at a pass's end)
        self._beyond_said = False  # a batch beyond a loader's len() was warned of (once)
        # an epoch cut by steps_per_epoch, then the loader restarted (once; limit_train_batches: a cut meant so)
        self._restart = RestartCheck(done=limit_train_batches is not None)
        self.train_step = self._jit(train_step, donate_argnums=0)
        self.eval_step = self._jit(eval_step)
        self._jit_loop()

    def _jit(self, fn: Callable, **kwargs) -> Callable:
        return fn if self.debug else jax.jit(fn, **kwargs)

    def _jit_loop(self, state_shardings=None) -> None:
        """Jit the loop's functions; on a mesh with explicit in/out shardings."""
        fns = self._functions
        self._lean: dict[str, LeanLoop] = {}  # per data path, found at its first step
        if state_shardings is None:
            self._train, self._block, self._train_at, self._block_at = (
                self._jit(fn, donate_argnums=0) for fn in (fns.train, fns.block, fns.train_at, fns.block_at))
            self._epoch_end_update = self._jit(_epoch_end_update, donate_argnums=0)
            self._evaluate = self._jit(fns.evaluate, donate_argnums=1)
            self._evaluate_jit = lambda batch: self._evaluate  # the jitted eval step for a batch (its .lower)
            return
        # Batches come placed by dist.to_global_batch, leaf by leaf: split over the devices, or
        # whole on every device (a leaf that is not per-example; every leaf of an epoch's smaller
        # last batch: the same numbers, without data parallelism for that one batch).
        rep, batch = dist.replicated(self.mesh), dist.step_batch_sharding(self.mesh)
        block = dist.step_batch_sharding(self.mesh, block=True)
        bounded = _in_flight_bound(self.mesh)

        def jit_train(fn, data_sharding):
            def with_token(state, acc, data):  # the token (a copy of the step) is never donated
                state, acc = fn(state, acc, data)
                return state, acc, state.step + 0

            return bounded(jax.jit(with_token, in_shardings=(state_shardings, rep, data_sharding),
                                   out_shardings=(state_shardings, rep, rep), donate_argnums=0))

        self._train, self._block = jit_train(fns.train, batch), jit_train(fns.block, block)
        self._epoch_end_update = jax.jit(_epoch_end_update, in_shardings=(state_shardings, rep),
                                         out_shardings=state_shardings, donate_argnums=0)
        self._evaluate = jax.jit(fns.evaluate, in_shardings=(state_shardings, rep, batch), out_shardings=rep,
                                 donate_argnums=1)
        self._evaluate_jit = lambda batch: self._evaluate

    # ------------------------------------------------------------------ placement and sums
    def distribute(self, state, mesh, mode: str | None, annotations=None, rules=None):
        """Shard (or replicate) ``state`` over ``mesh`` (annotated params as the model says, see
        :func:`flaxlight.distributed.state_shardings`) and re-jit the loop to match; returns
        ``(state, mode)`` with the mode resolved (``"auto"`` -> what the params allow)."""
        self.mesh = mesh
        mode = dist.resolve_mode(mode or "data_parallel", state.params)
        shardings = dist.state_shardings(state, mesh, mode, annotations, rules)
        state = dist.place(state, shardings)
        if not self.debug:
            self._jit_loop(shardings)
        return state, mode

    def device_scalar(self, value: int):
        """An int32 scalar on the device (replicated over the mesh, if any), e.g. the state's epoch."""
        value = np.asarray(value, np.int32)
        return jax.device_put(value, dist.replicated(self.mesh)) if self.mesh is not None else jnp.asarray(value)

    def zero_sums(self, kind: str, state, batch) -> dict:
        """Zeroed metric sums for a ``"train"``/``"eval"`` step on ``batch`` (shapes traced once per
        batch shape). With ``debug=True`` nothing is traced: the step runs once on ``batch`` with real
        values, its result unused (so ``float(x)`` and ``breakpoint()`` work; the step's prints show once
        more then)."""
        key = (kind, jax.tree.structure(batch),
               tuple((np.shape(x), np.result_type(x.dtype)) for x in jax.tree.leaves(batch)))
        if key not in self._templates:
            shapes_of = (lambda step, *args: step(*args)) if self.debug else jax.eval_shape
            with dist.axis_names_explained():  # the steps' first trace: nn.BatchNorm(axis_name=...) fails here
                if kind == "train":
                    metrics = _train_step_metrics(shapes_of(self.step_functions["train"], state, batch), state)
                else:
                    metrics = shapes_of(self.step_functions["eval"], state, batch)
            if not isinstance(metrics, Mapping):
                raise TypeError(f"The {kind} step must return metrics as a dict; got {type(metrics).__name__}.")
            self._templates[key] = init_accumulator(metrics)
        # The train loop does not donate its sums: the zeros are shared. Evaluation donates them.
        return placed_like(self._templates[key] if kind == "train" else fresh_zeros(self._templates[key]), state)

    # ------------------------------------------------------------------ feeding
    def serves_device_epochs(self, loader) -> bool:
        """Whether ``loader``'s epochs move to the device in one go: an :class:`ArrayLoader`
        that allows it, one device, no ``debug``."""
        return isinstance(loader, ArrayLoader) and loader.serves_device_epochs() and self.mesh is None \
            and not self.debug

    def _gathers_on_host(self) -> bool:
        """Where a device epoch is gathered: by numpy on the training thread with fused steps on
        XLA's CPU backend, else on the device. The gather goes to the side that waits: fused
        blocks keep the CPU's cores busy while the training thread waits (a device gather would
        take cores from the steps it overlaps: the tiny MLP's epoch went from 7.4 to 8.9 ms),
        single steps keep the training thread busy while the device has time (numpy on that
        thread would stall the next dispatches: 0.94 against 1.00 of the hand loop on the wide
        MLP). Measured in benchmarks/RESULTS.md, session 7."""
        return self.block_length > 1 and jax.default_backend() == "cpu"

    def feed(self, loader: Iterable, start: int, stop: int | None, step: int, position: Any = None,
             skip: int = 0, epoch: int | None = None) -> Feed:
        """Batches ``start`` to ``stop`` of ``loader``'s current epoch as the loop consumes them
        (``step``: the global step before the first, so fused blocks end at its multiples).
        ``position``: where a loader that saves its own position was at batch ``start`` (it then
        continues from there instead of skipping ``start`` batches); see :meth:`loader_position`.
        ``skip``: for a stream (see :func:`flaxlight.data.is_stream`: not restarted between epochs)
        given again after a resume, the batches the run's earlier epochs took from it, passed over
        first. A loader with a ``set_epoch`` (its own or its samplers': see
        :func:`flaxlight.resume.epoch_setter`) restarts at each epoch, even when its ``iter()`` hands
        out the epoch's one iterator: nothing of the earlier epochs is in it to pass over.

        Batches up to the loader's ``len()`` (not a cut: :func:`~flaxlight.data.ends_its_pass`) end
        with one more ``next()``, as a ``for`` loop's pass ends (a shuffled torch ``DataLoader`` draws
        its next order then; :meth:`_beyond_the_pass` for a batch it yields after all)."""
        if self.serves_device_epochs(loader):
            epoch, self._epoch_ahead = self._epoch_ahead, None
            if epoch is None or not epoch.serves(loader, stop):
                epoch = DeviceEpoch(loader, stop=stop, host_gather=self._gathers_on_host())
            return Feed(epoch.items(start, self.block_length, step), "indexed", lambda head: epoch.first_batch)
        iterator, reader, restored = positioned_iterator(
            loader, position, passed_over=start + (skip if skip and epoch_setter(loader) is None and is_stream(loader) else 0))
        position = position if restored else None  # refused: reached as a loader without a position is
        source, ends_pass, taken = iterator, ends_its_pass(loader, stop), stop  # taken: the epoch's batches
        held, self._held = self._held, None
        if held is not None and held[0] is iterator:  # a stream's batch drawn at the end of the last pass
            iterator = itertools.chain([held[1]], iterator)
        first = 1  # the number in the epoch of the iterator's next batch (for the note on a loader's error)
        if position is not None:
            start, stop, first = 0, None if stop is None else stop - start, start + 1
        elif skip and epoch_setter(loader) is None and is_stream(loader):
            start, stop, first = start + skip, None if stop is None else stop + skip, 1 - skip
        iterator = noting_loader_errors(iterator, "train_loader", first, epoch)
        # The position read at an event is that of the batches trained on when they are pulled
        # one at a time (no background loading ahead, no blocks).
        self._position = reader if self.block_length == 1 and not self.prefetch else None
        batches = itertools.islice(iterator, start, stop)
        if ends_pass:
            batches = ending_the_pass(batches, source, lambda batch: self._beyond_the_pass(loader, source, taken, batch),
                                      expected=None if stop is None else stop - start)
        items = group_batches(batches, self.block_length, start=step)
        prefetcher = None
        if self.prefetch:
            items = prefetcher = Prefetcher(items, size=self.prefetch, transform=self._to_device)
        elif self.mesh is not None:
            items = map(self._to_device, items)
        feed = Feed(items, "batches", _first_of, prefetcher, ends_pass)
        feed.source = source
        return feed

    def _beyond_the_pass(self, loader: Iterable, iterator: Any, taken: int, batch: Any) -> None:
        """A batch the loader's iterator yielded at the epoch's end, after the epoch's ``taken`` batches
        (its ``len()``, or a ``steps_per_epoch`` above it). A stream's (its ``iter()`` hands out one shared iterator, restarted by no
        ``set_epoch``): the next epoch's first, kept for it. Any other's: not trained on (the epoch is
        ``len()`` batches, the schedule sized for them, as in Lightning), and a warning says so."""
        if is_stream(loader) and epoch_setter(loader) is None:
            self._held = (iterator, batch)
            return
        if self._beyond_said:  # once: an endless stream sized by its len() would say it every epoch
            return
        self._beyond_said = True
        warnings.warn(f"train_loader yielded more batches in one pass than its len() ({len(loader)}) says: an epoch "
                      f"trains {taken} batches (the learning-rate schedule is sized for them), and the rest of the "
                      f"pass is not trained on (batch {taken + 1} was drawn to end the pass, as a for loop does). "
                      f"Intended for an endless stream whose len() sizes an epoch; else make len() the number of "
                      f"batches one pass yields (a torch IterableDataset's __len__, say). Said once.",
                      RuntimeWarning, stacklevel=2)

    def note_served(self, loader: Any) -> None:
        """Remember that ``loader`` yielded batches (see :meth:`served_before`)."""
        loader = loader.loader if isinstance(loader, FirstBatches) else loader
        try:
            self._served.add(loader)
        except TypeError:  # no weak reference: a list cannot run dry; an iterator (iter(list), zip): its id
            if is_iterator(loader) and id(loader) not in self._served_iterators:
                self._served_iterators.append(id(loader))

    def served_before(self, loader: Any) -> bool:
        """Whether ``loader`` yielded batches at an earlier pass (a loader that now yields none
        hands out one shared iterator: see :func:`flaxlight.data.no_batches_error`)."""
        loader = loader.loader if isinstance(loader, FirstBatches) else loader
        try:  # a WeakSet answers False for what takes no weak reference
            return loader in self._served or (is_iterator(loader) and id(loader) in self._served_iterators)
        except TypeError:
            return False

    def loader_position(self) -> Any:
        """Where the loader being trained on is, as JSON data (None when it cannot say)."""
        return self._position() if self._position is not None else None

    def train(self, loader: Iterable, span: Span, *, stop: int | None, schedule, on_event: Callable[[Span, int], bool],
              start_sums: Callable[[Any], dict], more_epochs: Callable[[], bool], position: Any = None,
              skip: int = 0, epoch_length: int | None = None, epoch: int | None = None) -> None:
        """Train on ``loader``'s batches ``span.batches`` to ``stop`` (see :meth:`run`; ``position``,
        ``skip`` and ``epoch``, the model's epoch named by a note on a loader's error: see :meth:`feed`).

        ``start_sums(first batch)`` gives the epoch's zeroed sums when ``span.acc`` is None (a
        fresh epoch); when ``more_epochs()`` after the span, the next epoch's device data are
        gathered before this epoch's end waits for its last steps. A span that reaches the epoch's
        end (``epoch_length`` batches, or the end of the loader's pass before ``stop``: a loader
        without ``len()`` sized by ``max_steps`` ends its epochs there) ends the epoch's training: an
        optimizer accumulating gradients makes its epoch-end update then (:meth:`end_accumulation`;
        at an event on the last batch, before it). A span cut short (``max_steps``, a stop, an
        interrupt) leaves the gradients of its partial group in the optimizer state, where a resumed
        run goes on with them: it then equals the uninterrupted run.
        """
        self._start_eval_compile(span.state)
        self._updated_at = None
        feed = self.feed(loader, span.batches, stop, span.step, position, skip, epoch)
        try:
            if feed.empty:  # e.g. resumed at the epoch's end, or where the loader's pass ended
                if stop is None or span.batches < stop or (epoch_length is not None and span.batches >= epoch_length):
                    self.end_accumulation(span)
                return
            self.note_served(loader)
            if span.acc is None and feed.path == "batches":
                self._restart.starts(loader, feed.first_batch)
            if span.acc is None:
                span.acc = start_sums(feed.first_batch)
            elif "saved_objects" in span.acc:  # resumed mid-epoch: metric objects back in their classes
                span.acc = with_saved_objects(start_sums(feed.first_batch), span.acc)
            ahead: list[DeviceEpoch] = []
            if feed.path == "indexed":
                self._work_before_waiting = lambda: ahead.append(DeviceEpoch(
                    loader, stop=stop, epoch=loader.epoch + 1, host_gather=self._gathers_on_host())) \
                    if more_epochs() else None
            ended_by_event = self.run(feed, span, schedule, self._updating_at_end(epoch_length, span.state, on_event))
            if ended_by_event and stop is not None and span.batches >= stop:  # an event at the pass's last batch
                feed.end_pass()
            ran_out = not ended_by_event and (stop is None or span.batches < stop)  # the pass ended first
            if ran_out or (epoch_length is not None and span.batches >= epoch_length):  # the epoch's end, not a cut
                self.end_accumulation(span)
            if not ran_out and feed.path == "batches" and not feed.ends_pass and epoch_length is not None \
                    and span.batches >= epoch_length and not is_stream(loader) and epoch_setter(loader) is None:
                self._restart.cut(loader, feed, epoch_length)  # steps_per_epoch ended it, not the loader
            if self.choosing_block_length and span.batches >= 2 * BLOCK_LENGTHS[-1]:
                self.choose_block_length(span.state, feed.first_batch)
            self.work_before_waiting()  # not done yet: now, before the epoch's end waits for its last steps
            self._epoch_ahead = ahead[0] if ahead and more_epochs() else None
        finally:
            self._work_before_waiting = None
            feed.close()

    def _updating_at_end(self, epoch_length: int | None, state, on_event: Callable[[Span, int], bool]
                         ) -> Callable[[Span, int], bool]:
        """``on_event``, with the epoch's end update (:meth:`end_accumulation`) made first when
        the event comes at the epoch's last batch: its log point, checkpoint or validation sees
        every batch trained on. Only events pay for the check."""
        if epoch_length is None or not updates_at_epoch_end(getattr(state, "tx", None)):
            return on_event

        def at_event(span: Span, steps: int) -> bool:
            if span.batches >= epoch_length:
                self.end_accumulation(span)
            return on_event(span, steps)

        return at_event

    def end_accumulation(self, span: Span) -> None:
        """At the end of an epoch (not at a cut: see :meth:`train`): the
        gradients accumulated since the optimizer's last update become one update, their mean
        (:func:`~flaxlight.optim.apply_accumulated`; the loss handed to optimizers that take one:
        the epoch's mean training loss), in one jitted call. Nothing for an optimizer that is not
        one of :func:`~flaxlight.optim.accumulate_gradients` (a plain ``optax.MultiSteps`` goes on
        accumulating across epochs), or when made at this step already."""
        if span.acc is None or self._updated_at == span.step or not updates_at_epoch_end(
                getattr(span.state, "tx", None)):
            return
        span.state = self._epoch_end_update(span.state, span.acc)
        self._updated_at = span.step

    def work_before_waiting(self) -> None:
        """Do the host work put off until the training thread would wait for the device: the
        next epoch's device data (see :meth:`train`). The trainer calls it before a log point's
        read that would wait: the steps queued by then overlap it, where the host alone would
        gather after the wait (the tiny MLP's fused epochs: 8.0 against up to 9.5 ms when a log
        point fell late in the epoch). Runs once per span; nothing to do is a no-op."""
        work, self._work_before_waiting = self._work_before_waiting, None
        if work is not None:
            work()

    def start_epoch_ahead(self) -> None:
        """Start the device gather of the next epoch's data, made ahead by :meth:`train`
        (:meth:`~flaxlight.data.DeviceEpoch.start_gather`), where the device would otherwise sit
        idle: once a validation's steps are queued (:meth:`evaluate`: the gather runs while the
        host reads them and ends the epoch), else by the trainer after the epoch's read. Queued
        behind the epoch's last steps, the tiny MLP's gather made its validation wait (1.9 against
        1.1 ms). Nothing when there is none, or it started already."""
        if self._epoch_ahead is not None:
            self._epoch_ahead.start_gather()

    def choose_block_length(self, state, batch, budget: float = 0.3) -> int:
        """``steps_per_execution="auto"``: time single steps and blocks of 16 on ``batch`` (on
        a copy of ``state``: training is not changed), pick the block length with
        :func:`block_length_for` and use it from the next span (epoch) on; a length beyond 16
        is timed against 16 (the same steps per round) and kept by :func:`longer_block_pays`. The
        timings are medians of 3-9 interleaved rounds (a busy machine slows them alike). Steps of 5 ms or more
        keep single steps without timing blocks. Takes about ``budget`` seconds, plus compiling
        the blocks. On a mesh, single steps are kept. Called after the first span of at least
        64 batches (shorter epochs keep single steps until one is that long)."""
        self.choosing_block_length = False
        if self.mesh is not None:
            return self.block_length
        batch, fused_length = jax.device_put(batch), 16
        state, acc = device_copy_of(state), self.zero_sums("train", state, batch)
        for _ in range(2):  # compiled for its arguments as they come: a restored state's are committed, the next not
            state, acc = jax.block_until_ready(self._train(state, acc, batch))
        single = math.inf
        for _ in range(3):  # the fastest of three: a busy moment does not decide
            start = time.perf_counter()
            state, acc = jax.block_until_ready(self._train(state, acc, batch))
            single = min(single, time.perf_counter() - start)
        if single < 5e-3:
            rounds = max(3, min(9, int(budget / (2 * fused_length * single))))  # slow steps: fewer rounds
            blocks = max(1, min(32, int(budget / (2 * rounds) / (fused_length * single))))  # per round
            single_call = (lambda s, a: self._train(s, a, batch), 1, blocks * fused_length)
            (single, fused), state, acc = _interleaved_seconds(
                [single_call, self._block_call(state, acc, batch, fused_length, blocks)], state, acc, rounds)
            self.block_length = block_length_for(single, fused, fused_length)
            longest = BLOCK_LENGTHS[-1]
            if self.block_length > fused_length:  # beyond what was timed: longer blocks must prove faster
                steps = -(-blocks * fused_length // longest) * longest  # per round, the same for both
                calls = [self._block_call(state, acc, batch, length, steps // length)
                         for length in (fused_length, longest)]
                (fused, longer), state, acc = _interleaved_seconds(calls, state, acc, rounds)
                accelerator = jax.default_backend() != "cpu"
                self.block_length = longest if longer_block_pays(fused, longer, accelerator) else fused_length
            messages.info(f"steps_per_execution='auto': {self.block_length} step(s) per dispatch (measured "
                          f"{single * 1e6:.0f} us per single step, {fused * 1e6:.0f} us per step in blocks of "
                          f"{fused_length})" + (f"; log points not at a multiple of it fall on block ends: pass "
                          f"steps_per_execution={self.block_length} for runs whose metrics.csv must match this one."
                                                if self.block_length > 1 else ": blocks would not pay here."))
        else:
            messages.info(f"steps_per_execution='auto': 1 step per dispatch (a single step takes "
                          f"{single * 1e3:.1f} ms: dispatch costs little next to it).")
        self._use_block_length()
        return self.block_length

    def chosen_block_length(self) -> int | None:
        """The block length ``"auto"`` chose (kept in checkpoints); None while still choosing, or
        for a fixed ``steps_per_execution``."""
        return None if self.choosing_block_length or not self.auto_block_length else self.block_length

    def adopt_block_length(self, length: int | None) -> None:
        """A resumed ``steps_per_execution="auto"`` run goes on with the block length it chose
        (its log points and step events then fall where the uninterrupted run's do)."""
        if length is not None and self.choosing_block_length:
            self.choosing_block_length, self.block_length = False, int(length)
            self._use_block_length()

    def _use_block_length(self) -> None:
        if self.block_length > 1:
            self._functions = _loop_functions(*self.step_functions.values(), block_length=self.block_length,
                                              guard=self.guard)
            self._jit_loop()

    def _block_call(self, state, acc, batch, length: int, calls: int) -> tuple[Callable, int, int]:
        """A timing variant for :func:`_interleaved_seconds`: blocks of ``length`` copies of
        ``batch``, ``calls`` per round (compiled here, untimed)."""
        block = jax.tree.map(lambda x: jnp.stack([x] * length), batch)
        warm_state, warm_acc = device_copy_of(state), device_copy_of(acc)
        for _ in range(2):  # as the single step: compiled for the arguments as they come
            warm_state, warm_acc = jax.block_until_ready(self._block(warm_state, warm_acc, block))
        return (lambda s, a: self._block(s, a, block)), length, calls

    def _to_device(self, item: tuple[int, Any]) -> tuple[int, Any]:
        """``(steps, batch or block)`` on the device(s), split over the mesh if any. A batch
        JAX cannot take is passed on as it is, for the training thread to report readably."""
        steps, payload = item
        try:
            if self.mesh is None:
                return steps, jax.device_put(payload)
            return steps, dist.to_global_batch(payload, self.mesh, block=steps > 1)
        except dist.UnsplittableBatchError:
            raise  # said readably already, naming the leaf
        except (TypeError, ValueError):
            return steps, payload

    # ------------------------------------------------------------------ running
    def run(self, feed: Feed, span: Span, schedule, on_event: Callable[[Span, int], bool]) -> bool:
        """The hot loop: run ``feed``'s items on ``span``, locals only, one comparison per step.

        When ``span.step`` reaches ``schedule.next_step`` and ``schedule.looks_up(step, steps,
        sums)`` says stop (else it noted a log point), ``span`` is brought up to date and
        ``on_event(span, steps)`` runs (``steps``: updates since the previous item); it may
        replace ``span.state`` (and then raise: the replacement is kept) and returns True to end
        the span. ``span`` is current when this returns, also by an exception. Returns True when
        an event ended the span (before the feed ran out).
        """
        lean = self._lean_loop(feed, span)
        single, fused = lean.single, lean.fused
        state, kept = lean.split(span.state)
        acc, step, batches = span.acc, span.step, span.batches
        try:
            for steps, item in feed.items:  # `steps` batches: 1, or a stacked block
                if self.compile_time is None:  # the very first step, timed to completion
                    first = time.perf_counter()
                    state, acc = jax.block_until_ready((single if steps == 1 else fused)(state, acc, item))
                    self.compile_time = time.perf_counter() - first
                elif steps == 1:
                    state, acc = single(state, acc, item)
                else:
                    state, acc = fused(state, acc, item)
                step += steps
                batches += steps
                if step >= schedule.next_step and schedule.looks_up(step, steps, acc):
                    span.state, span.acc, span.step, span.batches = lean.join(state, kept), acc, step, batches
                    state = None  # span.state is the state now (on_event may replace it, and then raise)
                    end = on_event(span, steps)
                    state, kept = lean.split(span.state)
                    if end:
                        return True
        except Exception as exc:  # the failure path only: nothing is added to a step
            if feed.path == "batches" and _raised_in(exc, self._functions.train):  # by a step, on `item`
                _note_later_batch(exc, feed, steps, item, batches, "this epoch of train_loader")
            raise
        finally:
            if state is not None:
                span.state = lean.join(state, kept)
            span.acc, span.step, span.batches = acc, step, batches
        return False

    def _lean_loop(self, feed: Feed, span: Span) -> LeanLoop:
        """The loop's functions for a data path without the state fields the step never uses
        (found once per path from its first item; see :mod:`flaxlight.lean`). On a mesh or
        with ``debug=True`` the full state goes through."""
        path = feed.path
        if path not in self._lean:
            fns = self._functions
            functions, jitted = ((fns.train_at, fns.block_at), (self._train_at, self._block_at)) \
                if path == "indexed" else ((fns.train, fns.block), (self._train, self._block))
            head = feed.head
            if head is None or self.debug or self.mesh is not None:
                self._lean[path] = LeanLoop((), *jitted)
            else:
                fields, lean_single, lean_fused = strip_idle_fields(*functions, span.state, span.acc,
                                                                     _first_step_input(head, path))
                lean_jitted = [self._jit(fn, donate_argnums=0) for fn in (lean_single, lean_fused)]
                self._lean[path] = LeanLoop(fields, *lean_jitted) if fields else LeanLoop((), *jitted)
        return self._lean[path]

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, state, batches: Iterable, *, on_first_batch: Callable[[Any], None],
                 after_batch: Callable[[], None]) -> dict | None:
        """Sum the eval metrics over ``batches`` on the device; None when there were none.
        ``on_first_batch`` checks the first batch; ``after_batch`` may raise to stop."""
        if self._eval_compiler is not None:  # compiling ahead: wait for it rather than compile twice
            self._eval_compiler.join()
            self._eval_compiler = None
        acc = first = None
        for index, batch in enumerate(batches):
            if acc is None:
                on_first_batch(batch)
                acc, first = self.zero_sums("eval", state, batch), batch
            if self.mesh is not None:
                batch = dist.to_global_batch(batch, self.mesh)
            try:
                acc = self._evaluate(state, acc, batch)
            except Exception as exc:  # a later batch unlike the first: said how
                note = later_batch_note(batch, first, index, "the evaluation loader") if index else None
                if note is not None and _raised_in(exc, self._functions.evaluate):
                    exc.add_note(note)
                raise
            after_batch()
        if acc is not None:
            self.note_served(batches)
        self.start_epoch_ahead()  # while the caller reads the sums
        return acc

    def close(self) -> None:
        """Wait for background work (the eval step compiling ahead) before the run ends."""
        self._eval_lowered, self._eval_ahead = [], ((), None)
        if self._eval_compiler is not None:
            self._eval_compiler.join()
            self._eval_compiler = None

    def compile_eval_ahead(self, state, loader, check: Callable[[Any], None] | None = None) -> None:
        """Before the first epoch: check the validation loader's first batch with ``check`` and
        trace the eval step for its batch shapes, so a validation that cannot work fails now,
        not after an epoch of training (Lightning's sanity check, without logging anything);
        the step is then compiled in a background thread while the first epoch trains.

        The batches: ``loader.example_batches()`` (:class:`ArrayLoader`: the first and the
        smaller last batch), the first and last batch of a list, else (with ``check``) the first
        batch of a fresh pass; a loader that is its own iterator (a generator) is left alone, as
        its batches would be used up. A step that does not trace is run on those batches, so
        only a real failure of the validation stops the run here.
        """
        self.close()  # an earlier run's compile (e.g. one refused its folder) is done first
        self.eval_metric_names, self.eval_result_shapes = None, {}
        if loader is None:
            return
        examples = _example_batches(loader, peek=check is not None)
        if check is not None and examples:
            check(examples[0])
        elif check is not None and examples is not None:
            raise no_batches_error("val_loader", loader)
        if self.debug or not examples:
            return
        try:
            lowered = self._lower_eval(state, examples)
        except Exception:  # noqa: BLE001 - the real step on the same batches raises the real error, if any
            self.evaluate(state, examples, on_first_batch=lambda batch: None, after_batch=lambda: None)
            return

        self._eval_lowered = lowered  # compiled while the first epoch trains (the run's folder is claimed then)
        self._eval_ahead = (examples, committed_device(state))  # a resume's restored state is placed otherwise
        sums = lowered[0].out_info
        self.eval_metric_names = (*sums["totals"].names, *sums.get("objects", {}))
        self.eval_result_shapes = result_shapes(sums.get("objects", {}))

    def _lower_eval(self, state, examples) -> list:
        """The eval step lowered for ``state`` and each of ``examples`` (batches)."""
        return [self._evaluate_jit(args[2]).lower(*args) for args in (self._eval_specs(state, b) for b in examples)]

    def _start_eval_compile(self, state) -> None:
        """Start compiling the eval steps :meth:`compile_eval_ahead` traced, in a background thread;
        traced again first when ``state`` is placed otherwise than the state they were traced for (a
        resume restores arrays committed to a device: jit compiles a step for each placement)."""
        lowered, self._eval_lowered = self._eval_lowered, []
        if not lowered:
            return
        examples, placed = self._eval_ahead
        if committed_device(state) != placed:
            try:
                lowered = self._lower_eval(state, examples)
            except Exception:  # noqa: BLE001 - it traced for the same shapes before; evaluate reports any error
                return

        def compile_all():
            for step in lowered:
                try:
                    step.compile()
                except Exception:  # noqa: BLE001 - reported by evaluate, where the batch is really used
                    return

        self._eval_compiler = threading.Thread(target=compile_all, daemon=True, name="flaxlight-eval-compile")
        self._eval_compiler.start()

    def _eval_specs(self, state, batch) -> tuple:
        """Shapes and dtypes of ``(state, sums, batch)`` as the eval step gets them."""
        if self.mesh is not None:
            batch = dist.to_global_batch(batch, self.mesh)
        acc = self.zero_sums("eval", state, batch)
        device = committed_device(state) if self.mesh is None else None  # a restored state's, and its sums'
        state, acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=device), (state, acc))
        placed = self.mesh is not None  # the batch's placement, leaf by leaf (see dist.step_batch_sharding)
        return state, acc, jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            np.shape(x), x.dtype, sharding=x.sharding if placed else None), batch)


class LearningRateTable:
    """Learning rates of a span of steps, computed in one dispatch and copied to the host in
    the background, so a log point reads its rate without waiting for the steps in flight.

    Examples:
        >>> table = LearningRateTable(jax.jit)
        >>> table.prepare(optax.linear_schedule(1.0, 0.0, 10), start=0, count=10)   # doctest: +SKIP
        >>> table.rate(optax.linear_schedule(1.0, 0.0, 10), 5)                       # doctest: +SKIP
    """

    def __init__(self, jit: Callable = jax.jit):
        self._jit = jit
        self._compiled: tuple | None = None  # (schedule, jitted vectorised schedule)
        self._table: tuple | None = None  # (schedule, first step, rates from there)

    def prepare(self, plan: Any, start: int, count: int) -> None:
        """Start computing the rates of steps ``start .. start + count`` of ``plan``'s schedule
        (an :class:`~flaxlight.optim.OptimizerPlan`: its rate per train step, or a schedule;
        nothing without one)."""
        schedule = getattr(plan, "step_schedule", plan)
        if schedule is None or self._covers(schedule, start, max(count, 0)):
            return
        # Whole power-of-two chunks of at least 4096 steps: one dispatch serves many epochs, and
        # few lengths are compiled.
        size = max(4096, 1 << max(count, 0).bit_length())
        if self._compiled is None or self._compiled[0] is not schedule:
            self._compiled = (schedule, self._jit(jax.vmap(schedule)))
        values = self._compiled[1](jax.device_put(np.arange(start, start + size, dtype=np.int32)))
        if hasattr(values, "copy_to_host_async"):
            with deliberate_reads():
                values.copy_to_host_async()
        self._table = (schedule, start, values)

    def _covers(self, schedule, start: int, count: int) -> bool:
        table = self._table
        return table is not None and table[0] is schedule and table[1] <= start \
            and start + count < table[1] + len(table[2])

    def rate(self, plan: Any, step: int) -> float | None:
        """The rate at ``step`` (from the table when it covers ``step``, else computed now);
        None when ``plan`` has no schedule."""
        schedule = getattr(plan, "step_schedule", plan)
        if schedule is None:
            return None
        table = self._table
        if table is None or table[0] is not schedule or not 0 <= step - table[1] < len(table[2]):
            self.prepare(schedule, step, 1)
            table = self._table
        if not isinstance(table[2], np.ndarray):  # first use: the copy started in prepare
            with deliberate_reads():
                table = self._table = (table[0], table[1], np.asarray(table[2]))
        return float(table[2][step - table[1]])


def _epoch_end_update(state, acc):
    """:func:`~flaxlight.optim.apply_accumulated` with the epoch's mean training loss as ``value``
    (when the step's metrics have a ``loss``)."""
    totals = acc["totals"]
    value = None
    if "loss" in totals.names:
        value = totals.values[totals.names.index("loss")] / jnp.maximum(totals.count, 1.0)
    return apply_accumulated(state, value=value)


def _in_flight_bound(mesh) -> Callable:
    """On several CPU devices, wait for the step from 8 steps back before dispatching more:
    XLA's CPU collectives deadlock with too many steps in flight. Elsewhere: no waiting."""
    in_flight: collections.deque = collections.deque()
    bound = 8 if mesh.devices.size > 1 and jax.devices()[0].platform == "cpu" else None

    def wrap(fn):
        def bounded(state, acc, batch):
            state, acc, token = fn(state, acc, batch)
            if bound is not None:
                in_flight.append(token)
                if len(in_flight) > bound:
                    in_flight.popleft().block_until_ready()
            return state, acc

        return bounded

    return wrap


def _interleaved_seconds(variants: list[tuple[Callable, int, int]], state, acc,
                         rounds: int) -> tuple[list[float], Any, Any]:
    """Median seconds per step of each variant ``(run, steps per call, calls per round)``, with
    ``run(state, acc) -> (state, acc)``, over ``rounds`` rounds that take the variants in turn."""
    seconds: list[list[float]] = [[] for _ in variants]
    for _ in range(rounds):
        for times, (run, steps, calls) in zip(seconds, variants):
            start = time.perf_counter()
            for _ in range(calls):
                state, acc = run(state, acc)
            state, acc = jax.block_until_ready((state, acc))
            times.append((time.perf_counter() - start) / (steps * calls))
    return [statistics.median(times) for times in seconds], state, acc


def _no_rows(batch) -> bool:
    """Whether every array of ``batch`` has 0 rows (static: shapes are known when tracing)."""
    return all(np.ndim(leaf) and np.shape(leaf)[0] == 0 for leaf in jax.tree.leaves(batch))


def _say_empty_batch(where: str, batch) -> None:
    """Warn (when a step is traced for it) that a batch of 0 rows is passed over (``where``:
    ``"training"`` or ``"evaluation"``)."""
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(batch)]
    what = "it still counts as a step, which changes nothing, and" if where == "training" else "it"
    warnings.warn(f"A{'n' if where[0] in 'aeiou' else ''} {where} batch has 0 rows (shapes {shapes}): it is passed "
                  f"over ({what} weighs nothing in the metrics). Drop empty batches in your loader to silence this.",
                  RuntimeWarning, stacklevel=2)


def _raised_in(exc: BaseException, function: Callable) -> bool:
    """Whether ``exc`` came out of a call of ``function`` (its frame is in the traceback): raised
    by a step while tracing it, not by the loader or an event."""
    code, tb = function.__code__, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def _note_later_batch(exc: BaseException, feed: Feed, steps: int, item: Any, index: int, source: str) -> None:
    """Add a note to ``exc``, raised by the step on ``item`` (``steps`` batches from the epoch's
    ``index``-th, counted from 0), that says how the batch differs from the epoch's first (see
    :func:`~flaxlight.data.later_batch_note`); nothing for the first item, or one like the first."""
    if feed.head is None or item is feed.head[1]:
        return
    note = later_batch_note(_first_of((steps, item)), feed.first_batch, index, source, count=steps)
    if note is not None:
        exc.add_note(note)


def _first_of(head: tuple[int, Any]):
    """The first batch of a ``(steps, batch or block)`` item."""
    steps, payload = head
    return payload if steps == 1 else jax.tree.map(lambda x: x[0], payload)


def _first_step_input(head: tuple[int, Any], path: str):
    """What a single step gets for the first item: a batch, or a device epoch and an index."""
    return _first_of(head) if path == "batches" else head[1]


def _example_batches(loader, peek: bool = False) -> list | None:
    """A batch of each shape ``loader`` yields when that is cheap to know, else (``peek``) its
    first batch, from a pass of its own (see :meth:`Engine.compile_eval_ahead`); ``[]``: it has
    none; None: not looked at (a stream, whose batch would be used up)."""
    if hasattr(loader, "example_batches"):
        return list(loader.example_batches())
    if isinstance(loader, (list, tuple)):
        if not loader:
            return []
        first, last = loader[0], loader[-1]
        return [first] if same_shapes(first, last) else [first, last]
    if not peek or is_iterator(loader) or not _starts_new_passes(loader):
        return None
    for batch in loader:
        return [batch]
    return []


def _starts_new_passes(loader) -> bool:
    """Whether each ``iter(loader)`` starts a new pass, so a batch read ahead is not lost to the
    validation (not a stream: see :func:`flaxlight.data.is_stream`)."""
    return not is_stream(loader)
