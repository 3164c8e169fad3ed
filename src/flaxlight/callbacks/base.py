"""The callback interface: every hook is declared here as a no-op; override what you need."""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Mapping, Protocol, Sequence

from flaxlight.messages import warn_at_user

__all__ = ["Callback", "TrainerView", "LIGHTNING_HOOKS", "check_callback_hooks", "refuse_keras_arguments", "check_mode",
           "may_hear_log_points_late"]

_BEFORE_NONE = "no hook runs before {what}; "
_IN_THE_STEP = ("gradients exist only inside the jitted train step: log_grad_norm=True logs their norm, "
                "optimizer_hparams sets clipping and accumulation, and create_functions() of your own does the rest")
_BATCHES = ("{what} batches run in one jitted loop with no hook per batch: return per-batch values from loss_fn "
            "(train=False) as metrics, or read the results in {hook}")

# Lightning's callback hooks that flaxlight never calls: what to write instead.
LIGHTNING_HOOKS = {
    "on_train_start": "on_fit_start(trainer)",
    "on_train_end": "on_fit_end(trainer) (after the final test too)",
    "on_train_batch_end": "on_step(trainer, step) with the class attribute every_n_steps = 1 (after each optimizer "
                          "update; the step's metrics reach on_log(trainer, step, metrics) at log points)",
    "on_train_batch_start": _BEFORE_NONE.format(what="a batch") + "on_step(trainer, step) with the class attribute "
                                                                  "every_n_steps = 1 runs after each",
    "on_validation_epoch_end": "on_validation_end(trainer, epoch, metrics)",
    "on_validation_start": _BEFORE_NONE.format(what="a validation") + "on_validation_end(trainer, epoch, metrics) "
                                                                      "runs after each",
    "on_validation_epoch_start": _BEFORE_NONE.format(what="a validation") + "on_validation_end(trainer, epoch, "
                                                                            "metrics) runs after each",
    "on_validation_batch_start": _BATCHES.format(what="validation", hook="on_validation_end(trainer, epoch, metrics)"),
    "on_validation_batch_end": _BATCHES.format(what="validation", hook="on_validation_end(trainer, epoch, metrics)"),
    "on_test_epoch_end": "on_test_end(trainer, metrics)",
    "on_test_start": _BEFORE_NONE.format(what="a test") + "on_test_end(trainer, metrics) runs after each",
    "on_test_epoch_start": _BEFORE_NONE.format(what="a test") + "on_test_end(trainer, metrics) runs after each",
    "on_test_batch_start": _BATCHES.format(what="test", hook="on_test_end(trainer, metrics)"),
    "on_test_batch_end": _BATCHES.format(what="test", hook="on_test_end(trainer, metrics)"),
    "on_sanity_check_start": "flaxlight runs no sanity validation (train_model checks the validation loader's first "
                             "batch instead); on_fit_start(trainer) runs before the first epoch",
    "on_sanity_check_end": "flaxlight runs no sanity validation; on_fit_start(trainer) runs before the first epoch",
    "on_save_checkpoint": "state_dict(): what it returns is saved in every checkpoint (under state_key) and given "
                          "back to load_state_dict(state) at a resume",
    "on_load_checkpoint": "load_state_dict(state), called at a resume with what state_dict() returned",
    "on_before_backward": _IN_THE_STEP, "on_after_backward": _IN_THE_STEP,
    "on_before_optimizer_step": _IN_THE_STEP, "on_before_zero_grad": _IN_THE_STEP,
    **{f"on_predict_{moment}": "predict() calls no callbacks: use the predictions it returns"
       for moment in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end")},
}


class TrainerView(Protocol):
    """What a callback may use of the trainer (``flaxlight.TrainerModule`` provides all of it).

    Read:
        global_step: optimizer updates completed. current_epoch: the epoch being trained
        (1-based). batch_in_epoch: batches of it trained on. num_epochs, steps_per_epoch: the
        run's length. batch_size: examples in the first batch of the epoch. compile_time: the
        first step's seconds, compilation included (None before it). state: the
        :class:`~flaxlight.TrainState`. log_dir: the run's folder (None in ``fast_dev_run``).
        options: the :class:`~flaxlight.TrainerOptions`. callback_metrics: the latest value of
        every logged metric. nonfinite_steps / nonfinite_checked_step: steps whose loss was
        NaN/Inf, as of that step; nonfinite_first: where the first was seen (None: none). is_best_validation: whether the latest validation is the best
        so far (the trainer's ``is_new_model_better``, asked once per validation).
        validation_metrics: the latest validation's metrics, the eval step's and those logged
        during it (by ``on_validation_epoch_end`` or callbacks), which the best model is ranked by.
        should_stop / stop_reason: whether (and why) the loop was asked to stop.
        checkpointer: the run's :class:`~flaxlight.Checkpointer` (where ``save_model`` writes).
        own_checkpoints: whether ``save_model`` writes checkpoints of its own (an override not
        calling ``super().save_model``, the UvA guide's), to be called at new best models only.
        train_loader / val_loader: the loaders ``train_model`` was given (e.g. to compute a
        confusion matrix at ``on_validation_end``; val_loader is None without validation).
        one_update_per_batch: whether the train step makes one optimizer update per batch (True
        for flaxlight's; a step of yours: None until its first epoch's end counted them).

    Act:
        stop(reason): end the loop after the current step's work. log_metrics(metrics, step):
        log values the way the trainer logs its own (loggers, ``callback_metrics``, ``on_log``).
        save_model(step): checkpoint now. learning_rate(step): the scheduled rate.
        monitored_value(name, owner): a logged metric, or an error naming the logged ones.
        log_point_time(step): in ``on_log``, the ``time.perf_counter()`` at which the loop reached
        the train log point ``step`` (None for other records): wall time per logged interval.
    """

    global_step: int
    num_epochs: int | None
    steps_per_epoch: int | None
    batch_size: int | None
    state: Any
    log_dir: str | None
    options: Any
    callback_metrics: dict[str, float]
    should_stop: bool
    stop_reason: str | None
    checkpointer: Any

    @property
    def current_epoch(self) -> int: ...

    @property
    def batch_in_epoch(self) -> int: ...

    @property
    def compile_time(self) -> float | None: ...

    @property
    def nonfinite_steps(self) -> int: ...

    @property
    def nonfinite_checked_step(self) -> int: ...

    @property
    def nonfinite_first(self) -> str | None: ...

    @property
    def is_best_validation(self) -> bool: ...

    @property
    def validation_metrics(self) -> dict[str, float]: ...

    @property
    def own_checkpoints(self) -> bool: ...

    @property
    def train_loader(self) -> Any: ...

    @property
    def val_loader(self) -> Any: ...

    @property
    def one_update_per_batch(self) -> bool | None: ...

    def stop(self, reason: str) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...

    def save_model(self, step: int | None = None) -> None: ...

    def learning_rate(self, step: int | None = None) -> float | None: ...

    def monitored_value(self, name: str, owner: str = "monitor") -> float: ...

    def log_point_time(self, step: int) -> float | None: ...


class Callback:
    """Side effects at fixed moments of the loop, called in the order the callbacks were listed.

    Hooks, in the order they fire for one epoch::

        on_fit_start(trainer)                         before the first epoch (after a resume)
        on_train_epoch_start(trainer, epoch)          before each epoch's training
        on_step(trainer, step)                        every ``every_n_steps`` optimizer updates
        on_log(trainer, step, metrics)                whenever metrics reach the loggers
        on_train_epoch_end(trainer, epoch, metrics)   after each training epoch
        on_validation_end(trainer, epoch, metrics)    after each validation
        on_epoch_end(trainer, epoch)                  after the epoch's training and validation
        on_test_end(trainer, metrics)                 after testing the best model
        on_fit_end(trainer)                           after training (and testing)
        on_exception(trainer, exc)                    when the loop raises (also on interrupts)

    ``on_step`` is only called at multiples of ``every_n_steps`` (None: never), decided by the
    trainer in one place, so a callback costs nothing on the other steps. Stateful callbacks
    return their state from ``state_dict()``; it is saved in every checkpoint under the
    callback's :attr:`state_key` and handed back to ``load_state_dict()`` on resume.

    Examples:
        >>> class PrintLoss(Callback):
        ...     def on_train_epoch_end(self, trainer, epoch, metrics):
        ...         print(epoch, metrics["train/loss"])
    """

    every_n_steps: int | None = None
    #: True when ``on_log`` only records or shows the values (a display, a file): the loop then
    #: need not stop at each log point for it; train log points reach ``on_log`` at the loop's next
    #: stop instead (see docs/callbacks.md), in step order, and what the trainer says there
    #: (``global_step``, ``current_epoch``, ``state``) is as of that stop. Said for the class
    #: that defines ``on_log``: a subclass with an ``on_log`` of its own says it again.
    on_log_may_lag: bool = False

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Before the first epoch (the state is built; after a resume, restored)."""

    def on_train_epoch_start(self, trainer: TrainerView, epoch: int) -> None:
        """Before the training part of ``epoch`` (also when it resumes mid-way)."""

    def on_step(self, trainer: TrainerView, step: int) -> None:
        """After optimizer update ``step`` when ``step % every_n_steps == 0``."""

    def on_log(self, trainer: TrainerView, step: int, metrics: Mapping[str, float]) -> None:
        """After ``metrics`` (host floats) were sent to the loggers."""

    def on_train_epoch_end(self, trainer: TrainerView, epoch: int, metrics: Mapping[str, float]) -> None:
        """After the training part of ``epoch`` with its ``train/...`` metrics."""

    def on_validation_end(self, trainer: TrainerView, epoch: int, metrics: Mapping[str, float]) -> None:
        """After validating at the end of ``epoch`` with its ``val/...`` metrics."""

    def on_epoch_end(self, trainer: TrainerView, epoch: int) -> None:
        """After the whole epoch (training and, when due, validation)."""

    def on_test_end(self, trainer: TrainerView, metrics: Mapping[str, float]) -> None:
        """After the test run with its ``test/...`` metrics."""

    def on_fit_end(self, trainer: TrainerView) -> None:
        """After training and testing finished."""

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        """When the loop is left by an exception (including a preemption signal)."""

    @property
    def state_key(self) -> str:
        """The name this callback's state is saved under in checkpoints, by which a resume finds
        it again (Lightning's ``Callback.state_key``). Default: the class name; callbacks that
        share a key are told apart by their order in the list. Override it with the settings
        that tell two callbacks of the class apart (``EarlyStopping`` adds its monitor and mode),
        so that each finds its own state when callbacks are added, removed or reordered at a
        resume. A saved state that no callback's key finds is named in a warning.

        Examples:
            >>> class Smoother(Callback):
            ...     def __init__(self, metric):
            ...         self.metric = metric
            ...     @property
            ...     def state_key(self):
            ...         return f"Smoother[{self.metric}]"
            >>> Smoother("val/loss").state_key
            'Smoother[val/loss]'
        """
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state to keep in checkpoints (empty for stateless callbacks)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def check_callback_hooks(callback: Callback) -> None:
    """Refuse a hook of ``callback`` that flaxlight could not call (another signature than the
    :class:`Callback` hook it overrides, e.g. Lightning's ``(trainer, pl_module)``; a
    ``pl_module=None`` that flaxlight's call leaves at its default is fine), naming the signature
    to write; warn of a method flaxlight never calls that is named as a hook it would be meant as:
    Lightning's (``on_train_batch_end``), or a close misspelling of flaxlight's
    (``on_validaton_end``), naming the hook to use. Other ``on_*`` methods (a helper of the
    callback's own, ``on_improvement``) are left alone. Run when the trainer is built.

    Examples:
        >>> class Ported(Callback):
        ...     def on_train_epoch_end(self, trainer, pl_module): ...
        >>> check_callback_hooks(Ported())   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: Ported.on_train_epoch_end(trainer, pl_module) cannot take what flaxlight passes: ...
    """
    hooks = [name for name in vars(Callback) if name.startswith("on_")]
    owner = type(callback).__name__
    for name in sorted(dir(type(callback))):
        method = getattr(callback, name, None)
        if not name.startswith("on_") or not callable(method):
            continue
        if name not in hooks:
            message = _never_called_message(owner, name, hooks)
            if message is not None:
                warn_at_user(message)
        elif getattr(type(callback), name) is not getattr(Callback, name):
            _check_signature(owner, name, method)


def _check_signature(owner: str, name: str, method: Any) -> None:
    """A clear error for an overridden hook that cannot be called with flaxlight's arguments."""
    expected = [p for p in inspect.signature(getattr(Callback, name)).parameters if p != "self"]
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:  # a pl_module (Lightning's second argument) must be left at its default, not given the epoch
        fits = "pl_module" not in signature.bind(*expected).arguments
    except TypeError:
        fits = False
    if fits:
        return
    lightning = (" It is written as Lightning's hook, whose arguments are (trainer, pl_module, ...): in flaxlight the "
                 "trainer is both (the model's parameters are trainer.state.params)." if "pl_module" in
                 signature.parameters else "")
    raise TypeError(f"{owner}.{name}{_plain(signature)} cannot take what flaxlight passes: it calls "
                    f"{name}({', '.join(expected)}).{lightning} Write def {name}(self, {', '.join(expected)}) (see "
                    f"flaxlight.Callback.{name}).")


def _plain(signature: inspect.Signature) -> str:
    """A signature without annotations: ``(trainer, pl_module)``."""
    return str(signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                             for p in signature.parameters.values()],
                                 return_annotation=inspect.Signature.empty))


def _never_called_message(owner: str, name: str, hooks: list[str]) -> str | None:
    """The warning for an ``on_*`` method flaxlight never calls: Lightning's hook, or a close
    misspelling of one of flaxlight's ``hooks``; None for any other name (a helper of the user's)."""
    said = f"{owner}.{name} is never called: flaxlight.Callback has no hook {name!r}"
    if name in LIGHTNING_HOOKS:
        return f"{said} (Lightning's). Use {LIGHTNING_HOOKS[name]}."
    close = difflib.get_close_matches(name, hooks, n=1, cutoff=0.85)
    if close:
        return (f"{said}. Did you mean {close[0]!r}? (A method of yours that your hooks call, not meant as "
                f"{close[0]!r}: name it less like it.)")
    return None


def refuse_keras_arguments(keywords: Mapping[str, str],
                           positional: Callable[[tuple, Mapping[str, Any]], str | None] | None = None,
                           lightning: Mapping[str, str] | None = None, keras_too: Sequence[str] = ()
                           ) -> Callable[[Callable], Callable]:
    """A decorator for a callback's ``__init__`` that refuses Keras' arguments with what to write
    instead, before Python binds them (its signature, read by configs, stays ``__init__``'s):
    what ``positional`` finds Keras-like in the arguments given (``(args, kwargs)`` -> what was
    given and flaxlight's way, or None), then the keywords of ``keywords`` (Keras' name ->
    flaxlight's way) and of ``lightning`` (Lightning's; those in ``keras_too`` are Keras' as well).

    Examples:
        >>> class Saver(Callback):
        ...     @refuse_keras_arguments({"verbose": "nothing is printed"})
        ...     def __init__(self, every: int = 1):
        ...         self.every = every
        >>> Saver(verbose=1)
        Traceback (most recent call last):
        TypeError: Saver() got an unexpected keyword argument 'verbose' (a Keras one): nothing is printed.
    """
    def decorate(init: Callable) -> Callable:
        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            said = positional(args, kwargs) if positional is not None else None
            if said is not None:  # first: Keras' positional arguments name the call (its keywords' advice included)
                raise TypeError(f"{type(self).__name__}() got {said}.")
            foreign = {**keywords, **(lightning or {})}
            name = next((name for name in kwargs if name in foreign), None)
            if name is not None:
                whose = ("a Keras one" if name not in (lightning or {}) else
                         "Lightning's and Keras'" if name in keras_too else "Lightning's")
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {name!r} ({whose}): "
                                f"{foreign[name]}.")
            init(self, *args, **kwargs)

        return checked

    return decorate


def check_mode(owner: str, mode: Any) -> None:
    """A ``ValueError`` unless ``mode`` is ``"min"`` or ``"max"`` (Keras' ``"auto"`` is told which).

    Examples:
        >>> check_mode("EarlyStopping", "auto")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: EarlyStopping mode must be 'min' or 'max', got 'auto' (Keras' 'auto' is not taken: 'max' for a ...).
    """
    if mode not in ("min", "max"):
        keras = " (Keras' 'auto' is not taken: 'max' for a score such as 'val/acc', 'min' for a loss)" \
            if mode == "auto" else ""
        raise ValueError(f"{owner} mode must be 'min' or 'max', got {mode!r}{keras}.")


def may_hear_log_points_late(callback: "Callback") -> bool:
    """Whether ``callback`` lets train log points reach its ``on_log`` at the loop's next stop:
    it has no ``on_log`` of its own, or ``on_log_may_lag`` is True on the instance or on the class
    that defines its ``on_log`` (or a subclass of it), so a subclass adding an ``on_log`` that may
    act does not inherit a display's True.

    Examples:
        >>> class Shown(Callback):
        ...     on_log_may_lag = True
        ...     def on_log(self, trainer, step, metrics): print(metrics)
        >>> class Acting(Shown):
        ...     def on_log(self, trainer, step, metrics): trainer.stop("enough")
        >>> may_hear_log_points_late(Callback()), may_hear_log_points_late(Shown()), may_hear_log_points_late(Acting())
        (True, True, False)
    """
    if "on_log_may_lag" in vars(callback):
        return bool(callback.on_log_may_lag)
    mro = type(callback).__mro__
    owner = next(cls for cls in mro if "on_log" in vars(cls))
    if owner is Callback:
        return True
    declared = next((cls for cls in mro if "on_log_may_lag" in vars(cls)), Callback)
    return bool(callback.on_log_may_lag) and issubclass(declared, owner)
