"""Batches: a reproducible in-memory loader and the checks every batch goes through once.

Any iterable of batches works with the trainer; a batch is an array, or a tuple/list/dict
pytree of arrays that share a leading batch dimension.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import jax
import numpy as np

__all__ = ["ArrayLoader", "check_batch"]


def _leading_dim(tree) -> int:
    return int(jax.tree.leaves(tree)[0].shape[0])


class ArrayLoader:
    """Batches of in-memory arrays; the order is a pure function of ``(seed, epoch)``.

    ``ArrayLoader(x, y, batch_size=64, shuffle=True, seed=0)`` yields ``(x_batch, y_batch)``
    tuples (a single array yields arrays; a dict yields dicts). The trainer calls
    :meth:`set_epoch` before each epoch, so a run that is stopped and resumed sees exactly the
    same batches. ``len()`` is the number of batches per epoch.

    Example:
        >>> import numpy as np
        >>> loader = ArrayLoader(np.arange(10), np.arange(10), batch_size=4, shuffle=True, seed=1)
        >>> len(loader), [b[0].shape[0] for b in loader]
        (3, [4, 4, 2])
        >>> len(ArrayLoader(np.arange(10), batch_size=4, drop_last=True))
        2
    """

    def __init__(self, *arrays: Any, batch_size: int, shuffle: bool = False, seed: int = 0, drop_last: bool = False):
        if not arrays:
            raise ValueError("ArrayLoader needs at least one array, e.g. ArrayLoader(x, y, batch_size=64).")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
        self.data = arrays[0] if len(arrays) == 1 else tuple(arrays)
        leaves = jax.tree.leaves(self.data)
        sizes = {tuple(np.shape(leaf))[:1] for leaf in leaves}
        if len(sizes) != 1 or () in sizes:
            shapes = [tuple(np.shape(leaf)) for leaf in leaves]
            raise ValueError(f"ArrayLoader arrays must share a leading dimension; got shapes {shapes}.")
        self.num_examples = _leading_dim(self.data)
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0

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
        if self.drop_last:
            return self.num_examples // self.batch_size
        return -(-self.num_examples // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        indices = self.order()
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            idx = indices[start : start + self.batch_size]
            yield jax.tree.map(lambda a: np.asarray(a)[idx], self.data)


def _describe(batch) -> str:
    return str(jax.tree.map(lambda a: f"{type(a).__name__}{tuple(np.shape(a))}", batch))


def check_batch(batch, where: str = "batch") -> None:
    """Fail with a readable message unless ``batch`` is a pytree of arrays with a batch dim."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise TypeError(f"The {where} is empty ({type(batch).__name__}); expected arrays, a tuple or a dict of arrays.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if not isinstance(leaf, (np.ndarray, jax.Array)) and not (
            isinstance(leaf, np.generic) and np.issubdtype(type(leaf), np.number)
        ):
            location = jax.tree_util.keystr(path) or "(the whole batch)"
            raise TypeError(
                f"The {where} must be an array or a tuple/list/dict pytree of numpy/JAX arrays; "
                f"the leaf at {location} is a {type(leaf).__name__}. Convert it with np.asarray, "
                f"e.g. return (np.asarray(x), np.asarray(y)) from your loader."
            )
        if np.ndim(leaf) == 0:
            location = jax.tree_util.keystr(path) or "(the whole batch)"
            raise ValueError(f"The {where} leaf at {location} is a scalar; every array needs a leading batch dimension.")


def check_input_shapes(batch, exmp_input: Sequence[Any]) -> None:
    """Compare the model inputs of a tuple/list batch with ``exmp_input`` (all but the batch dim).

    The seed's convention: a batch is ``(inputs..., targets...)`` and ``exmp_input`` holds the
    inputs, so ``batch[i]`` must look like ``exmp_input[i]``. Other batch layouts are checked when
    the step is first traced.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) < len(exmp_input):
        return
    for i, example in enumerate(exmp_input):
        got, want = np.shape(batch[i]), np.shape(example)
        if not hasattr(batch[i], "shape"):
            continue
        if len(got) != len(want) or tuple(got[1:]) != tuple(want[1:]):
            raise ValueError(
                f"Batch element {i} has shape {tuple(got)} but the model was initialised with "
                f"exmp_input[{i}] of shape {tuple(want)} (all dimensions but the first must match). "
                f"Pass an exmp_input taken from your loader, e.g. next(iter(train_loader))[0]. "
                f"Batch: {_describe(batch)}"
            )
