"""Datasets of the examples: factories returning ``(train, val, test)`` loaders.

A dataset factory takes ``batch_size``, ``eval_batch_size`` (None: ``batch_size``) and ``seed``
(the train order's seed, and the data's where it is generated or split) as keyword arguments,
plus its own settings, and returns ``(train_loader, val_loader, test_loader)``; val or test may
be None. The zoo's test loader is None for ``num_test=0`` (fit then does not test); an empty val
split stays an (empty) loader, which training refuses before it starts. Register one with
``@register_dataset("name")``.
"""

from __future__ import annotations

import numpy as np

from flaxlight.data import ArrayLoader
from flaxlight.registry import register_dataset

__all__ = ["digits", "digits_splits", "sine", "sine_data"]


def _test_loader(x: np.ndarray, y: np.ndarray, batch_size: int) -> ArrayLoader | None:
    """The test split's loader, or None for a split of no examples (``num_test=0``: fit does not
    test; an empty loader would fail only when it is first read, after the whole run)."""
    return ArrayLoader(x, y, batch_size=batch_size) if len(x) else None


def sine_data(num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``x ~ U(-2, 2)``, ``y = sin(3x)``, both ``(num, 1)`` float32."""
    x = np.random.default_rng(seed).uniform(-2, 2, size=(num, 1)).astype(np.float32)
    return x, np.sin(3 * x)


@register_dataset("sine")
def sine(*, batch_size: int = 64, eval_batch_size: int | None = None, seed: int = 0,
         num_train: int = 1000, num_val: int = 200, num_test: int = 500):
    """The seed's regression data: train/val/test drawn with seeds ``seed``, ``seed+1``, ``seed+2``;
    the test loader is None for ``num_test=0`` (fit then does not test).

    Examples:
        >>> train, val, test = sine(batch_size=100, num_test=0)
        >>> len(train), len(val), test
        (10, 2, None)
    """
    eval_batch_size = eval_batch_size or batch_size
    train = ArrayLoader(*sine_data(num_train, seed), batch_size=batch_size, shuffle=True, seed=seed)
    val = ArrayLoader(*sine_data(num_val, seed + 1), batch_size=eval_batch_size)
    test = _test_loader(*sine_data(num_test, seed + 2), eval_batch_size)
    return train, val, test


def digits_splits(seed: int = 0, num_val: int = 300, num_test: int = 300):
    """scikit-learn's 8x8 digits scaled to [0, 1], shuffled with ``seed`` and split
    train / val / test (1197 / 300 / 300 by default) as ``((x, y), (x, y), (x, y))``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("The digits dataset needs scikit-learn: pip install 'flaxlight[examples]'.") from exc

    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    num_train = len(x) - num_val - num_test
    if num_train < 1:
        raise ValueError(f"num_val={num_val} + num_test={num_test} leave no training examples of {len(x)}.")
    val_end = num_train + num_val
    return (x[:num_train], y[:num_train]), (x[num_train:val_end], y[num_train:val_end]), (x[val_end:], y[val_end:])


@register_dataset("digits")
def digits(*, batch_size: int = 64, eval_batch_size: int | None = None, seed: int = 0,
           num_val: int = 300, num_test: int = 300):
    """scikit-learn's digits (1797 images, 8x8, 10 classes), split 1197 / 300 / 300; the test
    loader is None for ``num_test=0`` (fit then does not test).

    Examples:
        >>> train, val, test = digits(batch_size=64, num_test=0)  # doctest: +SKIP
        >>> len(train), len(val), test                            # doctest: +SKIP
        (24, 5, None)
    """
    train_data, val_data, test_data = digits_splits(seed, num_val, num_test)
    eval_batch_size = eval_batch_size or batch_size
    train = ArrayLoader(*train_data, batch_size=batch_size, shuffle=True, seed=seed)
    val = ArrayLoader(*val_data, batch_size=eval_batch_size)
    test = _test_loader(*test_data, eval_batch_size)
    return train, val, test
