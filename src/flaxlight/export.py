"""A trained model as an artifact that serves without flaxlight: ``jax.export`` (StableHLO).

:meth:`TrainerModule.export <flaxlight.verbs.TrainerVerbsMixin.export>` writes a folder:

- ``model.jax_exported``: the model's eval-mode forward pass, serialized with
  :func:`jax.export.serialize`, its trained variables (params, batch statistics) baked in as
  constants (behind an optimization barrier, so that XLA computes with them as the jitted
  ``predict()`` does rather than folding them), the batch dimension symbolic (any batch size),
  lowered for the platforms asked for (default: the one exporting; an artifact runs only on a
  platform it was lowered for);
- ``export.json``: the inputs (``name`` in the call, shape, dtype), the outputs (``path`` in
  the result, shape, dtype), the ``platforms``, which checkpoint, the precision, the
  versions, and the line that loads and calls it (``load``), with the inputs' structure
  (a dict input is called as ``call({'a': a, 'b': b})``, two inputs as ``call(x0, x1)``).

Writing and loading need ``flatbuffers`` (``pip install 'flaxlight[export]'``, or plain
``pip install flatbuffers``) beside ``jax``; loading needs nothing else::

    exported = jax.export.deserialize(bytearray(open("export/model.jax_exported", "rb").read()))
    outputs = exported.call(x)

Examples:
    >>> trainer.export("export", which="best", platforms=("cpu", "cuda"))  # doctest: +SKIP
    >>> predict = load_exported("export")                              # doctest: +SKIP
    >>> predict(x_test).shape                                          # doctest: +SKIP
    (360, 10)
"""

from __future__ import annotations

import json
import keyword
import os
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

__all__ = ["EXPORTED_FILE", "PLATFORMS", "export_forward", "load_exported"]

EXPORTED_FILE = "model.jax_exported"
INFO_FILE = "export.json"
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # jax.export's platform names


def _checked_batch_size(batch_size: Any) -> int | None:
    """``batch_size`` as an int >= 1, or None (any batch size); else a ``ValueError`` saying so."""
    if batch_size is None:
        return None
    if isinstance(batch_size, (int, np.integer)) and not isinstance(batch_size, (bool, np.bool_)) and batch_size >= 1:
        return int(batch_size)
    raise ValueError(f"export's batch_size must be a whole number >= 1 (the exact batch size the artifact takes) or "
                     f"None (any batch size, the default); got {batch_size!r}.")


def _checked_platforms(platforms: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``platforms`` as a tuple of jax.export's platform names (a single name may be a string), or
    None (the platform exporting); else a ``ValueError`` naming the ones known."""
    if platforms is None:
        return None
    names = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    unknown = [name for name in names if not isinstance(name, str) or name.lower() not in PLATFORMS]
    if not names or unknown:
        gpu = " ('gpu' is 'cuda' for NVIDIA, 'rocm' for AMD)" if "gpu" in [str(n).lower() for n in unknown] else ""
        raise ValueError(f"export's platforms must name one or more of {', '.join(map(repr, PLATFORMS))}{gpu}, e.g. "
                         f"platforms=('cpu', 'cuda'); got {platforms!r}.")
    return tuple(dict.fromkeys(name.lower() for name in names))


def _input_specs(example: Any, batch_size: int | None) -> Any:
    """ShapeDtypeStructs like ``example`` with the leading dimension ``b`` (symbolic) or ``batch_size``."""
    leaves = jax.tree.leaves(example)
    if batch_size is None:
        (batch,) = jax.export.symbolic_shape("b")
    else:
        batch = batch_size
    for leaf in leaves:
        if np.ndim(leaf) == 0:
            raise ValueError("export needs inputs with a leading batch dimension; the example input has a scalar.")
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((batch, *np.shape(leaf)[1:]), np.asarray(leaf).dtype),
                        example)


def export_forward(forward: Callable[[Any], Any], example: Any, path: str | os.PathLike, *,
                   batch_size: int | None = None, info: dict[str, Any] | None = None,
                   several_inputs: bool = False, platforms: str | Sequence[str] | None = None) -> str:
    """Serialize ``forward`` (inputs -> outputs, variables closed over) for inputs shaped like
    ``example`` into the folder ``path``; returns the file written. ``several_inputs``:
    ``example`` is a tuple of inputs, ``forward`` takes that tuple, and the artifact takes them
    as separate arguments (``call(a, b)``). ``platforms``: what it is lowered for (any of
    :data:`PLATFORMS`; default: the platform exporting); it runs on those only.

    Examples:
        >>> export_forward(lambda x: x * 2.0, np.zeros((1, 3), np.float32), "doubler")   # doctest: +SKIP
        'doubler/model.jax_exported'
    """
    batch_size, platforms = _checked_batch_size(batch_size), _checked_platforms(platforms)

    def export(size: int | None):
        specs = _input_specs(example, size)  # one batch dimension, shared by every input
        if several_inputs:
            return jax.export.export(jax.jit(lambda *inputs: forward(inputs)), platforms=platforms)(*specs)
        return jax.export.export(jax.jit(forward), platforms=platforms)(specs)

    try:
        exported = export(batch_size)
    except Exception as exc:  # noqa: BLE001 - jax raises several kinds for shapes it cannot make symbolic
        if batch_size is not None:
            raise
        try:
            export(max(1, int(np.shape(jax.tree.leaves(example)[0])[0])))
        except Exception:  # noqa: BLE001 - it fails at a fixed batch size too: the model's own error
            raise exc from None
        raise ValueError(f"The model could not be exported for any batch size ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0]}). Export a fixed batch size instead: "
                         f"trainer.export(path, batch_size=N).") from exc
    folder = os.fspath(path)
    serialized = _serialization(exported.serialize)
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, EXPORTED_FILE)
    with open(target, "wb") as f:
        f.write(serialized)
    with open(os.path.join(folder, INFO_FILE), "w") as f:
        json.dump({**_describe(exported), **dict(info or {})}, f, indent=2)
    return target


def _describe(exported: Any) -> dict[str, Any]:
    """``export.json``'s description of an artifact: its inputs (each leaf's ``name`` in the ``load``
    line's call, shape, dtype; ``None`` for any batch size), its outputs (each leaf's ``path`` in
    the result), its platforms, jax's version, and the line that loads and calls it."""
    def shape(aval) -> list[int | None]:
        return [int(s) if isinstance(s, (int, np.integer)) else None for s in aval.shape]

    args, _ = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)  # (positional args, keywords)
    names = _input_names(args)
    call = ", ".join(map(repr, jax.tree_util.tree_unflatten(jax.tree.structure(args), map(_Name, names))))
    outputs = jax.tree_util.tree_unflatten(exported.out_tree, exported.out_avals)
    return {
        "inputs": [{"name": name, "shape": shape(aval), "dtype": str(aval.dtype)}
                   for name, aval in zip(names, jax.tree.leaves(args))],
        "outputs": [{"path": f"outputs{jax.tree_util.keystr(where)}", "shape": shape(aval), "dtype": str(aval.dtype)}
                    for where, aval in jax.tree_util.tree_leaves_with_path(outputs)],
        "platforms": list(exported.platforms), "jax": jax.__version__,
        "load": f"outputs = jax.export.deserialize(bytearray(open('{EXPORTED_FILE}', 'rb').read())).call({call})",
    }


class _Name(str):
    """A variable name that ``repr`` writes bare: ``{'a': a, 'b': b}`` in the ``load`` line."""

    def __repr__(self) -> str:
        return str(self)


def _input_names(args: tuple) -> list[str]:
    """A variable name for each input leaf of the artifact's positional ``args``: ``x`` for one
    array, ``x0``, ``x1`` for several; a dict's leaves by their keys (``a``, ``b``, or
    ``x_<key>`` where a key is no identifier)."""
    names = []
    for path, _ in jax.tree_util.tree_leaves_with_path(args):
        base = "x" if len(args) == 1 else f"x{path[0].idx}"
        parts = "_".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path[1:])
        parts = re.sub(r"\W", "_", parts)
        names.append(base if not parts else parts if parts.isidentifier() and not keyword.iskeyword(parts)
                     and parts not in ("jax", "outputs") else f"{base}_{parts}")
    return names if len(set(names)) == len(names) else [f"x{i}" for i in range(len(names))]


def load_exported(path: str | os.PathLike) -> Callable[..., Any]:
    """The exported model in ``path`` (a folder written by ``trainer.export`` or the file itself)
    as a function of the inputs; plain ``jax.export.deserialize(...).call`` does the same.

    Examples:
        >>> predict = load_exported("export")          # doctest: +SKIP
        >>> logits = predict(x_test)                    # doctest: +SKIP
    """
    path = os.fspath(path)
    file = os.path.join(path, EXPORTED_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"No exported model at {file}: give the folder trainer.export wrote.")
    with open(file, "rb") as f:
        data = bytearray(f.read())
    try:
        return _serialization(lambda: jax.export.deserialize(data)).call
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - flatbuffers fails in many ways on bytes that are not an artifact
        raise ValueError(f"{file} is not a jax.export artifact (the {EXPORTED_FILE} file trainer.export writes, or "
                         f"jax.export.serialize's bytes): jax could not read it ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}). Give the folder trainer.export wrote, or "
                         f"its {EXPORTED_FILE}.") from exc


def _serialization(run: Callable[[], Any]) -> Any:
    """``run()``; jax's missing-flatbuffers error with the extra to install."""
    try:
        return run()
    except ImportError as exc:
        raise ImportError(f"{exc}: pip install 'flaxlight[export]' (or flatbuffers).") from exc
