"""``TrainerVerbsMixin``: what a trained model is for, as trainer methods: ``load_from_checkpoint``,
``predict``, ``test``, ``export``, ``bind_model``.

:class:`~flaxlight.trainer.TrainerModule` inherits it. ``predict`` and ``test`` take a loader, or arrays and a
``batch_size`` (see :func:`flaxlight.data.as_loader`).

Examples:
    >>> trainer = MyTrainer.load_from_checkpoint("runs/mlp", exmp_input=x[:1])  # doctest: +SKIP
    >>> probabilities = trainer.predict(x_test, batch_size=256)          # doctest: +SKIP
    >>> trainer.test((x_test, y_test), batch_size=256)                   # doctest: +SKIP
    {'test/loss': 0.08, 'test/acc': 0.97}
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import warnings
import weakref
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np

from flaxlight import distributed as dist
from flaxlight import resume, runfiles
from flaxlight.checkpoint import ModelMismatchError, flat_shapes, param_differences
from flaxlight.data import REQUIRED, ArrayLoader, FirstBatches, StepsOf, as_input_list, checked_loader
from flaxlight.messages import logger as messages, warn_at_user
from flaxlight.metrics import batch_size as examples_in, deliberate_reads
from flaxlight.models import MODEL_FIT_ERRORS, shapes_text
from flaxlight.optim import PRECISIONS, as_optimizer_config, ema_params
from flaxlight.options import TRAINER_ARGUMENTS, check_foreign_arguments, foreign_method_message
from flaxlight.registry import explicit_parameters
from flaxlight.step import computing_state, step_owner
from flaxlight.view import is_flaxlights_own, refuse_deleted_arrays, writes_own_checkpoints

__all__ = ["TrainerVerbsMixin", "LIGHTNING_MODULE_METHODS", "TRAINER_HOOKS", "check_trainer_hooks",
           "warn_lightning_module_methods"]


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("flaxlight")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def _test_stem(name: Any) -> str:
    """The metric prefix and file name of a test: ``"test"``, or ``"test_<name>"``."""
    if name is None:
        return "test"
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"test's name must be letters, digits, '_' or '-' (it names the metrics test_<name>/... "
                         f"and the file metrics/test_<name>.json); got {name!r}. E.g. test(data, name='shifted').")
    return f"test_{name}"


def _model_inputs(batch: Any, count: int = 1) -> tuple:
    """The model's inputs in a batch: its first ``count`` elements (the model's inputs, as many as
    ``exmp_input`` holds) when it is a tuple / list, else the whole batch as the one input."""
    return tuple(batch[:count]) if isinstance(batch, (tuple, list)) else (batch,)


def _run_and_step(checkpoint: str | os.PathLike) -> tuple[str, int | None]:
    """``(run folder, step)`` of what ``load_from_checkpoint`` was given: a run's folder (step None),
    its ``checkpoints`` folder, or one ``checkpoints/<step>`` folder (the run is two folders up)."""
    path = os.path.abspath(os.fspath(checkpoint))
    name = os.path.basename(path)
    step = int(name) if name.isdigit() else None  # a step the run did not keep is said when it is loaded
    folder = path if step is None else os.path.dirname(path)
    run = os.path.dirname(folder)
    if os.path.basename(folder) == runfiles.CHECKPOINT_DIR and os.path.isfile(os.path.join(run, runfiles.HPARAMS_FILE)):
        return run, step
    return path, None


def _input_sized(shapes: Mapping[str, tuple]) -> bool:
    """Whether a parameter of a checkpoint's mismatch (``{path: (checkpoint shape, model shape)}``)
    differs where a wrong ``exmp_input`` would make it differ: in a dimension before its last (a
    layer's input size, which a Linen model takes from its input) or in its rank. Output sizes
    alone (a new head for another number of classes) are no input's doing.

    Examples:
        >>> _input_sized({"head/kernel": ((32, 10), (32, 5)), "head/bias": ((10,), (5,))})
        False
        >>> _input_sized({"Dense_0/kernel": ((4, 8), (1, 8))})
        True
    """
    return any(got is not None and want is not None and (len(got) != len(want) or got[:-1] != want[:-1])
               for got, want in shapes.values())


def _exmp_input_note(exmp_input: Any) -> str:
    """What a checkpoint of "a different model" may also mean when loading: a wrong ``exmp_input``."""
    return (f"This trainer's exmp_input is {_describe_inputs(as_input_list(exmp_input))}, and the model's first "
            f"layers are shaped from it: a wrong exmp_input (e.g. x[0] instead of x[:1]) gives this error too. It "
            f"must be shaped like one batch of the run's inputs, batch axis first.")


def _construct(cls: type, exmp_input: Any, kwargs: dict, overrides: Mapping[str, Any]):
    """``cls(exmp_input=..., **kwargs)``; a constructor that names its model itself (the seed's
    pattern, no model hyperparameters saved to tell) is called again without ``model_class`` /
    ``model_hparams``. Where the caller gave them (``act=nn.gelu``: a model hparam), the trainer
    so built must hold the same values (:func:`_check_given_model`): its ``__init__`` sets them."""
    with warnings.catch_warnings():  # num_epochs / batch_size in the run's hparams: said when it was trained
        warnings.filterwarnings("ignore", message=r".* it is recorded in the run's config, but only train_model's")
        try:
            return cls(exmp_input=exmp_input, **kwargs)
        except TypeError as exc:
            model_keys = [key for key in ("model_class", "model_hparams") if key in kwargs]
            if not any(f"argument '{key}'" in str(exc) for key in model_keys):
                raise
            trainer = cls(exmp_input=exmp_input, **{key: value for key, value in kwargs.items()
                                                    if key not in model_keys})
    return _check_given_model(trainer, {key: overrides[key] for key in model_keys if key in overrides})


def _same_value(given: Any, held: Any) -> bool:
    if given is held:
        return True
    try:
        return bool(np.all(given == held)) and np.shape(given) == np.shape(held)
    except Exception:  # values that do not compare (arrays of other shapes, objects refusing ==)
        return False


def _check_given_model(trainer: Any, given: Mapping[str, Any]) -> Any:
    """``trainer``, built by a constructor that sets ``model_class`` / ``model_hparams`` itself,
    when the ones ``load_from_checkpoint`` was given (``given``; by name: ``act=nn.gelu`` joins
    ``model_hparams``) are what it holds; else a TypeError naming those that could not reach the
    model, and what to pass instead. A value the run kept as text only stands for what the trainer sets."""
    name, differ = type(trainer).__name__, []
    if "model_class" in given and given["model_class"] is not trainer.model_class:
        differ.append(f"model_class={getattr(given['model_class'], '__name__', given['model_class'])} (it builds "
                      f"{getattr(trainer.model_class, '__name__', trainer.model_class)})")
    held = trainer.model_hparams if isinstance(trainer.model_hparams, Mapping) else {}
    for key, value in (given.get("model_hparams") or {}).items():
        if not runfiles.kept_as_text(value) and not _same_value(value, held.get(key, _MISSING)):
            shown = runfiles.to_yaml_safe  # a function by its path, not "<function gelu at 0x7f...>"
            differ.append(f"{key}={shown(value)!r} (it sets " + (f"{key}={shown(held[key])!r})" if key in held else "none)"))
    if differ:
        own = [arg for arg in explicit_parameters(type(trainer).__init__) if arg not in TRAINER_ARGUMENTS]
        raise TypeError(
            f"{name}.load_from_checkpoint: {', '.join(differ)}: {name}.__init__ picks its model itself (it passes "
            f"model_class and model_hparams to TrainerModule.__init__), so a model setting given to "
            f"load_from_checkpoint cannot reach the model. Pass an argument of {name}.__init__ instead"
            + (f" ({', '.join(own)})" if own else "") + ", or let __init__ take the setting and hand it to the model.")
    return trainer


_MISSING = object()


_LOSS_FN = ("loss_fn(self, params, batch, *, train, rng, state) returning (loss, metrics), from which the trainer "
            "builds the jitted train and eval steps (or create_functions() returning your own (train_step, "
            "eval_step))")
_EVAL = "the same loss_fn with train=False: its metrics are logged as {prefix}/... ({where})"
_IN_STEP = ("the gradients exist only inside the jitted train step: optimizer_hparams sets clipping "
            "('gradient_clip'), accumulation and the schedule; a TrainStep.compute_gradients override (or "
            "create_functions() of your own) changes the gradients")
_RUN_STATE = ("what must travel with the run goes in a field of a flaxlight.TrainState subclass (arrays: saved in "
              "every checkpoint, restored by load_from_checkpoint and resume=True), in an argument of the trainer's "
              "constructor (hparams.yaml: back with load_from_checkpoint), in the model (model_hparams: export() "
              "serves it too) or in a Callback's state_dict() / load_state_dict() (restored at a resume); see "
              "docs/models.md, \"State that travels with the run\"")
_BATCH_HOOK = "batches run in one jitted loop with no hook per batch: {what}"

# LightningModule methods that Lightning calls and flaxlight never does: what flaxlight calls instead
# (a TrainerModule subclass defining one is warned of, :func:`warn_lightning_module_methods`).
LIGHTNING_MODULE_METHODS = {
    "training_step": _LOSS_FN,
    "validation_step": _EVAL.format(prefix="val", where="train_model's val_loader, eval_model"),
    "test_step": _EVAL.format(prefix="test", where="test(), train_model's test_loader"),
    "predict_step": "predict() returns the model's eval-mode outputs (its __call__, through state.apply_model); "
                    "other outputs (a multi-step rollout, post-processing) are a method of your own around predict() "
                    "or a jitted state.apply_model, or part of the model's __call__ (then export() serves them too)",
    "configure_optimizers": "optimizer_hparams={'optimizer': 'adamw', 'lr': 1e-3, 'schedule': ...} (or an optax "
                            "transformation, or a function of the run's total_steps returning one); an "
                            "init_optimizer(num_epochs, num_steps_per_epoch) override for full control",
    "configure_callbacks": "callbacks=[...], given to the trainer",
    "on_save_checkpoint": _RUN_STATE, "on_load_checkpoint": _RUN_STATE,
    **dict.fromkeys(("backward", "optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping",
                     "lr_scheduler_step", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                     "on_before_zero_grad"), _IN_STEP),
    "on_fit_start": "on_training_start() (before the first epoch), or a Callback's on_fit_start(trainer)",
    "on_train_start": "on_training_start() (before the first epoch), or a Callback's on_fit_start(trainer)",
    "on_fit_end": "on_training_end(), or a Callback's on_fit_end(trainer)",
    "on_train_end": "on_training_end(), or a Callback's on_fit_end(trainer)",
    "on_train_epoch_start": "a Callback's on_train_epoch_start(trainer, epoch)",
    "on_train_epoch_end": "on_training_epoch_end(epoch_idx), or a Callback's on_train_epoch_end(trainer, epoch, "
                          "metrics)",
    **dict.fromkeys(("on_validation_start", "on_validation_end", "on_validation_epoch_start"),
                    "on_validation_epoch_end(epoch_idx, eval_metrics, val_loader) (after each validation), or a "
                    "Callback's on_validation_end(trainer, epoch, metrics)"),
    **dict.fromkeys(("on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end"),
                    "a Callback's on_test_end(trainer, metrics)"),
    **dict.fromkeys(("on_train_batch_start", "on_train_batch_end"),
                    _BATCH_HOOK.format(what="a Callback's on_step(trainer, step) with the class attribute "
                                            "every_n_steps = 1 runs after each optimizer update")),
    **dict.fromkeys(("on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start",
                     "on_test_batch_end"),
                    _BATCH_HOOK.format(what="return per-batch values from loss_fn (train=False) as metrics")),
    **{f"on_predict_{moment}": "predict() calls no hooks: use the outputs it returns"
       for moment in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end")},
    **dict.fromkeys(("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"),
                    "the loaders are given to the call: train_model(train_loader, val_loader, test_loader), "
                    "test(data), predict(data)"),
    **dict.fromkeys(("transfer_batch_to_device", "on_before_batch_transfer", "on_after_batch_transfer"),
                    "the loop moves batches to the device itself (prefetched): change them in the loader, or in "
                    "loss_fn"),
}


_SAID_LIGHTNING_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> its method names warned of


def warn_lightning_module_methods(cls: type) -> None:
    """Warn of each method of ``cls`` (a :class:`~flaxlight.TrainerModule` subclass) that is named
    as a LightningModule method Lightning would call and flaxlight never does
    (:data:`LIGHTNING_MODULE_METHODS`: ``predict_step``, ``configure_optimizers``,
    ``on_save_checkpoint``, ...), naming what flaxlight calls instead. Run when a trainer is built;
    each method is warned of once, whichever class of the ones inheriting it is built first. A
    name flaxlight's trainer has (``on_validation_epoch_end``, the seed's hook) is called, so left alone
    here (:func:`check_trainer_hooks` checks that it can take the loop's arguments).

    Examples:
        >>> class Ported(flaxlight.TrainerModule):        # doctest: +SKIP
        ...     def predict_step(self, batch, batch_idx): ...
        >>> Ported(model_class=MLP, ...)                  # doctest: +SKIP
        UserWarning: Ported.predict_step is never called: flaxlight.TrainerModule has no method 'predict_step' ...
    """
    for name, instead in LIGHTNING_MODULE_METHODS.items():
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is None or is_flaxlights_own(owner) or not callable(getattr(cls, name)):
            continue
        said = _SAID_LIGHTNING_METHODS.setdefault(owner, set())
        if name in said:  # a trainer of this class, or of another that inherits the method, was built
            continue
        said.add(name)
        warn_at_user(f"{cls.__name__}.{name} is never called: flaxlight.TrainerModule has no method {name!r} "
                     f"(a LightningModule's). Instead: {instead}. (A method of yours that your own code calls, not "
                     f"meant as Lightning's: name it otherwise. See docs/from-lightning.md.)")


# The trainer's own hooks (TrainerModule's no-op methods that the loop calls, with the arguments of
# their signatures there) and, for those LightningModule has too, what Lightning's takes instead.
TRAINER_HOOKS = {
    "on_training_start": "", "on_training_end": "",
    "on_training_epoch_end": "",
    "on_validation_epoch_end": " LightningModule's on_validation_epoch_end(self) takes no arguments (it reads what "
                               "validation_step kept); here the validation's metrics come as eval_metrics (means "
                               "of what loss_fn returned with train=False).",
}


def check_trainer_hooks(cls: type) -> None:
    """Refuse an override of one of the trainer's hooks (:data:`TRAINER_HOOKS`) that cannot take
    what the loop passes, e.g. LightningModule's ``on_validation_epoch_end(self)``, naming the
    signature to write. Run when a trainer is built, so that it fails before anything trains (the
    call came after the first epoch). A hook written with ``*args`` / ``**kwargs``, or with other
    names for the same positional arguments, is fine.

    Examples:
        >>> class Ported(flaxlight.TrainerModule):        # doctest: +SKIP
        ...     def on_validation_epoch_end(self): ...
        >>> Ported(model_class=MLP, ...)                  # doctest: +SKIP
        TypeError: Ported.on_validation_epoch_end(self) cannot take what flaxlight passes: ...
    """
    for name, lightning in TRAINER_HOOKS.items():
        base = next((klass for klass in cls.__mro__ if name in vars(klass) and is_flaxlights_own(klass)), None)
        if base is None or is_flaxlights_own(getattr(cls, name)):
            continue
        expected = [p for p in inspect.signature(vars(base)[name]).parameters if p != "self"]
        raw = inspect.getattr_static(cls, name)
        try:
            signature = inspect.signature(getattr(cls, name))
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check
            continue
        try:  # a plain method gets the trainer first; a staticmethod or a bound one does not
            signature.bind(*(["self"] if inspect.isfunction(raw) else []), *expected)
        except TypeError:
            written = str(signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                                        for p in signature.parameters.values()],
                                            return_annotation=inspect.Signature.empty))
            raise TypeError(f"{cls.__name__}.{name}{written} cannot take what flaxlight passes: the trainer calls "
                            f"self.{name}({', '.join(expected)}).{lightning} Write def {name}("
                            f"{', '.join(['self', *expected])}) (see flaxlight.TrainerModule.{name}; "
                            f"docs/callbacks.md).") from None


class TrainerVerbsMixin:
    """``load_from_checkpoint``, ``predict``, ``test``, ``export``, ``bind_model`` (see the module docstring)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A LightningModule method the trainer's class has, which flaxlight never calls, is warned of
        when the first trainer of that class is built (:func:`warn_lightning_module_methods`); an
        override of a trainer hook that cannot take the loop's arguments is refused (:func:`check_trainer_hooks`)."""
        warn_lightning_module_methods(cls)
        check_trainer_hooks(cls)
        check_foreign_arguments(cls, kwargs)  # model= for model_class=: said before Python's missing arguments
        return super().__new__(cls)

    def __getattr__(self, name: str) -> Any:  # only for names not found otherwise: Lightning's / Keras', with a hint
        if any(name in vars(klass) for klass in type(self).__mro__):  # a property that failed: its own error again
            return object.__getattribute__(self, name)
        message = foreign_method_message(type(self).__name__, name)
        raise AttributeError(message or f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def load_from_checkpoint(cls, checkpoint: str | os.PathLike, exmp_input: Any, which: str = "best",
                             with_optimizer: bool = False, **overrides: Any) -> Any:
        """Rebuild a trainer from a run's log dir (``hparams.yaml`` + a checkpoint): ``which`` is
        ``"best"`` (the newest when no validation ran) or ``"last"``; ``with_optimizer=True`` also
        restores the optimizer state (without it, a run with ``ema_decay`` loads its parameters'
        moving average, which evaluation used); ``overrides`` replace saved settings (``logger_params`` are merged;
        a ``log_dir`` there logs to that folder, a new one or one holding only earlier tests' records: an
        eval folder). ``test()`` and ``log_metrics`` add to the run's records.
        Example: ``MyTrainer.load_from_checkpoint("checkpoints/MLP/version_0", exmp_input=x[:1])``."""
        run, step = _run_and_step(checkpoint)
        overrides = runfiles.load_overrides(cls, run, overrides)  # num_classes=5: a model hparam; strict: refused
        if writes_own_checkpoints(cls) and runfiles.CHECKPOINT_DIR + "/" not in runfiles.run_files_present(run):
            return cls._load_own_checkpoint(run, step, exmp_input, which, overrides)
        trainer = _construct(cls, exmp_input, runfiles.trainer_kwargs(cls, run, which, overrides), overrides)
        source = resume.checkpointer_for(run if step is None else os.path.join(run, runfiles.CHECKPOINT_DIR))
        own = source.directory == trainer.checkpointer.directory
        trainer._loaded_from = None if own else source  # which="best"/"last" until the trainer saves its own
        trainer._hparams_written, trainer._loaded = own, True  # its hparams.yaml describes this trainer already
        wanted = trainer.optimizer_hparams
        saved = runfiles.read_hparams(run).get("optimizer_hparams", wanted)  # the optimizer whose state was saved
        run_ema = _keeps_ema(saved)
        if run_ema is None:  # settings recorded by name (a function of yours): the ones given stand for them
            saved, run_ema = wanted, bool(_keeps_ema(wanted))
        averaged = not with_optimizer and run_ema  # the model the run validated is the EMA in that state
        if with_optimizer or averaged:  # the run's schedule again: its length, and its epochs (accumulation's updates)
            trainer.steps_per_epoch = trainer.steps_per_epoch or resume.epoch_length(source)
            trainer._earlier_epochs = resume.earlier_epochs(source)  # epochs of another batch size, if any
            built = wanted if with_optimizer else saved  # an override's optimizer is built to train, at train_model
            trainer.optimizer_hparams = built
            with _quiet_step_check(not _same_settings(built, wanted)):
                trainer._build_optimizer(*resume.run_length(source))
            trainer.optimizer_hparams = wanted
        trainer._place_state()
        load = functools.partial(trainer._load_for_resume, purpose="load_from_checkpoint") if own else None
        try:
            trainer.state, step = resume.load_with_fallback(source, trainer.state, which, load, step=step)
        except ModelMismatchError as exc:  # a Linen model was shaped from exmp_input: it may be the one at fault
            if trainer.model_adapter.kind == "nnx" or not _input_sized(exc.shapes):
                raise
            raise ModelMismatchError(f"{exc}\n{_exmp_input_note(exmp_input)}", shapes=exc.shapes) from None
        if averaged:  # an inference load serves the moving average the run was validated with
            trainer.state = trainer._serving(trainer.state).replace(opt_state=None)
            if not _same_settings(wanted, saved):  # another optimizer: train_model builds it, for its own run
                trainer.optimizer_plan = None
        trainer._settle_global_step(step)  # the batches the checkpoint trained, not state.step (its updates)
        trainer._settle_loaded_epoch(source, step)
        trainer.logger.continue_run()  # test() and log_metrics add to the run's records
        return trainer

    @classmethod
    def _load_own_checkpoint(cls, run: str, step: int | None, exmp_input: Any, which: str,
                             overrides: Mapping[str, Any]) -> Any:
        """``load_from_checkpoint`` of a run whose ``save_model`` wrote checkpoints of its own (the UvA
        guide's pair, :func:`~flaxlight.view.writes_own_checkpoints`): the trainer rebuilt from
        ``hparams.yaml``, its best model restored by its ``load_model()``."""
        name = cls.__name__
        if is_flaxlights_own(cls.load_model):
            raise FileNotFoundError(f"No checkpoint of flaxlight's in {os.path.join(run, runfiles.CHECKPOINT_DIR)}: "
                                    f"{name}.save_model writes checkpoints of its own (it does not call "
                                    f"super().save_model(step)), which flaxlight cannot read. Override "
                                    f"load_model(self) to restore self.state from them (the UvA guide's pair: "
                                    f"save_model(step) at each new best model, load_model() for it): "
                                    f"load_from_checkpoint then calls it.")
        if which != "best" or step is not None:
            raise ValueError(f"{name}.save_model writes checkpoints of its own, called at new best models only: "
                             f"load_from_checkpoint loads the best model, through {name}.load_model(); "
                             f"{'which=' + repr(which) if which != 'best' else 'a step folder'} has no checkpoint.")
        kwargs = runfiles.trainer_kwargs(cls, run, which, overrides, need_checkpoint=False)
        trainer = _construct(cls, exmp_input, kwargs, overrides)
        trainer._hparams_written = trainer._loaded = True
        trainer._load_for_resume(None, purpose="load_from_checkpoint")
        trainer._settle_global_step()  # no meta: the state's step (its load_model replaced the state)
        trainer._settle_loaded_epoch()
        trainer.logger.continue_run()
        return trainer

    def predict(self, data: Any = REQUIRED, *, batch_size: int | None = None, which: str = "current",
                steps: int | None = None, **unknown: Any) -> Any:
        """The model's outputs on ``data`` in eval mode, stacked over batches (numpy arrays, in
        the structure the model returns). Each output is stacked along its first axis, which
        holds one row per example: a scalar is refused at its batch, naming it; one of other rows
        (per-token rows, or a prior's parameters, which would come back once per batch) is
        stacked as it is, with a warning naming it; one whose other dimensions differ from the
        first batch's is refused at that batch (bucketed sequence lengths: pad to one length, or
        call predict once per length).

        ``data``: a loader (its batches' first element, or the first ``len(exmp_input)`` for a
        model of several inputs, or the whole batch when it is not a tuple, is what the model
        takes), or an array / a tuple of arrays with ``batch_size``; data shaped as ``exmp_input`` without
        its batch axis (one example, ``x[0]``) is refused: pass ``x[:1]``. An ``exmp_input`` that is a
        whole ``(inputs, labels)`` batch, of which a ``run_model_init`` of yours gave the model the
        inputs (the UvA guide's classifier), counts as those inputs.
        ``which``: ``"current"`` (the trainer's state now: after ``train_model``, the model as
        training left it, with or without a ``test_loader``), ``"best"`` or ``"last"`` (that
        checkpoint, restored for this call; ``self.state`` is not changed). One jitted call per
        batch (the shorter last batch compiles once); outputs are copied to the host as they
        are made and read once at the end.

        ``steps``: the number of batches to take (Keras' ``steps``, Lightning's
        ``limit_predict_batches=N``), a whole number >= 1; ``None`` (the default) takes the whole
        loader. A loader that never ends (an endless generator) needs it: without it predict would
        never return.

        Examples:
            >>> logits = trainer.predict(x_test, batch_size=256, which="best")   # doctest: +SKIP
            >>> first = trainer.predict(endless_batches(), steps=10)            # doctest: +SKIP
        """
        loader = checked_loader(self, "predict", data, batch_size, unknown, steps)
        state = self._state_for(which)
        refuse_deleted_arrays(state, f"{type(self).__name__}.predict")  # shared with a trainer that trained since
        if getattr(self, "_predict_step", None) is None:
            precision = getattr(step_owner(self.eval_step), "precision", "fp32")  # as validation computes
            self._predict_step = jax.jit(functools.partial(_forward, precision=precision))
        outputs, examples, warned = [], as_input_list(self.exmp_input)[: self._input_count], set()
        for i, batch in enumerate(loader):
            inputs = _model_inputs(batch, self._input_count)
            if i == 0:
                _check_like_example(inputs, examples, self._whole_batch_hint())
                if self.options.check_batches:  # arrays: their whole shape (one example, x[0], is refused)
                    arrays = loader.loader if isinstance(loader, StepsOf) else loader
                    whole = _model_inputs(arrays.data, self._input_count) if isinstance(arrays, ArrayLoader) else None
                    _check_input_shapes(self._predict_step, state, inputs, examples, whole=whole)
            try:
                out = self._predict_step(state, inputs)
            except TypeError as exc:  # e.g. labels given as a second input: "got multiple values for argument"
                if i == 0 and self._whole_batch_hint():
                    exc.add_note(self._whole_batch_hint())
                raise
            _check_per_example(out, inputs, warned)  # shapes only: no wait for the device
            if outputs:
                _check_stackable(outputs[0], out, i, stackable)
            else:
                stackable = _trailing_shapes(out)
            with deliberate_reads():
                for leaf in jax.tree.leaves(out):
                    leaf.copy_to_host_async()
            outputs.append(out)
        if not outputs:
            raise ValueError("predict's data yielded no batches: check its size and batch_size.")
        return jax.tree.map(lambda *parts: np.concatenate(parts), *jax.device_get(outputs))

    def test(self, data: Any = REQUIRED, *, batch_size: int | None = None, which: str | None = None,
             name: str | None = None, steps: int | None = None, **unknown: Any) -> dict[str, float]:
        """Evaluate a model on ``data`` as ``train_model(..., test_loader=...)`` does: ``test/...``
        metrics, logged, saved to ``metrics/test.json`` and returned; callbacks hear ``on_test_end``.
        ``data`` as in :meth:`predict` (with labels: ``(x, y)`` plus ``batch_size``).

        ``which``: ``"best"`` or ``"last"`` tests that checkpoint (asked for by name on a trainer with
        checkpointing off: an error, as in :meth:`predict`; by default there: the current state, said once),
        restored for the test only, as :meth:`predict` restores it: the trainer is left as it was
        (``state``, ``global_step``, what :meth:`predict` serves by default and what a next
        ``train_model`` continues from, as Keras' ``evaluate``); ``"current"`` tests the state as it
        is. Default: ``"current"`` for a trainer from :meth:`load_from_checkpoint` (the checkpoint it
        loaded), else ``"best"`` (as Lightning's ``trainer.test()`` after ``fit``).

        ``name``: tells test sets apart (letters, digits, ``_``, ``-``): ``name="shifted"`` gives
        ``test_shifted/...`` metrics (their own columns in ``metrics.csv``) saved to
        ``metrics/test_shifted.json``. A result file is never overwritten: a second test under the
        same name (the run's ``test_loader`` counts as the first) is saved as ``metrics/test.2.json``
        (``test_shifted.2.json``, ...), with the same keys, and said.

        ``steps``: the number of batches to test on (Keras' ``evaluate(..., steps=N)``, Lightning's
        ``limit_test_batches=N``), a whole number >= 1; ``None`` (the default) tests the whole
        loader. A loader that never ends (an endless generator) needs it. The metrics are the
        means over the batches taken, and an info line says how many that was.

        Examples:
            >>> trainer.test((x_test, y_test), batch_size=256)                     # doctest: +SKIP
            >>> trainer.test((x_shifted, y_shifted), batch_size=256, name="shifted")   # doctest: +SKIP
            {'test_shifted/loss': 0.31, 'test_shifted/acc': 0.88}
            >>> trainer.test(endless_batches(), steps=100)                         # doctest: +SKIP
        """
        loader = checked_loader(self, "test", data, batch_size, unknown, steps)
        if which is None:
            which = "current" if self._loaded and not self._trained_here else "best"
        elif which in ("best", "last") and self._saves_no_checkpoints():  # asked for by name: as predict(which=...)
            raise FileNotFoundError(self._no_checkpointing_message(which))
        return self._test(loader, which, name=name)

    def _test(self, test_loader, which: str = "best", name: str | None = None) -> dict[str, float]:
        """Evaluate the ``which`` checkpoint (when there is one) on ``test_loader``: ``<stem>/...``
        metrics, logged at the run's step and saved; ``on_test_end`` callbacks see the tested model.
        The checkpoint is restored for the test only (through ``load_model``: a seam of the user's; a
        ``save_model`` writing checkpoints of its own, the UvA guide's, has the best restored by its
        ``load_model()``): ``self.state`` and ``global_step`` are put back afterwards, so the trainer
        (what ``predict()`` serves, what a next ``train_model`` continues from) is as it was."""
        if which not in ("current", "best", "last"):
            raise ValueError(f"which must be 'current', 'best' or 'last'; got {which!r}.")
        stem = _test_stem(name)
        self._check_records_folder("test results")  # before loading anything: a folder in use is refused
        kept, step, count = self.state, self.global_step, self._step_count
        try:
            self._restore_for_test(which)
            self._live_state("test")  # shared with a trainer that trained since: said before anything is written
            self.global_step = step  # the test's records are the run's, at its step
            steps_of = test_loader if isinstance(test_loader, StepsOf) else None  # test(steps=N)
            if self.options.fast_dev_run:  # a smoke test: the test loader's first batches too, as Lightning's
                test_loader = FirstBatches(test_loader, 1 if self.options.fast_dev_run is True else self.options.fast_dev_run)
            test_metrics = self.eval_model(test_loader, log_prefix=f"{stem}/")
            if steps_of is not None:  # what the metrics cover
                messages.info(f"test(steps={steps_of.n}) tested {steps_of.taken} batch"
                              f"{'es' if steps_of.taken != 1 else ''}: the {stem}/... metrics are their means.")
            try:  # the run folder's lock is held while the records are written, not during the evaluation
                with self._writing_records("test results"):
                    self._log(test_metrics)
                    self.save_metrics(self._unused_metrics_name(stem), test_metrics)
            except runfiles.RunInUseError as busy:  # taken since the evaluation began: its result is said
                raise runfiles.RunInUseError(f"{busy} The test ran meanwhile; its metrics, not written: "
                                             f"{test_metrics}.", busy.log_dir, busy.pid, busy.host) from None
            self._call_callbacks("on_test_end", test_metrics)  # with the tested model, as in Lightning
        finally:
            self.state, self.global_step, self._step_count = kept, step, count
        return test_metrics

    def _restore_for_test(self, which: str) -> None:
        """``self.state`` := the ``which`` checkpoint (none saved, or ``"current"``: left as it is)."""
        if which != "current":  # another trainer may have continued the run since: its checkpoints as they are now
            self._checkpoints_now("The test")
        source = self._checkpoint_source()
        if which != "current" and self._saves_no_checkpoints():
            if not getattr(self, "_said_tests_current", False) and self._trained_here:
                messages.warning(f"Testing the model as training left it, not the {which} checkpoint: "
                                 f"{self._no_checkpointing_reason()}, so none was kept (the val/... metrics "
                                 f"train_model returns are its best validation's). Pass which='current' to say so, "
                                 f"or turn checkpointing on to test the {which} model.")
                self._said_tests_current = True
        elif which != "current" and self.own_checkpoints and not source.all_steps():
            self._load_own_best(which, "the test")
        elif which != "current" and source.all_steps():
            own_load = not is_flaxlights_own(type(self).load_model)  # a seam of the user's
            if self.state.opt_state is None and not own_load:  # loaded for inference: served as loaded (the EMA)
                self.state = self._state_for(which).replace(opt_state=None)
            elif source is not self.checkpointer:  # loaded from another run's folder, with its optimizer
                self.state = resume.load_with_fallback(source, self.state, which)[0]
            else:
                source.wait()
                self._load_for_resume(None if which == "best" else resume.pick_checkpoint(source, which),
                                      purpose="the test")  # None: the best, by load_model()

    def _unused_metrics_name(self, stem: str) -> str:
        """``stem``, or ``stem.2``, ``stem.3``, ... when ``metrics/<stem>.json`` holds an earlier
        result (said): a test never overwrites another's file."""
        if self.log_dir is None or not dist.is_main_process():
            return stem
        folder, name, number = os.path.join(self.log_dir, runfiles.METRICS_DIR), stem, 1
        while os.path.exists(os.path.join(folder, f"{name}.json")):
            number += 1
            name = f"{stem}.{number}"  # not "_": test(name="2") is test_2
        if name != stem:
            hint = "" if stem != "test" else " Name test sets with test(..., name='shifted'): test_shifted/... metrics."
            messages.info(f"metrics/{stem}.json holds an earlier test's metrics: this one's ({stem}/...) are saved "
                          f"to metrics/{name}.json.{hint}")
        return name

    def export(self, path: str | os.PathLike, *, which: str | None = None, batch_size: int | None = None,
               platforms: str | Sequence[str] | None = None, precision: str | None = None) -> str:
        """Write the model's eval-mode forward pass with its trained variables to the folder
        ``path`` as a ``jax.export`` artifact that serves without flaxlight (see
        :mod:`flaxlight.export`); returns the file written.

        ``which``: ``"best"``, ``"last"`` or ``"current"``, as in :meth:`test`. Default:
        ``"current"`` for a trainer from :meth:`load_from_checkpoint` (the checkpoint it loaded,
        as :meth:`predict` and :meth:`test` use it), else ``"best"``.
        The inputs are shaped like the trainer's ``exmp_input`` with any batch size, or exactly
        ``batch_size`` (a whole number >= 1) when given (for a model whose shapes cannot be symbolic).
        ``platforms``: what the artifact is lowered for, any of ``"cpu"``, ``"cuda"``, ``"rocm"``,
        ``"tpu"`` (one or several; lowering for one needs no such device); default: the platform
        exporting. An artifact runs only on a platform it was lowered for, so a model trained on a
        GPU and served on CPUs is exported with ``platforms=("cpu", "cuda")``.
        ``precision``: ``"bf16"`` or ``"fp32"``; default: the run's, as :meth:`predict` and
        validation compute (``"bf16"``: bfloat16 parameters and inputs, float32 outputs).
        ``export.json`` records ``which``, the step, ``platforms`` and ``precision``. When the
        default picks a checkpoint other than the trainer's state now (after training, the best
        model of an earlier step), an info line says which, and ``which="current"`` exports the
        model as it is, as :meth:`predict` uses it by default.

        The variables are baked into the artifact, behind an optimization barrier so that XLA
        computes with them as the jitted :meth:`predict` does instead of folding them as
        constants: on the same machine its outputs equal ``predict()``'s (bitwise on CPU in the
        tests, fp32 and bf16); separately compiled programs are not promised to agree beyond
        float32 rounding (about 1e-6 relative), e.g. on another platform or batch size.
        An ``exmp_input`` set since the trainer was built, which the model's parameters do not fit,
        is a ``ValueError`` naming its shape, the shape the trainer was built from and, for a Linen
        model, the parameters that differ.

        Examples:
            >>> trainer.export("export")                                              # doctest: +SKIP
            >>> trainer.export("export_any", platforms=("cpu", "cuda"))             # doctest: +SKIP
            >>> exported = jax.export.deserialize(open("export/model.jax_exported", "rb").read())  # doctest: +SKIP
            >>> exported.call(x_test)                                                 # doctest: +SKIP
        """
        from flaxlight.export import export_forward

        defaulted = which is None
        if which is None:  # test()'s rule: a loaded trainer serves the checkpoint it loaded
            which = "current" if self._loaded and not self._trained_here else "best"
        precision = getattr(step_owner(self.eval_step), "precision", "fp32") if precision is None else precision
        if precision not in PRECISIONS:
            raise ValueError(f"export's precision must be one of {PRECISIONS} or None (the run's); got {precision!r}.")
        try:
            state = self._state_for(which)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc} export(which={which!r}) needs a saved checkpoint; pass which='current' "
                                    f"to export the trainer's state now.") from None
        refuse_deleted_arrays(state, f"{type(self).__name__}.export")
        step = int(np.asarray(state.step))
        if defaulted:
            self._say_if_not_current(which, step)
        example = _model_inputs(self.exmp_input, self._input_count)
        info = {"which": which, "step": step, "precision": precision,
                "model": getattr(self.model_class, "__name__", type(self.model_adapter).__name__),
                "flaxlight": _version()}
        forward = functools.partial(_exported_forward, state, precision=precision)
        options = {"batch_size": batch_size, "info": info, "platforms": platforms}
        try:
            if len(example) == 1:  # one input: the artifact is called as f(x)
                return export_forward(lambda x: forward((x,)), example[0], path, **options)
            return export_forward(forward, example, path, several_inputs=True, **options)
        except MODEL_FIT_ERRORS as exc:
            message = self._unfit_exmp_input_message(forward, state, example, exc)
            if message is None:  # exmp_input is as the trainer was built: the model's own error
                raise
            raise ValueError(message) from exc

    def _say_if_not_current(self, which: str, step: int) -> None:
        """An info line when export's default (``which``, after training: ``"best"``) writes a
        checkpoint of another step than the trainer's state, which ``predict()`` uses by default."""
        now = int(np.asarray(self.state.step))
        if which != "current" and step != now:
            messages.info(f"export: writing the {which} checkpoint (step {step}), export's default after training "
                          f"(the model test() uses), not the trainer's current state (step {now}), which predict() "
                          f"uses by default. trainer.export(path, which='current') exports the current state.")

    def _unfit_exmp_input_message(self, forward, state, example: tuple, exc: Exception) -> str | None:
        """Why export failed when ``trainer.exmp_input`` was set since the trainer was built (its
        shapes then: :meth:`_init_variables`) and the model (``forward``) cannot take it: its shapes
        now and then, the parameters that differ (a Linen model's, shaped from its input), the
        model's error, and the way on. None when ``exmp_input`` is shaped as it was (the model's own
        error) or the model takes it (the error is another one's: a symbolic batch size)."""
        built, now = getattr(self, "_built_from", None), shapes_text(as_input_list(self.exmp_input))
        if built is None or built == now:
            return None
        try:
            jax.eval_shape(forward, example)  # shapes only
            return None
        except Exception:  # noqa: BLE001 - the model cannot be called on exmp_input: said below
            pass
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        differ = list(_parameter_differences(self.model_adapter, state.params, example).items())
        shown = "".join(f"\n  params/{where}: {'missing' if got is None else got} in the trainer, "
                        f"{'missing' if want is None else want} from this exmp_input"
                        for where, (got, want) in differ[:5])
        more = f"\n  ... and {len(differ) - 5} more" if len(differ) > 5 else ""
        why = f"its parameters would be shaped otherwise:{shown}{more}\nThe model's error: {error}" if shown else \
            f"the model's error: {error}"
        return (f"export traces the model on inputs shaped like trainer.exmp_input, now {now}, but the trainer's "
                f"model and its parameters were built from an exmp_input that was {built}, and they do not fit the "
                f"new one; {why}\nSet trainer.exmp_input back to one batch of the model's inputs shaped as when the "
                f"trainer was built, batch axis first (e.g. x[:1]): the artifact takes that shape with any batch "
                f"size. To serve inputs of another shape to a model whose parameters do not depend on it (a "
                f"sequence's length), load the run with such an exmp_input: "
                f"{type(self).__name__}.load_from_checkpoint(run, exmp_input=x_new[:1]), and export that trainer.")

    @property
    def _input_count(self) -> int:
        """How many inputs the model takes: ``exmp_input``'s (a tuple / list holds several), or the
        first of them a ``run_model_init`` of the user's gave the model (:meth:`_init_variables`)."""
        return getattr(self, "_model_input_count", None) or len(as_input_list(self.exmp_input))

    def _init_variables(self, exmp_inputs: list, init_rng) -> dict:
        """``run_model_init``'s variables. For a Linen ``run_model_init`` of the user's and an
        ``exmp_input`` of several elements, which of them it gave the model is noted: the UvA guide's
        classifier passes a whole ``(imgs, labels)`` batch and unpacks ``imgs, _ = exmp_input``, so
        ``predict`` and ``export`` feed the model ``imgs`` only (:func:`_inputs_given`)."""
        self._model_input_count, self._built_from = None, shapes_text(exmp_inputs)  # export's check
        if is_flaxlights_own(type(self).run_model_init) or self.model_adapter.kind != "linen" or len(exmp_inputs) < 2:
            return self.run_model_init(exmp_inputs, init_rng)
        calls = []

        def note_first_call(next_fun, args, kwargs, context):  # the model's own method, entered first
            if not calls and context.method_name != "setup":
                calls.append((args, kwargs))
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(note_first_call):
            variables = self.run_model_init(exmp_inputs, init_rng)
        self._model_input_count = _inputs_given(exmp_inputs, *calls[0]) if calls else None
        return variables

    def _whole_batch_hint(self) -> str:
        """What to do when ``exmp_input`` may be a whole ``(inputs, labels)`` batch that flaxlight
        could not split (its elements all taken as model inputs); "" when that cannot be it."""
        count = len(as_input_list(self.exmp_input))
        if count < 2 or self._input_count < count or is_flaxlights_own(type(self).run_model_init):
            return ""
        return (f"exmp_input holds {count} elements, all taken as the model's inputs, as flaxlight could not tell "
                f"which of them {type(self).__name__}.run_model_init gives the model. If exmp_input is a whole batch "
                f"with labels (the UvA guide's classifier passes next(iter(train_loader)) and unpacks imgs, _ = "
                f"exmp_input), pass the model's inputs only, e.g. exmp_input=batch[:1] (a list of one array, as the "
                f"guide's regression example does), and unpack just those in run_model_init.")

    @property
    def model(self):
        """The model: the Linen module (its variables are in ``state``), or for NNX a live module
        with the weights of this moment (:meth:`bind_model`, in eval mode). An NNX module is a new
        one at each access: take it again after training, as training reuses the old one's arrays.

        Examples:
            >>> trainer.model.head.kernel[...]  # NNX: the trained weights  # doctest: +SKIP
        """
        if "_model" in vars(self):  # set by the user's code (``self.model = ...``): theirs
            return self._model
        adapter = self.model_adapter
        if adapter.kind == "nnx" and getattr(self, "state", None) is not None:
            return self.bind_model()
        return adapter.module

    @model.setter
    def model(self, model) -> None:
        self._model = model

    def bind_model(self):
        """The model with the trained variables, for interactive use: ``model(x, train=False)``."""
        return self.model_adapter.bind(self._serving(self.state).variables())

    def _checkpoint_source(self):
        """Where ``which="best"/"last"`` are found: this run's checkpoints, or, for a trainer from
        :meth:`load_from_checkpoint` logging to another folder that has not trained since, the loaded run's."""
        trained = self._trained_here  # its own training since: never the loaded run's checkpoints
        return self.checkpointer if self._loaded_from is None or trained or self.checkpointer.all_steps() \
            else self._loaded_from

    def _state_for(self, which: str):
        """The state ``which`` names, with the parameters evaluation uses (:func:`_served`)."""
        if which == "current":
            return self._serving(self.state)
        if which not in ("best", "last"):
            raise ValueError(f"which must be 'current', 'best' or 'last'; got {which!r}.")
        checkpoints = self._checkpoint_source()
        if self.own_checkpoints and not checkpoints.all_steps():  # the UvA guide's pair: the best by load_model()
            return self._serving(self._own_best_state(which))
        if self._saves_no_checkpoints():  # checkpointing off: not "no model yet"
            raise FileNotFoundError(self._no_checkpointing_message(which))
        checkpoints.wait()
        step = resume.pick_checkpoint(checkpoints, which)
        template = self.state
        if template.opt_state is None and template.tx is not None:  # loaded for inference: its optimizer's shape
            template = template.replace(opt_state=template.tx.init(template.params))
        with_ema = ema_params(template) is not None  # the checkpoint's optimizer state holds the average
        restored = checkpoints.restore(template if with_ema else self.state, step=step, with_opt_state=with_ema)
        return self._serving(restored)

    def _saves_no_checkpoints(self) -> bool:
        """Whether this trainer keeps no checkpoint (checkpointing off, or ``fast_dev_run``) and has none."""
        checkpoints = self._checkpoint_source()
        if checkpoints is not self.checkpointer or getattr(self, "_checkpoint_callback", None) is not None \
                or self.own_checkpoints:
            return False
        checkpoints.wait()
        return not checkpoints.all_steps()

    def _no_checkpointing_reason(self) -> str:
        return (f"fast_dev_run={self.options.fast_dev_run!r} writes no checkpoint" if self.options.fast_dev_run else
                "checkpointing is off for this trainer (enable_checkpointing=False, and no ModelCheckpoint among its "
                "callbacks)")

    def _no_checkpointing_message(self, which: str) -> str:
        """Why ``which="best"/"last"`` has no checkpoint on a trainer that saves none, and what to use."""
        why = self._no_checkpointing_reason()
        return (f"No {which!r} checkpoint: {why}, so no best or last model is saved to load. Use which='current' "
                f"(the trainer's state now: the model as training left it), or turn checkpointing on "
                f"(enable_checkpointing=True, or callbacks=[ModelCheckpoint(...)]) and train to keep them.")

    def _own_best_state(self, which: str):
        """The best model a ``save_model`` of the user's wrote, restored by its ``load_model()`` for
        this call (``self.state`` and ``global_step`` are left as they were)."""
        kept, step = self.state, self.global_step
        try:
            self._load_own_best(which, f"predict / export with which={which!r}")
            return self.state
        finally:
            self.state, self.global_step = kept, step

    def _serving(self, state):
        """``state`` with the parameters the eval step uses: :func:`_served`, unless the trainer's
        :class:`~flaxlight.TrainStep` was built with ``eval_with_ema=False``."""
        return _served(state) if getattr(step_owner(self.eval_step), "eval_with_ema", True) else state


def _same_settings(first: Any, second: Any) -> bool:
    try:
        return bool(first == second)
    except Exception:  # noqa: BLE001 - objects without a plain equality: taken as different
        return False


def _keeps_ema(optimizer_hparams: Any) -> bool | None:
    """Whether a run's optimizer settings keep a moving average of the parameters (``ema_decay``);
    None when they cannot be read back (a function of the user's, recorded by name)."""
    try:
        config = as_optimizer_config(optimizer_hparams)
    except Exception:  # noqa: BLE001 - settings this flaxlight cannot read
        return None
    return None if config is None else config.ema_decay is not None


@contextlib.contextmanager
def _quiet_step_check(quiet: bool):
    """The run's own optimizer, built only to restore its average: the checks of its settings
    against the train step (made from the settings given) are not this load's to say."""
    if not quiet:
        yield
        return
    level = messages.level
    messages.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        messages.setLevel(level)


def _inputs_given(examples: list, args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """How many leading elements of ``exmp_input`` (``examples``) the model's first call at init got
    (positional or by keyword): the same objects, else (traced, e.g. under ``jax.jit``) values of
    the same structure, shapes and dtypes. None when that is all of them, none, or not the first few."""
    given = [*args, *kwargs.values()]

    def signature(value):
        return jax.tree.structure(value), [(np.shape(x), getattr(x, "dtype", type(x))) for x in jax.tree.leaves(value)]

    same = [i for i, example in enumerate(examples) if any(value is example for value in given)]
    try:  # an input converted on the way (jnp.asarray(t)) is the same example by its shape and dtype
        alike = [i for i, example in enumerate(examples) if any(signature(v) == signature(example) for v in given)]
    except Exception:  # noqa: BLE001 - values numpy cannot shape: not known
        alike = []
    used = sorted(set(same) | set(alike))
    if len(used) > len(given):  # more examples look alike than the model got values: trust the same objects
        used = same
    return len(used) if used and used == list(range(len(used))) and len(used) < len(examples) else None


def _check_like_example(inputs: tuple, examples: list, hint: str = "") -> None:
    """Fail with a readable message when predict's inputs are not structured as ``exmp_input``
    (e.g. dict batches ``{"x", "y"}`` for a model of one array, one array for a model of two);
    ``hint``: what to do when ``exmp_input`` may be a whole batch with labels."""
    want, got = [jax.tree.structure(x) for x in examples], [jax.tree.structure(x) for x in inputs]
    if want == got:
        return
    if len(examples) == 1:
        fix = "e.g. trainer.predict(x, batch_size=256) (for dict batches: [batch['x'] for batch in batches])"
        takes = "the whole batch, or the first element of a tuple batch (the rest, e.g. labels, left out)"
    else:
        names = ", ".join(f"x{i}" for i in range(len(examples)))
        fix = f"as one tuple of its {len(examples)} inputs: trainer.predict(({names}), batch_size=256)"
        takes = f"the first {len(examples)} elements of each tuple batch (the rest, e.g. labels, left out)"
    plural = "s" * (len(examples) > 1)
    advice = f"{hint} If the model does take {len(examples)} inputs, pass them {fix}." if hint else \
        f"Give predict the model's inputs only, {fix}."
    raise TypeError(f"predict feeds the model {takes}; the model takes {len(examples)} input{plural} like exmp_input: "
                    f"{_describe_inputs(examples)}, but predict's batches give {len(inputs)}: "
                    f"{_describe_inputs(inputs)}. {advice}")


def _describe_inputs(inputs) -> str:
    """``"an array of shape (64, 8), a dict with keys ['a', 'b']"``: what each input is, readably."""
    def describe(value) -> str:
        if hasattr(value, "shape"):
            return f"an array of shape {tuple(np.shape(value))}"
        if isinstance(value, Mapping):
            return f"a dict with keys {sorted(map(str, value))}"
        if isinstance(value, (tuple, list)):
            return f"a {type(value).__name__} of {len(value)}"
        return f"a {type(value).__name__}"

    return "; ".join(describe(value) for value in inputs)


def _check_input_shapes(forward, state, inputs: tuple, examples: list, whole: tuple | None = None) -> None:
    """Fail with flaxlight's shape message (as ``test()`` does for its batches) when predict's first
    batch is shaped unlike ``exmp_input`` in any dimension but the batch axis and the model cannot
    take it (traced, shapes only: a model of variable sizes is given what it takes). Data shaped as
    ``exmp_input`` without its batch axis (``whole``: all of predict's arrays, else the first batch)
    is refused before the model runs, even when it traces (an RNN takes unbatched sequences); one
    dimension fewer and the same trailing dimensions otherwise is warned of when it traces."""
    _refuse_missing_batch_axis(inputs if whole is None else whole, examples)
    for i, (given, example) in enumerate(zip(inputs, examples)):
        pairs = zip(jax.tree_util.tree_leaves_with_path(given), jax.tree.leaves(example))
        for (path, leaf), want_leaf in pairs:
            got, want = tuple(np.shape(leaf)), tuple(np.shape(want_leaf))
            if len(got) == len(want) and got[1:] == want[1:]:
                continue
            where = f"{f'[{i}]' if len(examples) > 1 else ''}{jax.tree_util.keystr(path)}"
            try:
                jax.eval_shape(forward, state, inputs)
            except Exception as exc:  # noqa: BLE001 - the model's own error, shown under ours
                raise ValueError(_shape_message(where, got, want, exc)) from exc
            if len(got) == len(want) - 1 and got[1:] == want[2:]:
                warnings.warn(f"predict's data{where} has one dimension fewer than exmp_input{where} {want}: its "
                              f"batches have shape {got}. If it is one example without its batch axis (x[0]), predict "
                              f"cuts it into rows of shape {want[2:]} and the model takes each batch of rows as one "
                              f"input: pass x[None] or x[:1] instead. (A model that takes inputs of this rank: "
                              f"ignore this, or check_batches=False.)", UserWarning, stacklevel=3)
            return


def _refuse_missing_batch_axis(data: tuple, examples: list) -> None:
    """A clear error when predict's data (an input, or a leaf of one) is shaped exactly as
    ``exmp_input``'s without its batch axis: one example, ``x[0]``, which predict would cut along
    its first axis into batches of rows, silently wrong for a model that takes unbatched inputs. A
    one-element example (``(1,)`` where ``exmp_input`` is ``(1, 1)``) is as well a batch of one value:
    not refused (the looser check warns)."""
    for i, (given, example) in enumerate(zip(data, examples)):
        for (path, leaf), want_leaf in zip(jax.tree_util.tree_leaves_with_path(given), jax.tree.leaves(example)):
            got, want = tuple(np.shape(leaf)), tuple(np.shape(want_leaf))
            if want and got == want[1:] and int(np.prod(got)) > 1:  # (1,) for (1, 1): as well one value each row
                where = f"{f'[{i}]' if len(examples) > 1 else ''}{jax.tree_util.keystr(path)}"
                raise ValueError(
                    f"predict's data{where} has shape {got}: exmp_input{where}'s shape {want} without its batch axis, "
                    f"i.e. one example (x[0]) rather than a batch of them. predict takes the first axis as the batch "
                    f"axis: it would cut the example into rows of shape {want[2:]} and give the model batches of "
                    f"those. Pass one example as x[:1] or x[None] (shape {(1, *got)}). (check_batches=False skips "
                    f"this check.)")


def _shape_message(where: str, got: tuple, want: tuple, exc: Exception) -> str:
    expected = "(N" + "".join(f", {d}" for d in want[1:]) + ")"
    hint = ""
    if len(got) == len(want) - 1 and got[1:] == want[2:]:
        hint = (f" The data seems to lack the batch axis: pass one example as x[:1] or x[None] (shape "
                f"{(1,) + want[1:]}), not x[0] (shape {want[1:]}), which predict splits into rows of shape {want[2:]}.")
    return (f"predict's data does not fit the model: its batches' input{where} has shape {got}, but the model was "
            f"initialised with exmp_input{where} of shape {want}; all dimensions but the first (the batch axis) "
            f"must match: expected {expected}.{hint} (The model, traced on it: {type(exc).__name__}: {str(exc)[:200]})")


def _check_per_example(out: Any, inputs: Sequence[Any], warned: set) -> None:
    """``predict`` stacks each output of the model (one of ``out``'s leaves) over the batches along
    its first axis. A scalar cannot be stacked: a clear error naming it. One whose leading
    dimension is not the batch's is stacked as it is, with a warning naming it (once per call and
    output; ``warned`` holds those said): right for rows that are not examples (per-token rows,
    ``(B*T, V)``), wrong for a value that is the same for every batch (a prior's parameters, which
    come back once per batch). Shapes only (no device wait)."""
    rows = {np.shape(leaf)[:1] for leaf in jax.tree.leaves(out)}
    first_input = jax.tree.leaves(inputs)[:1]
    if first_input and rows == {np.shape(first_input[0])[:1]} != {()}:  # the usual case, at a set's cost
        return
    try:
        examples = examples_in(list(inputs))
    except ValueError:  # no leading dimension to go by: nothing to check against
        examples = None
    for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        shape, where = tuple(np.shape(leaf)), jax.tree_util.keystr(path)
        if not shape:
            raise ValueError(
                f"predict: the model's output{where} is a scalar (shape ()): predict stacks each output over the "
                f"batches along its first axis, and a scalar has no rows to stack. Return per-example values from "
                f"the model (e.g. a loss term per example, not its batch mean), and compute what is not per example "
                f"(a batch statistic) outside predict, e.g. from trainer.bind_model() or trainer.state.params.")
        if examples is not None and shape[0] != examples and where not in warned:
            warned.add(where)
            warnings.warn(
                f"predict: the model's output{where} has shape {shape}, and the batch has {examples} examples: "
                f"predict stacks each output over the batches along its first axis, so its {shape[0]} rows per batch "
                f"are stacked as they are. Right for rows that are not examples (per-token rows); a value that is the "
                f"same for every batch (a prior's parameters) would come back once per batch: compute it outside "
                f"predict, e.g. from trainer.bind_model() or trainer.state.params.", UserWarning, stacklevel=3)


def _trailing_shapes(out: Any) -> list:
    """Each output's shape beyond the batch dimension (what stacking over batches needs equal)."""
    return [np.shape(leaf)[1:] for leaf in jax.tree.leaves(out)]


def _check_stackable(first: Any, out: Any, index: int, expected: list) -> None:
    """A clear error, at the batch where it happens, when an output's shape beyond the batch
    dimension differs from the first batch's (``expected``: :func:`_trailing_shapes` of ``first``;
    sequences of another length, bucketed): ``predict`` could not stack them at the end, after
    computing every batch. Shapes only (no device wait)."""
    if _trailing_shapes(out) == expected:
        return
    for (path, was), now in zip(jax.tree_util.tree_leaves_with_path(first), jax.tree.leaves(out)):
        if np.shape(was)[1:] != np.shape(now)[1:]:
            raise ValueError(
                f"predict: the model's output{jax.tree_util.keystr(path)} has shape {np.shape(now)} in batch "
                f"{index} and {np.shape(was)} in batch 0: predict stacks the batches' outputs into one array, so "
                f"they must agree beyond the batch dimension. Batches of several sequence lengths (bucketing) give "
                f"such outputs: pad the inputs to one length for predict, or call predict once per length.")
    raise ValueError(f"predict: the model's outputs in batch {index} have another structure than in batch 0 "
                     f"({jax.tree.structure(out)} vs {jax.tree.structure(first)}): predict stacks them, so every "
                     f"batch must give the same outputs.")


def _exported_forward(state, inputs, *, precision: str = "fp32"):
    """:func:`_forward` for an artifact, whose variables are closed over (constants of its program):
    they pass an optimization barrier first, so that XLA computes with them as it does with the
    arguments of the jitted predict / eval step instead of folding them into the constants of
    another computation (which differed from ``predict()`` by float32 rounding, 2e-7..5e-7)."""
    params, batch_stats = jax.lax.optimization_barrier((state.params, state.batch_stats))
    return _forward(state.replace(params=params, batch_stats=batch_stats), inputs, precision=precision)


def _parameter_differences(adapter, params, example: tuple) -> dict[str, tuple]:
    """``{path: (the trainer's shape, the shape example gives)}`` of a Linen model's parameters
    that ``example`` (its inputs) would shape otherwise (traced, shapes only); empty for an NNX
    model (its sizes come from model_hparams) or one whose init fails on ``example``."""
    if adapter.kind != "linen":
        return {}
    try:
        wanted = jax.eval_shape(lambda: adapter.init(jax.random.key(0), list(example)))["params"]
    except Exception:  # noqa: BLE001 - the model cannot even be initialised on it: the model's error says why
        return {}
    return param_differences(flat_shapes(params), flat_shapes(wanted))


def _forward(state, inputs, *, precision: str = "fp32"):
    """Eval-mode outputs, computed as the eval step computes them (:func:`computing_state`): with
    ``precision="bf16"`` on bfloat16 copies of the parameters and inputs, the bfloat16 outputs
    returned as float32."""
    state, params = computing_state(state, precision)
    return state.apply_model(params, *inputs, train=False)[0]


def _served(state):
    """``state`` with the parameters evaluation uses: their moving average when the optimizer keeps
    one (``ema_decay``; as :meth:`flaxlight.TrainStep.eval_step`), else its own."""
    averaged = ema_params(state) if state.opt_state is not None else None
    return state if averaged is None else state.replace(params=averaged)
