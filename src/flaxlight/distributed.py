"""Several devices and processes: a ``jax.sharding.Mesh``, batch and parameter shardings.

``TrainerModule(..., distributed="data_parallel" | "fsdp" | "auto", mesh=None)``:

- ``data_parallel``: parameters and optimizer state replicated on every device, batches split
  along the ``data`` axis; gradients are averaged by XLA (the step is one program over the mesh).
- ``fsdp``: as above, but each parameter (and its optimizer moments) is split along its
  largest dimension divisible by the device count; small tensors stay replicated.
- ``auto``: ``fsdp`` when the parameters are large (over 64 MiB), else ``data_parallel``.

Across processes (hosts), :func:`initialize` starts JAX's distributed runtime; every process
feeds its own slice of each global batch (``ArrayLoader(..., shard_index=jax.process_index(),
num_shards=jax.process_count())``), only process 0 writes logs, all take part in checkpoints.

Examples:
    >>> mesh = make_mesh()                                    # all devices on a "data" axis
    >>> sharding = batch_sharding(mesh)                        # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["MODES", "make_mesh", "batch_sharding", "replicated", "state_shardings", "initialize",
           "resolve_mode", "is_main_process", "to_global_batch"]

MODES = ("data_parallel", "fsdp", "auto")
DATA_AXIS = "data"
FSDP_MIN_ELEMENTS = 2**14  # smaller tensors are replicated: splitting them costs more than it saves
AUTO_FSDP_BYTES = 64 * 2**20


def make_mesh(devices=None) -> Mesh:
    """A 1-D mesh over ``devices`` (default: all, across processes) with the axis ``"data"``."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(np.array(devices), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split along ``data``."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def resolve_mode(mode: str, params) -> str:
    if mode not in MODES:
        raise ValueError(f"distributed must be one of {MODES} or None; got {mode!r}.")
    if mode != "auto":
        return mode
    size = sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    return "fsdp" if size > AUTO_FSDP_BYTES else "data_parallel"


def _fsdp_spec(shape: tuple[int, ...], devices: int) -> PartitionSpec:
    if math.prod(shape) < FSDP_MIN_ELEMENTS:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % devices == 0:
            spec = [None] * len(shape)
            spec[dim] = DATA_AXIS
            return PartitionSpec(*spec)
    return PartitionSpec()


def state_shardings(state, mesh: Mesh, mode: str):
    """Shardings for every array of a TrainState: params and optimizer moments by ``mode``,
    everything else (step, rng, batch statistics, scalars) replicated."""
    devices = mesh.devices.size
    rep = replicated(mesh)

    def for_leaf(leaf):
        shape = tuple(np.shape(leaf))
        if mode == "fsdp" and shape:
            return NamedSharding(mesh, _fsdp_spec(shape, devices))
        return rep

    shardings = jax.tree.map(lambda _: rep, state)
    return shardings.replace(
        params=jax.tree.map(for_leaf, state.params),
        opt_state=jax.tree.map(for_leaf, state.opt_state),
    )


def place(tree, shardings):
    """Put ``tree`` on the mesh as ``shardings`` say, in fresh buffers (safe to donate later)."""
    return jax.jit(lambda t: jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, t),
                   out_shardings=shardings)(tree)


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
    """Fail unless a (global) batch of ``batch_size`` examples splits evenly over the mesh."""
    devices = mesh.devices.size
    if batch_size % devices:
        raise ValueError(
            f"A batch of {batch_size} examples cannot be split over {devices} devices: use a batch size that is "
            f"a multiple of {devices} (global batch = per-device batch x {devices} devices)."
        )


def to_global_batch(batch, mesh: Mesh, block: bool = False):
    """A process-local batch as a global array split along ``data`` (one process: a plain put).

    ``block``: a stack of batches (steps first), split along its second axis.
    """
    sharding = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS)) if block else batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def is_main_process() -> bool:
    """True on process 0 (the one that writes logs and shows progress)."""
    return jax.process_index() == 0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, cpu_collectives: str | None = "gloo") -> None:
    """Start JAX's multi-process runtime; call it first thing in every process.

    Arguments default to the environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``); with none of them, JAX's own cluster detection (SLURM, TPU pods) is
    used. On CPU, collectives go through ``gloo``.

    Example (two processes on one machine, one command each)::

        JAX_COORDINATOR_ADDRESS=127.0.0.1:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python train.py
        JAX_COORDINATOR_ADDRESS=127.0.0.1:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 python train.py
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def describe(mesh: Mesh | None) -> dict[str, Any]:
    """A small summary for logs: devices, processes, mesh shape."""
    if mesh is None:
        return {"devices": 1, "processes": jax.process_count()}
    return {"devices": int(mesh.devices.size), "processes": jax.process_count(), "mesh": dict(mesh.shape)}
