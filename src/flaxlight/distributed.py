"""Several devices and processes: a ``jax.sharding.Mesh``, batch and parameter shardings.

``TrainerModule(..., distributed="data_parallel" | "fsdp" | "auto", mesh=None)``:

- ``data_parallel``: parameters and optimizer state replicated on every device, batches split
  along the ``data`` axis; gradients are averaged by XLA (the step is one program over the mesh).
- ``fsdp``: as above, but each parameter (and its optimizer moments) is split along its
  largest dimension divisible by the device count; small tensors stay replicated.
- ``auto``: ``fsdp`` when the parameters are large (over 64 MiB), else ``data_parallel``.

``mesh=`` may be a :class:`jax.sharding.Mesh` or its shape, ``{"data": 2, "model": 2}``; batches
are split over the ``data`` axis. Parameters annotated by the model (Linen
``nn.with_partitioning`` / ``nn.with_logical_partitioning``, the latter mapped to mesh axes by
``sharding_rules=[("embed", "model"), ...]``) are placed as annotated in every mode; the mode
decides only for the others. The optimizer state follows its parameters.

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
import warnings
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["MODES", "make_mesh", "mesh_for", "batch_sharding", "replicated", "state_shardings", "initialize",
           "resolve_mode", "is_main_process", "to_global_batch", "split_annotations"]

MODES = ("data_parallel", "fsdp", "auto")
DATA_AXIS = "data"
FSDP_MIN_ELEMENTS = 2**14  # smaller tensors are replicated: splitting them costs more than it saves
AUTO_FSDP_BYTES = 64 * 2**20


UNANNOTATED = "unannotated"  # a parameter the model did not annotate: the mode decides


def make_mesh(devices=None, shape: dict[str, int] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all, across processes): 1-D with the axis ``"data"``,
    or shaped by ``shape`` (axis name -> size, in order), e.g. ``{"data": 2, "model": 2}``.

    Examples:
        >>> make_mesh().axis_names
        ('data',)
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = dict(shape or {DATA_AXIS: len(devices)})
    if DATA_AXIS not in shape:
        raise ValueError(f"mesh={shape} has no {DATA_AXIS!r} axis, which the batches are split over; add one, "
                         f"e.g. {{'data': 2, 'model': 2}} (a 'data' axis of size 1 keeps whole batches).")
    if math.prod(shape.values()) != len(devices):
        raise ValueError(f"mesh={shape} needs {math.prod(shape.values())} devices, and there are {len(devices)}; "
                         f"choose axis sizes whose product is {len(devices)}.")
    grid = np.array(devices).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape), axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def mesh_for(mesh: Mesh | dict[str, int] | None, distributed: str | None) -> Mesh | None:
    """The trainer's mesh: ``mesh`` as given (a shape dict becomes a :func:`make_mesh`), or all
    devices on ``data`` when only ``distributed`` is set, or None (one device)."""
    if isinstance(mesh, dict):
        return make_mesh(shape=mesh)
    if mesh is None and distributed is not None:
        return make_mesh()
    if mesh is not None and DATA_AXIS not in mesh.axis_names:
        raise ValueError(f"The mesh's axes are {mesh.axis_names}; it needs a {DATA_AXIS!r} axis to split batches over.")
    return mesh


def mesh_record(mesh: Mesh | dict[str, int] | None) -> dict[str, Any]:
    """``{"mesh": {"data": 2, "model": 2}}`` for a run's ``hparams.yaml`` (``{}`` without a mesh)."""
    if mesh is None:
        return {}
    return {"mesh": {str(axis): int(size) for axis, size in dict(mesh if isinstance(mesh, dict) else mesh.shape).items()}}


def fit_mesh(shape: dict[str, int], devices: int | None = None) -> dict[str, int] | None:
    """A saved mesh shape for the ``devices`` present (default: all): its ``data`` axis resized to
    what the other axes leave; None when they do not fit (the model then loads unsharded)."""
    devices = jax.device_count() if devices is None else devices
    others = math.prod(size for axis, size in shape.items() if axis != DATA_AXIS)
    if devices % others:
        return None
    return {axis: devices // others if axis == DATA_AXIS else size for axis, size in shape.items()}


def _data_size(mesh: Mesh) -> int:
    return int(dict(mesh.shape).get(DATA_AXIS, 1))


def data_axis_size(mesh: Mesh) -> int:
    """Devices along the mesh's ``data`` axis (a batch is split into that many parts).

    Examples:
        >>> data_axis_size(make_mesh(jax.devices()[:1]))
        1
    """
    return _data_size(mesh)


def splits(batch, mesh: Mesh) -> bool:
    """Whether ``batch``'s leading dimension divides over the mesh's ``data`` axis."""
    leaves = jax.tree.leaves(batch)
    return not leaves or _leading(leaves[0]) % _data_size(mesh) == 0


def _leading(leaf) -> int:
    """The leading dimension of an array (or a ``jax.ShapeDtypeStruct``)."""
    shape = getattr(leaf, "shape", None)
    return int((shape if shape is not None else np.shape(leaf))[0])


def split_annotations(params, given: Any = None) -> tuple[Any, Any]:
    """``(plain params, annotations)``: Linen partitioning boxes removed, and per parameter its
    :class:`PartitionSpec` (``nn.with_partitioning``), its logical names as a tuple
    (``nn.with_logical_partitioning``) or :data:`UNANNOTATED`; annotations is None when no
    parameter is annotated. ``given``: annotations known otherwise (an NNX model's metadata),
    used when ``params`` carry no Linen boxes."""
    def is_box(x):
        return isinstance(x, nn.meta.AxisMetadata)

    if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
        return params, given

    def annotation(x):
        if isinstance(x, nn.LogicallyPartitioned):
            return tuple(x.names)
        return PartitionSpec(*x.names) if isinstance(x, nn.Partitioned) else UNANNOTATED

    return nn.unbox(params), jax.tree.map(annotation, params, is_leaf=is_box)


def _mesh_spec(annotation, path: str, shape: tuple[int, ...], mesh: Mesh, rules) -> PartitionSpec:
    """An annotation as a PartitionSpec of ``mesh``'s axes (logical names through ``rules``),
    checked: known axes, and each split dimension a multiple of its axes' devices."""
    logical = not isinstance(annotation, PartitionSpec)  # a tuple of logical axis names
    spec = PartitionSpec(*nn.logical_to_mesh_axes(annotation, rules)) if logical else annotation
    for dim, axes in enumerate(spec):
        axes = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a is not None)
        for axis in axes:
            if axis not in mesh.axis_names:
                hint = ("map logical names to mesh axes with sharding_rules=[('embed', 'model'), ...]"
                        if logical else "use the mesh's axis names (for a trainer that loads a run: pass its mesh=...)")
                raise ValueError(f"Parameter {path} is annotated {annotation}, and {axis!r} is not an axis of the "
                                 f"mesh {tuple(mesh.axis_names)}: {hint}.")
        devices = math.prod(mesh.shape[axis] for axis in axes)
        if dim < len(shape) and shape[dim] % devices:
            raise ValueError(f"Parameter {path} of shape {shape} is annotated {annotation} ({spec} on the mesh "
                             f"{dict(mesh.shape)}): its dimension {dim} ({shape[dim]}) does not split over {axes} "
                             f"({devices} devices). Give the mesh axis a size that divides {shape[dim]}, or change "
                             f"the annotation{' or sharding_rules' if logical else ''}.")
    return spec


def _unmapped_names(annotations, rules) -> list[str]:
    """The logical axis names of ``annotations`` that no rule maps (their dimension is not split)."""
    mapped = {rule[0] for rule in rules or ()}
    names = {name for annotation in jax.tree.leaves(annotations, is_leaf=lambda a: isinstance(a, (tuple, PartitionSpec)))
             if isinstance(annotation, tuple) and not isinstance(annotation, PartitionSpec)
             for name in annotation if isinstance(name, str)}
    return sorted(names - mapped)


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
    if devices == 1:
        return PartitionSpec()
    if math.prod(shape) < FSDP_MIN_ELEMENTS:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % devices == 0:
            spec = [None] * len(shape)
            spec[dim] = DATA_AXIS
            return PartitionSpec(*spec)
    return PartitionSpec()


def state_shardings(state, mesh: Mesh, mode: str, annotations=None, rules=None):
    """Shardings for every array of a TrainState: annotated params as annotated (see
    :func:`split_annotations`), the others and their optimizer moments by ``mode`` (FSDP splits
    over ``data``), everything else (step, rng, batch statistics, scalars) replicated. With
    annotations, optimizer moments follow their parameters (``optax.tree_map_params``)."""
    devices = _data_size(mesh)
    rep = replicated(mesh)

    def for_leaf(leaf):
        shape = tuple(np.shape(leaf))
        if mode == "fsdp" and shape:
            return NamedSharding(mesh, _fsdp_spec(shape, devices))
        return rep

    shardings = jax.tree.map(lambda _: rep, state)
    if annotations is None:
        return shardings.replace(params=jax.tree.map(for_leaf, state.params),
                                 opt_state=jax.tree.map(for_leaf, state.opt_state))

    def for_param(path, leaf, annotation):
        if isinstance(annotation, str):
            return for_leaf(leaf)
        return NamedSharding(mesh, _mesh_spec(annotation, jax.tree_util.keystr(path), tuple(np.shape(leaf)), mesh, rules))

    unmapped = _unmapped_names(annotations, rules)
    if unmapped and set(mesh.axis_names) - {DATA_AXIS}:  # a model axis to split over, and names that never reach it
        warnings.warn(f"The logical axis name(s) {unmapped} of the parameters' annotations have no sharding rule, so "
                      f"those dimensions are not split (copied on every device). Map each to a mesh axis "
                      f"(sharding_rules=[({unmapped[0]!r}, 'model'), ...]) or, to keep it whole, to None.",
                      RuntimeWarning, stacklevel=4)

    params = jax.tree_util.tree_map_with_path(for_param, state.params, annotations)  # annotations: a prefix tree
    opt_state = state.opt_state
    if state.tx is not None and opt_state is not None:
        opt_state = optax.tree_map_params(state.tx, lambda _, sharding: sharding, opt_state, params,
                                          transform_non_params=lambda _: rep)
    return shardings.replace(params=params, opt_state=opt_state)


def place(tree, shardings):
    """Put ``tree`` on the mesh as ``shardings`` say, in fresh buffers (safe to donate later)."""
    return jax.jit(lambda t: jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, t),
                   out_shardings=shardings)(tree)


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
    """Fail unless a (global) batch of ``batch_size`` examples splits evenly over the mesh."""
    devices = _data_size(mesh)
    if batch_size % devices:
        raise ValueError(
            f"A batch of {batch_size} examples cannot be split over {devices} devices (the mesh's data axis): use "
            f"a batch size that is a multiple of {devices} (global batch = per-device batch x {devices} devices)."
        )


def check_loader_divisible(loader: Any, mesh: Mesh | None) -> None:
    """:func:`check_batch_divisible` before a run, for a loader that says its batch size (an
    :class:`~flaxlight.ArrayLoader`, a torch ``DataLoader``) on one process; others are checked
    at their first batch."""
    size = getattr(loader, "batch_size", None)
    if mesh is None or jax.process_count() > 1 or isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return
    examples = getattr(loader, "num_examples", None)  # an ArrayLoader's; a torch DataLoader's dataset length
    if examples is None and hasattr(getattr(loader, "dataset", None), "__len__"):
        examples = len(loader.dataset)
    check_batch_divisible(min(size, examples) if isinstance(examples, int) and examples > 0 else size, mesh)


def to_global_batch(batch, mesh: Mesh, block: bool = False):
    """A process-local batch as a global array split along ``data`` (one process: a plain put).

    ``block``: a stack of batches (steps first), split along its second axis. On one process, a
    batch that does not divide (an epoch's smaller last batch) is put whole on every device
    (:func:`splits`); with several, it fails with :func:`check_batch_divisible`'s message.
    """
    sharding = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS)) if block else batch_sharding(mesh)
    if not block and jax.process_count() > 1:  # process-local rows: the global batch must split
        check_batch_divisible(_leading(jax.tree.leaves(batch)[0]) * jax.process_count(), mesh)
    elif not block and not splits(batch, mesh):
        sharding = replicated(mesh)
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
