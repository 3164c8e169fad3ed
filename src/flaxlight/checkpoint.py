"""Orbax checkpoints of a :class:`TrainState`: every array field, saved atomically and async.

Layout: ``<directory>/<step>/`` with the items ``params``, ``opt_state`` (when there is an
optimizer), ``model_state`` (batch stats, rng, step, epoch) and ``meta`` (JSON: metrics and
anything the trainer wants to remember). No pickle anywhere; restoring runs no stored code.

Example:
    >>> ckpt = Checkpointer("/tmp/run/checkpoints")            # doctest: +SKIP
    >>> ckpt.save(100, state, meta={"val/acc": 0.9})           # doctest: +SKIP
    >>> state = ckpt.restore(state)                            # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

__all__ = ["Checkpointer"]

_MODEL_STATE_FIELDS = ("batch_stats", "rng", "step", "epoch")


def _ocp():
    # Importing orbax logs an absl warning about TensorFlow being absent; keep it quiet.
    logging.getLogger("absl").setLevel(logging.ERROR)
    import orbax.checkpoint as ocp

    return ocp


def _abstract(tree):
    ocp = _ocp()
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _model_state(state) -> dict:
    return {name: getattr(state, name) for name in _MODEL_STATE_FIELDS if getattr(state, name) is not None}


class Checkpointer:
    """Save and restore train states under one directory with an orbax ``CheckpointManager``.

    ``max_to_keep`` old checkpoints are kept (None keeps all). Saves are asynchronous: call
    :meth:`wait` before reading files from another process, :meth:`close` when done.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 1, async_save: bool = True,
                 read_only: bool = False):
        ocp = _ocp()
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, meta: dict[str, Any] | None = None) -> None:
        """Write ``state`` as checkpoint ``step`` (returns once the arrays are copied off device)."""
        ocp = _ocp()
        items = {
            "params": ocp.args.StandardSave(state.params),
            "model_state": ocp.args.StandardSave(_model_state(state)),
            "meta": ocp.args.JsonSave(dict(meta or {})),
        }
        if state.opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(state.opt_state)
        self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON ``meta`` item of a checkpoint (the latest by default)."""
        ocp = _ocp()
        step = self._resolve(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"] or {})

    def restore(self, target, step: int | None = None, with_opt_state: bool = True):
        """Return ``target`` (a TrainState of the right structure) with the saved arrays.

        The optimizer state is restored when ``with_opt_state`` and ``target`` has one;
        otherwise ``target.opt_state`` is kept (e.g. None for inference).
        """
        ocp = _ocp()
        step = self._resolve(step)
        target_model_state = _model_state(target)
        items = {
            "params": ocp.args.StandardRestore(_abstract(target.params)),
            "model_state": ocp.args.StandardRestore(_abstract(target_model_state)),
        }
        restore_opt = with_opt_state and target.opt_state is not None
        if restore_opt:
            items["opt_state"] = ocp.args.StandardRestore(_abstract(target.opt_state))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as exc:  # orbax raises several types; say which file and what to do
            raise ValueError(
                f"Could not restore checkpoint {step} from {self.directory}: {exc}. The checkpoint "
                f"does not match the model/optimizer built now (changed hyperparameters?), or it is damaged."
            ) from exc
        replace = dict(restored["model_state"])
        replace["params"] = restored["params"]
        if restore_opt:
            replace["opt_state"] = restored["opt_state"]
        return target.replace(**replace)

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
        """Block until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
