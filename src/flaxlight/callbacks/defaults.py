"""The callbacks a trainer adds to the user's list: what its settings ask for."""

from __future__ import annotations

import dataclasses
from typing import Any

from flaxlight import distributed as dist
from flaxlight.callbacks.base import Callback, check_callback_hooks
from flaxlight.callbacks.early_stopping import EarlyStopping
from flaxlight.callbacks.history import History
from flaxlight.callbacks.model_checkpoint import ModelCheckpoint
from flaxlight.callbacks.progress_bar import ProgressBar
from flaxlight.callbacks.timer import Timer

__all__ = ["with_default_callbacks", "one_best", "start_fresh"]


def with_default_callbacks(callbacks: list[Callback], options: Any, enable_progress_bar: bool) -> list[Callback]:
    """The user's callbacks, in their order, then the defaults ``options`` ask for (a
    :class:`ModelCheckpoint` that keeps the best by the trainer's ``is_new_model_better``, a
    :class:`Timer` for ``max_time``, a :class:`ProgressBar`, a :class:`History`) unless one of
    that kind was given. ``fast_dev_run`` writes no checkpoint. :class:`ModelCheckpoint`
    callbacks come last, so each hook reaches them after the others, and :class:`EarlyStopping`
    callbacks just before them (they read what the others logged at that moment).

    Examples:
        >>> [type(cb).__name__ for cb in with_default_callbacks([], TrainerOptions(), True)]   # doctest: +SKIP
        ['ProgressBar', 'History', 'ModelCheckpoint']
    """
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise TypeError(_not_a_callback(callback))
        check_callback_hooks(callback)  # Lightning's hook names and signatures: said before any training
    def given(kind: type) -> bool:  # a subclass counts: it replaces the default
        return any(isinstance(cb, kind) for cb in callbacks)

    checkpointers = sum(isinstance(cb, ModelCheckpoint) for cb in callbacks)
    if checkpointers > 1:
        raise ValueError(f"callbacks hold {checkpointers} ModelCheckpoint callbacks; give one: they share the run's "
                         f"checkpoints/ folder, and each would delete the checkpoints the others keep (a best one "
                         f"included). One does both jobs: save_top_k=k keeps the best k, save_last=True the newest, "
                         f"and every_n_epochs / every_n_steps / every_n_seconds set how often it saves.")

    if options.fast_dev_run:
        callbacks = [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)]
    elif not given(ModelCheckpoint) and options.enable_checkpointing:
        callbacks = callbacks + [ModelCheckpoint()]  # ranks by the trainer's is_new_model_better (an override too)
    if options.max_time is not None and not given(Timer):
        callbacks = callbacks + [Timer(options.max_time)]
    if enable_progress_bar and not given(ProgressBar) and dist.is_main_process():
        callbacks = callbacks + [ProgressBar()]
    if not given(History):
        callbacks = callbacks + [History()]
    # Stoppers decide after the others have logged (Lightning's EarlyStopping reads the metrics
    # of every on_validation_epoch_end); checkpoint callbacks hear of every moment last (as in
    # Lightning), so that a checkpoint holds the other callbacks' state after that moment.
    def rank(callback: Callback) -> int:
        return 2 if isinstance(callback, ModelCheckpoint) else 1 if isinstance(callback, EarlyStopping) else 0

    return sorted(callbacks, key=rank)  # stable: the order given within each rank


def one_best(options: Any, callbacks: list[Callback], *,
             own_rule: str | None = None) -> tuple[Any, ModelCheckpoint | None]:
    """``(options, checkpoint callback)`` with one meaning of "best": a trainer without a
    ``monitor`` takes its :class:`ModelCheckpoint`'s (as in Lightning, where the checkpoint
    callback's monitor is the only one); when both are given and differ, an error: ``test()``,
    ``which="best"`` and the exported model would be the callback's best while the returned
    metrics and ``metrics/best_eval.json`` described the trainer's. So is a callback ``monitor``
    next to a rule of the user's (``own_rule``: the qualified name of the ``is_new_model_better``
    override the trainer asks), unless the trainer's ``monitor`` says the same as the callback's.

    Examples:
        >>> options, _ = one_best(TrainerOptions(), [ModelCheckpoint(monitor="val/acc", mode="max")])  # doctest: +SKIP
        >>> options.monitor, options.mode                                                             # doctest: +SKIP
        ('val/acc', 'max')
    """
    chosen = next((cb for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)
    if chosen is None or chosen.monitor is None:
        return options, chosen
    if own_rule is not None and options.monitor is None:
        raise ValueError(f"{own_rule} picks the best model, and ModelCheckpoint(monitor={chosen.monitor!r}) ranks "
                         f"checkpoints by its monitor: test(), which='best' and export would use the callback's best "
                         f"while train_model's metrics and metrics/best_eval.json described the override's. Drop the "
                         f"callback's monitor (it then keeps the checkpoint is_new_model_better picks), or the override "
                         f"(or give the trainer the same monitor and mode if the override agrees with it).")
    if options.monitor is None:
        return dataclasses.replace(options, monitor=chosen.monitor, mode=chosen.mode), chosen
    if (options.monitor, options.mode) != (chosen.monitor, chosen.mode):
        raise ValueError(f"ModelCheckpoint(monitor={chosen.monitor!r}, mode={chosen.mode!r}) ranks checkpoints by "
                         f"another measure than the trainer's monitor={options.monitor!r} (mode={options.mode!r}), "
                         f"so test(), which='best' and export would use one model while train_model's metrics and "
                         f"metrics/best_eval.json described another. {_same_best_advice(options, chosen)}")
    return options, chosen


def _same_best_advice(options: Any, chosen: ModelCheckpoint) -> str:
    """How to give the trainer and its ``ModelCheckpoint`` one best: the fix that keeps the
    callback's ``save_top_k`` (above 1 it needs a monitor of its own, so dropping it is no fix)."""
    same = f"ModelCheckpoint(monitor={options.monitor!r}, mode={options.mode!r}, save_top_k={chosen.save_top_k})"
    if chosen.monitor == options.monitor:  # ModelCheckpoint's mode defaults to 'min', as in Lightning
        return (f"Give both the same monitor and mode: pass mode={options.mode!r} to the callback ({same}), or "
                f"mode={chosen.mode!r} to the trainer.")
    if chosen.save_top_k not in (-1, 0, 1):
        return (f"Give both the same monitor and mode, e.g. {same} (its save_top_k={chosen.save_top_k} needs a "
                f"monitor of its own to rank checkpoints by), or the trainer monitor={chosen.monitor!r}, "
                f"mode={chosen.mode!r}.")
    return "Give both the same monitor and mode, or drop the callback's monitor (it then follows the trainer's)."


def start_fresh(callbacks: list[Callback], validates: bool = True) -> None:
    """Forget what the built-in callbacks kept from an earlier ``train_model`` of the same trainer
    (the history, early stopping's patience, the time spent): a new call starts afresh, and a
    resume then restores the run's own states. The checkpoints' ranking goes on
    (:meth:`ModelCheckpoint.start_call`): the run's best so far stays its best until a better one
    comes, as Keras' and Lightning's checkpoint callbacks keep theirs across ``fit`` calls.
    Settings that cannot work in this run (an ``EarlyStopping`` on ``val/...`` when it does not
    validate) fail here, before the run's folder is written.

    Examples:
        >>> start_fresh(trainer.callbacks, validates=val_loader is not None)   # doctest: +SKIP
    """
    for callback in callbacks:
        if isinstance(callback, EarlyStopping):
            callback.check_run(validates)
        if isinstance(callback, History):
            callback.clear()
        elif isinstance(callback, ModelCheckpoint):
            callback.start_call()
        elif isinstance(callback, (EarlyStopping, Timer)):
            callback.load_state_dict({})


def _not_a_callback(given: Any) -> str:
    """What to say of an entry of ``callbacks`` that is no :class:`Callback` instance.

    Examples:
        >>> _not_a_callback(ModelCheckpoint)
        'callbacks must be flaxlight.Callback instances; got the class ModelCheckpoint itself: write ModelCheckpoint(...).'
    """
    if isinstance(given, type) and issubclass(given, Callback):
        return (f"callbacks must be flaxlight.Callback instances; got the class {given.__name__} itself: write "
                f"{given.__name__}(...).")
    if isinstance(given, str):
        return (f"callbacks must be flaxlight.Callback instances; got the string {given!r}. Build it: e.g. "
                f"flaxlight.callbacks.EarlyStopping(monitor='val/loss', patience=3) (names such as {given!r} are "
                f"for the YAML config's callbacks: list).")
    return f"callbacks must be flaxlight.Callback instances; got {type(given).__name__}."
