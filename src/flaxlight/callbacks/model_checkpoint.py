"""``ModelCheckpoint``: which checkpoints to write and which to keep (best k + last)."""

from __future__ import annotations

import difflib
import inspect
import math
import os
import re
import time
import warnings
from typing import Any, Mapping

from flaxlight.callbacks.base import Callback, check_mode, refuse_keras_arguments
from flaxlight.options import MetricNotLoggedError, rank_key, warn_if_mode_contradicts_name

__all__ = ["ModelCheckpoint"]

# Lightning's ModelCheckpoint arguments and attributes that flaxlight spells otherwise or has not.
_LIGHTNING_ARGUMENTS = {
    "every_n_train_steps": "every_n_steps={value!r}",
    "every_n_val_epochs": "every_n_epochs={value!r}",
    "train_time_interval": "every_n_seconds=<seconds> (a timedelta's .total_seconds())",
    "dirpath": "checkpoints are written to <log_dir>/checkpoints/<step>/: choose the run's folder with the "
               "trainer's logger_params={{'log_dir': {value!r}}} (its checkpoints then go to {value}/checkpoints), "
               "or {{'base_log_dir': ...}}",
    "filename": "checkpoints are named by their step, <log_dir>/checkpoints/<step>/, with no file-name template; one "
                "saved for its score carries it as orbax metrics, and the best validation's metrics are in "
                "<log_dir>/metrics/best_eval.json (best_model_path and best_model_score name the best after fit)",
    "auto_insert_metric_name": "checkpoints are named by their step, with no file-name template",
    "enable_version_counter": "checkpoints are named by their step: one name per checkpoint, never reused",
    "save_on_train_epoch_end": "a validation's checkpoint is written after that validation, the periodic ones "
                               "(every_n_epochs) at the epoch's end, after its validation; there is no switch",
    "save_weights_only": "a checkpoint holds the whole train state (an exact resume needs it); "
                         "MyTrainer.load_from_checkpoint(...) reads the parameters from it",
    "verbose": "ModelCheckpoint says nothing per save (its checkpoints are the folders of <log_dir>/checkpoints); "
               "flaxlight's messages go to the logging logger 'flaxlight'",
}
_WHERE_CHECKPOINTS_GO = (
    "checkpoints are written to <log_dir>/checkpoints/<step>/, with no file name: choose the run's folder with the "
    "trainer's logger_params={'log_dir': ...}. Keras' ModelCheckpoint(filepath, monitor='val_loss', "
    "save_best_only=True) is ModelCheckpoint(monitor='val/loss', mode='min'), or no callback at all: the default one "
    "keeps the best by the trainer's monitor (MyTrainer(..., monitor='val/loss', mode='min')) and the last, which "
    "resume=True goes on from. Load the best with MyTrainer.load_from_checkpoint(log_dir, exmp_input=x[:1], "
    "which='best')")
# Keras' ModelCheckpoint arguments, and what to write in flaxlight (verbose and save_weights_only: Lightning's too).
KERAS_ARGUMENTS = {
    "filepath": _WHERE_CHECKPOINTS_GO,
    "save_best_only": "the default save_top_k=1 keeps the best checkpoint (by monitor) and save_last=True the last, "
                      "which resume=True goes on from: leave both as they are. save_last=False would keep only the "
                      "best, and a resume would then go on from the best epoch, not from where the run ended. Load the "
                      "best with which='best' (predict, export) or MyTrainer.load_from_checkpoint(log_dir, "
                      "exmp_input=x[:1], which='best')",
    "save_freq": "checkpoints are written after validations (the best) and at epoch ends (the last), as with Keras' "
                 "save_freq='epoch' (drop it); for one every N batches, every_n_steps=N (with save_top_k=-1 to keep "
                 "each)",
    "initial_value_threshold": "flaxlight has none: the first validation's checkpoint is the best until a better "
                               "one comes (checkpoint.best_model_score is the best's value after training)",
}
# What a monitor that is Keras' filepath (given first) ends with: a Keras model or weights file.
_KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")
# Where the trainer's metric names start (a name logged by hooks may start otherwise).
_METRIC_PREFIXES = ("val/", "test/", "train/")
# Keras' filepath template fields: {epoch}, {batch}, or any with a format spec ({val_loss:.2f}).
_TEMPLATE_FIELD = re.compile(r"\{(?:epoch|batch)(?::[^{}]*)?\}|\{[A-Za-z_]\w*:[^{}]*\}")
# The start of a relative or absolute path: ./ ../ ~/ (or with a backslash), /, a Windows drive or share.
_PATH_START = re.compile(r"^(?:\.{1,2}[/\\]|~[/\\]|/|[A-Za-z]:[/\\]|\\\\)")
_LIGHTNING_ATTRIBUTES = {
    "best_k_models": "best_step and best_model_path name the best; the checkpoints kept are the steps in "
                     "trainer.checkpointer.all_steps(), folders <log_dir>/checkpoints/<step>",
    "kth_best_model_path": "the checkpoints kept are the steps in trainer.checkpointer.all_steps(), folders "
                           "<log_dir>/checkpoints/<step>; best_model_path names the best",
    "last_model_path": "last_step is the newest checkpoint's step: <log_dir>/checkpoints/<last_step>",
    "dirpath": "checkpoints are in <log_dir>/checkpoints (trainer.checkpointer.directory)",
    "filename": "checkpoints are named by their step: <log_dir>/checkpoints/<step>",
}


def _looks_like_path(name: Any) -> bool:
    """Whether a monitor ``name`` is a file path (Keras' ``filepath`` given first), never a metric
    name the trainer logs: it does not start as one (``val/``, ``test/``, ``train/``) and has a
    Keras file's suffix (``.keras``, ``.h5``, ``.hdf5``), a field of Keras' name template
    (``{epoch:02d}``, ``{val_loss:.2f}``) or a path's start (``./``, ``../``, ``~/``, ``/``, ``C:\\``).

    Examples:
        >>> [_looks_like_path(name) for name in ("best.keras", "ckpt/{epoch:02d}", "./best", "/tmp/ckpt/")]
        [True, True, True, True]
        >>> [_looks_like_path(name) for name in ("val/loss", "val/f1_{macro}", "val/nll.h5", "ckpts/", "f1.pt")]
        [False, False, False, False, False]
    """
    return (isinstance(name, str) and not name.startswith(_METRIC_PREFIXES)
            and (name.lower().endswith(_KERAS_SUFFIXES) or bool(_TEMPLATE_FIELD.search(name))
                 or bool(_PATH_START.match(name))))


def _keras_filepath(args: tuple, kwargs: Mapping[str, Any]) -> str | None:
    """What the arguments given to ``ModelCheckpoint`` hold of Keras' ``filepath`` (its first
    argument): a file path, first or as ``monitor=``, or a first argument besides ``monitor=``."""
    if args and (_looks_like_path(args[0]) or "monitor" in kwargs):
        return (f"{args[0]!r} as its first argument, which is monitor (the metric that ranks checkpoints, e.g. "
                f"'val/loss'), not Keras' filepath: {_WHERE_CHECKPOINTS_GO}")
    if not args and _looks_like_path(kwargs.get("monitor")):
        return (f"monitor={kwargs['monitor']!r}, a file path (Keras' filepath?), not a metric such as 'val/loss': "
                f"{_WHERE_CHECKPOINTS_GO}")
    return None


class _DeclaredSignature:
    """``inspect.signature`` of the class: its ``__init__``'s without the ``**unknown`` that only
    refuses (with Lightning's spelling), so a config naming an unknown argument is refused there,
    with its key."""

    def __get__(self, instance: Any, owner: type) -> inspect.Signature:
        signature = inspect.signature(owner.__init__)
        return signature.replace(parameters=[p for name, p in signature.parameters.items()
                                             if name not in ("self", "unknown")])


class ModelCheckpoint(Callback):
    """Save the full train state at validations, epochs or steps; keep the best k and the last.

    Args:
        monitor: metric that ranks checkpoints (e.g. ``"val/acc"``): one the eval step returns, or
            one logged during the validation before this callback runs (it runs after the other
            callbacks), from the trainer's ``on_validation_epoch_end`` or a callback's
            ``on_validation_end`` (``trainer.log_metrics({"val/f1": f1})``, as Lightning ranks by
            anything logged by then); None follows the trainer's ``is_new_model_better`` (the
            seed's rule, asked once per validation by the trainer) and keeps only the single best.
            Ranked by the trainer's rule (:func:`~flaxlight.options.rank_key`): a NaN below every
            number, and of NaNs the newest first (while every validation is NaN, the newest is the best).
        mode: ``"min"`` or ``"max"`` for ``monitor``.
        save_top_k: how many best checkpoints to keep (0: none kept for being best). -1 keeps
            every checkpoint written, as in Lightning: each validation's (ranked by ``monitor``,
            or, without one, by ``is_new_model_better``, which still picks the best) and each
            periodic one. With an ``every_n_*``, a validation's checkpoint is written when one is
            due (``every_n_epochs=2``: the validations of epochs 2, 4, ..., as in Lightning), or
            when it is the best so far, kept while it is the best (so ``test()`` and
            ``which="best"`` find it), and for good once another checkpoint is written while it
            is the best (that one's saved ranking names it: a resume from there finds it). With a
            ``monitor``, any k; without one, 0, 1 or -1.
        save_last: keep the most recent checkpoint, so a run can resume from where it ended; the
            state at the end of training is then always saved. ``False`` (Keras'
            ``save_best_only=True``): only the checkpoints ``save_top_k`` keeps, so ``resume=True``
            goes on from the newest of them (the best, with ``save_top_k=1``), which it says;
            periodic saves (``every_n_*``) then need ``save_top_k=-1`` (they are written
            and all kept; Lightning's ``ModelCheckpoint(every_n_train_steps=N, save_top_k=-1)``),
            else they would be deleted at the next save, so asking for them is an error.
        every_n_epochs: write a checkpoint every N epochs (after validation when it runs).
        every_n_steps: also write one every N train steps (batches), mid-epoch included.
        every_n_seconds: write one at the first epoch end (or ``every_n_steps`` step) at least
            this many seconds after the previous save.
        max_overhead: the share of wall time checkpoint writes may take (they run on a
            background thread, which still shares the CPU with training). Default: 0.03 when no
            ``every_n_*`` is given, else unlimited. Within it, saves are spaced out: an
            epoch-end save is skipped while the previous write is in progress or its pause (its
            duration / ``max_overhead``; orbax's one-time set-up, which a process's first write
            pays, left out) lasts, and a new best waits in the queue until the pause is over;
            the first save waits as long (the pause of a typical write), so a run of a few
            seconds writes only its final checkpoint.

    Lightning's other arguments (``every_n_train_steps``, ``dirpath``, ``filename``, ...) and
    Keras' (a file path first, ``filepath``, ``save_best_only``, ``save_freq``, ``mode="auto"``;
    :data:`KERAS_ARGUMENTS`) are refused with flaxlight's way (checkpoints are
    ``<log_dir>/checkpoints/<step>``; the default keeps the best and the last, which a resume
    goes on from). After training, :attr:`best_model_path` and :attr:`best_model_score` name the
    best, as in Lightning.

    What is never skipped: the best model (a new best is queued behind the pause and written at
    its end; one not yet written when a better one arrives is replaced unwritten), the state at
    the end of training (the queue, with the best then, is written out before the run ends), and
    the state on SIGTERM / SIGINT. With the defaults, a ``kill -9`` loses the work since the
    newest checkpoint on disk: at most one epoch plus the writer's pause (33 times the duration
    of one write: 2.6-8 s for the 0.08-0.25 s writes of a small MLP on 2 cores) plus one write,
    and twice that when a best found during a pause is written before the current state (the
    bests of the pause a kill cuts short are lost; ``best_eval.json`` may then name a better
    model than the checkpoints hold, which ``load_from_checkpoint`` says).

    This callback decides *when* to save and what to keep; the trainer's ``save_model(step)``
    decides *how* (override it to save differently). An override that does not call
    ``super().save_model(step)`` writes checkpoints of its own (``trainer.own_checkpoints``, the
    UvA guide's way): it is called at each new best model only, as in the guide, never for the
    periodic and last checkpoints (nor the other top-k ones), which would replace the best. Checkpoints land in
    ``<log_dir>/checkpoints/<step>/`` (asynchronously; atomically). A checkpoint saved for its
    validation score carries that score as orbax metrics (``{"val/acc": 0.97}``), so plain
    orbax finds the same best step: ``ocp.CheckpointManager(dir, options=
    ocp.CheckpointManagerOptions(best_fn=lambda m: m["val/acc"], best_mode="max")).best_step()``.

    Examples:
        >>> trainer = MyTrainer(..., callbacks=[ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=3)])  # doctest: +SKIP
        >>> every_500 = ModelCheckpoint(every_n_steps=500, save_top_k=-1, save_last=False)  # a snapshot every 500 steps
        >>> every_2nd = ModelCheckpoint(every_n_epochs=2, save_top_k=-1)  # epochs 2, 4, ... (and the best)
    """

    __signature__ = _DeclaredSignature()

    @refuse_keras_arguments(KERAS_ARGUMENTS, positional=_keras_filepath)
    def __init__(self, monitor: str | None = None, mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 every_n_epochs: int | None = None, every_n_steps: int | None = None,
                 every_n_seconds: float | None = None, max_overhead: float | None = None, **unknown: Any):
        if unknown:  # Lightning's every_n_train_steps, dirpath, filename, ...: what flaxlight writes
            raise TypeError(_unknown_argument_message(unknown))
        check_mode("ModelCheckpoint", mode)
        if monitor is not None:
            warn_if_mode_contradicts_name("ModelCheckpoint", monitor, mode)
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"save_top_k must be an int >= 0, or -1 to keep every checkpoint written; "
                             f"got {save_top_k!r}.")
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ValueError(f"save_top_k={save_top_k} needs a monitor='val/<metric>' to rank checkpoints by (the "
                             f"trainer's monitor is not taken for that): give it one with its mode, the trainer's if "
                             f"it has one, e.g. ModelCheckpoint(monitor='val/acc', mode='max', save_top_k="
                             f"{save_top_k}). Without one, save_top_k is 1 (keep the best by the trainer's "
                             f"is_new_model_better), 0 (none for being best) or -1 (keep every checkpoint written).")
        for name, value in (("every_n_epochs", every_n_epochs), ("every_n_steps", every_n_steps)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"ModelCheckpoint {name} must be a positive int or None, got {value!r}.")
        for name, value, upper in (("every_n_seconds", every_n_seconds, math.inf), ("max_overhead", max_overhead, 1)):
            if value is not None and (not isinstance(value, (int, float)) or not 0 < value <= upper):
                raise ValueError(f"ModelCheckpoint {name} must be a number in (0, {upper}] or None, got {value!r}.")
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_epochs, self.every_n_steps, self.every_n_seconds = every_n_epochs, every_n_steps, every_n_seconds
        self.spaced = every_n_epochs is None and every_n_steps is None and every_n_seconds is None
        self.keeps_all = save_top_k == -1  # every checkpoint written stays
        # save_top_k=-1 with every_n_*: a validation's checkpoint only when one is due (as in Lightning), or it is
        # the new best (kept while it is the best: test() and which="best" load it)
        self.snapshots_only = self.keeps_all and not self.spaced
        _check_periodic_kept(save_last, save_top_k, every_n_epochs=every_n_epochs, every_n_steps=every_n_steps,
                             every_n_seconds=every_n_seconds)
        # Periodic saves (every_n_*, the budget's epoch-end saves, the final state) are written for
        # save_last; without it, only the every_n_* ones asked for, which save_top_k=-1 keeps.
        self.periodic = save_last or (self.keeps_all and not self.spaced)
        self.max_overhead = max_overhead if max_overhead is not None else (0.03 if self.spaced else None)
        self.best: list[tuple[float, int]] = []  # (score, step), best first
        self.best_metrics: dict[str, float] | None = None
        self.last_step: int | None = None
        self._last_save_time = time.monotonic()
        self._scored: tuple[int, dict[str, float]] | None = None  # the step being saved for its score
        self._owed_at_epoch_end = False  # a step save deferred to the epoch's end (see on_step)
        self._started_fresh, self._earlier_runs = True, set()  # an earlier run's checkpoints in the folder stay
        self._interim: set[int] = set()  # snapshots_only: validations saved for being the best, not periodic
        self._directory: str | None = None  # the run's checkpoints folder, once known
        self._followed_monitor: str | None = None  # without a monitor: the trainer's (see best_model_score)

    def __getattr__(self, name: str) -> Any:  # only for names not found otherwise: Lightning's, with a hint
        if name in _LIGHTNING_ATTRIBUTES:
            raise AttributeError(f"ModelCheckpoint has no attribute {name!r} (Lightning's): "
                                 f"{_LIGHTNING_ATTRIBUTES[name]}.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---------------------------------------------------------------- decisions
    @property
    def best_step(self) -> int | None:
        """Step of the best checkpoint kept so far (None before the first validation)."""
        return self.best[0][1] if self.best else None

    @property
    def best_model_path(self) -> str | None:
        """The best checkpoint's folder, ``<log_dir>/checkpoints/<best_step>`` (Lightning's
        ``best_model_path``; None until a ``train_model`` run has saved one). Load it with
        ``MyTrainer.load_from_checkpoint(checkpoint.best_model_path, exmp_input=x[:1])``.

        Assigning it (a subclass keeping its own, as Lightning's code does) sets what it reads from
        then on; flaxlight's choice of the best checkpoint (``best_step``) is unchanged.

        Examples:
            >>> ModelCheckpoint().best_model_path is None
            True
        """
        if "_assigned_best_model_path" in self.__dict__:
            return self.__dict__["_assigned_best_model_path"]
        if self.best_step is None or self._directory is None:
            return None
        return os.path.join(self._directory, str(self.best_step))

    @best_model_path.setter
    def best_model_path(self, value: Any) -> None:
        self.__dict__["_assigned_best_model_path"] = value

    @property
    def best_model_score(self) -> float | None:
        """The best checkpoint's ``monitor`` value (Lightning's ``best_model_score``, a float here);
        None before one is saved. Without a ``monitor`` of its own (the default checkpoint), the
        trainer's ``is_new_model_better`` ranks, and this is the best checkpoint's value of the
        trainer's ``monitor`` (``MyTrainer(..., monitor="val/elbo", mode="max")``), or None when the
        trainer has none either (``best_metrics`` holds that validation's metrics).

        Assigning it sets what it reads from then on, as for :attr:`best_model_path`.

        Examples:
            >>> ModelCheckpoint(monitor="val/loss").best_model_score is None
            True
        """
        if "_assigned_best_model_score" in self.__dict__:
            return self.__dict__["_assigned_best_model_score"]
        if not self.best:
            return None
        if self.monitor is None:
            value = (self.best_metrics or {}).get(self._followed_monitor) if self._followed_monitor else None
            return None if value is None else float(value)
        score = self.best[0][0]
        return -score if self.mode == "max" else score

    @best_model_score.setter
    def best_model_score(self, value: Any) -> None:
        self.__dict__["_assigned_best_model_score"] = value

    def _score(self, metrics: Mapping[str, float]) -> float | None:
        if self.monitor is None:
            return None
        if self.monitor not in metrics:
            raise KeyError(
                f"ModelCheckpoint monitor {self.monitor!r} is not among the validation metrics {sorted(metrics)}."
            )
        value = float(metrics[self.monitor])
        return -value if self.mode == "max" else value  # lower is better internally

    def _with_logged_monitor(self, trainer, metrics: Mapping[str, float]) -> Mapping[str, float]:
        """The eval step's ``metrics`` and the monitored value when another hook or callback logged
        it during this validation (``trainer.validation_metrics``; they run before this callback)."""
        monitor = self.monitor or getattr(trainer.options, "monitor", None)
        if not monitor or monitor in metrics:
            return metrics
        logged = trainer.validation_metrics
        if monitor not in logged:  # the trainer says why first, when it ranks by it too
            if self.monitor is None:
                return metrics
            raise MetricNotLoggedError(f"ModelCheckpoint(monitor={monitor!r}) ranks checkpoints at each validation "
                                       f"among its metrics {sorted(logged)} (the eval step's and those logged during "
                                       f"it, before this callback), and {monitor!r} is not among them.")
        return {**metrics, monitor: logged[monitor]}

    def _is_top_k(self, trainer, metrics: Mapping[str, float]) -> bool:
        if self.save_top_k == 0:
            return False
        if self.monitor is None:
            return trainer.is_best_validation
        return (self.save_top_k == -1 or len(self.best) < self.save_top_k
                or self._ranks_above(trainer, metrics, self.best[-1]))

    def _ranks_above(self, trainer, metrics: Mapping[str, float], kept: tuple[float, int]) -> bool:
        """Whether this validation ranks above the ``kept`` (score, step), by the trainer's rule
        (``options.rank_key``: a NaN below every number, the newer of two NaNs above)."""
        return rank_key(self._score(metrics), trainer.global_step) < rank_key(*kept)

    def score_of(self, step: int) -> dict[str, float] | None:
        """``{metric: value}`` that ranks checkpoint ``step`` when it is saved for its validation
        score (the trainer writes it as the checkpoint's orbax metrics), else None."""
        return dict(self._scored[1]) if self._scored is not None and self._scored[0] == step else None

    def _ranking_metric(self, trainer, metrics: Mapping[str, float]) -> dict[str, float] | None:
        if self.monitor is not None:
            return {self.monitor: float(metrics[self.monitor])}
        try:  # the trainer's own rule: its monitored metric, when it logs one
            key, _ = trainer.options.monitored(metrics)
        except KeyError:
            return None
        return {key: float(metrics[key])}

    def _is_new_best(self, trainer, metrics: Mapping[str, float]) -> bool:
        """Whether this validation beats every checkpoint ranked so far (a NaN only other NaNs)."""
        if self.monitor is None:
            return trainer.is_best_validation
        return not self.best or self._ranks_above(trainer, metrics, self.best[0])

    def _validation_due(self, trainer, epoch: int) -> bool:
        """Whether a validation falls on a periodic point (``every_n_epochs``: any validation of
        such an epoch, as in Lightning; ``every_n_steps``: at such a step; ``every_n_seconds``)."""
        return ((self.every_n_epochs is not None and epoch % self.every_n_epochs == 0)
                or (self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0)
                or self._seconds_due())

    def _seconds_due(self) -> bool:
        return self.every_n_seconds is not None and time.monotonic() - self._last_save_time >= self.every_n_seconds

    @staticmethod
    def _is_final(trainer, epoch: int) -> bool:
        """Whether this epoch end is the run's last (its state is never skipped)."""
        return (trainer.should_stop or (trainer.num_epochs is not None and epoch >= trainer.num_epochs)
                or trainer.options.reached_max_steps(trainer.global_step))

    # ---------------------------------------------------------------- hooks
    def on_fit_start(self, trainer) -> None:
        if self.monitor is not None and trainer.val_loader is None:
            warnings.warn(f"ModelCheckpoint(monitor={self.monitor!r}) ranks checkpoints at validations, and this run "
                          f"has no validation data: no checkpoint is kept for being best, only the last (and the "
                          f"periodic ones save_top_k=-1 keeps).", RuntimeWarning, stacklevel=2)
        trainer.checkpointer.budget_writes(self.max_overhead)
        self._directory = trainer.checkpointer.directory
        self._followed_monitor = None if self.monitor is not None else getattr(trainer.options, "monitor", None)
        self._last_save_time = time.monotonic()
        self._owed_at_epoch_end = False
        # A fresh run in a folder with checkpoints (the same trainer training again): they are an
        # earlier run's, which this run's ranking does not know, so they are never pruned.
        if self._started_fresh:
            self._earlier_runs = set(trainer.checkpointer.all_steps())

    def on_step(self, trainer, step: int) -> None:
        if self.periodic and (self.every_n_steps is not None or self._seconds_due()):
            if self._epoch_ends_at(trainer, step):  # its rows and validation at this step come later: saved after them
                self._owed_at_epoch_end = True
                return
            self._save(trainer, step, best_metrics=None)

    @staticmethod
    def _epoch_ends_at(trainer, step: int) -> bool:
        """Whether the epoch's training ends with ``step`` (its epoch-end records, at the same step,
        are still to come: a checkpoint taken now would have a resume log them twice)."""
        return ((trainer.steps_per_epoch is not None and trainer.batch_in_epoch >= trainer.steps_per_epoch)
                or trainer.options.reached_max_steps(step) or trainer.should_stop)

    def on_validation_end(self, trainer, epoch: int, metrics: Mapping[str, float]) -> None:
        metrics = self._with_logged_monitor(trainer, metrics)
        ranked = self._is_top_k(trainer, metrics)
        if self.snapshots_only and not self._validation_due(trainer, epoch):
            if not self._is_new_best(trainer, metrics):
                return  # save_top_k=-1 with every_n_*: the due validations' checkpoints, and the best
            self._interim.add(trainer.global_step)  # kept while it is the best
        if ranked or self.keeps_all:  # save_top_k=-1 without a monitor: kept, the best still the trainer's
            self._save(trainer, trainer.global_step, best_metrics=metrics if ranked else None,
                       scored=metrics if ranked or self.monitor is None else None)

    def on_epoch_end(self, trainer, epoch: int) -> None:
        owed, self._owed_at_epoch_end = self._owed_at_epoch_end, False
        if not self.periodic or self.last_step == trainer.global_step:
            return
        if self.spaced:
            due = not trainer.checkpointer.busy
        else:
            due = (self.every_n_epochs is not None and epoch % self.every_n_epochs == 0) or self._seconds_due()
        if due or owed or (self.save_last and self._is_final(trainer, epoch)):
            self._save(trainer, trainer.global_step, best_metrics=None)

    def save_final_state(self, trainer) -> None:
        """Save the state training ended with if no epoch end did (``stop()`` at an epoch's start);
        the trainer asks before it tests the best model.

        Examples:
            >>> checkpoint.save_final_state(trainer)   # doctest: +SKIP
        """
        if self.save_last and self.last_step != trainer.global_step:
            self._save(trainer, trainer.global_step, best_metrics=None)

    def on_fit_end(self, trainer) -> None:
        trainer.checkpointer.wait()
        self._prune(trainer)

    # ---------------------------------------------------------------- saving and pruning
    def _save(self, trainer, step: int, best_metrics: Mapping[str, float] | None,
              scored: Mapping[str, float] | None = None) -> None:
        """Save ``step``; ``best_metrics``: it ranks among the best with these; ``scored``: the
        validation metrics it carries as orbax metrics (default: ``best_metrics``)."""
        own = trainer.own_checkpoints  # a save_model of the UvA guide's: called at a new best model only
        if own and best_metrics is None:
            return
        # Deletions queue behind the saves before them on the checkpointer's writer, and none runs
        # after a failed write: a failed or killed save never leaves the run without a checkpoint.
        self._prune(trainer, also_keep=step)  # `step` itself may be saved again right below
        if best_metrics is not None:
            self.best_metrics = dict(best_metrics)
            if self.monitor is None:
                self.best = [(0.0, step)]
            else:
                entry = (self._score(best_metrics), step)
                ranked = sorted([b for b in self.best if b[1] != step] + [entry], key=lambda b: (rank_key(*b), b[1]))
                self.best = ranked if self.save_top_k == -1 else ranked[: self.save_top_k]
        if own and self.best_step != step:  # among the top k, not the best: it would replace the best
            return
        self.last_step, self._last_save_time = step, time.monotonic()
        scored = best_metrics if scored is None else scored
        self._scored = (step, self._ranking_metric(trainer, scored)) if scored is not None else None
        try:
            trainer.save_model(step)
        finally:
            self._scored = None

    def _keep(self) -> set[int]:
        keep = {step for _, step in self.best}
        if self.save_last and self.last_step is not None:
            keep.add(self.last_step)
        return keep

    def _prune(self, trainer, also_keep: int | None = None) -> None:
        """Delete (in the background) the checkpoints neither best, last nor ``also_keep``
        (with ``save_top_k=-1``: every checkpoint written is kept, but the ones written only for
        being the best when ``every_n_*`` decides the others, once they are no longer the best)."""
        if self.keeps_all:
            self._prune_interim(trainer, also_keep)
            return
        keep, steps = self._keep() | {also_keep}, trainer.checkpointer.all_steps()
        if self.save_last and steps and self.last_step not in steps and also_keep not in steps:
            keep.add(max(steps))  # the last save was refused (NaN params): the newest on disk stands in
        for step in steps:
            if step not in keep and step not in self._earlier_runs:
                trainer.checkpointer.delete(step)

    def _prune_interim(self, trainer, also_keep: int | None) -> None:
        """Delete the checkpoints written only for being the best once a later one beats them, but
        one that a checkpoint on disk names as its best: that one was written while it was the
        best (a periodic one, a SIGTERM's, a manual save), and a resume from it (``resume_from``,
        a rewind) restores that ranking, so it stays for good."""
        keep = {self.best_step, also_keep} | ({self.last_step} if self.save_last else set())
        steps = trainer.checkpointer.all_steps()
        # An interim step is looked at once, at the first pruning after the save that beat it: the
        # best now is that save's step, and the checkpoints between the two name it as the best.
        beaten_at = self.best_step if self.best_step is not None else math.inf
        for step in sorted(self._interim - keep):
            self._interim.discard(step)
            if any(step < other < beaten_at for other in steps):
                continue  # named as the best by a checkpoint kept: kept too (no longer interim)
            if step in steps and step not in self._earlier_runs:
                trainer.checkpointer.delete(step)
            self.best = [entry for entry in self.best if entry[1] != step]

    def start_call(self) -> None:
        """A new ``train_model`` call of the same trainer (into its run folder): the ranking goes on,
        so the run's best checkpoint stays its best until this call validates a better one (as
        Keras' and Lightning's checkpoint callbacks across ``fit`` calls); the checkpoints already
        in the folder are never pruned (a resume then restores the checkpoint's own ranking).

        Examples:
            >>> checkpoint.start_call()   # doctest: +SKIP
        """
        best, best_metrics = self.best, self.best_metrics
        self.load_state_dict({})
        self.best, self.best_metrics = best, best_metrics

    def state_dict(self) -> dict[str, Any]:
        return {"best": [[score, step] for score, step in self.best], "best_metrics": self.best_metrics,
                "last_step": self.last_step, "save_last": self.save_last, "monitor": self.monitor, "mode": self.mode,
                "earlier_runs": sorted(self._earlier_runs), "interim": sorted(self._interim)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a run's ranking (``{}``: a fresh start, which leaves the checkpoints already in
        the folder, an earlier run's, where they are). Ranked by another ``monitor`` or
        ``mode`` than this callback's, the earlier checkpoints' scores do not count: the ranking
        starts again (said with a warning), and they are pruned as the new ones come. Without a
        ``monitor``, the run's best so far stays the best until the trainer's rule finds a better."""
        self._started_fresh, self._earlier_runs = not state, set(state.get("earlier_runs", []))
        self.best = [(float(score), int(step)) for score, step in state.get("best", [])]
        self.best_metrics = state.get("best_metrics")
        self.last_step = state.get("last_step")
        self._interim = set(state.get("interim", []))
        saved = (state.get("monitor", self.monitor), state.get("mode", self.mode))
        if self.monitor is None:  # the trainer's rule ranks from now on; its best so far is the run's
            self.best = self.best[:1]
        elif self.best and saved != (self.monitor, self.mode):
            warnings.warn(f"ModelCheckpoint ranked this run's checkpoints by {saved[0]!r} ({saved[1]}) and now by "
                          f"{self.monitor!r} ({self.mode}): the ranking starts again from the next validation.",
                          RuntimeWarning, stacklevel=2)
            self.best, self.best_metrics = [], None


def _check_periodic_kept(save_last: bool, save_top_k: int, **every: Any) -> None:
    """A clear error for periodic saves (``every_n_*``) that nothing would keep: with
    ``save_last=False`` only ``save_top_k=-1`` keeps checkpoints that are not among the best."""
    asked = {name: value for name, value in every.items() if value is not None}
    if save_last or save_top_k == -1 or not asked:
        return
    named = ", ".join(f"{name}={value}" for name, value in asked.items())
    raise ValueError(f"ModelCheckpoint({named}, save_last=False, save_top_k={save_top_k}) would write periodic "
                     f"checkpoints and delete each at the next save: with save_last=False only the ones kept for "
                     f"their validation score stay (save_top_k={save_top_k} of them). To keep every periodic "
                     f"checkpoint (Lightning's every_n_train_steps with save_top_k=-1), pass save_top_k=-1; to keep "
                     f"the newest for resuming, save_last=True; else drop {', '.join(asked)}.")


def _unknown_argument_message(unknown: Mapping[str, Any]) -> str:
    """The error for keywords ``ModelCheckpoint`` does not take: Lightning's with flaxlight's way."""
    key, value = next(iter(unknown.items()))
    takes = [name for name in inspect.signature(ModelCheckpoint.__init__).parameters if name not in ("self", "unknown")]
    if key in _LIGHTNING_ARGUMENTS:
        hint = f" It is Lightning's; in flaxlight: {_LIGHTNING_ARGUMENTS[key].format(value=value)}."
    else:
        close = difflib.get_close_matches(key, takes, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"ModelCheckpoint got an unexpected keyword argument {key!r}.{hint} It takes {', '.join(takes)} "
            f"(see docs/from-lightning.md).")
