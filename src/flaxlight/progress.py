"""Progress display: tqdm bars on a terminal (or in a notebook), one plain line per epoch elsewhere.

Everything shown here is already on the host; nothing in this module reads device values.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Mapping

import numpy as np

__all__ = ["is_ci", "bars_wanted", "progress", "format_metrics"]


def is_ci() -> bool:
    """True when ``CI`` is set to a true value: bars turn into plain per-epoch lines."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def bars_wanted() -> bool:
    """Whether progress shows as bars: stderr is a terminal or a notebook runs us, and not ``CI``
    (Keras' ``verbose="auto"``). A log file or pipe gets plain lines instead of bar redraws.

    Examples:
        >>> isinstance(bars_wanted(), bool)
        True
    """
    if is_ci():
        return False
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress(iterable: Iterable, enabled: bool, **tqdm_kwargs):
    """Wrap ``iterable`` in a tqdm bar when ``enabled`` and bars are wanted; else return it as is."""
    if not enabled or not bars_wanted():
        return iterable
    from tqdm.auto import tqdm

    tqdm_kwargs.setdefault("dynamic_ncols", True)
    tqdm_kwargs.setdefault("file", sys.stderr)
    return tqdm(iterable, **tqdm_kwargs)


def format_metrics(metrics: Mapping[str, float], skip: tuple[str, ...] = ("epoch_time",)) -> str:
    """``"train/loss=0.123 val/acc=0.95"`` with 4 significant digits."""
    return " ".join(f"{key}={value:.4g}" for key, value in metrics.items() if key not in skip and np.ndim(value) == 0)
