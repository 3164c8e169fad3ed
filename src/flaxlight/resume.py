"""What a checkpoint remembers besides the arrays, and how a run picks up from it.

:class:`CheckpointMeta` is the one owner of the JSON item saved next to the arrays of every
checkpoint: where the loop was (epoch, phase, batch), the epoch's metric sums so far, the
running log, the best validation, the callbacks' states and the run's length.
:func:`choose_step` picks the best or the last checkpoint of a run (the trainer and the tuner
both ask it).

Examples:
    >>> meta = CheckpointMeta(step=120, epoch=3, phase="epoch_end", best_step=80)
    >>> CheckpointMeta.from_json(meta.to_json()) == meta
    True
    >>> choose_step([40, 80, 120], meta, which="best"), choose_step([40, 120], meta, which="best")
    (80, 120)
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import shutil
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxlight.checkpoint import Checkpointer, DamagedCheckpointError
from flaxlight.data import is_stream
from flaxlight.loop import LoopState, RunSoFar, safe_len
from flaxlight.messages import logger as messages, warn_at_user
from flaxlight.metrics import Totals, placed_like, to_host
from flaxlight.runfiles import ABANDONED_DIR, CHECKPOINT_DIR, HPARAMS_FILE, METRICS_DIR, run_files_present, write_metrics

__all__ = ["CheckpointMeta", "choose_step", "pick_checkpoint", "restore_run", "run_length", "epoch_length", "earlier_epochs",
           "load_with_fallback",
           "checkpointer_for", "ResumeTarget", "check_epoch_position", "set_aside_branch", "ABANDONED_DIR",
           "step_in_path", "named_callbacks", "match_states",
           "sums_to_json", "sums_from_json", "encode_state", "decode_state", "epoch_setter", "set_loader_epoch"]


@dataclasses.dataclass
class CheckpointMeta:
    """The JSON ``meta`` item of a checkpoint: everything but the arrays needed to continue.

    Attributes:
        step: train steps (batches) completed, the trainer's ``global_step`` (``state.step``
            counts optimizer updates: more for a step of yours updating twice per batch).
        epoch, phase, batch_index: where the loop was (``phase``: ``"train"`` mid-epoch,
            ``"val"`` after the epoch's training, ``"epoch_end"`` after its validation).
        validated: whether the epoch's validation ran (a save at validation: it is not repeated).
        cut_validated: an epoch cut short (``max_steps``, ``stop()``: saved as mid-epoch, a longer
            run continues it) was validated at the cut: that validation's records are this step's.
        train_metrics: the last finished epoch's ``train/...`` means.
        train_sums: the current epoch's metric sums so far (mid-epoch saves), as floats.
        running_log: the running log's position (:class:`flaxlight.loop.RunningLog`).
        loader_position: mid-epoch, where a loader that saves its own position was (grain,
            torchdata; see :func:`flaxlight.data.positioned_iterator`).
        best_eval_metrics: the best validation so far (what ``train_model`` returns).
        best_step: the step of the best checkpoint kept (None before a validation).
        num_epochs, steps_per_epoch: the run's length; schedule_steps: the train steps its optimizer's
            schedule spans (what ``max_steps`` leaves the run when that ends it first); start_step:
            the model's step when the run began (its optimizer was built; a fine-tune's: the loaded
            model's), so that a resume sizes the schedule as the run did (0: older checkpoints, whose
            schedule spanned ``max_steps`` from step 0).
        block_length: the steps per dispatch ``steps_per_execution="auto"`` chose (None before).
        nonfinite: the run's non-finite steps so far, those before the current epoch and where the
            first was seen (:meth:`flaxlight.loop.NonfiniteTally.state_dict`; ``[steps, before_epoch]``
            in older checkpoints).
        callbacks: each callback's ``state_dict()``, by :func:`named_callbacks` name (its
            ``state_key``). state_keys: whether they are (False: a checkpoint of a flaxlight that
            named them by class and position, matched by :func:`match_states` when unambiguous).
        owed_events, owed_steps: the events of ``step`` an interrupt came before (``"log"``,
            ``"val"``, ``"callbacks"``) and the updates they cover: a resume runs them first.
        epochs_before: the model's training epochs before the run (earlier ``train_model`` calls):
            the loader's ``set_epoch`` gets them plus the run's epoch.
        earlier_epochs: ``[[batches, epoch length], ...]``: the run's first batches were trained in
            epochs of other lengths than ``steps_per_epoch`` (resumed with another batch size),
            oldest first; its optimizer's schedule counts their updates with their lengths.
    """

    step: int
    epoch: int = 1
    phase: str = "epoch_end"
    batch_index: int = 0
    train_metrics: dict = dataclasses.field(default_factory=dict)
    validated: bool = False
    train_sums: dict | None = None
    running_log: dict = dataclasses.field(default_factory=dict)
    loader_position: Any = None
    best_eval_metrics: dict | None = None
    best_step: int | None = None
    num_epochs: int | None = None
    steps_per_epoch: int | None = None
    callbacks: dict = dataclasses.field(default_factory=dict)
    owed_events: list = dataclasses.field(default_factory=list)
    owed_steps: int = 1
    schedule_steps: int | None = None
    start_step: int = 0
    block_length: int | None = None
    nonfinite: dict | list = dataclasses.field(default_factory=lambda: [0, 0])
    epochs_before: int = 0
    state_keys: bool = False
    earlier_epochs: list = dataclasses.field(default_factory=list)
    cut_validated: bool = False

    def to_json(self) -> dict[str, Any]:
        # One pass that copies as it converts (a metric object's array result as nested lists): a
        # save at each new best paid dataclasses.asdict's deep copy first, as much again. The
        # callbacks' states are JSON of their own already (encode_state's new objects, or read from
        # a file): walked again, a History of 500 epochs cost each save ~0.5 ms more.
        return {field.name: dict(self.callbacks) if field.name == "callbacks" else _jsonable(getattr(self, field.name))
                for field in dataclasses.fields(self)}

    @classmethod
    def capture(cls, step: int, loop: LoopState, *, callbacks: Sequence[Any], **run: Any) -> "CheckpointMeta":
        """The meta of a checkpoint taken now: the loop's position, the callbacks' states and
        ``run`` (``best_eval_metrics``, ``best_step``, ``num_epochs``, ``steps_per_epoch``)."""
        # An epoch cut short (max_steps, stop()) is saved as mid-epoch: a longer run continues it.
        return cls(step=step, epoch=loop.epoch, phase="train" if loop.cut else loop.phase,
                   batch_index=loop.batch_index, train_metrics=loop.train_metrics,
                   validated=loop.validated and not loop.cut, cut_validated=loop.validated and loop.cut,
                   train_sums=sums_to_json(loop.acc),
                   running_log=loop.running_log.state_dict(), owed_events=list(loop.owed_events),
                   owed_steps=loop.owed_steps, epochs_before=loop.epochs_before, state_keys=True,
                   callbacks={name: encode_state(cb.state_dict(), f"{type(cb).__name__}.state_dict()")
                              for name, cb in named_callbacks(callbacks)}, **run)

    def loop_state(self, steps_per_epoch: int | None = None, like: Any = None) -> LoopState:
        """Where the loop continues: the saved position, or the next epoch after an epoch's end.
        ``steps_per_epoch``: the resumed run's epoch length; a checkpoint taken after the last batch
        of an epoch of another length (before the epoch's end routine) continues with none left.
        ``like``: the restored state, whose placement the epoch's metric sums take."""
        loop = LoopState(epoch=self.epoch, phase=self.phase, batch_index=self.batch_index, validated=self.validated,
                         acc=placed_like(sums_from_json(self.train_sums), like), train_metrics=dict(self.train_metrics),
                         loader_position=self.loader_position if self.phase == "train" else None,
                         owed_events=list(self.owed_events), owed_steps=self.owed_steps,
                         epochs_before=self.epochs_before, resumed_epoch_length=self.steps_per_epoch,
                         resumed_from=self.step)
        loop.running_log.load_state_dict(self.running_log)
        if self.trained_whole_epoch and steps_per_epoch:
            loop.batch_index = steps_per_epoch
        if loop.phase == "epoch_end":
            loop.epoch, loop.batch_index, loop.validated = loop.epoch + 1, 0, False
        return loop

    def so_far(self) -> RunSoFar:
        """What the run trained before this checkpoint (a resume fits its schedule to the rest).

        Examples:
            >>> CheckpointMeta(step=95, epoch=5, steps_per_epoch=19).so_far()
            RunSoFar(steps=95, epochs=5, batches=0, epoch_length=19, earlier=())
        """
        whole = self.phase != "train" or self.trained_whole_epoch
        return RunSoFar(steps=self.step - self.start_step, epochs=self.epoch if whole else self.epoch - 1,
                        batches=0 if whole else self.batch_index, epoch_length=self.steps_per_epoch,
                        earlier=tuple(tuple(pair) for pair in self.earlier_epochs))

    def trained_up_to(self, num_epochs: int, max_steps: int | None) -> str | None:
        """What the checkpoint reached when a run of ``num_epochs`` (or ``max_steps``) has nothing
        left to train from it (its epochs, or ``max_steps``), else None.

        Examples:
            >>> CheckpointMeta(step=95, epoch=5).trained_up_to(num_epochs=5, max_steps=None)
            'num_epochs=5 (its checkpoint, step 95, ends epoch 5)'
            >>> CheckpointMeta(step=95, epoch=5).trained_up_to(num_epochs=7, max_steps=None) is None
            True
        """
        if max_steps is not None and self.step >= max_steps:
            return f"max_steps={max_steps} (its checkpoint is step {self.step})"
        ended = self.phase == "epoch_end" or (self.phase == "val" and self.validated)
        if self.epoch > num_epochs or (self.epoch == num_epochs and ended):
            return (f"num_epochs={num_epochs} (its checkpoint, step {self.step}, {'ends' if ended else 'is in'} "
                    f"epoch {self.epoch})")
        return None

    @property
    def mid_epoch(self) -> bool:
        """Saved part-way through an epoch's batches (some trained, some not).

        Examples:
            >>> CheckpointMeta(step=12, epoch=2, phase="train", batch_index=4, steps_per_epoch=8).mid_epoch
            True
            >>> CheckpointMeta(step=8, epoch=1, phase="train", batch_index=8, steps_per_epoch=8).mid_epoch
            False
        """
        return self.phase == "train" and 0 < self.batch_index and not self.trained_whole_epoch

    @property
    def trained_whole_epoch(self) -> bool:
        """Saved in the training phase after the epoch's last batch (before its end routine)."""
        return self.phase == "train" and bool(self.steps_per_epoch) and self.batch_index >= self.steps_per_epoch

    def restore_callbacks(self, callbacks: Sequence[Any]) -> None:
        """Hand each callback the state saved under its key (:func:`match_states`); a saved state
        that no callback takes is named in one warning (it is not restored)."""
        saved = {name: decode_state(state) for name, state in self.callbacks.items()}
        matched, left = match_states(saved, callbacks, by_position=not self.state_keys)
        for callback, state in matched:
            callback.load_state_dict(state)
        left = [name for name in left if saved[name]]  # a stateless callback's {}: nothing lost
        if left:
            taken = {id(callback) for callback, _ in matched}
            fresh = [name for name, callback in named_callbacks(callbacks) if id(callback) not in taken
                     and callback.state_dict()]
            warnings.warn(f"The checkpoint holds the state of {_names(left)}, which no callback of this run takes "
                          f"(removed, or its state_key changed: EarlyStopping's includes its monitor and mode), so "
                          f"{'it is' if len(left) == 1 else 'they are'} not restored."
                          + (f" This run's callbacks with no saved state start fresh: {_names(fresh)}." if fresh else "")
                          + " A callback finds its state again under the same state_key.",
                          RuntimeWarning, stacklevel=3)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CheckpointMeta":
        """Read a saved meta item; keys this version does not know are ignored, missing ones
        take their defaults (checkpoints of older versions load)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known and v is not None}
        if "step" not in values:
            raise ValueError(f"The checkpoint's meta item has no 'step'; keys found: {sorted(data)}.")
        return cls(**values)


def choose_step(steps: Sequence[int], meta: CheckpointMeta | None, which: str = "best") -> int:
    """The checkpoint to load among ``steps``: ``"best"`` (the newest meta's ``best_step`` when
    it is still there, else the newest) or ``"last"`` (the newest)."""
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}.")
    if not steps:
        raise FileNotFoundError("No checkpoint to choose from.")
    if which == "best" and meta is not None and meta.best_step in steps:
        return int(meta.best_step)
    return int(max(steps))


def pick_checkpoint(checkpointer: Checkpointer, which: str = "best") -> int:
    """:func:`choose_step` for the checkpoints on disk, by the newest one's meta (unreadable:
    the newest)."""
    steps = checkpointer.all_steps()
    if not steps:
        raise FileNotFoundError(f"No checkpoint in {checkpointer.directory}: this run saved no model yet.")
    meta = None
    for step in sorted(steps, reverse=True):  # the newest meta that reads names the best step
        try:
            meta = CheckpointMeta.from_json(checkpointer.read_meta(step))
            break
        except Exception:  # noqa: BLE001 - a damaged checkpoint's meta: ask the one before
            if which == "best":
                warnings.warn(f"Checkpoint {step} in {checkpointer.directory} has a damaged meta item; the best "
                              f"checkpoint is taken from an earlier one's.", RuntimeWarning, stacklevel=3)
    if which == "best" and meta is not None and meta.best_step is not None and meta.best_step not in steps:
        warnings.warn(f"The best checkpoint, step {meta.best_step}, is not in {checkpointer.directory} (removed?); "
                      f"loading the newest, step {max(steps)}, instead.", RuntimeWarning, stacklevel=3)
    elif which == "best" and meta is not None and meta.best_step is None and meta.best_eval_metrics:
        warnings.warn(f"The run validated, but kept no checkpoint for its best validation (ModelCheckpoint("
                      f"save_top_k=0), or a monitored value NaN at every validation): loading the newest, step "
                      f"{max(steps)}, which the run's best metrics may not describe.", RuntimeWarning, stacklevel=3)
    chosen = choose_step(steps, meta, which)
    if which == "best" and meta is not None and meta.step == max(steps) and (
            meta.best_step in steps or not meta.best_eval_metrics):  # else: said above (damaged, removed, none kept)
        _warn_if_records_name_a_later_best(checkpointer, meta, chosen)
    return chosen


def _warn_if_records_name_a_later_best(checkpointer: Checkpointer, meta: CheckpointMeta, chosen: int) -> None:
    """Warn when the run's ``metrics/best_eval.json`` names another best validation than the
    newest checkpoint knows of: the run found a better model and ended (``kill -9``, a crash)
    before a checkpoint of it was written (a new best waits for the write budget's pause), so
    the best checkpoint on disk, loaded, is an older best than the records say."""
    run = os.path.dirname(checkpointer.directory)
    recorded, known = _best_file(run), _best_as_of(meta) or None
    if os.path.basename(checkpointer.directory) != CHECKPOINT_DIR or recorded is None \
            or _same_metrics(recorded, known):
        return
    where = _validation_named(run, recorded)
    warn_at_user(
        f"The records of the run in {run} name a better model than any checkpoint holds: "
        f"{METRICS_DIR}/best_eval.json is the validation {where} ({_brief(recorded)}), but the run's newest "
        f"checkpoint (step {meta.step}) knows of "
        + (f"no better one than step {meta.best_step}'s ({_brief(known)})" if known else "no validation")
        + f". The run ended (killed, or failed) before that model's checkpoint was written, or it still trains and the "
        f"checkpoint waits for the writer's pause (a new best is queued behind it). Loading step {chosen}, the best "
        f"checkpoint on disk; a resume (resume=True, flaxlight fit --resume) continues from the newest checkpoint and "
        f"sets the later records aside.", RuntimeWarning)


def _validation_named(run: str, recorded: Mapping[str, Any]) -> str:
    """Which validation a ``best_eval.json`` holds, by the validation file that holds the same
    values (the newest first): ``"of epoch 1841"``, ``"at step 400"`` (``"logged last"`` if none does)."""
    folder, found = os.path.join(run, METRICS_DIR), []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = re.fullmatch(r"eval_(epoch|step)_(\d+)\.json", name)
        if match:
            found.append((int(match[2]), match[1], name))
    for number, kind, name in sorted(found, reverse=True):
        metrics = _best_file_at(os.path.join(folder, name))
        if metrics is not None and all(key in metrics for key in recorded) and _same_metrics(
                {key: metrics[key] for key in recorded}, recorded):
            return f"of epoch {number}" if kind == "epoch" else f"at step {number}"
    return "logged last"


def _brief(metrics: Mapping[str, Any] | None, limit: int = 3) -> str:
    """``"val/acc 1, val/loss 0.0101"``: a few metrics, for a message."""
    items = [f"{key} {value:.6g}" if isinstance(value, (int, float)) else f"{key} {value}"
             for key, value in list((metrics or {}).items())[:limit]]
    return ", ".join(items) + (", ..." if len(metrics or {}) > limit else "")


def restore_run(own: Checkpointer, resume_from: str | os.PathLike | None, state: Any, *,
                load: Callable[[int], Any], train_loader: Any, schedule_steps: int | None = None,
                loaded_from: Checkpointer | None = None,
                steps_per_epoch: int | None = None) -> tuple[Any, CheckpointMeta, int] | None:
    """Restore the checkpoint a run resumes from: ``(state, meta, step)``, or None for a fresh
    start (``resume=True`` into a run with no checkpoint yet). ``schedule_steps``: the length of
    the resumed run's schedule when its rates depend on it; a change from the checkpoint's is said.
    ``loaded_from``: the run a trainer from ``load_from_checkpoint`` was loaded from, into another
    folder (with no checkpoint there yet, training goes on from the loaded model: said, no warning).
    ``steps_per_epoch``: the resumed run's epoch length; a mid-epoch checkpoint of epochs of another
    length is refused before anything is said (:func:`check_epoch_position`; not for a
    ``train_loader`` without ``len()``, a stream whose epoch ``max_steps`` sets).

    Without ``resume_from``: the newest readable checkpoint of ``own`` (the run's own folder),
    restored by ``load(step)`` (the trainer's ``load_model``); damaged newer ones are skipped
    with a warning and removed. An error ``load`` marks as the user's code (``flaxlight_user_code``:
    a ``load_model`` override's own) propagates: no checkpoint is skipped or removed for it.
    ``resume_from``: a run dir, its ``checkpoints`` dir or a step dir.
    """
    checkpointer = own if resume_from is None else checkpointer_for(resume_from)
    if not checkpointer.all_steps():
        if resume_from is not None:
            raise FileNotFoundError(f"resume_from={os.fspath(resume_from)!r}: no checkpoint there.")
        if loaded_from is not None:
            messages.info(f"resume=True: no checkpoint in {checkpointer.directory} yet; training goes on from the "
                          f"model loaded from {loaded_from.directory}.")
            return None
        warnings.warn(f"resume=True, but there is no checkpoint in {checkpointer.directory}: a new run starts from "
                      f"the trainer's current state (its model as built, or as your code set it: a restored "
                      f"backbone), not from a checkpoint. If you meant to continue a run, check the log_dir."
                      f"{_sibling_run_hint(os.path.dirname(checkpointer.directory))}", RuntimeWarning, stacklevel=4)
        return None
    wanted_step = step_in_path(resume_from) if resume_from is not None else None
    if wanted_step is not None:
        state, step = checkpointer.restore(state, step=wanted_step), wanted_step
        meta = checkpointer.read_meta(step)
    else:
        state, meta, step = checkpointer.restore_latest_valid(state, load=load if checkpointer is own else None)
        if checkpointer is own:
            for newer in [s for s in checkpointer.all_steps() if s > step]:
                checkpointer.delete(newer)  # unreadable: it would block re-saving that step
    meta = CheckpointMeta.from_json(meta)
    if safe_len(train_loader) is not None:
        check_epoch_position(meta, steps_per_epoch, checkpointer)
    position = meta.loop_state()  # where the checkpoint was, as said
    if epoch_setter(train_loader) is None and meta.loader_position is None:
        warnings.warn(_stream_resume_message(step, position, meta.steps_per_epoch) if is_stream(train_loader) else
                      "Resuming with a train_loader that has no set_epoch(epoch) method: the run continues exactly "
                      "only if the loader's order does not depend on how often it was iterated before.",
                      RuntimeWarning, stacklevel=4)
    messages.info("Resumed from checkpoint %d in %s (%s).", step, checkpointer.directory, _place(meta))
    if schedule_steps and meta.schedule_steps and schedule_steps != meta.schedule_steps:
        messages.info("The run's learning-rate schedule spanned %d steps and this run's spans %d: from step %d on, "
                      "the rates follow the new length.", meta.schedule_steps, schedule_steps, step)
    return state, meta, step


def _sibling_run_hint(run_dir: str) -> str:
    """For a new ``version_N`` run folder (``base_log_dir``'s) with nothing to resume: the newest
    other ``version_M`` beside it that holds a checkpoint, and how to continue it ("" if none).

    Examples:
        >>> _sibling_run_hint("/nowhere/MLP/version_1")
        ''
    """
    parent, name = os.path.split(os.path.abspath(run_dir))
    if not re.fullmatch(r"version_\d+", name) or not os.path.isdir(parent):
        return ""
    siblings = sorted((int(entry.split("_", 1)[1]), entry) for entry in os.listdir(parent)
                      if re.fullmatch(r"version_\d+", entry) and entry != name)
    for _, entry in reversed(siblings):  # the newest version first
        folder = os.path.join(parent, entry, CHECKPOINT_DIR)
        steps = [int(step) for step in os.listdir(folder) if step.isdigit()] if os.path.isdir(folder) else []
        if steps:
            run = os.path.join(parent, entry)
            return (f" The newest run beside it that holds a checkpoint is {run} (step {max(steps)}): "
                    f"logger_params={{'base_log_dir': ...}} gives each new trainer a new version_N folder, so to "
                    f"continue that run build the trainer with logger_params={{'log_dir': {run!r}}} and train with "
                    f"resume=True, or train this one with resume_from={run!r} (its records then go to {name}).")
    return ""


def _place(meta: CheckpointMeta) -> str:
    """Where in the run checkpoint ``meta`` was taken, in the run's epoch count (``num_epochs``', the
    progress lines' and ``metrics.csv``'s): ``"the end of epoch 4"``, ``"epoch 3, after batch 7"``.
    A model that trained epochs before the run (a fine-tune, an earlier ``train_model`` call) counts
    its own too, as ``metrics/eval_epoch_<N>.json`` and ``set_epoch`` do: that is said beside.

    Examples:
        >>> _place(CheckpointMeta(step=24, epoch=1, epochs_before=2))
        "the end of epoch 1; the model's epoch 3, after the 2 it trained before this run"
        >>> _place(CheckpointMeta(step=20, epoch=3, phase="train", batch_index=4, steps_per_epoch=8))
        'epoch 3, after batch 4'
    """
    position = meta.loop_state()
    ended = meta.phase == "epoch_end" or bool(meta.steps_per_epoch) and meta.batch_index >= meta.steps_per_epoch
    epoch = meta.epoch if ended else position.epoch
    place = f"the end of epoch {epoch}" if ended else f"epoch {epoch}, after batch {position.batch_index}"
    if not meta.epochs_before:
        return place
    return f"{place}; the model's epoch {meta.epochs_before + epoch}, after the {meta.epochs_before} it trained " \
           f"before this run"


def _stream_resume_message(step: int, position: LoopState, steps_per_epoch: int | None) -> str:
    """What a resume does with a train_loader that is a stream (see :func:`flaxlight.data.is_stream`)."""
    trained = (position.epoch - 1) * (steps_per_epoch or 0) + position.batch_index
    return (f"Resuming with a train_loader that is a stream (an iterator such as a generator, or a loader whose iter() "
            f"hands out one shared iterator), which cannot say where it was: the resumed run passes over its first "
            f"{trained} batches (those the run trained on before checkpoint {step}, {steps_per_epoch or 0} per epoch) "
            f"and trains on the next ones. It continues exactly only if this stream yields "
            f"the same batches in the same order as the run's first one (e.g. a generator made again from the same "
            f"seed and data).")


@dataclasses.dataclass(frozen=True)
class ResumeTarget:
    """What ``train_model``'s ``resume`` / ``resume_from`` ask for, checked by :meth:`make` before
    the run's folder is claimed (a refusal writes nothing).

    Attributes:
        resume_from: the path restored from (None: the run's own newest checkpoint).
        resumes: whether the run starts from a checkpoint at all.
        continuing: whether the run in ``log_dir`` goes on (its files are this run's history).
        rewind_step: ``resume_from`` is one of the run's own checkpoints: those after it are a
            branch the run leaves, set aside by :meth:`begin` (:func:`set_aside_branch`).
        replaces: another run's checkpoint continued with ``overwrite=True`` in a ``log_dir``
            holding a run: that run is replaced.

    Examples:
        >>> ResumeTarget.make(True, None, own=None, log_dir="runs/a", overwrite=False)
        ResumeTarget(resume_from=None, resumes=True, continuing=True, rewind_step=None, replaces=False)
    """

    resume_from: str | None
    resumes: bool
    continuing: bool
    rewind_step: int | None = None
    replaces: bool = False
    _found: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # checkpoint()'s answer

    @classmethod
    def make(cls, resume: bool, resume_from: str | os.PathLike | None, *, own: Checkpointer | None,
             log_dir: str | None, overwrite: bool) -> "ResumeTarget":
        """Runs never overwrite runs: ``resume_from`` another run's checkpoint into a ``log_dir``
        holding a run is a ``FileExistsError`` (as the CLI refuses ``--resume A --log-dir B``),
        unless ``overwrite=True`` replaces that run; into a new or empty folder it continues a
        copy. A checkpoint of the run's own ``checkpoints/`` continues (or rewinds) that run."""
        if resume_from is None:
            return cls(None, resumes=resume, continuing=resume)
        source = checkpointer_for(resume_from).directory  # a missing path fails here, before anything is written
        resume_from = os.fspath(resume_from)
        if own is not None and os.path.realpath(source) == os.path.realpath(own.directory):
            return cls(resume_from, resumes=True, continuing=True, rewind_step=step_in_path(resume_from))
        # A run: its hparams.yaml or checkpoints. Records alone (a baseline test of this trainer's) are the claim's.
        present = [name for name in (run_files_present(log_dir) if log_dir is not None and os.path.isdir(log_dir)
                                     else []) if name != "metrics.csv"]
        if present and not overwrite:
            raise FileExistsError(
                f"log_dir {log_dir} already holds a run ({', '.join(present)}), and resume_from={resume_from!r} is "
                f"a checkpoint of another run ({source}): continuing that run here would overwrite this one's "
                f"checkpoints and history. Give a new log_dir to continue it as a copy (logger_params={{'log_dir': "
                f"...}}; without log_dir, a new version_N folder), pass overwrite=True to replace the run in "
                f"{log_dir}, or use resume=True without resume_from to continue the run in {log_dir} itself.")
        return cls(resume_from, resumes=True, continuing=False, replaces=bool(present))

    def start_step(self, own: Checkpointer, current: int) -> int:
        """The model's step the run began at, from which ``max_steps`` leaves it its steps:
        ``current`` (the model's step now) for a new run; for a resume, the one its checkpoint
        records (the newest that reads, or ``resume_from``'s step), so the resumed run's schedule
        is the interrupted one's; ``current`` when there is no checkpoint to resume from.

        Examples:
            >>> ResumeTarget(None, resumes=False, continuing=False).start_step(None, current=30)
            30
        """
        found = self.checkpoint(own)
        return current if found is None else found[1].start_step

    def so_far(self, own: Checkpointer) -> RunSoFar | None:
        """What the run trained before the checkpoint it resumes from (None: a new run, or no
        checkpoint), for :meth:`flaxlight.loop.RunPlan.make`."""
        found = self.checkpoint(own)
        return None if found is None else found[1].so_far()

    def checkpoint(self, own: Checkpointer) -> tuple[Checkpointer, CheckpointMeta] | None:
        """``(where, meta)`` of the checkpoint the run resumes from: ``resume_from``'s step, else the
        newest whose meta reads (of ``own``, or of the run ``resume_from`` names); None for a new
        run or when there is none."""
        if not self.resumes:
            return None
        if id(own) not in self._found:  # read once per train_model call (it asks three times)
            source = own if self.resume_from is None else checkpointer_for(self.resume_from)
            wanted = step_in_path(self.resume_from) if self.resume_from is not None else None
            self._found[id(own)] = None
            for step in [wanted] if wanted is not None else sorted(source.all_steps(), reverse=True):
                try:
                    self._found[id(own)] = source, CheckpointMeta.from_json(source.read_meta(step))
                    break
                except Exception:  # noqa: BLE001 - a damaged checkpoint: the resume skips it too
                    continue
        return self._found[id(own)]

    def begin(self, meta: CheckpointMeta, own: Checkpointer, log_dir: str | None) -> None:
        """Once the checkpoint is read (and accepted by :func:`restore_run`), before the run goes on
        from it: what the run in ``log_dir`` holds after it, a rewind's later checkpoints or the
        records of a run killed (or failed) after its newest checkpoint, is set aside
        (:func:`set_aside_branch`), on process 0."""
        if self.continuing and log_dir is not None and jax.process_index() == 0:
            set_aside_branch(own, log_dir, meta)

    def begin_from_loaded_model(self, step: int, epochs_before: int, own: Checkpointer, log_dir: str | None, *,
                                loaded_from: str) -> None:
        """:meth:`begin` for a fine-tune resumed before its first checkpoint (``resume=True`` of a trainer
        from ``load_from_checkpoint`` logging to a folder of its own, which holds none yet): the run
        goes on from the loaded model (its ``step``; ``epochs_before``: the epochs it had trained), so
        what an earlier attempt recorded after that step (``metrics.csv`` rows, validation files, a
        best) is set aside as for a run killed after its newest checkpoint (:func:`set_aside_branch`).

        Examples:
            >>> target.begin_from_loaded_model(57, 3, trainer.checkpointer, "runs/ft",     # doctest: +SKIP
            ...                                loaded_from="runs/base/checkpoints")
        """
        if self.continuing and log_dir is not None and jax.process_index() == 0:
            meta = CheckpointMeta(step=step, epoch=0, phase="epoch_end", epochs_before=epochs_before)
            set_aside_branch(own, log_dir, meta, start=f"from the model loaded from {loaded_from} (step {step})")


def check_epoch_position(meta: CheckpointMeta, steps_per_epoch: int | None, source: Checkpointer) -> None:
    """A checkpoint saved mid-epoch continues at its batch number: with epochs of another number of
    batches (another batch size), that batch starts elsewhere in the data, so part of the epoch
    would be trained twice or skipped. That is a ``ValueError`` naming the checkpoints of
    ``source`` saved at an epoch's end (:func:`_epoch_end_steps`), where the batch size may change
    (said). A checkpoint taken after an epoch's last batch (an interrupt before the epoch's end
    routine) is at an epoch's end: the resumed run trains none of that epoch's batches again."""
    saved = meta.steps_per_epoch
    if not saved or not steps_per_epoch or saved == steps_per_epoch:
        return
    if meta.mid_epoch:
        ends = _epoch_end_steps(source, up_to=meta.step)
        raise ValueError(
            f"Checkpoint {meta.step} in {source.directory} was saved mid-epoch (epoch {meta.epoch}, after batch "
            f"{meta.batch_index} of {saved}), and this run's epochs have {steps_per_epoch} batches: another batch "
            f"size (or limit_train_batches / steps_per_epoch) than the run's. Continuing at batch "
            f"{meta.batch_index} would train part of epoch {meta.epoch}'s examples twice or skip some. Resume with "
            f"the run's train_loader and settings ({saved} batches per epoch: a checkpoint it saves at an epoch's "
            f"end then resumes with the new batch size), or from a checkpoint saved at an epoch's end, where the "
            f"batch size may change: resume_from='{source.directory}/<step>' "
            f"({'steps there: ' + ', '.join(map(str, ends)) if ends else 'none is kept there yet'}).")
    next_epoch = meta.epoch + (meta.phase != "train" or meta.trained_whole_epoch)
    messages.info("The run's epochs had %d batches and this run's have %d (another batch size or limit): from "
                  "epoch %d on, each has %d.", saved, steps_per_epoch, next_epoch, steps_per_epoch)


def _epoch_end_steps(source: Checkpointer, up_to: int) -> list[int]:
    """The checkpoints of ``source`` up to step ``up_to`` saved at an epoch's end (not
    :attr:`CheckpointMeta.mid_epoch`: a resume may change the batch size there), by their meta."""
    ends = []
    for step in source.all_steps():
        if step > up_to:
            continue
        try:
            meta = CheckpointMeta.from_json(source.read_meta(step))
        except Exception:  # noqa: BLE001 - a damaged checkpoint's meta: not one to suggest
            continue
        if not meta.mid_epoch:
            ends.append(step)
    return sorted(ends)


def set_aside_branch(own: Checkpointer, log_dir: str, meta: CheckpointMeta, start: str | None = None) -> str | None:
    """Rewind the run in ``log_dir`` to its checkpoint ``meta.step``: what came after it is a branch
    the run leaves. Its later checkpoints move to ``<log_dir>/abandoned/after_step_<step>/checkpoints/``,
    next to copies of the run's ``hparams.yaml``, ``metrics.csv`` and ``metrics/`` as they were (a
    run folder: ``load_from_checkpoint`` reads it), and that is said. The run's own ``metrics/``
    then drops the later validations' and tests' files (their copies stay there) and its
    ``best_eval.json`` is the checkpoint's best (the CSV rows after the step are dropped by the
    loggers' resume). With no later checkpoint (a run killed, or failed, after its newest one), its
    records after the step (``metrics.csv`` rows, validation and test files, a later best) are set
    aside the same way, without checkpoints, and that is said. ``start``: where the run went on from
    when that is no checkpoint of its own (``"from the model loaded from ..."``: a fine-tune's).
    Returns the folder (None when nothing came after the step: nothing moves)."""
    own.wait()
    later = sorted((step for step in own.all_steps() if step > meta.step), reverse=True)
    records = _later_records(log_dir, meta)
    if not later and not records:
        return None
    base = os.path.join(log_dir, ABANDONED_DIR, f"after_step_{meta.step}")
    aside = next(path for path in (base if n == 1 else f"{base}_{n}" for n in range(1, 10**6))
                 if not os.path.exists(path))
    os.makedirs(os.path.join(aside, CHECKPOINT_DIR) if later else aside)
    for name in (HPARAMS_FILE, "metrics.csv"):
        if os.path.isfile(os.path.join(log_dir, name)):
            shutil.copy2(os.path.join(log_dir, name), os.path.join(aside, name))
    if os.path.isdir(os.path.join(log_dir, METRICS_DIR)):
        shutil.copytree(os.path.join(log_dir, METRICS_DIR), os.path.join(aside, METRICS_DIR))
    for step in later:  # the newest first: a kill part-way leaves the fewest of them behind
        os.rename(os.path.join(own.directory, str(step)), os.path.join(aside, CHECKPOINT_DIR, str(step)))
    own.reload()
    _drop_later_metrics(log_dir, meta)
    if not later:
        messages.warning(f"{_why_no_later_checkpoint(log_dir, meta, start)} ({'; '.join(records)}) describe "
                         f"models no checkpoint holds. They are set aside in {aside} "
                         f"(with the run's hparams.yaml, metrics.csv and metrics/ as they were); this run's "
                         f"metrics.csv and metrics/ go on from step {meta.step}."
                         + (" To resume where a run ended, keep ModelCheckpoint's save_last=True (the default: the "
                            "best and the last checkpoint are kept)." if _kept_no_last(meta) else ""))
        return aside
    messages.warning(f"Rewinding the run in {log_dir} to checkpoint {meta.step}: checkpoints "
                     f"{', '.join(map(str, sorted(later)))} came after it, on a branch this run leaves. They are moved "
                     f"to {aside} (with the run's hparams.yaml, metrics.csv and metrics/ as they were; "
                     f"load_from_checkpoint({aside!r}) loads that branch). This run's best and last checkpoints, "
                     f"metrics.csv and metrics/ go on from step {meta.step}.")
    return aside


def _kept_no_last(meta: CheckpointMeta) -> bool | None:
    """Whether the run's ``ModelCheckpoint`` kept only its best checkpoints (``save_last=False``),
    as its state in checkpoint ``meta`` says (None: not said, a checkpoint of an older flaxlight)."""
    said = [state["save_last"] for state in meta.callbacks.values()
            if isinstance(state, Mapping) and {"save_last", "last_step", "best"} <= set(state)]
    return None if not said else not all(said)


def _why_no_later_checkpoint(log_dir: str, meta: CheckpointMeta, start: str | None) -> str:
    """The first words of :func:`set_aside_branch`'s message about a run that saved no checkpoint
    after ``meta.step``: it kept none (``save_last=False``), or it ended before saving again."""
    if start is not None:
        return (f"The run in {log_dir} went on {start} and ended (killed, or failed) before saving a checkpoint, so "
                f"its records of that training")
    kept_no_last = _kept_no_last(meta)
    if kept_no_last:
        kept = "its best" if meta.best_step == meta.step else "the newest it kept"
        return (f"The run in {log_dir} kept no last checkpoint (ModelCheckpoint(save_last=False): only the ones "
                f"save_top_k keeps), so it goes on from checkpoint {meta.step}, {kept} ({_place(meta)}), not from "
                f"where it ended: its records of the training after that checkpoint")
    how = "killed, or failed" if kept_no_last is False else \
        "killed, or failed; or it kept only its best checkpoints: ModelCheckpoint(save_last=False)"
    return (f"The run in {log_dir} went on after checkpoint {meta.step} and ended ({how}) before saving again, so its "
            f"records of that training")


def _later_records(log_dir: str, meta: CheckpointMeta) -> list[str]:
    """What the run in ``log_dir`` recorded after checkpoint ``meta.step``, said in a few words
    (empty: nothing): ``metrics.csv`` rows of later steps, validation and test files of later
    epochs or steps, a ``best_eval.json`` other than the checkpoint's best."""
    found = []
    rows = _rows_after(os.path.join(log_dir, "metrics.csv"), meta.step)
    if rows:
        found.append(f"{rows} metrics.csv row(s) of later steps")
    files = _later_metric_files(log_dir, meta)
    if files:
        found.append(f"{len(files)} file(s) in {METRICS_DIR}/ ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})")
    if not _same_metrics(_best_file(log_dir), _best_as_of(meta) or None):
        found.append(f"{METRICS_DIR}/best_eval.json of a later validation")
    return found


def _rows_after(table: str, step: int) -> int:
    """How many rows of the CSV file ``table`` were logged after ``step`` (by their
    ``trainer/global_step``, else their step; as the CSV logger's resume drops them)."""
    if not os.path.isfile(table):
        return 0
    with open(table, newline="", encoding="utf-8", errors="replace") as f:
        steps = [row.get("trainer/global_step") or row.get("step") for row in csv.DictReader(f)]
    return sum(1 for value in steps if str(value or "").strip().isdigit() and int(value) > step)


def _later_metric_files(log_dir: str, meta: CheckpointMeta) -> list[str]:
    """The run's validation files of epochs or steps after checkpoint ``meta.step``, and its test
    files logged after it (:func:`_later_tests`), in order."""
    folder = os.path.join(log_dir, METRICS_DIR)
    # an epoch cut short (max_steps, stop()) and validated at the cut: that validation is the checkpoint's model's
    whole = meta.phase == "epoch_end" or meta.validated or meta.cut_validated
    last_epoch = meta.epochs_before + (meta.epoch if whole else meta.epoch - 1)
    later = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        found = re.fullmatch(r"eval_(epoch|step)_(\d+)\.json", name)
        if found and int(found[2]) > (last_epoch if found[1] == "epoch" else meta.step):
            later.append((found[1], int(found[2]), name))
    return [name for *_, name in sorted(later)] + _later_tests(log_dir, meta.step)


def _best_as_of(meta: CheckpointMeta) -> dict:
    """The best validation's metrics as of the checkpoint, as ``best_eval.json`` holds them: without
    the epoch's train means saved with them (the names ``meta.train_metrics`` has, ``epoch_time``),
    but with a ``train/...`` value a callback logged during the validation.

    Examples:
        >>> _best_as_of(CheckpointMeta(step=8, best_eval_metrics={"val/loss": 0.5, "train/loss": 0.4,
        ...     "train/seen": 2.0, "epoch_time": 1.0}, train_metrics={"train/loss": 0.3, "epoch_time": 1.1}))
        {'val/loss': 0.5, 'train/seen': 2.0}
    """
    means = meta.train_metrics or {}
    return {key: value for key, value in (meta.best_eval_metrics or {}).items()
            if key not in means and key != "epoch_time"}


def _best_file(log_dir: str) -> dict | None:
    """The run's ``metrics/best_eval.json`` (None: none, or unreadable)."""
    return _best_file_at(os.path.join(log_dir, METRICS_DIR, "best_eval.json"))


def _best_file_at(path: str) -> dict | None:
    """A metrics file (``metrics/<name>.json``) as a dict (None: none, or unreadable)."""
    try:
        with open(path) as f:
            metrics = json.load(f)
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) else None


def _same_metrics(first: Mapping[str, Any] | None, second: Mapping[str, Any] | None) -> bool:
    """Whether two metric dicts (as JSON holds them) have the same names and values (NaN equals NaN)."""
    if first is None or second is None:
        return first is None and second is None
    return set(first) == set(second) and all(
        _same_number(str(first[key]), second[key]) if isinstance(second[key], (int, float)) else first[key] == second[key]
        for key in first)


def _drop_later_metrics(log_dir: str, meta: CheckpointMeta) -> None:
    """The run's ``metrics/`` as of checkpoint ``meta.step``: no validation or test files after it
    (:func:`_later_metric_files`), and ``best_eval.json`` the checkpoint's best validation (none
    before one)."""
    folder = os.path.join(log_dir, METRICS_DIR)
    for name in _later_metric_files(log_dir, meta):
        os.remove(os.path.join(folder, name))
    best = _best_as_of(meta)
    if best and not _same_metrics(_best_file(log_dir), best):
        write_metrics(log_dir, "best_eval", best)
    elif not best and os.path.isfile(os.path.join(folder, "best_eval.json")):
        os.remove(os.path.join(folder, "best_eval.json"))


def _later_tests(log_dir: str, step: int) -> list[str]:
    """The run's test results (``metrics/test*.json``: ``test.json``, ``test.2.json``,
    ``test_<name>.json``, ...) logged after ``step``: a file whose metrics only ``metrics.csv`` rows
    of later steps hold (a test's row holds its metrics; the file does not say its step)."""
    folder, table = os.path.join(log_dir, METRICS_DIR), os.path.join(log_dir, "metrics.csv")
    if not os.path.isdir(folder) or not os.path.isfile(table):
        return []
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    later = []
    for name in sorted(os.listdir(folder)):
        if not re.fullmatch(r"test(_[A-Za-z0-9_-]+)?(\.\d+)?\.json", name):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                result = {key: value for key, value in json.load(f).items() if isinstance(value, (int, float))}
        except (OSError, ValueError, AttributeError):  # not a test's metrics: left alone
            continue
        steps = [int(row["step"]) for row in rows if result and str(row.get("step") or "").isdigit()
                 and all(_same_number(row.get(key), value) for key, value in result.items())]
        if steps and min(steps) > step:
            later.append(name)
    return later


def _same_number(cell: str | None, value: float) -> bool:
    """Whether a ``metrics.csv`` cell holds ``value`` (as the CSV writes it; NaN equals NaN)."""
    try:
        number = float(cell)
    except (TypeError, ValueError):
        return False
    return (math.isnan(number) and math.isnan(value)) or math.isclose(number, value, rel_tol=1e-6, abs_tol=1e-12)


def _newest_meta(checkpointer: Checkpointer) -> CheckpointMeta | None:
    """The meta of the newest checkpoint whose meta reads (None when none does)."""
    for step in sorted(checkpointer.all_steps(), reverse=True):
        try:
            return CheckpointMeta.from_json(checkpointer.read_meta(step))
        except Exception:  # noqa: BLE001 - a damaged checkpoint: try the one before
            continue
    return None


def run_length(checkpointer: Checkpointer) -> tuple[int, int]:
    """``(epochs, steps per epoch)`` whose product is the train steps the run's optimizer schedule
    spans (for ``init_optimizer``: the same schedule again), from the newest checkpoint whose meta
    reads; ``(1, 1)`` when unknown."""
    meta = _newest_meta(checkpointer)
    if meta is None:
        return 1, 1
    if meta.schedule_steps:
        return 1, meta.schedule_steps
    return meta.num_epochs or 1, meta.steps_per_epoch or 1


def checkpoint_epoch(checkpointer: Checkpointer, step: int) -> int | None:
    """The run's epoch (1-based) that checkpoint ``step`` was saved in (after it, or during it for a
    checkpoint taken mid-epoch); None when its meta does not read."""
    try:
        return CheckpointMeta.from_json(checkpointer.read_meta(step)).epoch
    except Exception:  # noqa: BLE001 - a checkpoint without a readable meta: the caller falls back
        return None


def epoch_length(checkpointer: Checkpointer) -> int | None:
    """The run's batches per epoch, from the newest checkpoint whose meta reads (where an
    accumulating optimizer applied a partial group: its schedule's updates depend on it); None
    when unknown."""
    meta = _newest_meta(checkpointer)
    return None if meta is None else meta.steps_per_epoch


def earlier_epochs(checkpointer: Checkpointer) -> tuple:
    """``((batches, epoch length), ...)`` the run trained in epochs of other lengths before its
    newest checkpoint's (resumed with another batch size; its schedule counts their updates with
    their lengths), from the newest checkpoint whose meta reads; ``()`` when none or unknown."""
    meta = _newest_meta(checkpointer)
    return () if meta is None else tuple(tuple(pair) for pair in meta.earlier_epochs)


def load_with_fallback(checkpointer: Checkpointer, state: Any, which: str,
                       load: Callable[[int], Any] | None = None, step: int | None = None) -> tuple[Any, int]:
    """``(state, step)``: the ``which`` checkpoint (``step``: that one) loaded by ``load(step)`` (default:
    restored into ``state``), and its step, the batches it trained (``state.step`` counts optimizer
    updates); past a damaged one, with a warning, the newest that reads; a damaged best checkpoint
    kept for its score (older than the newest), or the ``step`` asked for, raises
    :class:`DamagedCheckpointError` instead: no other checkpoint holds that model. A checkpoint of
    another model or optimizer raises its own error."""
    load = load or (lambda step: checkpointer.restore(state, step=step))
    asked = step is not None
    if asked and step not in checkpointer.all_steps():
        raise FileNotFoundError(_missing_checkpoint_message(os.path.join(checkpointer.directory, str(step))))
    step = step if asked else pick_checkpoint(checkpointer, which)
    try:
        return load(step), step
    except Exception as exc:  # noqa: BLE001 - orbax, tensorstore and JSON raise many types
        if getattr(exc, "flaxlight_user_code", False) or checkpointer.describe_mismatch(state, step):
            raise  # an error of the user's load_model (never damage), or another model's checkpoint
        regrouped = checkpointer.describe_regrouping(state, step)
        if regrouped:  # another grouping of the optimizer's state (freeze changed), not damage
            raise ValueError(regrouped) from exc
        cause = exc.__cause__ if isinstance(exc, DamagedCheckpointError) and exc.__cause__ is not None else exc
        problem = (f"Checkpoint {step} in {checkpointer.directory} is damaged or partial ({type(cause).__name__}: "
                   f"{_first_line(cause)})")
        earlier = [s for s in checkpointer.all_steps() if s != step]
        if asked:
            others = f"; the run holds {', '.join(map(str, sorted(earlier)))}" if earlier else ""
            raise DamagedCheckpointError(f"{problem}. It is the checkpoint asked for{others}.") from exc
        if not earlier:
            raise DamagedCheckpointError(f"{problem}, and it is the run's only checkpoint: train again.") from exc
        if which == "best" and step < max(earlier):  # a best kept for its score: no other is it
            raise DamagedCheckpointError(f"{problem}. It is the run's best checkpoint and no other holds that model: "
                                         f"load which='last' (step {max(earlier)}) for the newest one, or train "
                                         f"again.") from exc
        warnings.warn(f"{problem}; loading the newest readable checkpoint instead.", RuntimeWarning, stacklevel=3)
        state, _, step = checkpointer.restore_latest_valid(state, load=load, before=max(earlier) + 1)
        return state, step


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """An error's message, first line, at most ``limit`` characters: one line to show."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def checkpointer_for(path: str | os.PathLike) -> Checkpointer:
    """A read-only view of the checkpoints named by a run dir, a checkpoints dir or a step dir."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, HPARAMS_FILE)):
        path = os.path.join(path, CHECKPOINT_DIR)
    elif step_in_path(path) is not None:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(_missing_checkpoint_message(path))
    return Checkpointer(path, read_only=True)


def _missing_checkpoint_message(path: str) -> str:
    """What a missing checkpoint path is: a step the run did not keep (naming those it kept), or no folder."""
    parent, name = os.path.split(path)
    steps = sorted(int(entry) for entry in os.listdir(parent) if entry.isdigit()) if os.path.isdir(parent) else []
    if name.isdigit() and steps:
        return (f"No checkpoint of step {name} in {parent}: it holds steps {', '.join(map(str, steps))}. By default "
                f"only the best and the last checkpoints are kept; ModelCheckpoint(save_top_k=-1) with every_n_epochs "
                f"or every_n_steps keeps every one it writes.")
    return f"No checkpoint directory at {path}."


def step_in_path(path: str | os.PathLike) -> int | None:
    """``.../checkpoints/120`` -> 120 (a step dir written by orbax), else None."""
    path = os.path.abspath(os.fspath(path))
    name = os.path.basename(path)
    if name.isdigit() and os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")):
        return int(name)
    return None


def named_callbacks(callbacks: Sequence[Any]) -> list[tuple[str, Any]]:
    """The names callback states are saved under: each callback's ``state_key`` (by default its
    class name; EarlyStopping adds its monitor and mode, as Lightning's ``Callback.state_key``),
    numbered in list order when several callbacks share one (``"Counter"``, ``"Counter_2"``).

    Examples:
        >>> from flaxlight.callbacks import EarlyStopping, Timer
        >>> [name for name, _ in named_callbacks([EarlyStopping("val/acc", mode="max"), Timer(60), Timer(90)])]
        ["EarlyStopping{'monitor': 'val/acc', 'mode': 'max'}", 'Timer', 'Timer_2']
    """
    counts: dict[str, int] = {}
    named = []
    for callback in callbacks:
        base = getattr(callback, "state_key", type(callback).__name__)
        if not isinstance(base, str) or not base:
            raise TypeError(f"{type(callback).__name__}.state_key must be a non-empty str (the name its state is "
                            f"saved under in checkpoints), got {base!r}.")
        counts[base] = counts.get(base, 0) + 1
        named.append((base if counts[base] == 1 else f"{base}_{counts[base]}", callback))
    return named


def match_states(saved: Mapping[str, Any], callbacks: Sequence[Any],
                 by_position: bool = False) -> tuple[list[tuple[Any, Any]], list[str]]:
    """``([(callback, state)], names left)``: each callback with the state saved under its name
    (:func:`named_callbacks`). ``by_position``: the states of a checkpoint whose flaxlight named them
    by class and position (``"EarlyStopping"``, ``"EarlyStopping_2"``): a state no name matches goes, as it did then, to
    the callback of that class at that position among the callbacks of its class.

    Examples:
        >>> from flaxlight.callbacks import EarlyStopping
        >>> stoppers = [EarlyStopping("val/acc", mode="max"), EarlyStopping("val/loss")]
        >>> matched, left = match_states({"EarlyStopping{'monitor': 'val/loss', 'mode': 'min'}": {"wait": 1}}, stoppers)
        >>> [(callback.monitor, state) for callback, state in matched], left
        ([('val/loss', {'wait': 1})], [])
        >>> matched, left = match_states({"EarlyStopping": {"wait": 1}, "EarlyStopping_2": {"wait": 2}}, stoppers,
        ...                              by_position=True)
        >>> [(callback.monitor, state) for callback, state in matched], left
        ([('val/acc', {'wait': 1}), ('val/loss', {'wait': 2})], [])
    """
    left = dict(saved)
    matched, unmatched = [], []
    for name, callback in named_callbacks(callbacks):
        if name in left:
            matched.append((callback, left.pop(name)))
        else:
            unmatched.append(callback)
    if by_position:  # the names earlier versions gave, in list order: class, then class_2, class_3, ...
        waiting = {id(callback) for callback in unmatched}
        for old_name, callback in _positional_names(callbacks):
            if id(callback) in waiting and old_name in left:
                matched.append((callback, left.pop(old_name)))
    return matched, list(left)


def _positional_names(callbacks: Sequence[Any]) -> list[tuple[str, Any]]:
    """The state names of checkpoints written before ``Callback.state_key``: the class name,
    numbered by position among the callbacks of that class."""
    counts: dict[str, int] = {}
    named = []
    for callback in callbacks:
        kind = type(callback).__name__
        counts[kind] = counts.get(kind, 0) + 1
        named.append((kind if counts[kind] == 1 else f"{kind}_{counts[kind]}", callback))
    return named


def _names(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names))


_JSON_SCALARS, _STR = frozenset((str, int, float, bool, type(None))), frozenset((str,))
_TAGS = ("__tuple__", "__set__", "__frozenset__", "__items__", "__array__")  # a callback state's non-JSON parts


def encode_state(value: Any, where: str = "state") -> Any:
    """A callback's ``state_dict()`` as JSON that :func:`decode_state` turns back into the same
    values: tuples, sets, frozensets, dicts with keys that are not strings and numeric numpy
    arrays and scalars are tagged (a JAX array comes back as a numpy one); anything else that
    JSON cannot hold is an error naming its place (``where``: the state's name).

    Examples:
        >>> decode_state(encode_state({1: (2, 3), "best": np.float32(0.5)}))
        {1: (2, 3), 'best': np.float32(0.5)}
    """
    return _encode(value, where)


def _encode(value: Any, where: Any) -> Any:
    """:func:`encode_state`'s walk. ``where`` is the place: a name, or ``(parent, key, how)``, put
    into words (:func:`_state_place`) only for an error: a save at each new best encodes a ``History``
    of every epoch so far, and naming each value's place as it went cost 5 us a row."""
    kind = type(value)
    if kind in _JSON_SCALARS:  # most values: no isinstance checks against the ABCs
        return value
    if isinstance(value, (str, bool, int, float)):  # their subclasses (np.float64, an IntEnum)
        return value
    if kind is dict and _STR.issuperset(map(type, value)) and value.keys().isdisjoint(_TAGS):
        if _JSON_SCALARS.issuperset(map(type, value.values())):  # a row of numbers: copied whole
            return dict(value)
        return {key: _encode(item, (where, key, "item")) for key, item in value.items()}
    if isinstance(value, Mapping):  # any Mapping, read through its items() as it defines them
        if all(isinstance(key, str) for key in value) and not set(value) & set(_TAGS):
            return {key: _encode(item, (where, key, "item")) for key, item in value.items()}
        return {"__items__": [[_encode(key, (where, key, "key")), _encode(item, (where, key, "item"))]
                              for key, item in value.items()]}
    if kind is list or isinstance(value, (tuple, list, set, frozenset)):
        items = [_encode(item, (where, i, "index")) for i, item in enumerate(value)]
        tag = "__frozenset__" if isinstance(value, frozenset) else "__set__" if isinstance(value, set) else "__tuple__"
        return items if isinstance(value, list) else {tag: items}
    if isinstance(value, (np.ndarray, np.generic, jax.Array)) and (
            np.asarray(value).dtype.kind in "biuf" or np.asarray(value).dtype.name == "bfloat16"):
        array = np.asarray(value)
        return {"__array__": array.tolist(), "dtype": str(array.dtype), "scalar": isinstance(value, np.generic)}
    raise TypeError(f"{_state_place(where)} holds a {type(value).__module__}.{type(value).__qualname__} ({value!r:.60}), "
                    f"which a checkpoint cannot keep: a callback's state may hold numbers, strings, None, lists, tuples, "
                    f"sets, dicts and numeric numpy/JAX arrays. Convert it in state_dict() (and back in "
                    f"load_state_dict()).")


def _state_place(where: Any) -> str:
    """``(("KeepsADate.state_dict()", "log", "item"), 2, "index")`` -> ``"KeepsADate.state_dict()['log'][2]"``."""
    parts = []
    while isinstance(where, tuple):
        where, key, how = where
        parts.append(f"[{key!r}]" if how == "item" else f"[{key}]" if how == "index" else " key")
    return where + "".join(reversed(parts))


def decode_state(value: Any) -> Any:
    """The inverse of :func:`encode_state` (a state saved before it was used reads as it was saved)."""
    if isinstance(value, list):
        return [decode_state(item) for item in value]
    if not isinstance(value, Mapping):
        return value
    if "__array__" in value:
        array = np.asarray(value["__array__"], dtype=value["dtype"])
        return array[()] if value.get("scalar") else array
    if "__items__" in value:
        return {_hashable(decode_state(key)): decode_state(item) for key, item in value["__items__"]}
    if "__tuple__" in value:
        return tuple(decode_state(item) for item in value["__tuple__"])
    if "__set__" in value or "__frozenset__" in value:
        items = [_hashable(decode_state(item)) for item in value.get("__set__", value.get("__frozenset__"))]
        return set(items) if "__set__" in value else frozenset(items)
    return {key: decode_state(item) for key, item in value.items()}


def _hashable(value: Any) -> Any:
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _jsonable(value: Any) -> Any:
    """``value`` as JSON data, copied (dicts and lists anew, arrays as nested lists)."""
    if type(value) in _JSON_SCALARS:  # most leaves: no isinstance checks against the ABCs
        return value
    if isinstance(value, (dict, Mapping)):
        if type(value) is dict and _JSON_SCALARS.issuperset(map(type, value.values())):  # a row of numbers
            return dict(value)
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable({field.name: getattr(value, field.name) for field in dataclasses.fields(value)})
    return value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value


def sums_to_json(acc: Mapping[str, Any] | None) -> dict | None:
    """The epoch's metric sums as JSON floats (exact: float32 -> float64 -> float32 round-trips)."""
    if acc is None:
        return None
    host = to_host(acc)
    sums, count, nonfinite = host["totals"].read()
    out = {"sums": sums, "count": count, "nonfinite": nonfinite}
    if "objects" in host:  # metric objects: their leaves, rebuilt on the step's structure at resume
        out["objects"] = {name: [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(value)]
                          for name, value in host["objects"].items()}
    return out


def sums_from_json(sums: Mapping[str, Any] | None) -> dict | None:
    """The inverse of :func:`sums_to_json`: device arrays again."""
    if sums is None:
        return None
    values = [*sums["sums"].values(), sums["count"], sums.get("nonfinite", 0)]
    acc: dict[str, Any] = {"totals": Totals(tuple(sums["sums"]), jnp.asarray(values, jnp.float32))}
    if "objects" in sums:  # see flaxlight.metrics.with_saved_objects
        acc["saved_objects"] = sums["objects"]
    return acc


def epoch_setter(loader: Any) -> Callable[[int], None] | None:
    """The ``set_epoch`` that orders ``loader``'s data, None when it has none: the loader's own
    (flaxlight's ArrayLoader, yours) and, for a torch ``DataLoader``, as Lightning does, those of
    its ``sampler`` (``DistributedSampler``), its ``batch_sampler`` (a bucketing batch sampler)
    and the batch sampler's ``sampler``: each one that has ``set_epoch`` is told, once.

    Examples:
        >>> class Sampler:
        ...     def set_epoch(self, epoch): print("epoch", epoch)
        >>> class Loader:
        ...     batch_sampler = Sampler()
        >>> epoch_setter(Loader())(3)
        epoch 3
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = {id(owner): owner for owner in (loader, getattr(loader, "sampler", None), batch_sampler,
                                             getattr(batch_sampler, "sampler", None)) if owner is not None}
    setters = [owner.set_epoch for owner in owners.values() if callable(getattr(owner, "set_epoch", None))]
    if not setters:
        return None

    def set_epoch(epoch: int) -> None:
        for setter in setters:
            setter(epoch)

    return set_epoch


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Tell a loader which epoch comes (see :func:`epoch_setter`)."""
    set_epoch = epoch_setter(loader)
    if set_epoch is not None:
        set_epoch(epoch)
