"""Several devices and processes: a ``jax.sharding.Mesh``, batch and parameter shardings.

``TrainerModule(..., distributed="data_parallel" | "fsdp" | "auto", mesh=None)``:

- ``data_parallel``: parameters and optimizer state replicated on every device, batches split
  along the ``data`` axis; gradients are averaged by XLA (the step is one program over the mesh).
- ``fsdp``: as above, but each parameter (and its optimizer moments) is split along its
  largest dimension divisible by the device count; small tensors stay replicated.
- ``auto``: ``fsdp`` when the parameters are large (over 64 MiB), else ``data_parallel``.

``mesh=`` may be a :class:`jax.sharding.Mesh` or its shape, ``{"data": 2, "model": 2}``; batches
are split over the ``data`` axis (each per-example leaf along its first axis; on one process a
leaf that is not per-example, such as class weights, is put whole on every device). A mesh's axes
are used as ``Auto`` axes (``jax.make_mesh`` makes ``Explicit`` ones; under an ``Explicit``
context mesh, ``with jax.set_mesh(m):``, ``mesh=m`` is used as given): the step is one program
over the global batch, and XLA decides how it is split. Parameters annotated by the model (Linen
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

import collections.abc
import contextlib
import math
import os
import re
import warnings
from typing import Any, Iterator, Mapping

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxlight.messages import logger as messages
from flaxlight.metrics import majority_leading_dims

__all__ = ["MODES", "make_mesh", "mesh_for", "batch_sharding", "replicated", "state_shardings", "initialize",
           "resolve_mode", "is_main_process", "to_global_batch", "split_annotations", "example_count",
           "step_batch_sharding"]

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
    """The trainer's mesh: ``mesh`` as given (a shape dict becomes a :func:`make_mesh`; a
    ``Mesh`` with ``Explicit`` axes, as ``jax.make_mesh`` makes, the same mesh with ``Auto``
    axes), or all devices on ``data`` when only ``distributed`` is set, or None (one device).
    Under an ``Explicit`` context mesh (``with jax.set_mesh(m):`` around the trainer) JAX runs
    steps only on that mesh: ``mesh=m`` is used as given, and another mesh is refused.

    Examples:
        >>> mesh_for(jax.make_mesh((1,), ("data",)), None).axis_types
        (Auto,)
    """
    mesh = checked_mesh_argument(mesh)
    if mesh is None and distributed is None:
        return None
    context = _explicit_context_mesh()
    if isinstance(mesh, dict):
        given, mesh = f"mesh={mesh} (made with Auto axes)", make_mesh(shape=mesh)
    elif mesh is None:
        given, mesh = f"distributed={distributed!r} without mesh= (all devices on {DATA_AXIS!r}, Auto axes)", \
            make_mesh()
    elif DATA_AXIS not in mesh.axis_names:
        raise ValueError(f"The mesh's axes are {mesh.axis_names}; it needs a {DATA_AXIS!r} axis to split batches over.")
    else:
        given = f"the mesh= given ({dict(mesh.shape)}, {'/'.join(sorted({t.name for t in mesh.axis_types}))} axes)"
        if context is None:  # Explicit axes would type the model's ops by sharding (FSDP failed inside the model)
            mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    if context is not None and mesh.abstract_mesh != context:
        raise ValueError(f"JAX's context mesh here has Explicit axes ({dict(context.shape)}, set by jax.set_mesh or "
                         f"jax.sharding.use_mesh around the trainer), and the trainer's mesh, from {given}, is "
                         f"another mesh: JAX runs a step only on arrays of its context mesh (the same axes, sizes and "
                         f"axis types). Pass that mesh itself (mesh=m for `with jax.set_mesh(m):`; it is used as "
                         f"given), or create and train the trainer outside the `with` block (any mesh; one from "
                         f"jax.make_mesh is then used with Auto axes).")
    return mesh


def _explicit_context_mesh() -> Any:
    """JAX's context mesh (``jax.set_mesh``, ``jax.sharding.use_mesh``) when it has ``Explicit`` axes, else None."""
    context = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
    if context is None or getattr(context, "empty", True):
        return None
    return context if jax.sharding.AxisType.Explicit in tuple(getattr(context, "axis_types", ())) else None


def _check_fsdp_axes(mesh: Mesh, params) -> None:
    """Refuse FSDP-split parameters on a mesh with ``Explicit`` axes (the context mesh's, used as
    given): JAX types the model's ops by sharding, and a layer whose inputs and kernel are both
    split over ``data`` is an illegal op for it (``ShardingTypeError`` inside the model)."""
    if jax.sharding.AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
        return
    split = [(jax.tree_util.keystr(path), sharding.spec) for path, sharding in
             jax.tree_util.tree_leaves_with_path(params) if any(axis is not None for axis in sharding.spec)]
    if split:
        raise ValueError(f"distributed='fsdp' splits parameters over {DATA_AXIS!r} (here {split[0][0]} as "
                         f"{split[0][1]}), and the mesh has Explicit axes ({dict(mesh.shape)}: the context mesh "
                         f"of jax.set_mesh around the trainer, used as given). With Explicit axes JAX types the "
                         f"model's ops by sharding, and a layer whose inputs and kernel are both split over "
                         f"{DATA_AXIS!r} is an illegal op. Create and train the trainer outside the `with` block "
                         f"(the mesh, passed as mesh=..., is then used with Auto axes and XLA splits the step), or "
                         f"use distributed='data_parallel' under it.")


def checked_mesh_argument(mesh: Any) -> Mesh | dict[str, int] | None:
    """``mesh=`` as the trainer takes it: None, a :class:`jax.sharding.Mesh`, or a dict of axis
    sizes (returned as a plain dict); anything else is a ``TypeError`` listing those forms.

    Examples:
        >>> checked_mesh_argument({"data": 2, "model": 2})
        {'data': 2, 'model': 2}
    """
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, Mapping) and all(isinstance(axis, str) for axis in mesh) and all(
            isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size >= 1 for size in mesh.values()):
        return {axis: int(size) for axis, size in mesh.items()}
    raise TypeError(f"mesh= takes a jax.sharding.Mesh with a {DATA_AXIS!r} axis, or a dict of axis names to sizes "
                    f"(in order, sizes whose product is the device count), e.g. mesh={{'data': 4}} or "
                    f"mesh={{'data': 2, 'model': 2}}; or leave it out and pass distributed='data_parallel' to put "
                    f"all devices on {DATA_AXIS!r}. Got {mesh!r:.100} ({type(mesh).__name__}).{_mesh_hint(mesh)}")


def _mesh_hint(mesh: Any) -> str:
    """A suggestion for a ``mesh=`` given in another form (sizes, or (name, size) pairs)."""
    if isinstance(mesh, (list, tuple)) and mesh and all(isinstance(size, int) for size in mesh):
        names = [DATA_AXIS, "model"] + [f"axis{i}" for i in range(2, len(mesh))]
        return f" Name the axes: mesh={dict(zip(names, mesh))}."
    if isinstance(mesh, (list, tuple)) and mesh and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in mesh):
        return f" As a dict: mesh={ {str(name): size for name, size in mesh} }."
    return ""


def mesh_record(mesh: Mesh | dict[str, int] | None) -> dict[str, Any]:
    """``{"mesh": {"data": 2, "model": 2}}`` for a run's ``hparams.yaml`` (``{}`` without a mesh)."""
    mesh = checked_mesh_argument(mesh)
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
    """Whether ``batch``'s examples (:func:`example_count`) divide over the mesh's ``data`` axis."""
    rows, _ = example_count(batch)
    return rows is None or rows % _data_size(mesh) == 0


def _shape(leaf, block: bool = False) -> tuple[int, ...]:
    """The shape of an array (or a ``jax.ShapeDtypeStruct``); ``block``: without its first (steps) axis."""
    shape = getattr(leaf, "shape", None)
    return tuple(int(n) for n in (shape if shape is not None else np.shape(leaf)))[1 if block else 0:]


def example_count(batch, block: bool = False) -> tuple[int | None, bool]:
    """``(examples, ambiguous)``: how many examples ``batch`` holds, as the leading dimension
    most of its leaves share (a leaf with another one, such as class weights, is not
    per-example), and whether that was a tie, broken in favour of the batch's first leaf as
    written (a dict's first key, a tuple's first item). ``block``: a stack of batches (steps
    first), counted along its second axis. ``(None, False)`` for a batch of scalars.

    Examples:
        >>> example_count({"x": np.zeros((8, 3)), "y": np.zeros(8), "class_weights": np.ones(10)})
        (8, False)
        >>> example_count({"image": np.zeros((8, 4)), "class_weights": np.ones(10)})
        (8, True)
    """
    tied, _ = majority_leading_dims(batch, block)
    if not tied:
        return None, False
    if len(tied) == 1:
        return tied[0], False
    first = _first_leaf(batch)
    first = _shape(first, block)[:1] if first is not None else ()
    return (first[0] if first and first[0] in tied else tied[0]), True


def _first_leaf(batch) -> Any:
    """``batch``'s first leaf in its own order: a dict's first key as written (JAX sorts the
    keys when it flattens a dict), a tuple's or list's first item; None when it has none."""
    tree = batch
    while isinstance(tree, (Mapping, list, tuple)) and len(tree):
        tree = next(iter(tree.values())) if isinstance(tree, Mapping) else tree[0]
    leaves = jax.tree.leaves(tree)
    return leaves[0] if leaves else None


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
    checked: known axes, each used for one dimension at most, and each split dimension a
    multiple of its axes' devices."""
    logical = not isinstance(annotation, PartitionSpec)  # a tuple of logical axis names
    spec = PartitionSpec(*nn.logical_to_mesh_axes(annotation, rules)) if logical else annotation
    dims = [tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a is not None) for axes in spec]
    for axis in (axis for axes in dims for axis in axes):
        if axis not in mesh.axis_names:
            hint = ("map logical names to mesh axes with sharding_rules=[('embed', 'model'), ...]"
                    if logical else "use the mesh's axis names (for a trainer that loads a run: pass its mesh=...)")
            raise ValueError(f"Parameter {path} is annotated {annotation}, and {axis!r} is not an axis of the "
                             f"mesh {tuple(mesh.axis_names)}: {hint}.")
    _check_axes_used_once(annotation, path, spec, dims)
    for dim, axes in enumerate(dims):
        devices = math.prod(mesh.shape[axis] for axis in axes)
        if dim < len(shape) and shape[dim] % devices:
            raise ValueError(f"Parameter {path} of shape {shape} is annotated {annotation} ({spec} on the mesh "
                             f"{dict(mesh.shape)}): its dimension {dim} ({shape[dim]}) does not split over {axes} "
                             f"({devices} devices). Give the mesh axis a size that divides {shape[dim]}, or change "
                             f"the annotation{' or sharding_rules' if logical else ''}.")
    return spec


def _check_axes_used_once(annotation, path: str, spec: PartitionSpec, dims: list[tuple[str, ...]]) -> None:
    """Fail, naming the parameter, when ``spec`` splits two dimensions (or one twice) over the
    same mesh axis: each of a mesh axis's devices holds one block, so it can split one dimension."""
    for axis in dict.fromkeys(axis for axes in dims for axis in axes):
        used = [dim for dim, axes in enumerate(dims) for name in axes if name == axis]
        if len(used) > 1:
            where = (f"dimensions {', '.join(map(str, used[:-1]))} and {used[-1]}" if len(set(used)) > 1
                     else f"dimension {used[0]} twice")
            given = "" if isinstance(annotation, PartitionSpec) else f" ({spec} on the mesh, through sharding_rules)"
            raise ValueError(
                f"Parameter {path} is annotated {annotation}{given}, which splits {where} over the mesh axis "
                f"{axis!r}: a mesh axis can split at most one dimension of a parameter, once. Name {axis!r} once "
                f"(e.g. {_once(spec, axis)}), and split another dimension over another axis of the mesh if you want "
                f"it split too.")


def _once(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """``spec`` with ``axis`` kept only where it first appears (the suggestion of :func:`_check_axes_used_once`)."""
    seen, out = False, []
    for axes in spec:
        kept = []
        for name in (axes if isinstance(axes, tuple) else (axes,)):
            if name != axis or not seen:
                kept.append(name)
            seen = seen or name == axis
        out.append(tuple(kept) if isinstance(axes, tuple) and len(kept) > 1 else (kept[0] if kept else None))
    return PartitionSpec(*out)


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


def step_batch_sharding(mesh: Mesh, block: bool = False) -> NamedSharding | None:
    """The batch's ``in_shardings`` for the jitted steps: on one process None, the batch as
    :func:`to_global_batch` placed it, leaf by leaf (split along ``data``, or whole on every
    device); with several processes the split along ``data`` (every leaf is per-example and
    the global batch divides). ``block``: for a stack of batches (split along its second axis).

    Examples:
        >>> step_batch_sharding(make_mesh()) is None
        True
    """
    if jax.process_count() == 1:
        return None
    return NamedSharding(mesh, PartitionSpec(None, DATA_AXIS)) if block else batch_sharding(mesh)


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
        if mode == "fsdp":
            _check_fsdp_axes(mesh, jax.tree.map(for_leaf, state.params))
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
        masked = lambda node: isinstance(node, optax.MaskedNode)  # a parameter outside a group (multi_transform)
        opt_state = optax.tree_map_params(state.tx, lambda leaf, sharding: leaf if masked(leaf) else sharding,
                                          opt_state, params, transform_non_params=lambda _: rep, is_leaf=masked)
    return shardings.replace(params=params, opt_state=opt_state)


def place(tree, shardings):
    """Put ``tree`` on the mesh as ``shardings`` say, in fresh buffers (safe to donate later)."""
    return jax.jit(lambda t: jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, t),
                   out_shardings=shardings)(tree)


def check_batch_divisible(examples: int, mesh: Mesh, batch_size: Any = None) -> None:
    """Fail unless a (global) batch of ``examples`` splits evenly over the mesh's ``data`` axis.
    ``batch_size``: the loader's, when it says one. A batch with fewer examples is an epoch's
    smaller last batch (all of an epoch when the dataset is smaller than ``batch_size``): on one
    process it runs whole on every device (:func:`to_global_batch`), so it passes here; with
    several processes it must split too.

    Examples:
        >>> check_batch_divisible(1197, make_mesh(), batch_size=1200)  # an epoch's last batch (any size on 1 device)
    """
    devices = _data_size(mesh)
    if examples % devices == 0:
        return
    if jax.process_count() == 1 and examples < (_declared_batch_size(batch_size) or 0):
        return
    last = ("" if jax.process_count() == 1 else
            f" If this batch is an epoch's smaller last batch (the examples left after the full "
            f"batches, or all of a dataset smaller than batch_size): with several processes "
            f"({jax.process_count()}) it must split too: drop it (drop_last=True, with a batch_size no larger than "
            f"the dataset), or use a dataset whose size splits.")
    raise UnsplittableBatchError(
        f"A batch of {examples} examples cannot be split over {devices} devices (the mesh's data axis): use "
        f"a batch size that is a multiple of {devices} (global batch = per-device batch x {devices} devices).{last}"
    )


def _declared_batch_size(size: Any) -> int | None:
    """``size`` (a loader's ``batch_size`` attribute) when it is a positive int, else None.

    Examples:
        >>> _declared_batch_size(64), _declared_batch_size(None), _declared_batch_size(True)
        (64, None, None)
    """
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
        return None
    return int(size)


def check_loader_divisible(loader: Any, mesh: Mesh | None) -> None:
    """:func:`check_batch_divisible` (with several processes also :func:`check_per_example`)
    before a run: for a loader that says its batch size (an :class:`~flaxlight.ArrayLoader`, a
    torch ``DataLoader``) on one process, from that size (a dataset smaller than it is one batch
    per epoch, its last, which runs whole on every device: said once); for a list of batches, or
    a loader whose each ``iter()`` starts a new pass, from its first batch's :func:`example_count`
    (read from a pass of its own, as the validation loader's).
    A generator (or a loader handing out one shared stream) is checked at its first batch, when
    training starts: its batch would be used up here.

    Examples:
        >>> check_loader_divisible([(np.zeros((30, 2)), np.zeros(30))], make_mesh())  # one device: any size
    """
    size = _declared_batch_size(getattr(loader, "batch_size", None))
    if mesh is None:
        return
    if size is None:
        first = _first_batch_ahead(loader)
        if first is not None and _checkable(first):
            if jax.process_count() > 1:
                check_per_example(first, mesh)
            rows, _ = example_count(first)
            if rows is not None:  # scalars only: nothing is split
                check_batch_divisible(rows * jax.process_count(), mesh)
        return
    if jax.process_count() > 1:
        return
    examples = getattr(loader, "num_examples", None)  # an ArrayLoader's; a torch DataLoader's dataset length
    if examples is None and hasattr(getattr(loader, "dataset", None), "__len__"):
        examples = len(loader.dataset)
    one_batch = isinstance(examples, int) and 0 < examples <= size and not getattr(loader, "drop_last", False)
    if not one_batch:  # full batches of `size`: they must split
        check_batch_divisible(size, mesh)
    elif examples % _data_size(mesh):
        messages.info(f"The training data holds {examples} examples, fewer than batch_size={size}: each epoch is "
                      f"one batch of {examples}, which does not split over the {_data_size(mesh)} devices of the "
                      f"mesh's data axis, so it runs whole on every device (the same numbers as one device, without "
                      f"data parallelism). A dataset size that is a multiple of {_data_size(mesh)} splits it.")


def _first_batch_ahead(loader: Any) -> Any:
    """A list's first batch, or the first batch of a fresh pass of a loader whose each
    ``iter()`` starts one; None for an iterator (a generator), a loader that hands out one
    shared stream, and torch / grain loaders (their ``iter`` starts workers)."""
    if isinstance(loader, (list, tuple)):
        return loader[0] if loader else None
    if (not isinstance(loader, collections.abc.Iterable) or isinstance(loader, collections.abc.Iterator)
            or type(loader).__module__.split(".")[0] in ("torch", "grain") or iter(loader) is iter(loader)):
        return None
    return next(iter(loader), None)


class UnsplittableBatchError(ValueError):
    """A batch the mesh cannot split: its examples do not divide over the ``data`` axis
    (:func:`check_batch_divisible`), or, with several processes, a leaf without one row per
    example (:func:`check_per_example`)."""


def check_per_example(batch, mesh: Mesh, block: bool = False) -> None:
    """Fail, naming the leaf, unless every leaf of ``batch`` is per-example: its leading
    dimension is the batch's example count (:func:`example_count`). Checked with several
    processes, where each one passes its own rows of every leaf and JAX joins them along the
    first axis into the global batch: a leaf that is not per-example (class weights next to
    the examples, a scalar) has no rows to join. On one process such a leaf is put whole on
    every device instead (:func:`to_global_batch`). ``block``: a stack of batches (steps
    first), checked along its second axis. Leaves that are not numeric arrays are left to
    :func:`flaxlight.data.check_batch`.

    Examples:
        >>> check_per_example({"x": np.zeros((8, 3)), "y": np.zeros(8)}, make_mesh())
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    shapes = [_shape(leaf, block) for _, leaf in leaves]
    if not shapes or all(shape and shape[:1] == shapes[0][:1] for shape in shapes) or not _checkable(batch):
        return  # the per-step path: shapes only
    rows, ambiguous = example_count(batch, block)
    where = [(jax.tree_util.keystr(path) or "(the whole batch)", shape) for (path, _), shape in zip(leaves, shapes)]
    odd = [(place, shape) for place, shape in where if shape[:1] != (rows,)]
    example = next(((place, shape) for place, shape in where if shape[:1] == (rows,)), None)
    holds = "" if example is None else f", and the batch holds {rows} examples (leaf {example[0]} has shape {example[1]})"
    if ambiguous:
        holds += (f"; that count is ambiguous: as many leaves have another first dimension, and the batch's first "
                  f"leaf as written is taken for the examples")
    others = f" Also: {', '.join(f'{place} {shape}' for place, shape in odd[1:])}." if len(odd) > 1 else ""
    raise UnsplittableBatchError(
        f"The batch's leaf {odd[0][0]} has shape {odd[0][1]}{'' if odd[0][1] else ' (a scalar)'}{holds}.{others} With "
        f"several processes ({jax.process_count()}) each passes its own rows of every leaf, joined along the first "
        f"axis into the global batch that is split over the {DATA_AXIS!r} axis ({_data_size(mesh)} device(s)), so "
        f"every leaf needs one row per example. Yield per-example arrays only: a constant such as class weights "
        f"belongs in the model (model_hparams) or in your loss_fn (e.g. an attribute of the trainer that loss_fn "
        f"reads). (On one process such a leaf is put whole on every device.)")


def _checkable(batch) -> bool:
    """Whether every leaf is a numeric (or bool) array, as :func:`flaxlight.data.check_batch` wants."""
    def numeric(leaf) -> bool:
        return isinstance(leaf, (np.ndarray, jax.Array, np.generic)) and (
            np.issubdtype(leaf.dtype, np.number) or np.issubdtype(leaf.dtype, np.bool_))

    leaves = jax.tree.leaves(batch)
    return bool(leaves) and all(numeric(leaf) for leaf in leaves)


def to_global_batch(batch, mesh: Mesh, block: bool = False):
    """A process-local batch as a global array split along ``data`` (one process: a plain put).

    ``block``: a stack of batches (steps first), split along its second axis. On one process, a
    leaf that is not per-example (its leading dimension is not the batch's
    :func:`example_count`: class weights, a scalar) is put whole on every device, and so is
    every leaf of a batch whose examples do not divide (an epoch's smaller last batch): the
    step sees the global batch a single device would. With several processes every leaf must
    be per-example (:func:`check_per_example`) and the global batch must divide
    (:func:`check_batch_divisible`).

    Examples:
        >>> [leaf.sharding.spec for leaf in to_global_batch((np.zeros((8, 3)), np.ones(10)), make_mesh())]
        [P('data',), P()]
    """
    rows, _ = example_count(batch, block)
    processes = jax.process_count()
    if processes > 1:
        check_per_example(batch, mesh, block=block)
        if not block and rows is not None:  # process-local rows: the global batch must split
            check_batch_divisible(rows * processes, mesh)
    split = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS) if block else PartitionSpec(DATA_AXIS))
    whole, rep = processes == 1 and (rows is None or rows % _data_size(mesh) != 0), replicated(mesh)
    shardings = jax.tree.map(lambda leaf: split if not whole and _shape(leaf, block)[:1] == (rows,) else rep, batch)
    if processes == 1:
        return jax.device_put(batch, shardings)
    return jax.tree.map(lambda x, sharding: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                        batch, shardings)


@contextlib.contextmanager
def axis_names_explained() -> Iterator[None]:
    """Re-raise JAX's "unbound axis name" ``NameError`` (``nn.BatchNorm(axis_name="data")``,
    ``jax.lax.pmean(x, "data")`` in a step) with what to do instead: flaxlight's step is one
    program over the global batch, so its means and batch statistics are global already.

    Examples:
        >>> with axis_names_explained():
        ...     pass
    """
    try:
        yield
    except NameError as exc:
        found = re.search(r"unbound axis name: ([^.\s]+)", str(exc))
        if found is None:
            raise
        name = found.group(1)
        raise NameError(
            f"The step uses the axis name {name!r} (e.g. nn.BatchNorm(axis_name={name!r}) or "
            f"jax.lax.pmean(x, {name!r})), and no axis of that name is bound: flaxlight's step is one program over "
            f"the whole (global) batch, not a per-device function (pmap, shard_map). On a mesh XLA splits that "
            f"program over the devices, and means, gradients and BatchNorm statistics are already computed over the "
            f"whole global batch (synced BatchNorm without asking). Remove axis_name (and any pmean/psum over it)."
        ) from exc


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
