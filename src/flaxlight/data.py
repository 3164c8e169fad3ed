"""Batches: a reproducible in-memory loader and the checks every batch goes through once.

Any iterable of batches works with the trainer; a batch is an array, or a tuple/list/dict
pytree of arrays that share a leading batch dimension.
"""

from __future__ import annotations

import base64
import collections.abc
import difflib
import functools
import inspect
import itertools
import queue
import re
import threading
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import jax
import numpy as np

__all__ = ["FirstBatches", "ArrayLoader", "DeviceEpoch", "EpochRows", "Prefetcher", "as_loader", "check_batch", "fit_loaders",
           "group_batches", "take_batches", "is_stream", "lists_as_arrays", "refuse_unknown_keywords",
           "REQUIRED", "checked_loader", "StepsOf"]

DEVICE_EPOCH_MAX_BYTES = 1 << 30


def _leading_dim(tree) -> int:
    return int(jax.tree.leaves(tree)[0].shape[0])


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, jax.Array))


def _is_frame(value: Any) -> bool:
    """Whether ``value`` is a pandas ``DataFrame`` / ``Series`` (or another table with
    ``to_numpy()``): taken as the array it converts to, as Keras' ``fit`` takes them."""
    return not _is_array(value) and callable(getattr(value, "to_numpy", None)) and hasattr(value, "shape")


def _is_numeric(leaf: Any) -> bool:
    """Whether JAX can hold ``leaf``'s values (numbers or booleans, not text or objects)."""
    try:
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        return bool(jax.numpy.issubdtype(dtype, jax.numpy.number) or jax.numpy.issubdtype(dtype, np.bool_))
    except TypeError:  # another library's dtype (a torch tensor): numpy takes its batches
        return False


def _holds_values(value: Any) -> bool:
    """Whether ``value`` is a (nested) Python list of values (numbers, strings), as ``y.tolist()``
    makes, rather than a list of arrays or batches: its first item's first item ... is a scalar."""
    if not isinstance(value, list) or not value:
        return False
    while isinstance(value, list) and value:
        value = value[0]
    return not isinstance(value, (list, tuple, Mapping)) and not _is_array(value)


def _shapes_of(leaves: list, shown: int = 8) -> str:
    """``[0] (10, 3), [1] (4,)`` for a pytree's ``(path, leaf)`` pairs, the first ``shown`` of them
    (a leaf without a dimension: ``[1] a str, not an array``)."""
    def one(path, leaf) -> str:
        shape = tuple(np.shape(leaf)) if np.ndim(leaf) else f"a {type(leaf).__name__}, not an array"
        return f"{jax.tree_util.keystr(path)} {shape}".strip()

    text = ", ".join(one(path, leaf) for path, leaf in leaves[:shown])
    return text + (f" ... ({len(leaves)} arrays in all)" if len(leaves) > shown else "")


def lists_as_arrays(data: Any, what: str = "data") -> Any:
    """``data`` with each Python list of numbers (or strings) in it made a numpy array, as Keras
    takes ``y.tolist()``, and each pandas ``DataFrame`` / ``Series`` its ``to_numpy()``; a list of
    arrays or of batches is left as it is. ``what`` names the data in the error for a list that is
    not rectangular.

    Examples:
        >>> x, y = lists_as_arrays((np.zeros((3, 2)), [0, 1, 2]))
        >>> y
        array([0, 1, 2])
    """
    if not any(isinstance(leaf, list) or _is_frame(leaf) for leaf in jax.tree.leaves(data, is_leaf=_holds_values)):
        return data  # nothing to convert: the same object back

    def convert(path, leaf):
        if _is_frame(leaf):
            return np.asarray(leaf.to_numpy())
        if not isinstance(leaf, list):
            return leaf
        try:
            return np.asarray(leaf)
        except ValueError as exc:  # ragged: numpy says "inhomogeneous shape"
            where = jax.tree_util.keystr(path) or ""
            raise ValueError(f"{what}{where} is a Python list that is not rectangular, so it makes no array "
                             f"({exc}). Pass arrays, e.g. np.asarray(...) of equal-length rows.") from None

    return jax.tree_util.tree_map_with_path(convert, data, is_leaf=_holds_values)


class ArrayLoader:
    """Batches of in-memory arrays; the order is a pure function of ``(seed, epoch)``.

    ``ArrayLoader(x, y, batch_size=64, shuffle=True, seed=0)`` yields ``(x_batch, y_batch)``
    tuples (a single array yields arrays; a dict yields dicts; Python lists of numbers, as
    ``y.tolist()``, are made arrays with ``np.asarray``). The trainer calls
    :meth:`set_epoch` before each epoch, so a run that is stopped and resumed sees exactly the
    same batches. ``len()`` is the number of batches per epoch.

    With several processes, ``shard_index=jax.process_index(), num_shards=jax.process_count()``
    makes each process yield its contiguous part of every global batch of ``batch_size``
    examples (the global order is the same as with one process).

    ``on_device``: the trainer (on one device) copies the data to the device once and sends
    each epoch's order, and the jitted step gathers its batch there (see :class:`DeviceEpoch`): the
    same batches in the same order, without a host-to-device copy per step. ``None`` (the
    default) does so when the data take at most 1 GiB; ``False`` always goes batch by batch.
    Once training has started, do not edit the arrays in place (the device copy is made once, so
    the edit is not trained on); assign ``loader.data = (x_new, y_new)`` instead.

    Examples:
        >>> import numpy as np
        >>> loader = ArrayLoader(np.arange(10), np.arange(10), batch_size=4, shuffle=True, seed=1)
        >>> len(loader), [b[0].shape[0] for b in loader]
        (3, [4, 4, 2])
        >>> len(ArrayLoader(np.arange(10), batch_size=4, drop_last=True))
        2
    """

    def __init__(self, *arrays: Any, batch_size: int, shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 shard_index: int = 0, num_shards: int = 1, on_device: bool | None = None):
        if not arrays:
            raise ValueError("ArrayLoader needs at least one array, e.g. ArrayLoader(x, y, batch_size=64).")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
        self.data = arrays[0] if len(arrays) == 1 else tuple(arrays)
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        if not 0 <= shard_index < num_shards or self.batch_size % num_shards:
            raise ValueError(f"shard_index={shard_index}, num_shards={num_shards}: need 0 <= shard_index < num_shards "
                             f"and a batch_size ({self.batch_size}) divisible by num_shards.")
        self.shard_index, self.num_shards = shard_index, num_shards
        self.on_device = on_device
        rest = self.num_examples % self.batch_size
        if num_shards > 1 and not drop_last and rest % num_shards:
            warnings.warn(f"ArrayLoader(num_shards={num_shards}): the last batch of {rest} examples does not split over "
                          f"{num_shards} shards, so its last {rest % num_shards} example(s) are not served (every "
                          f"process must take the same number). Pass drop_last=True to drop that batch, or give a "
                          f"number of examples whose last batch splits.", UserWarning, stacklevel=2)

    @property
    def data(self) -> Any:
        """The arrays (one, a tuple or a dict). Assigning new ones (the same structure) takes
        effect from the next epoch; ``num_examples`` and ``len()`` follow them."""
        return self._data

    @data.setter
    def data(self, data: Any) -> None:
        data = lists_as_arrays(data, "ArrayLoader's data")
        leaves = jax.tree_util.tree_leaves_with_path(data)
        sizes = {tuple(np.shape(leaf))[:1] for _, leaf in leaves}
        if len(sizes) != 1 or () in sizes:
            raise ValueError(f"ArrayLoader arrays must share a leading dimension (one row per example); got "
                             f"{_shapes_of(leaves)}.")
        if hasattr(self, "_data") and jax.tree.structure(data) != jax.tree.structure(self._data):
            raise ValueError(f"ArrayLoader.data: the new arrays are a {jax.tree.structure(data)}, the loader's a "
                             f"{jax.tree.structure(self._data)}; give the same structure (e.g. (x, y)).")
        self._data, self.num_examples = data, _leading_dim(data)

    @property
    def nbytes(self) -> int:
        """Bytes of the data (read from the arrays, nothing copied)."""
        return sum(int(getattr(leaf, "nbytes", None) or np.asarray(leaf).nbytes) for leaf in jax.tree.leaves(self.data))

    def device_data(self):
        """The data on the default device, copied there once (for :class:`DeviceEpoch`)."""
        cached = getattr(self, "_device_copy", None)
        if cached is None or cached[0] is not self.data:
            cached = self._device_copy = (self.data, jax.device_put(self.data))
        return cached[1]

    def serves_device_epochs(self) -> bool:
        """Whether the trainer may move whole epochs to the device (see ``on_device``)."""
        if self.on_device is False or self.num_shards > 1 or type(self).__iter__ is not ArrayLoader.__iter__ \
                or type(self).take is not ArrayLoader.take:  # a subclass's batches come from its own code
            return False
        if not all(_is_numeric(leaf) for leaf in jax.tree.leaves(self.data)):  # text: the first batch's check names it
            return False
        return bool(self.on_device) or self.nbytes <= DEVICE_EPOCH_MAX_BYTES

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch`` (called by the trainer before each epoch)."""
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The example indices of an epoch, in the order they are served."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def __len__(self) -> int:
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (not self.drop_last and rest >= self.num_shards)  # sharded: a rest too small for a share is dropped

    def __iter__(self) -> Iterator[Any]:
        indices = self.order()
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield self.take(indices[start : start + self.batch_size])

    def take(self, idx: np.ndarray):
        """The batch of the examples ``idx`` (this process's part of it when sharded)."""
        if self.num_shards > 1:
            per = len(idx) // self.num_shards
            idx = idx[self.shard_index * per : (self.shard_index + 1) * per]
        return jax.tree.map(lambda a: np.asarray(a)[idx], self.data)

    def example_batches(self) -> list:
        """One batch of each shape the loader yields: the first and, when it is smaller, the
        last (the trainer compiles its steps for them ahead of use).

        Examples:
            >>> [b.shape for b in ArrayLoader(np.zeros((10, 3)), batch_size=4).example_batches()]
            [(4, 3), (2, 3)]
            >>> [b.shape for b in ArrayLoader(np.zeros((10, 3)), batch_size=4, drop_last=True).example_batches()]
            [(4, 3)]
        """
        if len(self) == 0:
            return []
        last = self.batch_size if self.drop_last else self.num_examples - (len(self) - 1) * self.batch_size
        sizes = {min(self.batch_size, self.num_examples), last}
        return [self.take(np.arange(size)) for size in sorted(sizes, reverse=True)]


@functools.lru_cache(maxsize=8)
def _device_indices(count: int) -> tuple:
    """``0 .. count-1`` as device scalars, made once per count: a step that gets its batch index
    this way transfers nothing (a Python int would be sent to the device at every step)."""
    return tuple(jax.device_put([np.int32(i) for i in range(count)]))


class EpochRows(NamedTuple):
    """An epoch's batches as row numbers into the data on the device: batch ``i`` is
    ``data[rows[i]]``, gathered inside the jitted step by :func:`take_batches` (the data are
    copied once per step, into the batch, as a loader's own batches are)."""

    data: Any
    rows: Any


ROWS_MIN_EXAMPLE_BYTES = 1024  # examples this large are gathered by each step (see DeviceEpoch)


@jax.jit
def _gather_epoch(data, rows):
    return jax.tree.map(lambda a: a[rows], data)


def _device_gather(loader: ArrayLoader) -> Callable[[np.ndarray], Any]:
    """Rows of the loader's device copy of the data, gathered on the device in one dispatch
    (only the row numbers cross to it)."""
    data = loader.device_data()
    return lambda rows: _gather_epoch(data, jax.device_put(rows))


def _device_rows(loader: ArrayLoader) -> Callable[[np.ndarray], EpochRows]:
    """Batches as row numbers into the loader's device copy of the data (only the row numbers
    cross to the device)."""
    data = loader.device_data()
    return lambda rows: EpochRows(data, jax.device_put(rows))


def _host_gather(loader: ArrayLoader) -> Callable[[np.ndarray], Any]:
    """Rows of the loader's data gathered by numpy, then put on the device in one transfer."""
    return lambda rows: jax.device_put(jax.tree.map(lambda leaf: np.asarray(leaf)[rows], loader.data))


class DeviceEpoch:
    """An :class:`ArrayLoader` epoch on the device: its first ``stop`` batches in the epoch's
    order, taken from the loader's device copy of the data (made once; the host only sends the
    permutation). Examples of at least ``ROWS_MIN_EXAMPLE_BYTES`` are served as row numbers of
    shape ``(batches, batch_size)`` (:class:`EpochRows`) and each step gathers its batch: one
    copy of the data per step where a gathered epoch costs a second, and no epoch copies held on
    the device (784-float MLPs on the CPU: 1-4% faster). Smaller examples are gathered as one
    epoch in one dispatch, leaves of shape ``(batches, batch_size, ...)``, from which a step
    slices its batch (a step's gather of short rows costs more than that copy: 2-12% slower on
    64-float MLPs); ``device_rows`` forces either. With ``host_gather=True`` numpy gathers the epoch and puts it on the device in
    one transfer. The smaller last batch, when reached, is a second such source of one batch.

    Made ahead of its epoch (the trainer makes the next epoch's while this one's last steps run),
    an epoch does its host work at once (the permutation, its transfer, a host gather) and starts
    its device gather at :meth:`start_gather`, or at the first :meth:`items`: the trainer starts it
    where the device would otherwise sit idle, while the host reads the epoch's results (queued
    behind the last steps, the tiny MLP's 4 MB gather made its validation wait: 1.9 against 1.1 ms).

    :meth:`items` yields ``(steps, (batches, index))``: ``steps`` batches starting at batch
    ``index`` (a device scalar); the jitted step slices them out (:func:`take_batches`), so a
    step transfers nothing. The batches and their order are exactly those ``iter(loader)``
    yields.

    Examples:
        >>> loader = ArrayLoader(np.arange(10.0), batch_size=4)
        >>> epoch = DeviceEpoch(loader, stop=3)
        >>> [(n, int(i)) for n, (_, i) in epoch.items(start=0, steps=1, global_step=0)]
        [(1, 0), (1, 1), (1, 0)]
        >>> epoch.first_batch
        array([0., 1., 2., 3.])
    """

    def __init__(self, loader: ArrayLoader, stop: int, epoch: int | None = None, *, host_gather: bool = False,
                 device_rows: bool | None = None):
        stop = min(int(stop), len(loader))
        epoch = loader.epoch if epoch is None else int(epoch)
        self._key = (id(loader), id(loader.data), epoch, stop)
        size = loader.batch_size
        full = min(stop, loader.num_examples // size)
        order = loader.order(epoch).astype(np.int32)
        if device_rows is None:
            device_rows = loader.nbytes >= ROWS_MIN_EXAMPLE_BYTES * max(loader.num_examples, 1)
        rows = (order[: full * size].reshape(full, size) if full else None,  # the full batches
                order[full * size :][None] if stop > full else None)  # the smaller last batch
        self.num_full = full
        self.index = _device_indices(full + 1)
        self._first = (loader, order[: min(size, len(order))])
        if host_gather or device_rows:  # host work, or no device work: done now
            gather = _host_gather(loader) if host_gather else _device_rows(loader)
            self._batches, self._gather = tuple(None if part is None else gather(part) for part in rows), None
        else:  # the row numbers cross now; the device gathers at start_gather()
            self._batches = tuple(None if part is None else jax.device_put(part) for part in rows)
            self._gather = _device_gather(loader)

    def start_gather(self) -> None:
        """Start gathering the epoch's batches on the device (dispatched: nothing waits for it).
        Done by the first :meth:`items` when not called; a second call does nothing."""
        if self._gather is not None:  # cleared once gathered: a gather that raised (Ctrl-C) is tried again
            self._batches = tuple(None if part is None else self._gather(part) for part in self._batches)
            self._gather = None

    @property
    def full(self) -> Any:
        """The epoch's full batches, stacked (None when it has none)."""
        self.start_gather()
        return self._batches[0]

    @property
    def last(self) -> Any:
        """The smaller last batch, stacked as a block of one (None when it is not served)."""
        self.start_gather()
        return self._batches[1]

    @property
    def first_batch(self):
        """The epoch's first batch on the host (the trainer checks it; made only when asked)."""
        loader, first = self._first
        return loader.take(first)

    def serves(self, loader: ArrayLoader, stop: int) -> bool:
        """Whether this is the epoch ``loader`` is set to, cut at ``stop`` batches (an epoch
        made ahead of time is used only then)."""
        return self._key == (id(loader), id(loader.data), loader.epoch, min(int(stop), len(loader)))

    def items(self, start: int, steps: int, global_step: int) -> Iterator[tuple[int, Any]]:
        """``(steps, (arrays, index))`` from batch ``start`` on; blocks of ``steps`` end at
        global-step multiples of ``steps``, as :func:`group_batches` makes them."""
        i, index = start, self.index
        if steps > 1:
            while i < self.num_full and (global_step + i - start) % steps:
                yield 1, (self.full, index[i])
                i += 1
            while i + steps <= self.num_full:
                yield steps, (self.full, index[i])
                i += steps
        while i < self.num_full:
            yield 1, (self.full, index[i])
            i += 1
        if self.last is not None and i <= self.num_full:
            yield 1, (self.last, index[0])


def positioned_iterator(loader: Iterable, position: Any = None, name: str = "train_loader",
                        passed_over: int = 0) -> tuple[Iterator, Callable[[], Any] | None, bool]:
    """``iter(loader)``, continued from ``position`` when given, a function that reads the
    iterator's position (JSON data), or None when the loader cannot tell it, and whether the
    position was restored.

    Loaders that save their own position: grain iterators (``get_state`` / ``set_state``) and
    torchdata's ``StatefulDataLoader`` (``state_dict`` / ``load_state_dict``). A resumed run then
    continues the epoch where it was, without re-reading the batches already trained on. When the
    loader refuses the saved position (grain checks it against ``repr(data_source)``, which holds
    an address unless the source has a ``__repr__`` of its own), a warning says why, and the
    iterator is a new pass (False): the caller passes over the ``passed_over`` batches trained on
    already, as for a loader that cannot tell its position. The first position read that holds
    such an address warns too, naming the fix (:func:`_warn_address_repr`).

    Examples:
        >>> it, where, restored = positioned_iterator(grain.MapDataset.range(8).batch(2).to_iter_dataset())  # doctest: +SKIP
        >>> next(it); where()                                                                                 # doctest: +SKIP
        {'next_index': 1}
    """
    if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
        restored = position is None or _restored(lambda: loader.load_state_dict(_from_json(position)), name,
                                                 passed_over)
        return iter(loader), lambda: _to_json(loader.state_dict()), restored
    iterator = iter(loader)
    if callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None)):
        restored = position is None or _restored(lambda: iterator.set_state(_from_json(position)), name, passed_over)
        if not restored and not is_iterator(loader):
            iterator = iter(loader)  # a new pass, untouched by the refused state
        return iterator, lambda: _to_json(_warn_address_repr(iterator.get_state(), name)), restored
    return iterator, None, position is None


def _restored(restore: Callable[[], Any], name: str, passed_over: int) -> bool:
    """Whether ``restore()`` took the saved position; if not, a warning says why and what the
    resumed epoch does instead."""
    try:
        restore()
        return True
    except Exception as error:  # noqa: BLE001 - any refusal: the batches are reached another way
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        warnings.warn(f"{name} refused the position saved in the checkpoint ({reason[:400]}). The resumed epoch "
                      f"instead starts the loader again and passes over the {passed_over} batches trained on "
                      f"already: exact when each iter() yields the epoch's batches in the same order (a "
                      f"grain.DataLoader does: it restarts at every iter()). For grain, give the data source a "
                      f"__repr__ that names its content and stays the same between runs (docs/data.md, "
                      f"\"Epochs, set_epoch and resuming\").", RuntimeWarning, stacklevel=4)
        return False


_ADDRESS_SAID: set[str] = set()


def _warn_address_repr(state: Any, name: str) -> Any:
    """``state`` (a grain iterator's), after a warning, once per data source, when it holds a
    ``repr`` with an address (``<Src object at 0x7f...>``): a new process cannot give the same
    one, so grain refuses the position a mid-epoch checkpoint saves."""
    text = state.decode("utf-8", "replace") if isinstance(state, bytes) else str(state)
    found = re.search(r"<[^<>]* object at 0x[0-9a-fA-F]+>", text)
    if found and found.group(0) not in _ADDRESS_SAID:
        _ADDRESS_SAID.add(found.group(0))
        warnings.warn(f"{name}'s saved position holds the data source's default repr {found.group(0)}, an address "
                      f"that a new process cannot match: grain refuses such a position, and a run resumed from a "
                      f"mid-epoch checkpoint passes over the epoch's batches trained on already instead (exact for a "
                      f"grain.DataLoader). Give the data source a __repr__ that names its content, e.g. "
                      f"`def __repr__(self): return f\"MySource({{self.path!r}}, n={{len(self)}})\"` (docs/data.md, "
                      f"\"Epochs, set_epoch and resuming\"). Said once.", RuntimeWarning, stacklevel=4)
    return state


def noting_loader_errors(iterator: Iterator, name: str, first: int = 1, epoch: int | None = None) -> Iterator:
    """``iterator``'s batches; an exception the loader raises while producing one gets a note that
    names the loader, the batch (``first``: the number in the epoch of the first one yielded) and
    how to go on (a step that fails on a batch gets its own note; this one is the loader's).

    Examples:
        >>> def shards():
        ...     yield 1
        ...     raise OSError("corrupt shard")
        >>> try:
        ...     list(noting_loader_errors(shards(), "train_loader", first=7, epoch=3))
        ... except OSError as exc:
        ...     print(exc.__notes__[0].split(" (")[0])
        flaxlight: train_loader raised this while producing the 8th batch of epoch 3
    """
    number = first
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:
            where = f"the {_ordinal(number)} batch" + (f" of epoch {epoch}" if epoch is not None else " of the epoch")
            exc.add_note(f"flaxlight: {name} raised this while producing {where} (your loader's code, not a step). "
                         f"The steps trained since the newest checkpoint are lost unless a callback saved them "
                         f"(on_exception calling trainer.save_model(): docs/data.md, \"A loader that raises\"). "
                         f"Fix the loader and call train_model(..., resume=True) with the same log_dir: the run "
                         f"continues from its newest checkpoint.")
            raise
        number += 1
        yield batch


class RestartCheck:
    """Whether a re-iterable loader whose epoch was cut by ``steps_per_epoch`` (its pass had more
    batches) starts its next epoch at the same first batch: each epoch calls ``iter(loader)``, so
    the batches after the cut are never trained on (a grain ``DataLoader`` over an endless
    ``IndexSampler`` used for "virtual epochs"). Checked once per run (not with ``limit_train_batches``, a
    cut meant so): for a loader without ``len()``, one batch is drawn past the cut to tell whether its pass
    went on; the next epoch's first batch is compared with the cut epoch's; a warning names the fix.
    A loader that reshuffles at each ``iter()`` starts elsewhere and is not warned about."""

    def __init__(self, done: bool = False):
        self.done, self.pending = done, None

    def cut(self, loader: Any, feed: Any, length: int) -> None:
        """The epoch over ``loader`` (``feed``: its batches) ended at ``length`` batches."""
        if self.done or isinstance(loader, FirstBatches) or feed.first_batch is None:
            return
        self.done = True
        total = _safe_len(loader)  # without len(), one batch is drawn past the cut to tell
        if (length < total) if total is not None else next(feed.source, _PASS_ENDED) is not _PASS_ENDED:
            self.pending = (loader, jax.tree.map(np.asarray, feed.first_batch), length)

    def starts(self, loader: Any, first_batch: Any) -> None:
        """A fresh epoch over ``loader`` begins with ``first_batch``."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0] is not loader or not _same_values(pending[1], first_batch):
            return
        warnings.warn(f"train_loader starts this epoch again at the same first batch as the last one: that epoch "
                      f"ended after steps_per_epoch={pending[2]} batches while the loader had more, and each epoch "
                      f"calls iter(loader), which restarts it, so the batches after the first {pending[2]} are never "
                      f"trained on (Keras carries its iterator on across epochs; Lightning restarts too). To go on "
                      f"through the data, pass iter(loader): a stream that keeps its place across epochs (a grain "
                      f"iterator resumes exactly from checkpoints too; docs/data.md, \"Without len()\"). Said once.",
                      RuntimeWarning, stacklevel=4)


def _same_values(a: Any, b: Any) -> bool:
    """Whether the batches ``a`` and ``b`` hold the same arrays."""
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.shape(x) == np.shape(y) and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def _to_json(value: Any) -> Any:
    """A loader's state as JSON data (bytes as base64, numpy scalars as numbers)."""
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _from_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def take_batches(batches, index, count: int | None = None):
    """Inside a jitted step: batch ``index`` of a :class:`DeviceEpoch`'s batches (stacked
    arrays, or :class:`EpochRows` gathered here), or with ``count`` the ``count`` batches from
    there (a block for fused steps).

    Examples:
        >>> batches = np.arange(12.0).reshape(3, 2, 2)   # 3 batches of 2 examples
        >>> take_batches(batches, 1)
        array([[4., 5.],
               [6., 7.]])
        >>> take_batches(EpochRows(np.arange(6.0) * 10, np.array([[5, 0], [2, 3]])), 0)
        array([50.,  0.])
    """
    if isinstance(batches, EpochRows):
        rows = batches.rows[index] if count is None else jax.lax.dynamic_slice_in_dim(batches.rows, index, count)
        return jax.tree.map(lambda a: a[rows], batches.data)
    if count is None:
        return jax.tree.map(lambda a: a[index], batches)
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, index, count), batches)


def _describe(batch) -> str:
    return str(jax.tree.map(lambda a: f"{type(a).__name__}{tuple(np.shape(a))}", batch))


class FirstBatches:
    """The first ``n`` batches of ``loader``, as a loader: each ``iter()`` starts a new pass
    (``limit_val_batches``; hooks that read the validation loader get all ``n`` again).

    Examples:
        >>> first = FirstBatches([1, 2, 3], 2)
        >>> list(first), list(first), len(first)
        ([1, 2], [1, 2], 2)
    """

    def __init__(self, loader: Iterable, n: int):
        self.loader, self.n = loader, int(n)

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.loader), self.n)

    def __len__(self) -> int:
        length = _safe_len(self.loader)
        return self.n if length is None else min(self.n, length)


def _safe_len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def is_iterator(loader: Any) -> bool:
    """Whether ``loader`` is an iterator (a generator, ``iter(list)``): one pass only. Asked
    without calling ``iter`` (a torch or grain loader would start its workers)."""
    if isinstance(loader, FirstBatches):  # the first n batches of a stream: a pass of its own each time, n batches on
        return is_iterator(loader.loader)
    return isinstance(loader, collections.abc.Iterator)


def is_stream(loader: Any) -> bool:
    """Whether ``loader`` is one pass that goes on across epochs, not restarted at each ``iter()``:
    an iterator (a generator), or a loader whose ``iter()`` hands out one shared iterator (asked by
    calling ``iter`` twice; torch's and grain's loaders, whose ``iter`` starts workers, are not
    asked: they start a new pass each time).

    Examples:
        >>> is_stream(iter([1, 2])), is_stream([1, 2])
        (True, False)
    """
    if is_iterator(loader):
        return True
    if type(loader).__module__.split(".")[0] in ("torch", "grain"):
        return False
    try:
        return iter(loader) is iter(loader)
    except TypeError:  # not iterable: not a stream (the loop says what is wrong with it)
        return False


def ends_its_pass(loader: Any, stop: int | None) -> bool:
    """Whether an epoch that takes ``stop`` batches of ``loader`` takes a whole pass of it, as a
    ``for batch in loader`` loop does (``len(loader)`` batches or more), so that its iterator is
    to be run to its end (:func:`ending_the_pass`). False for a cut (``limit_train_batches``,
    ``max_steps``, a ``steps_per_epoch`` below ``len()``), for a loader without ``len()``, and for
    an iterator (a stream: what comes next is the next epoch's).

    Examples:
        >>> ends_its_pass([1, 2, 3], 3), ends_its_pass([1, 2, 3], 2), ends_its_pass(iter([1, 2]), 2)
        (True, False, False)
    """
    length = _safe_len(loader)
    return stop is not None and length is not None and stop >= length and not is_iterator(loader)


def ending_the_pass(batches: Iterator, iterator: Iterator, beyond: Callable[[Any], None],
                    expected: int | None = None) -> Iterator:
    """``batches`` (an ``islice`` of ``iterator``), then one more ``next(iterator)``, as a ``for``
    loop ends a pass: a loader learns there that its pass is over (torch's ``RandomSampler`` draws
    its generator for the next shuffle only then), on the thread that iterates, a prefetcher's too.
    A batch it yields after all is given to ``beyond``. ``expected``: the batches the slice takes;
    when fewer came, the iterator ended already and is not asked again (a loader whose ``len()``
    says more than it yields may block on such a ``next()``: a queue fed by a thread).

    Examples:
        >>> it = iter([1, 2, 3])
        >>> list(ending_the_pass(itertools.islice(it, 2), it, print))
        3
        [1, 2]
    """
    taken = 0

    def counted() -> Iterator:
        nonlocal taken
        for taken, batch in enumerate(batches, start=1):
            yield batch

    def end() -> Iterator:
        if expected is None or taken >= expected:
            extra = next(iterator, _PASS_ENDED)
            if extra is not _PASS_ENDED:
                beyond(extra)
        yield from ()

    return itertools.chain(counted(), end())


_PASS_ENDED = object()


def no_batches_error(name: str, loader: Any, served_before: bool = False) -> ValueError:
    """The error for a loader that yielded no batch: an iterator (a generator) that ran dry after
    its one pass (``served_before``: it yielded batches at an earlier pass) or never yielded any
    (empty data, or used up before the trainer got it), a loader that yielded batches at an earlier
    pass but whose ``iter()`` hands out one shared iterator, or an empty dataset.

    Examples:
        >>> "that ran dry" in str(no_batches_error("train_loader", iter([]), served_before=True))
        True
        >>> "not even at its first pass" in str(no_batches_error("train_loader", iter([])))
        True
    """
    if served_before and not is_iterator(loader):
        return ValueError(f"{name} yielded no batches this time, though it yielded some at an earlier pass: its "
                          f"__iter__ hands out one shared iterator (a generator made once, or `return self`), which "
                          f"runs dry after one pass. Make __iter__ start a new pass at each call: write it with "
                          f"`yield`, or return a new generator each time (`return make_batches()`); or give a list "
                          f"of batches or an ArrayLoader.")
    if is_iterator(loader) and served_before:
        return ValueError(f"{name} yielded no batches: it is an iterator (a generator?) that ran dry: it yielded "
                          f"batches at an earlier pass, and an iterator makes one pass only. Give something that "
                          f"starts a new pass at each iter(): a list, an ArrayLoader, or a class whose __iter__ makes "
                          f"the generator (for a stream that never ends, steps_per_epoch=N takes N batches per "
                          f"epoch).")
    if is_iterator(loader):
        return ValueError(f"{name} yielded no batches: it is an iterator (a generator?) that has yielded none since "
                          f"the trainer got it, not even at its first pass. Its data are empty (a filter that drops "
                          f"every example? check the dataset size, batch_size and drop_last), or it was used up before "
                          f"(an iterator makes one pass only: a next(...) or list(...) over it beforehand takes its "
                          f"batches).")
    return ValueError(f"{name} yielded no batches: check the dataset size, batch_size and drop_last.")


def check_batch(batch, where: str = "batch") -> None:
    """Fail with a readable message unless ``batch`` is a pytree of arrays with a batch dim."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise TypeError(f"The {where} is empty ({type(batch).__name__}); expected arrays, a tuple or a dict of arrays.")
    sizes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):  # None: an empty part, as in jit
        location = jax.tree_util.keystr(path) or "(the whole batch)"
        if not isinstance(leaf, (np.ndarray, jax.Array)) and not (
            isinstance(leaf, np.generic) and np.issubdtype(type(leaf), np.number)
        ):
            raise TypeError(f"The {where} must be an array or a tuple/list/dict pytree of numpy/JAX arrays; "
                            f"the leaf at {location} is a {type(leaf).__name__}. {_leaf_fix(leaf)}")
        if not (jax.numpy.issubdtype(leaf.dtype, jax.numpy.number) or jax.numpy.issubdtype(leaf.dtype, np.bool_)):
            raise TypeError(f"The leaf at {location} of the {where} holds {np.dtype(leaf.dtype)} values, not numbers; "
                            f"convert it first (class names to ints: np.unique(labels, return_inverse=True)[1]). "
                            f"{_NON_NUMERIC}")
        if np.ndim(leaf) == 0:
            what = f"The {where} is" if not path else f"The leaf at {location} of the {where} is"
            raise ValueError(f"{what} a scalar ({leaf!r}); every array of a batch needs a leading batch dimension, "
                             f"e.g. shape (batch_size, ...). Yield whole batches, not single values.")
        sizes[location] = int(np.shape(leaf)[0])
    if len(set(sizes.values())) > 1:
        raise ValueError(_uneven_rows_message(batch, sizes, where))


_NON_NUMERIC = ("Fields that are not numbers (ids, file names, captions) cannot ride in a batch into the jitted step: "
                "keep them out of the batch, e.g. in a list kept by the examples' index, and yield only arrays.")


def _leaf_fix(leaf: Any) -> str:
    """How to turn a batch leaf that is not an array into one: a torch tensor (a torch ``DataLoader``'s
    default collate), a string (an id: kept out of the batch), anything else (``np.asarray``)."""
    if type(leaf).__module__.split(".")[0] == "torch":
        return ("A torch DataLoader's default collate makes torch tensors: give it a collate_fn that stacks numpy "
                "arrays, collate_fn=lambda samples: tuple(np.stack(f) for f in zip(*samples)) (docs/data.md, "
                "\"torch\"); a DataLoader with batch_size=None over a dataset that yields whole numpy batches needs "
                "collate_fn=lambda batch: batch.")
    if isinstance(leaf, (str, bytes)):
        return _NON_NUMERIC
    return "Convert it with np.asarray, e.g. return (np.asarray(x), np.asarray(y)) from your loader."


def _per_example_list(batch) -> tuple[str, list | tuple] | None:
    """The path and items of a list (or tuple) in ``batch`` that holds per-example arrays, as a
    collate that did not stack or pad them makes: arrays, 8 or more of them, or as many as another
    leaf has rows (the batch size)."""
    def arrays(node) -> bool:
        return isinstance(node, (list, tuple)) and len(node) > 1 and all(_is_array(v) and np.ndim(v) for v in node)

    parts = jax.tree_util.tree_leaves_with_path(batch, is_leaf=arrays)
    rows = {np.shape(node)[0] for _, node in parts if not arrays(node) and np.ndim(node)}
    for path, node in parts:
        if arrays(node) and (len(node) >= 8 or len(node) in rows):
            return jax.tree_util.keystr(path), node
    return None


def _uneven_rows_message(batch, sizes: dict[str, int], where: str, shown: int = 6) -> str:
    """Why the arrays of ``batch`` (``sizes``: leaf path -> leading dimension) are no batch: the
    first ``shown`` sizes and their count, and for a list of per-example arrays, what to do."""
    listed = ", ".join(f"{k} {v}" for k, v in list(sizes.items())[:shown])
    if len(sizes) > shown:
        listed += f", ... ({len(sizes)} arrays in all)"
    text = f"The arrays of the {where} have different leading (batch) dimensions: {listed}"
    ragged = _per_example_list(batch)
    if ragged is None:
        return text + "; every array needs one row per example."
    location, items = ragged
    lengths = sorted({int(np.shape(v)[0]) for v in items})
    length = f"length {lengths[0]}" if len(lengths) == 1 else f"lengths {lengths[0]} to {lengths[-1]}"
    return (f"{text}. batch{location} is a {type(items).__name__} of {len(items)} arrays of {length}: one "
            f"array per example, not one array for the batch. Stack them into one array of one row per example "
            f"(np.stack) when they have one shape, else pad them to one length first, e.g. in the loader's collate "
            f"function (pad to a few fixed lengths: each new shape compiles the step again).")


def check_input_shapes(batch, exmp_input: Sequence[Any], where: str = "batch", *, one_input: bool = False) -> None:
    """Compare the model inputs of a tuple/list batch with ``exmp_input`` (all but the batch dim).

    The seed's convention: a batch is ``(inputs..., targets...)`` and ``exmp_input`` holds the
    inputs, so ``batch[i]`` must look like ``exmp_input[i]``. Other batch layouts are checked when
    the step is first traced. ``one_input``: ``exmp_input`` was one array (not a tuple / list of
    inputs), named so in the message. Shapes that differ by exactly one leading axis are said to be
    a missing batch axis (``x[0]`` for ``x[:1]``).

    Examples:
        >>> check_input_shapes((np.zeros((4, 8, 8)), np.zeros(4)), [np.zeros((8, 8))], one_input=True)
        Traceback (most recent call last):
        ...
        ValueError: Element 0 of the batch has shape (4, 8, 8) but the model was initialised with exmp_input of shape (8, 8): exmp_input lacks the batch axis: ...
    """
    if not isinstance(batch, (tuple, list)) or len(batch) < len(exmp_input):
        return
    for i, example in enumerate(exmp_input):
        got, want = tuple(np.shape(batch[i])), tuple(np.shape(example))
        if not hasattr(batch[i], "shape"):
            continue
        if len(got) == len(want) and got[1:] == want[1:]:
            continue
        name = "exmp_input" if one_input and len(exmp_input) == 1 else f"exmp_input[{i}]"
        if len(got) == len(want) + 1 and got[1:] == want:
            why = (f"{name} lacks the batch axis: it is shaped like one example. Pass one batch of the model's "
                   f"inputs, batch axis first: x[:1] (shape {(1, *want)}), not x[0] (shape {want}).")
        elif len(got) + 1 == len(want) and got == want[1:]:
            why = (f"the batch's element {i} lacks the batch axis: it is shaped like one example of {name}, so the "
                   f"loader yields single examples. Batch them, e.g. ArrayLoader(x, y, batch_size=64), or pass arrays "
                   f"with batch_size=64.")
        else:
            why = (f"all dimensions but the first must match. Pass an exmp_input taken from your loader, e.g. "
                   f"next(iter(train_loader))[0].")
        raise ValueError(f"Element {i} of the {where} has shape {got} but the model was initialised with {name} of "
                         f"shape {want}: {why} Batch: {_describe(batch)}")


def as_input_list(exmp_input: Any) -> list:
    """The model's example inputs as a list (one input, or a tuple/list of them); an input that
    holds no array (``None``, a string) fails here, naming it, rather than inside the model."""
    several = isinstance(exmp_input, (list, tuple)) and len(exmp_input) > 0
    inputs = [lists_as_arrays(example) if _is_frame(example) else example
              for example in (list(exmp_input) if several else [exmp_input])]  # a DataFrame: its values
    for i, example in enumerate(inputs):
        leaves = jax.tree.leaves(example)
        where = f"exmp_input[{i}]" if several else "exmp_input"
        if not leaves or any(isinstance(leaf, (str, bytes)) for leaf in leaves):
            raise TypeError(f"{where} must be an array (or a pytree of arrays) shaped like one batch of the model's "
                            f"input, e.g. exmp_input=x[:1] or next(iter(train_loader))[0]; got {example!r:.80} "
                            f"({type(example).__name__}).")
        text = next((leaf for leaf in leaves if _is_array(leaf) and not _is_numeric(leaf)), None)
        if text is not None:
            raise TypeError(f"{where} holds an array of dtype {text.dtype} (shape {text.shape}), which JAX cannot "
                            f"hold: the model's inputs must be numbers. Convert the columns first (category names "
                            f"to integer ids, e.g. pandas' .astype('category').cat.codes, then x.astype(np.float32)).")
    return inputs


def check_first_batch(batch, exmp_input: Any, loader_name: str) -> None:
    """:func:`check_batch` and :func:`check_input_shapes` for a loader's first batch."""
    check_batch(batch, where=f"first batch of {loader_name}")
    rows = np.shape(jax.tree.leaves(batch)[0])[0]
    if rows == 0:  # the step is traced on it (its metric names): the loss would see no examples
        raise ValueError(f"The first batch of {loader_name} has 0 rows (shapes "
                         f"{[np.shape(leaf) for leaf in jax.tree.leaves(batch)]}); drop empty batches in the loader "
                         f"(later ones are passed over with a warning).")
    several = isinstance(exmp_input, (list, tuple)) and len(exmp_input) > 0  # as as_input_list reads it
    check_input_shapes(batch, as_input_list(exmp_input), where=f"first batch of {loader_name}", one_input=not several)


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ... ``11th``, ``21st``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def later_batch_note(batch, first, index: int, source: str, count: int = 1) -> str | None:
    """For an error raised by the step on a batch after the first (``index``: its place in
    ``source``, e.g. ``"this epoch of train_loader"``, from 0; ``count`` > 1: the first of a block
    of that many, run together): what is wrong with ``batch``, as :func:`check_batch` says it, or
    how its structure, shapes (but for the batch dimension) or dtypes differ from ``first``'s;
    None when they do not. Only first batches are checked before their step runs, so this runs
    once a step has failed.

    Examples:
        >>> first = (np.zeros((4, 3)), np.zeros(4))
        >>> later_batch_note((np.zeros((4, 3)), np.zeros(3)), first, 2, "train_loader")[:80]
        'flaxlight: The arrays of the 3rd batch of train_loader have different leading (b'
        >>> later_batch_note((np.zeros((2, 3)), np.zeros(2)), first, 2, "train_loader") is None
        True
    """
    span = _ordinal(index + 1) if count == 1 else f"{_ordinal(index + 1)} to {_ordinal(index + count)}"
    where = f"{span} batch{'es' if count > 1 else ''} of {source}"
    checked = "only the first batch, in training each epoch's, is checked before its step runs"
    try:
        check_batch(batch, where=where)
    except (TypeError, ValueError) as problem:
        return f"flaxlight: {problem} ({checked[0].upper()}{checked[1:]}.)"
    if jax.tree.structure(batch) != jax.tree.structure(first):
        return (f"flaxlight: the step failed on the {where}, a {jax.tree.structure(batch)}, where the first batch "
                f"was a {jax.tree.structure(first)}: give every batch one structure ({checked}).")

    def spec(leaf) -> tuple:
        return tuple(np.shape(leaf))[1:], np.dtype(leaf.dtype)

    changed = [f"{jax.tree_util.keystr(path) or '(the whole batch)'} {np.shape(leaf)} {np.dtype(leaf.dtype)} "
               f"(first batch: {np.shape(old)} {np.dtype(old.dtype)})"
               for (path, leaf), old in zip(jax.tree_util.tree_leaves_with_path(batch), jax.tree.leaves(first))
               if spec(leaf) != spec(old)]
    if not changed:
        return None
    shown = ", ".join(changed[:4]) + (f", ... ({len(changed)} arrays in all)" if len(changed) > 4 else "")
    return (f"flaxlight: the step failed on the {where}, whose arrays differ from the first batch's beyond the "
            f"batch dimension: {shown}. The step is traced anew for such a batch, and {checked}: if batches of "
            f"these shapes are a mistake, give every batch the first one's shapes (all but the batch dimension) "
            f"and dtypes.")


def same_shapes(a, b) -> bool:
    return [np.shape(x) for x in jax.tree.leaves(a)] == [np.shape(x) for x in jax.tree.leaves(b)]


def group_batches(batches: Iterable, steps: int, start: int = 0) -> Iterator[tuple[int, Any]]:
    """Yield ``(1, batch)`` or, for ``steps > 1``, ``(steps, block)`` with ``steps`` batches
    stacked along a new leading axis (one host array per leaf, so one transfer per block).

    Blocks end at multiples of ``steps`` counted from step ``start`` (the global step before
    the first batch): the batches before the first such boundary, those that cannot fill a
    block of equal shapes (the end of an epoch, a smaller last batch) come out one by one. So
    any interval that is a multiple of ``steps`` falls on a block end.

    Examples:
        >>> [n for n, _ in group_batches([np.zeros((2, 3))] * 6, steps=2, start=1)]
        [1, 2, 2, 1]
    """
    batches = iter(batches)
    if steps == 1:
        for batch in batches:
            yield 1, batch
        return
    for batch in itertools.islice(batches, (-start) % steps):
        yield 1, batch
    block: list = []
    for batch in batches:
        if block and not same_shapes(batch, block[0]):
            yield from ((1, b) for b in block)
            block = []
        block.append(batch)
        if len(block) == steps:
            yield steps, jax.tree.map(lambda *leaves: np.stack(leaves), *block)
            block = []
    yield from ((1, b) for b in block)


class Prefetcher:
    """Run an iterator in a background thread, ``size`` items ahead, putting them on the device.

    Host work (loading, indexing, stacking blocks) and the host-to-device copy overlap with the
    training step running on the device. Exceptions of the source are re-raised in the consumer.
    Call :meth:`close` (or exhaust it) to stop the thread.

    ``transform`` is applied to each item in the thread (default: ``jax.device_put``).

    Examples:
        >>> for batch in Prefetcher(loader, size=2):   # doctest: +SKIP
        ...     ...
    """

    _DONE = object()

    def __init__(self, items: Iterable, size: int = 2, transform: Callable[[Any], Any] | None = jax.device_put):
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._transform = transform
        self._thread = threading.Thread(target=self._run, args=(iter(items),), daemon=True, name="flaxlight-prefetch")
        self._thread.start()

    def _run(self, items: Iterator) -> None:
        try:
            for item in items:
                if self._transform is not None:
                    item = self._transform(item)
                if not self._put(item):
                    return
            self._put(self._DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer thread
            self._put(exc)

    def _put(self, item) -> bool:
        """Queue ``item`` as soon as there is room; False when :meth:`close` came first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _looks_like_one_datasets_arrays(data: Any) -> bool:
    """Whether ``data`` is a list of 2 or 3 arrays (or lists of numbers) that share their leading
    dimension but differ in the rest of their shape, as Keras' ``[x, y]`` does: the arrays of one
    dataset, not batches of one loader (those have one shape, bar a shorter last one)."""
    if not isinstance(data, list) or not 2 <= len(data) <= 3:
        return False
    if not all((_is_array(v) and np.ndim(v) >= 1) or _holds_values(v) for v in data):
        return False
    try:
        shapes = [tuple(np.shape(v)) for v in data]
    except ValueError:  # a ragged list of numbers: no shape
        return False
    return len({shape[0] for shape in shapes}) == 1 and len(set(shapes)) > 1


def _list_of_arrays_error(data: list, what: str) -> ValueError:
    shapes = ", ".join(f"[{i}] {tuple(np.shape(v))}" for i, v in enumerate(data))
    names = ", ".join(("x", "y", "w")[:len(data)])
    return ValueError(f"{what} is a list of {len(data)} arrays that share their first dimension ({shapes}), like "
                      f"Keras' [{names}]; a list is a loader of batches here (each item one batch), so it is not cut "
                      f"by batch_size. Pass the arrays as a tuple, ({names}), to cut them into batches; if the items "
                      f"are batches, drop batch_size (and give any other data as loaders, e.g. "
                      f"flaxlight.ArrayLoader(x, y, batch_size=64)).")


def _as_arrays(data: Any, split: bool, what: str = "data") -> Any:
    """``data`` as the arrays to cut into batches, or None when it is a loader (or a list of batches).

    Arrays are an array, or a tuple / dict of arrays (lists of numbers, as ``y.tolist()``, made
    arrays). With ``split`` (a ``batch_size`` was given) also a nested tuple / dict pytree of them
    (Keras' ``({"a": xa, "b": xb}, y)``) and one array as a Python list of numbers. A list of
    arrays or batches stays a loader; with ``split``, one that looks like Keras' ``[x, y]`` (see
    :func:`_looks_like_one_datasets_arrays`) is an error asking for a tuple."""
    if _is_array(data):
        return data
    if _is_frame(data):
        return np.asarray(data.to_numpy())
    if split and _looks_like_one_datasets_arrays(data):  # also [x.tolist(), y.tolist()]
        raise _list_of_arrays_error(data, what)
    if split and _holds_values(data):  # one array as a Python list
        return lists_as_arrays(data, what)
    if not isinstance(data, (tuple, dict)) or not data:
        return None
    parts = data.values() if isinstance(data, dict) else data
    if not split and not all(((_is_array(v) or _is_frame(v)) and np.ndim(v) >= 1) or _holds_values(v) for v in parts):
        return None
    return lists_as_arrays(data, what)


def _array_loader(arrays: Any, batch_size: int, what: str, shuffle: bool, seed: int) -> ArrayLoader:
    parts = arrays if isinstance(arrays, tuple) else (arrays,)
    try:
        return ArrayLoader(*parts, batch_size=batch_size, shuffle=shuffle, seed=seed)
    except ValueError as exc:  # said for the argument the user gave, not for an ArrayLoader they never made
        raise ValueError(f"{what} (cut into batches of {batch_size} by an ArrayLoader): {exc}") from None


def as_loader(data: Any, batch_size: int | None = None, *, what: str = "data", shuffle: bool = False,
              seed: int = 0) -> Any:
    """``data`` as something to iterate batches from: an array, a tuple or dict of arrays (with
    ``batch_size`` also a nested one; lists of numbers become arrays) becomes an
    :class:`ArrayLoader` of ``batch_size``; anything else (a loader, a list of batches) is
    returned as it is. ``what`` names the argument in errors.

    Examples:
        >>> len(as_loader((np.zeros((10, 3)), np.zeros(10)), batch_size=4))
        3
        >>> next(iter(as_loader(({"a": np.zeros((10, 3))}, list(range(10))), batch_size=4)))[1]
        array([0, 1, 2, 3])
    """
    arrays = _as_arrays(data, batch_size is not None, what)
    if arrays is None:
        if batch_size is not None:
            raise ValueError(f"batch_size is for arrays; {what} is a {type(data).__name__} (a loader: its batches "
                             f"are used as they are). Drop batch_size, or pass arrays.")
        return data
    if batch_size is None:
        raise ValueError(f"{what} is arrays: pass batch_size=... to split them into batches.")
    return _array_loader(arrays, batch_size, what, shuffle, seed)


def fit_loaders(train: Any, val: Any, test: Any, batch_size: int | None, *, seed: int) -> tuple[Any, Any, Any]:
    """``train_model``'s data as loaders: arrays (see :func:`as_loader`) become
    :class:`ArrayLoader` s of ``batch_size``, the training arrays shuffled by ``seed`` (the same
    order again on resume: it is a pure function of the seed and the epoch), validation and test
    arrays in order. Loaders pass through; ``None`` stays ``None``.

    Examples:
        >>> train, val, _ = fit_loaders((np.zeros((10, 3)), np.zeros(10)), None, None, 4, seed=0)
        >>> (len(train), train.shuffle, val)
        (3, True, None)
    """
    given = {"training": (train, True), "validation": (val, False), "test": (test, False)}
    arrays = {name: _as_arrays(data, batch_size is not None, f"train_model's {name} data")
              for name, (data, _) in given.items()}
    if batch_size is not None and all(a is None for a in arrays.values()):
        lists = " (a list is a loader of batches; arrays go in a tuple)" if any(
            isinstance(data, list) for data, _ in given.values()) else ""
        raise ValueError(f"train_model(batch_size=...) is for arrays; the data given are loaders, whose batches are "
                         f"used as they are{lists}. Drop batch_size, or pass arrays, e.g. train_model((x, y), (xv, yv), "
                         f"batch_size=64).")
    loaders = []
    for name, (data, shuffle) in given.items():
        if arrays[name] is None:
            loaders.append(data)  # a loader (or None): its batches are used as they are
        elif batch_size is None:
            raise ValueError(f"train_model's {name} data is arrays: pass batch_size=... to split them into batches.")
        else:
            loaders.append(_array_loader(arrays[name], batch_size, f"train_model's {name} data", shuffle, seed))
    return loaders[0], loaders[1], loaders[2]


# Keras' fit() keywords that train_model does not take, and what to do instead.
KERAS_KEYWORDS = {
    "validation_data": "pass the validation data as the second argument: train_model((x, y), (x_val, y_val), "
                       "batch_size=64)",
    "validation_split": "split the arrays yourself and pass the held-out part as the second argument, e.g. "
                        "n = int(0.8 * len(x)); train_model((x[:n], y[:n]), (x[n:], y[n:]), batch_size=64) (shuffle "
                        "them first when the examples are in some order)",
    "epochs": "it is num_epochs=N",
    "shuffle": "training arrays are always shuffled, anew each epoch, by the trainer's seed; for a fixed order pass "
               "flaxlight.ArrayLoader(x, y, batch_size=64, shuffle=False) as the training data",
    "x": "pass the arrays as one argument: train_model((x, y), (x_val, y_val), batch_size=64)",
    "y": "pass the arrays as one argument: train_model((x, y), (x_val, y_val), batch_size=64)",
    "verbose": "progress bars are the trainer's: MyTrainer(..., enable_progress_bar=False)",
    "callbacks": "callbacks are the trainer's: MyTrainer(..., callbacks=[...])",
    "validation_freq": "it is the trainer's check_val_every_n_epoch=N",
    "initial_epoch": "num_epochs counts the whole run, not this call's epochs, and resume=True goes on from the "
                     "run's last checkpoint: to go on to epoch 10, train_model((x, y), (x_val, y_val), num_epochs=10, "
                     "batch_size=64, resume=True)",
    "sample_weight": "pass the weights as a third array, train_model((x, y, w), (x_val, y_val), batch_size=64), and "
                     "write a loss_fn that reads (x, y, w) batches (docs/data.md, \"Sample and class weights\")",
    "class_weight": "make per-example weights w = class_weights[y] (class_weights: an array of one weight per class), "
                    "pass them as a third array, train_model((x, y, w), (x_val, y_val), batch_size=64), and write a "
                    "loss_fn that reads (x, y, w) batches (docs/data.md, \"Sample and class weights\")",
    "validation_steps": "it is the trainer's limit_val_batches=N (batches per validation): MyTrainer(..., "
                        "limit_val_batches=N)",
    "validation_batch_size": "validation arrays are cut by batch_size too; for another size pass them as a loader: "
                             "train_model((x, y), flaxlight.ArrayLoader(x_val, y_val, batch_size=256), batch_size=64)",
}


# Lightning's keywords of trainer.fit / validate / test / predict that flaxlight's methods do not
# take: a function of the method and the value given (a LightningDataModule's setup is said when it has one).
_LIGHTNING_CALLS = {  # method: (Lightning's call, setup stage, loaders to pass, more arguments)
    "train_model": ("trainer.fit(model, datamodule=dm)", "fit", "dm.train_dataloader(), dm.val_dataloader()", ""),
    "eval_model": ("trainer.validate(model, datamodule=dm)", "validate", "dm.val_dataloader()", ", log_prefix='val/'"),
    "test": ("trainer.test(model, datamodule=dm)", "test", "dm.test_dataloader()", ""),
    "predict": ("trainer.predict(model, datamodule=dm)", "predict", "dm.predict_dataloader()", ""),
}
# Keywords of Lightning's trainer.fit that train_model does not take (besides datamodule=).
_LIGHTNING_FIT_KEYWORDS = {
    "ckpt_path": "Lightning's fit(ckpt_path='last') is train_model(..., resume=True): the newest readable checkpoint "
                 "of the run in the trainer's log_dir; another run, or an older checkpoint of this one: "
                 "resume_from='runs/MLP/version_0' (or its checkpoints/<step> folder)",
    "dataloaders": "pass the loaders themselves: train_model(train_loader, val_loader)",
    "train_dataloaders": "pass the loaders themselves: train_model(train_loader, val_loader)",
    "val_dataloaders": "pass the validation loader as the second argument: train_model(train_loader, val_loader)",
}
# Keywords of Keras' evaluate / predict and Lightning's test / predict that flaxlight's evaluations do not take.
_EVALUATION_KEYWORDS = {
    "x": "pass the data as the first argument: {example}",
    "y": "pass the data as the first argument: {example}",
    "dataloaders": "pass the loader as the first argument: {example}",
    "ckpt_path": "it is which='best' (or 'last'); another run's checkpoint: "
                 "MyTrainer.load_from_checkpoint(path, exmp_input=x[:1]).{method}(data)",
    "steps": "eval_model evaluates the whole loader it is given; its first N batches are "
             "flaxlight.data.FirstBatches(loader, N) (test() and predict() take steps=N)",
}
_EXAMPLES = {"eval_model": "eval_model((x, y), log_prefix='val/', batch_size=256)",
             "test": "test((x, y), batch_size=256)", "predict": "predict(x, batch_size=256)"}
_NEEDS = {"train_model": "the training data: a loader of batches, train_model(train_loader, "
                         "val_loader, num_epochs=10), or arrays, train_model((x, y), (x_val, y_val), batch_size=64)",
          "eval_model": "the data to evaluate: a loader of batches, eval_model(val_loader, log_prefix='val/'), or "
                        "arrays, eval_model((x, y), log_prefix='val/', batch_size=256)",
          "test": "the data to test on: a loader of (inputs, labels) batches, test(test_loader), or arrays, "
                  "test((x, y), batch_size=256)",
          "predict": "the inputs: a loader of batches, predict(loader), or arrays, predict(x, batch_size=256)"}


class _Required:
    """The default of a data argument that must be given (``train_model``'s ``train_loader``), so
    that a call without it, or with Keras' ``x=`` / Lightning's ``datamodule=`` instead, is answered
    by :func:`refuse_unknown_keywords` in flaxlight's words, not by Python's "missing argument"."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()


def _datamodule_hint(method: str, dm: Any) -> str:
    lightning, stage, loaders, rest = _LIGHTNING_CALLS[method]
    call = f"trainer.{method}({loaders}{rest})"
    if callable(getattr(dm, "setup", None)):
        return (f"flaxlight takes the loaders themselves: Lightning's {lightning} is dm.setup({stage!r}) (Lightning "
                f"calls it for you; flaxlight does not) and then {call}")
    return f"flaxlight takes the loaders themselves: Lightning's {lightning} is {call}"


def _keyword_hint(method: str, name: str, value: Any) -> str | None:
    """What to write instead of keyword ``name`` (given ``value``) of ``method``, when it is a Keras or Lightning one."""
    if name == "datamodule" and method in _LIGHTNING_CALLS:
        return _datamodule_hint(method, value)
    if method not in _EXAMPLES:  # train_model's, Keras' fit()'s
        return KERAS_KEYWORDS.get(name) or _LIGHTNING_FIT_KEYWORDS.get(name)
    if name in _EVALUATION_KEYWORDS and (name != "steps" or method == "eval_model"):
        return _EVALUATION_KEYWORDS[name].format(example=_EXAMPLES[method], method=method)
    return None


def _keyword_names(method: Callable) -> set[str]:
    """The parameters ``method`` takes by name (not ``self``, ``*args`` or ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return set()
    return {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}


def _subclass_keywords(owner: Any, name: str) -> set[str]:
    """The keywords of the ``name`` methods that ``owner``'s classes define (a subclass's own
    ``train_model(self, ..., *, log_images=False, **kwargs)`` that calls ``super()``'s)."""
    return set().union(*(_keyword_names(cls.__dict__[name]) for cls in type(owner).__mro__
                         if callable(cls.__dict__.get(name))))


def refuse_unknown_keywords(owner: Any, method: str, unknown: Mapping[str, Any], **data: Any) -> None:
    """Raise for the keywords ``owner.<method>`` does not take (gathered in its ``**unknown``):
    what to do instead (Keras' ``validation_split``, ``epochs``, ``x=``; Lightning's
    ``datamodule=``, ...) or the closest name it takes, not a bare ``TypeError``; a subclass's own
    keywords for ``method`` are suggested too. ``data``: the method's data arguments, by name; one
    left at :data:`REQUIRED` (not given) is refused next, saying what to pass.

    Examples:
        >>> class Fit:
        ...     def fit(self, data, num_epochs=1, **unknown):
        ...         refuse_unknown_keywords(self, "fit", unknown)
        >>> Fit().fit([], epochs=3)
        Traceback (most recent call last):
        TypeError: fit() got an unexpected keyword argument 'epochs': it is num_epochs=N.
    """
    if unknown:
        name, known = next(iter(unknown)), sorted(_subclass_keywords(owner, method))
        close = difflib.get_close_matches(name, known, n=1)
        hint = _keyword_hint(method, name, unknown[name]) or (
            f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(known)}.")
        raise TypeError(f"{method}() got an unexpected keyword argument {name!r}: "
                        f"{hint}{'' if hint.endswith(('.', '?')) else '.'}")
    for name, value in data.items():
        if value is REQUIRED:
            raise TypeError(f"{method}() missing its first argument {name!r}: it takes "
                            f"{_NEEDS.get(method, 'the data')}.")
        if method in _LIGHTNING_CALLS and _is_datamodule(value):
            raise TypeError(f"{method}() got a data module ({type(value).__name__}, which makes loaders and is none) "
                            f"as {name!r}: {_datamodule_hint(method, value)}.")


def _is_datamodule(value: Any) -> bool:
    """Whether ``value`` is a LightningDataModule, or an object written like one: not iterable, with
    a ``train_dataloader()`` (or ``val_``, ``test_``, ``predict_dataloader()``) method."""
    return not isinstance(value, collections.abc.Iterable) and any(
        callable(getattr(value, f"{stage}_dataloader", None)) for stage in ("train", "val", "test", "predict"))


class StepsOf(FirstBatches):
    """:class:`FirstBatches` that counts what its last pass yielded (``taken``): ``test(steps=N)``
    says how many batches its metrics cover."""

    taken = 0

    def __iter__(self) -> Iterator[Any]:
        self.taken = 0
        for batch in super().__iter__():
            self.taken += 1
            yield batch


def checked_loader(owner: Any, method: str, data: Any, batch_size: int | None, unknown: Mapping[str, Any],
                   steps: int | None = None, *, name: str = "data") -> Any:
    """The data of ``owner.<method>`` (``eval_model``, ``test``, ``predict``) as a loader (see
    :func:`as_loader`), after :func:`refuse_unknown_keywords` (``data`` not given, Lightning's
    ``datamodule=``: what to write); with ``steps``, its first ``steps`` batches only
    (:class:`StepsOf`; Keras' ``steps=``), an endless generator's too. ``name``: the data
    argument's name in ``method``'s signature.

    Examples:
        >>> list(checked_loader(None, "predict", iter(range(100)), None, {}, steps=2))
        [0, 1]
    """
    refuse_unknown_keywords(owner, method, unknown, **{name: data})
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1):
        raise ValueError(f"{method}(steps=...) is the number of batches to take, a whole number >= 1 (None: the "
                         f"whole loader); got {steps!r}. E.g. trainer.{method}(loader, steps=100).")
    loader = as_loader(data, batch_size, what=f"{method}'s data")
    return loader if steps is None else StepsOf(loader, int(steps))
