"""The callbacks a trainer adds to the user's list: what its settings ask for."""

from __future__ import annotations

from typing import Any

from flaxlight import distributed as dist
from flaxlight.callbacks.base import Callback
from flaxlight.callbacks.history import History
from flaxlight.callbacks.model_checkpoint import ModelCheckpoint
from flaxlight.callbacks.progress_bar import ProgressBar
from flaxlight.callbacks.timer import Timer

__all__ = ["with_default_callbacks"]


def with_default_callbacks(callbacks: list[Callback], options: Any, enable_progress_bar: bool) -> list[Callback]:
    """The user's callbacks, in their order, then the defaults ``options`` ask for (a
    :class:`ModelCheckpoint` on ``monitor``/``mode``, a :class:`Timer` for ``max_time``, a
    :class:`ProgressBar`, a :class:`History`) unless one of that kind was given. ``fast_dev_run`` writes no checkpoint.
    :class:`ModelCheckpoint` callbacks come last, so each hook reaches them after the others.

    Examples:
        >>> [type(cb).__name__ for cb in with_default_callbacks([], TrainerOptions(), True)]   # doctest: +SKIP
        ['ModelCheckpoint', 'ProgressBar', 'History']
    """
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise TypeError(f"callbacks must be flaxlight.Callback instances; got {type(callback).__name__}.")
    def given(kind: type) -> bool:  # a subclass counts: it replaces the default
        return any(isinstance(cb, kind) for cb in callbacks)

    if options.fast_dev_run:
        callbacks = [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)]
    elif not given(ModelCheckpoint) and options.enable_checkpointing:
        callbacks = callbacks + [ModelCheckpoint(monitor=options.monitor, mode=options.mode)]
    if options.max_time is not None and not given(Timer):
        callbacks = callbacks + [Timer(options.max_time)]
    if enable_progress_bar and not given(ProgressBar) and dist.is_main_process():
        callbacks = callbacks + [ProgressBar()]
    if not given(History):
        callbacks = callbacks + [History()]
    # Checkpoint callbacks hear of every moment after the others (as in Lightning), so that a
    # checkpoint holds the other callbacks' state after that moment (an exact resume needs it).
    return [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)] + \
        [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]
