"""Orbax checkpoints of a :class:`TrainState`: every array field, saved atomically and async.

Layout: ``<directory>/<step>/`` with two orbax items: ``state``, one pytree of arrays
``{"params", "opt_state" (when there is an optimizer), "model_state" (batch stats, rng, step,
epoch)}``, and ``meta`` (JSON: metrics and anything the trainer wants to remember). One array
item rather than three halves orbax's work per save (~40 ms less per save for a small model on
2 cores). No pickle anywhere; restoring runs no stored code.

Examples:
    >>> ckpt = Checkpointer("/tmp/run/checkpoints")            # doctest: +SKIP
    >>> ckpt.save(100, state, meta={"val/acc": 0.9})           # doctest: +SKIP
    >>> state = ckpt.restore(state)                            # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import shutil
import time
import uuid
import warnings
from typing import Any, Callable

import jax
import numpy as np

from flaxlight.metrics import checked_copy, deliberate_reads, finite_now, is_typed_key
from flaxlight.writer import BackgroundWriter, Job

__all__ = ["Checkpointer", "Snapshot", "DamagedCheckpointError", "ModelMismatchError"]

_OWN_ITEMS = ("params", "opt_state")  # the checkpoint's other items; every other array field is "model_state"


def _ocp():
    # Importing orbax logs an absl warning about TensorFlow being absent; keep it quiet.
    logging.getLogger("absl").setLevel(logging.ERROR)
    import orbax.checkpoint as ocp

    _finish_reads_on_failure()
    return ocp


_LEFT_RUNNING_SECONDS = 5.0  # how long a failed orbax call waits for its other reads before cancelling them


def _finish_reads_on_failure() -> None:
    """Make a failed orbax restore (or save, or metadata query) finish its other reads before
    orbax closes their event loop (installed before orbax is used; a successful call is untouched).

    orbax runs each such call as one coroutine in a fresh event loop, which it closes as soon as the
    coroutine returns or raises (``orbax.checkpoint._src.asyncio_utils.run_sync`` and its
    ``_run_sync_via_new_loop``). The coroutine reads every array at once (``asyncio.gather``
    without ``return_exceptions`` in ``serialization.async_io_engine.execute_restore`` and
    ``serialization.jax_array_handlers._deserialize_arrays``; the metadata query's
    ``metadata.tree.InternalTreeMetadata.as_custom_metadata`` alike), so when one array of a damaged
    checkpoint fails to read, the gather raises at once and the other reads are left in flight in
    tensorstore's threads. Each one that finishes after the loop closed sends its result to the
    closed loop (``RuntimeError: Event loop is closed``, printed as an unraisable exception: dozens
    per damaged checkpoint); one that finishes in the loop's last turn leaves a task or future whose
    exception nobody retrieves (asyncio logs "Task / Future exception was never retrieved" when it is
    collected: on a busy machine, now and then). Here ``run_sync`` (every orbax call in the process)
    gets the coroutine wrapped by :func:`_finishing_others`: on failure it waits for the loop's other
    tasks, which are that call's own (the loop is fresh), before raising. An orbax without this
    ``run_sync`` is left as it is.
    """
    try:
        from orbax.checkpoint._src import asyncio_utils

        run_sync = asyncio_utils.run_sync
    except (ImportError, AttributeError):  # pragma: no cover - another orbax layout
        return
    if getattr(run_sync, "_flaxlight_finishes_reads", False):
        return

    def finishing_run_sync(coro):
        return run_sync(_finishing_others(coro))

    finishing_run_sync._flaxlight_finishes_reads = True  # type: ignore[attr-defined]
    asyncio_utils.run_sync = finishing_run_sync


async def _finishing_others(coro):
    """``await coro``; when it raises, first wait until every other task of the event loop (the reads
    it left running) is done and retrieve their exceptions: the first error is the one raised."""
    try:
        return await coro
    except Exception:
        await _finish_other_tasks(_LEFT_RUNNING_SECONDS)
        raise


async def _finish_other_tasks(timeout: float) -> None:
    """Wait until the running loop's other tasks (and the tasks they start) are done, marking their
    exceptions retrieved; after ``timeout`` seconds, cancel what still runs and wait one more second."""
    me = asyncio.current_task()
    deadline = time.monotonic() + timeout
    while True:
        await asyncio.sleep(0)  # callbacks already queued (a gather's bookkeeping of a finished read) run
        others = {task for task in asyncio.all_tasks() if task is not me}
        left = deadline - time.monotonic()
        if others and left <= 0:
            for task in others:
                task.cancel()
        if others:
            done, _ = await asyncio.wait(others, timeout=max(left, 1.0))
            for task in done:
                if not task.cancelled():
                    task.exception()
        if not others or left <= 0:
            return


def _abstract(tree):
    ocp = _ocp()
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _key_data(tree):
    """``tree`` with typed PRNG keys (``jax.random.key``, e.g. in ``optax.noisy_sgd``'s state) as
    their raw data: what orbax stores; :func:`_typed_like` wraps them back on restore."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_typed_key(x) else x, tree)


def _typed_like(restored, target):
    """``restored`` with the leaves that are typed keys in ``target`` wrapped as keys again."""
    return jax.tree.map(lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if is_typed_key(t)
                        else r, restored, target)


def flat_shapes(tree) -> dict[str, tuple]:
    """``{"Dense_0/kernel": (4, 8), ...}`` for a tree of arrays or orbax array metadata.

    Examples:
        >>> flat_shapes({"Dense_0": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}})
        {'Dense_0/bias': (8,), 'Dense_0/kernel': (4, 8)}
    """
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        shape = getattr(leaf, "shape", None)
        flat[name] = tuple(shape) if shape is not None else tuple(np.shape(leaf))
    return flat


def param_differences(saved: dict[str, tuple], wanted: dict[str, tuple]) -> dict[str, tuple]:
    """``{path: (checkpoint shape, model shape)}`` for every parameter path whose shape differs
    (None: the path is missing there); empty when nothing was saved to compare with.

    Examples:
        >>> param_differences({"a": (4, 8), "b": (8,)}, {"a": (4, 16), "b": (8,), "c": (2,)})
        {'a': ((4, 8), (4, 16)), 'c': (None, (2,))}
    """
    return {path: (saved.get(path), wanted.get(path)) for path in sorted(set(saved) | set(wanted)) if saved
            and saved.get(path) != wanted.get(path)}


def _param_problems(differences: dict[str, tuple]) -> list[str]:
    """``params/<path>: checkpoint <shape>, model <shape>`` for every path whose shape differs."""
    return [f"  params/{path}: checkpoint {'missing' if got is None else got}, model {'missing' if want is None else want}"
            for path, (got, want) in differences.items()]


def _layer(path: str) -> str:
    """The layer a parameter path is in: ``"head"`` for ``"head/kernel"``."""
    return path.rpartition("/")[0] or path


def _different_model_message(where: str, differences: dict[str, tuple], model_paths: list[str], limit: int) -> str:
    """:class:`ModelMismatchError`'s text: the parameters that differ (the first ``limit``), and the
    way on. When some of the model's layers (of ``model_paths``) fit the checkpoint whole and only
    others differ, as in fine-tuning on a new task (a new head), it names both: the run's own model
    hyperparameters load it as it was, and a partial load (docs/models.md, "Fine-tuning") keeps the
    new layers."""
    problems = _param_problems(differences)
    more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
    text = (f"{where} was saved from a different model; first mismatching parameters:\n" + "\n".join(problems[:limit])
            + more)
    differ = sorted({_layer(path) for path in differences})
    fit = sorted({_layer(path) for path in model_paths} - set(differ))
    if not fit:
        return text + "\nBuild the trainer with the model hyperparameters of that run (see its hparams.yaml)."
    return (f"{text}\nThe model's layers {', '.join(fit)} fit the checkpoint; only {', '.join(differ)} "
            f"differ{'s' if len(differ) == 1 else ''}. To load that run's model as it was, build the trainer with the "
            f"model hyperparameters of that run (see its hparams.yaml). To fine-tune it with new layers of their own "
            f"shapes (e.g. a head for another number of classes), restore the layers that fit and keep the new ones "
            f"as initialised: a partial load (Keras' load_weights(skip_mismatch=True)), shown in docs/models.md, "
            f"section \"Fine-tuning\"; a checkpoint is otherwise restored whole or not at all.")


def _first_metric(metrics: dict) -> float:
    return float(next(iter(metrics.values())))


def _model_state(state) -> dict:
    """The state's fields besides params and optimizer state that hold arrays: step, epoch, rng,
    batch_stats, ``metrics`` and a ``TrainState`` subclass's own fields (an EMA, a counter)."""
    return {field.name: getattr(state, field.name) for field in dataclasses.fields(state)
            if field.metadata.get("pytree_node", True) and field.name not in _OWN_ITEMS
            and getattr(state, field.name) is not None}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A train state's arrays as a checkpoint holds them, taken by :meth:`Checkpointer.snapshot`
    (a copy on the device where saves are written in the background: the next training step
    reuses the state's buffers), and whether its params, optimizer state and batch statistics
    are finite (a damaged model is not saved).

    Examples:
        >>> snapshot = trainer.checkpointer.snapshot(trainer.state)   # doctest: +SKIP
        >>> snapshot.finite                                           # doctest: +SKIP
        True
    """

    arrays: dict
    finite: bool


class DamagedCheckpointError(ValueError):
    """A checkpoint whose files cannot be read (a partial write, damaged files), where no other
    checkpoint will do: the one asked for, or the run's best model, whose weights no other holds."""


class ModelMismatchError(ValueError):
    """A checkpoint whose parameters are shaped unlike the model's: saved from another model (or
    the model was built from another ``exmp_input``); the message names the mismatching paths.
    ``shapes``: ``{path: (checkpoint shape, model shape)}`` of those parameters (None: missing there).

    Examples:
        >>> ModelMismatchError("...", shapes={"head/bias": ((10,), (5,))}).shapes["head/bias"]
        ((10,), (5,))
    """

    def __init__(self, message: str, shapes: dict[str, tuple] | None = None):
        super().__init__(message)
        self.shapes = dict(shapes or {})


class Checkpointer:
    """Save and restore train states under one directory with an orbax ``CheckpointManager``.

    ``max_to_keep`` old checkpoints are kept (None keeps all). Saves and deletions go, in order,
    to one background writer (on one process; with several, orbax's collective async saves):
    :meth:`save` returns once a device-side copy of the state is made, so the training thread
    pays neither the write nor orbax's set-up. With ``max_overhead`` (a fraction of the wall
    time, e.g. 0.03), a save waits in the queue until the writer's work stays within it; a
    newer save that replaces it (:meth:`delete` of a queued step) takes it out of the queue
    unwritten, and :meth:`wait` writes everything queued at once. A failed write is raised on the
    training thread at the next :meth:`save` or :meth:`wait`, and no deletion runs after it
    (the earlier checkpoints stay); a deletion never runs before the save queued ahead of it
    is on disk. :meth:`wait` before reading the files from another process; :meth:`close`
    when done.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 1, async_save: bool = True,
                 read_only: bool = False, max_overhead: float | None = None):
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep, self.async_save, self.read_only = max_to_keep, async_save, read_only
        self._manager_instance = None
        self._swept = read_only  # a killed run's leftovers are removed once, before this object's first write
        self._writer = BackgroundWriter("checkpoints", max_overhead=max_overhead)
        self._steps: set[int] | None = None  # on disk or on their way there (the writer's queue)
        self._held: list[Job] = []  # deletions whose save was replaced: they wait for the next save

    typical_write_seconds = 0.1  # the latest background write's duration in this process (orbax's set-up left out)

    @property
    def max_overhead(self) -> float | None:
        """The share of wall time background writes may take (None: write each save at once)."""
        return self._writer.max_overhead

    def budget_writes(self, max_overhead: float | None) -> None:
        """Keep background writes under ``max_overhead`` of the wall time from now on (None: no
        limit). The first write waits as if one had just been made (its cost is the latest
        write's in this process, else 0.1 s): a short run writes only what may not be skipped."""
        self._writer.max_overhead = max_overhead
        if max_overhead:
            self._writer.hold_off(Checkpointer.typical_write_seconds / max_overhead)

    @property
    def busy(self) -> bool:
        """Whether a save now would wait: the writer is writing, has work queued, or is within
        its ``max_overhead`` pause. A periodic save may be skipped while busy; a save that must
        not be lost can still be made (it waits in the queue)."""
        return self._background and self._writer.busy

    @property
    def last_write_seconds(self) -> float | None:
        """How long the latest background save took to write, orbax's one-time set-up (its import,
        the manager's opening) left out (None before the first)."""
        return self._writer.last_duration

    @property
    def _background(self) -> bool:
        """Whether saves go to this object's writer thread (one process, async saves)."""
        return self.async_save and not self.read_only and jax.process_count() == 1

    @property
    def _manager(self):
        """The orbax manager, created on first use (so a run that never saves writes nothing)."""
        if self._manager_instance is None:
            ocp = _ocp()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                # Saves given `metrics` store them (orbax writes metrics only with a best_fn); which
                # checkpoints to keep is decided by max_to_keep / the caller's deletions, not by them.
                best_fn=None if self.read_only else _first_metric, keep_checkpoints_without_metrics=True,
                # Steps are listed without reading each one's metadata: a damaged checkpoint's files
                # then fail its own restore (and the fallback to the one before), not the opening.
                lightweight_initialize=True,
                enable_async_checkpointing=self.async_save and not self._background,
                create=not self.read_only,
                read_only=self.read_only,
            )
            handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
            if not self._swept:  # before the manager lists the steps: a checkpoint put back is among them
                self._swept = True
                self._sweep_leftovers()
            self._manager_instance = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        return self._manager_instance

    def _sweep_leftovers(self) -> None:
        """Finish what a killed run left half done: remove a deletion (renamed ``.deleting-...``)
        and orbax's temporary folder of an unfinished write (``<step>.orbax-checkpoint-tmp``, never
        a checkpoint); put back a checkpoint set aside for a replacement that never finished
        (``.replacing-<step>-...``). Runs before this object's first write, so none of its own
        writes is touched."""
        if not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if name.startswith(".deleting-") or ".orbax-checkpoint-tmp" in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        for name in os.listdir(self.directory):  # a replaced checkpoint whose replacement never finished
            if name.startswith(".replacing-"):
                step = os.path.join(self.directory, name.split("-")[1])
                if os.path.isdir(step):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                else:
                    try:
                        os.rename(os.path.join(self.directory, name), step)
                    except OSError:  # another process put it back first
                        pass

    def all_steps(self) -> list[int]:
        """The checkpoints' steps, those still being written included."""
        if self._steps is not None:
            return sorted(self._steps)
        if self._manager_instance is None and not os.path.isdir(self.directory):
            return []
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)

    def save(self, step: int, state, meta: dict[str, Any] | None = None,
             metrics: dict[str, float] | None = None, before_write: Callable[[], None] | None = None) -> None:
        """Write ``state`` (a train state, or its :meth:`snapshot`) as checkpoint ``step`` (replacing a
        checkpoint of that step); returns once the arrays are copied on the device (or, with several
        processes, off it).
        ``metrics`` (``{"val/acc": 0.97}``) are stored as the checkpoint's orbax metrics, which
        orbax's ``best_step()`` ranks with a ``best_fn``. ``before_write()`` runs right before the
        write, on the thread that writes (the trainer's: its records reach the disk first)."""
        self._writer.raise_failure_as(self._failure_message)
        step, arrays = int(step), (state if isinstance(state, Snapshot) else self.snapshot(state)).arrays
        if not self._background:
            if before_write is not None:
                before_write()
            if step in self.all_steps():
                self.delete(step, background=False)
            self._write(step, arrays, meta, metrics)
            return
        self._track_steps().add(step)
        self._writer.wait_until(lambda: sum(job.tag[0] == "save" for job in self._writer.pending()) < 2)
        self._writer.submit(self._replace, step, arrays, meta, metrics, before_write, tag=("save", step),
                            throttled=True)
        for job in self._held:  # deletions of replaced saves go behind this one
            self._writer.submit(job.fn, *job.args, tag=job.tag)
        self._held = []

    def snapshot(self, state) -> Snapshot:
        """``state``'s arrays for :meth:`save`, taken now, and whether its params, optimizer state
        and batch statistics hold no NaN/Inf: one dispatch and one small read. Where saves are
        written in the background the arrays are a device copy (the next training step reuses the
        state's buffers), whose move to the host starts at once."""
        arrays = {"params": state.params, "model_state": _model_state(state)}
        if state.opt_state is not None:
            arrays["opt_state"] = state.opt_state
        arrays = _key_data(arrays)
        checked = (state.params, state.opt_state, getattr(state, "batch_stats", None))
        if not self._background:  # written before save() returns: no copy
            return Snapshot(arrays, bool(finite_now(checked)))
        arrays, finite = checked_copy(arrays, checked)
        if jax.devices()[0].platform != "cpu":  # the CPU's arrays are in host memory already
            with deliberate_reads():
                for leaf in jax.tree.leaves(arrays):
                    leaf.copy_to_host_async()
        return Snapshot(arrays, bool(finite))

    def _write(self, step: int, arrays, meta: dict[str, Any] | None, metrics: dict[str, float] | None) -> None:
        ocp = _ocp()
        items = {"state": ocp.args.PyTreeSave(arrays), "meta": ocp.args.JsonSave(dict(meta or {}))}
        self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics or None, force=True)

    def _replace(self, step: int, arrays, meta, metrics, before_write=None) -> float:  # on the writer thread
        """Write checkpoint ``step`` (after ``before_write()``); one of that step already on disk (a
        periodic save, then the step's validation made it the best) is set aside until the new one
        is written, so a kill in between leaves it to be put back (:meth:`_sweep_leftovers`), never
        no checkpoint. Returns the seconds of orbax's one-time set-up and of ``before_write`` it
        began with (importing orbax, opening the manager: ~0.4-0.8 s on 2 cores; the records'
        writers): no write's cost, so the write budget's pause leaves them out."""
        opened = time.monotonic()
        if before_write is not None:
            before_write()
        self._manager  # noqa: B018 - opened (orbax imported) before the write is timed
        start = time.monotonic()
        aside = self._set_aside(step) if step in self._manager.all_steps() else None
        try:
            self._write(step, arrays, meta, metrics)
            self._manager.wait_until_finished()
        except BaseException:
            folder = os.path.join(self.directory, str(step))
            if aside is not None and not os.path.isdir(folder):
                os.rename(aside, folder)  # the failed write's step: the one it replaced again
                self._reopen()
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        Checkpointer.typical_write_seconds = time.monotonic() - start
        return start - opened

    def _set_aside(self, step: int) -> str:
        """Rename checkpoint ``step`` to ``.replacing-<step>-<id>`` (atomic) and return that path."""
        aside = os.path.join(self.directory, f".replacing-{step}-{uuid.uuid4().hex[:8]}")
        os.rename(os.path.join(self.directory, str(step)), aside)
        self._reopen()
        return aside

    def _reopen(self) -> None:
        """Close the orbax manager; it is opened again (lightly) at the next use and lists the folder anew."""
        if self._manager_instance is not None:
            self._manager_instance.close()
            self._manager_instance = None

    def _delete_now(self, step: int) -> None:  # on the writer thread
        """Rename the step's folder out of the way first (atomic: a kill mid-deletion never leaves
        half a checkpoint), then remove it; a killed run's leftovers go when the folder is next opened."""
        folder = os.path.join(self.directory, str(step))
        if step not in self._manager.all_steps() or not os.path.isdir(folder):
            return
        doomed = os.path.join(self.directory, f".deleting-{step}-{uuid.uuid4().hex[:8]}")
        os.rename(folder, doomed)
        self._reopen()
        shutil.rmtree(doomed, ignore_errors=True)

    def _track_steps(self) -> set[int]:
        if self._steps is None:
            self._steps = set(self.all_steps())
        return self._steps

    def _failure_message(self, exc: BaseException) -> RuntimeError:
        self._steps, self._held = None, []  # what is on disk is what orbax lists again
        steps = sorted(self.all_steps())
        kept = f"the earlier checkpoints are kept (steps {', '.join(map(str, steps))})" if steps else "no earlier checkpoint is on disk"
        advice = " Check the disk (space, permissions)." if isinstance(exc, OSError) else ""
        return RuntimeError(f"Writing a checkpoint to {self.directory} failed ({type(exc).__name__}: {exc}); "
                            f"{kept}.{advice}")

    def _withdraw_save(self, step: int) -> bool:
        """Take the queued, unstarted save of ``step`` out of the queue; the deletions queued
        right behind it then wait for the next save instead. Returns whether one was taken out."""
        queue = self._writer.pending()
        at = next((i for i, job in enumerate(queue) if job.tag == ("save", step)), None)
        if at is None or not self._writer.withdraw([queue[at]]):
            return False
        behind = list(itertools.takewhile(lambda job: job.tag[0] != "save", queue[at + 1:]))
        later = next((job for job in queue[at + 1:] if job.tag[0] == "save"), None)
        if behind and not (later is not None and self._writer.insert_after(later, behind)):
            self._held += self._writer.withdraw(behind)
        return True

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON ``meta`` item of a checkpoint (the latest by default)."""
        self.wait()
        ocp = _ocp()
        step = self._resolve(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"] or {})

    def restore(self, target, step: int | None = None, with_opt_state: bool = True):
        """Return ``target`` (a TrainState of the right structure) with the saved arrays.

        The optimizer state is restored when ``with_opt_state`` and ``target`` has one;
        otherwise ``target.opt_state`` is kept (e.g. None for inference).
        """
        self.wait()
        ocp = _ocp()
        step = self._resolve(step)
        self._refuse_mismatch(target, step)
        wanted = {"params": target.params, "model_state": self._saved_part(_model_state(target), step)}
        restore_opt = with_opt_state and target.opt_state is not None
        if restore_opt:
            wanted["opt_state"] = target.opt_state
        abstract = _abstract(_key_data(wanted))
        # partial_restore: the optimizer state stays on disk when it is not wanted.
        item = ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                                      partial_restore=True)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=item))["state"]
        except Exception as exc:  # orbax raises several types; the shapes matched above, so the files are bad
            raise DamagedCheckpointError(
                f"Could not restore checkpoint {step} from {self.directory}: it is damaged or partial (its "
                f"structure matches the model and optimizer built now, its files do not read: "
                f"{type(exc).__name__}: {str(exc)[:300]}). Load another checkpoint (which='last', or an earlier step)."
            ) from exc
        restored = _typed_like(restored, wanted)
        replace = dict(restored.get("model_state") or {})
        replace["params"] = restored["params"]
        if restore_opt:
            replace["opt_state"] = restored["opt_state"]
        return target.replace(**replace)

    def _saved_part(self, model_state: dict, step: int) -> dict:
        """The fields of ``model_state`` that checkpoint ``step`` holds; the others (a field added to
        the state after the run was saved) keep their values, said with a warning."""
        try:
            saved = self._manager.item_metadata(step)["state"]
            saved = set(getattr(saved, "tree", saved).get("model_state") or {})
        except Exception:  # noqa: BLE001 - unreadable metadata is reported by the restore itself
            return model_state
        missing = sorted(set(model_state) - saved)
        if missing:
            warnings.warn(f"Checkpoint {step} in {self.directory} holds no {', '.join(missing)} (a state field it was "
                          f"not saved with): {'it keeps its' if len(missing) == 1 else 'they keep their'} value from "
                          f"the state built now.", RuntimeWarning, stacklevel=3)
        return {name: value for name, value in model_state.items() if name in saved}

    def delete(self, step: int, background: bool = True) -> None:
        """Remove checkpoint ``step``: a save of it still queued is taken out unwritten; one on
        disk is deleted behind the saves queued before (background, one process), else at once
        (with several processes, orbax's coordinated delete)."""
        step = int(step)
        if background and self._background:
            on_disk = step in self._track_steps() and not self._withdraw_save(step)
            self._track_steps().discard(step)
            if on_disk or os.path.isdir(os.path.join(self.directory, str(step))):
                self._writer.submit(self._delete_now, step, tag=("delete", step))
            return
        self.wait()
        if self._steps is not None:
            self._steps.discard(step)
        self._manager.delete(step)

    def restore_latest_valid(self, target, with_opt_state: bool = True, before: int | None = None,
                             load: Callable[[int], Any] | None = None):
        """Restore the newest checkpoint that reads back; returns ``(state, meta, step)``.

        ``load(step)`` restores one step (default: :meth:`restore` into ``target``); the
        trainer passes its ``load_model``, so that an override of it is used.

        A damaged or partial newest checkpoint (truncated or missing files) is skipped with a
        warning and the one before it is tried. A checkpoint of a *different model* is not
        skipped: that is a user error and raises with the mismatching paths; so is an error of a
        ``load_model`` override's own code (marked ``flaxlight_user_code`` by the trainer).
        """
        self.wait()
        steps = sorted((s for s in self.all_steps() if before is None or s < before), reverse=True)
        if not steps:
            raise FileNotFoundError(f"No checkpoint found in {self.directory}.")
        for i, step in enumerate(steps):
            self._refuse_mismatch(target, step)
            try:
                meta = self.read_meta(step)
                state = load(step) if load is not None else self.restore(target, step, with_opt_state)
                return state, meta, step
            except Exception as exc:  # noqa: BLE001 - any read failure means "damaged": try the previous one
                if getattr(exc, "flaxlight_user_code", False):  # the trainer's load_model override's own error
                    raise
                regrouped = self.describe_regrouping(target, step)
                if regrouped:  # not damage: another grouping of the optimizer's state (freeze changed)
                    raise ValueError(regrouped) from exc
                remaining = steps[i + 1 :]
                if not remaining:
                    raise ValueError(f"No readable checkpoint in {self.directory}; the last error: {exc}") from exc
                warnings.warn(
                    f"Checkpoint {step} in {self.directory} is damaged or partial ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); falling back to checkpoint {remaining[0]}.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        raise AssertionError("unreachable")

    def _refuse_mismatch(self, target, step: int) -> None:
        """Raise :meth:`describe_mismatch`'s message: :class:`ModelMismatchError` for parameters."""
        mismatch = self.describe_mismatch(target, step)
        if mismatch and "different model" in mismatch:
            saved = self._saved_metadata(step) or {}
            raise ModelMismatchError(mismatch, shapes=param_differences(flat_shapes(saved.get("params", {})),
                                                                         flat_shapes(target.params)))
        if mismatch:
            raise ValueError(mismatch)

    def _saved_metadata(self, step: int) -> dict | None:
        """The shapes of checkpoint ``step``'s state, as orbax's metadata holds them (None: unreadable)."""
        try:
            saved = self._manager.item_metadata(step)["state"]
            return getattr(saved, "tree", saved)
        except Exception:  # noqa: BLE001 - unreadable metadata is reported by the restore itself
            return None

    def describe_regrouping(self, target, step: int) -> str | None:
        """After a restore of checkpoint ``step`` into ``target`` failed: a message when its
        optimizer state holds arrays of the same shapes as ``target``'s at other places (the
        optimizer's ``freeze`` or ``multi_transform`` groups changed), not damage; else None."""
        saved = self._saved_metadata(step)
        if saved is None or target.opt_state is None or saved.get("opt_state") is None:
            return None
        got, want = set(flat_shapes(saved["opt_state"])), set(flat_shapes(_key_data(target.opt_state)))
        if got == want:
            return None
        return (f"Checkpoint {step} in {self.directory} holds the state of a differently grouped optimizer (its "
                f"arrays sit at {len(got - want)} other place(s), e.g. {sorted(got - want)[0]!r}): optimizer_hparams "
                f"changed (freeze, or the groups of a multi_transform). The checkpoint is not damaged. Resume with the "
                f"run's optimizer_hparams (see its hparams.yaml), or start fresh from its weights: "
                f"load_from_checkpoint(run_dir, exmp_input, with_optimizer=False, optimizer_hparams=...) and "
                f"train_model into a new log_dir.")

    def describe_mismatch(self, target, step: int, limit: int = 5) -> str | None:
        """What differs between checkpoint ``step`` and ``target`` (a readable list of parameter
        paths whose shape differs, or an optimizer state of another shape), or None."""
        self.wait()
        saved = self._saved_metadata(step)
        if saved is None:
            return None
        wanted = flat_shapes(target.params)
        differences = param_differences(flat_shapes(saved.get("params", {})), wanted)
        if differences:
            return _different_model_message(f"Checkpoint {step} in {self.directory}", differences, list(wanted), limit)
        if target.opt_state is None or saved.get("opt_state") is None:
            return None
        got = sorted(flat_shapes(saved["opt_state"]).values())
        want = sorted(flat_shapes(_key_data(target.opt_state)).values())
        if got != want:
            return (f"Checkpoint {step} in {self.directory} holds the state of a different optimizer ({len(got)} "
                    f"arrays; the optimizer built now has {len(want)}): optimizer_hparams changed (optimizer, "
                    f"momentum, accumulate_grad_batches, ...). Resume with the run's optimizer_hparams (see its "
                    f"hparams.yaml), or start fresh from its weights: load_from_checkpoint(run_dir, exmp_input, "
                    f"with_optimizer=False, optimizer_hparams=...) and train_model into a new log_dir.")
        return None

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"No checkpoint found in {self.directory}.")
        if step is None:
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"No checkpoint {step} in {self.directory}; available: {sorted(steps)}.")
        return int(step)

    def wait(self) -> None:
        """Block until the queued saves and deletions are on disk; raise if a write failed."""
        for job in self._held:
            self._writer.submit(job.fn, *job.args, tag=job.tag)
        self._held = []
        self._writer.wait_until(lambda: False)
        if self._manager_instance is not None and not self._background:  # the writer waits after each save
            self._manager_instance.wait_until_finished()
        self._writer.raise_failure_as(self._failure_message)

    def reload(self) -> None:
        """Forget what the manager knows of the folder (after its files changed outside it); the
        next use opens it afresh."""
        self.wait()
        self._steps = None
        if self._manager_instance is not None:
            self._manager_instance.close()
            self._manager_instance = None

    def refresh(self) -> list[int]:
        """List the folder's checkpoints anew, as they are on disk now: another trainer object or
        process may have written or pruned some since this object last looked (orbax's manager keeps
        the list it read). This object's own queued writes finish first. Returns the steps on disk
        now that this object did not know of (another writer's); empty when it had listed nothing yet.

        Examples:
            >>> new = Checkpointer("runs/a/checkpoints").refresh()   # doctest: +SKIP
        """
        if self._steps is None and self._manager_instance is None:  # nothing listed yet (and no folder made)
            return []
        knew = set(self.all_steps())
        self.reload()
        return sorted(set(self.all_steps()) - knew)

    def close(self) -> None:
        self.wait()
        if self._manager_instance is not None:
            self._manager_instance.close()
