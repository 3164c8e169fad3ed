"""A trained model as an artifact that serves without flaxlight: ``jax.export`` (StableHLO).

:meth:`TrainerModule.export <flaxlight.verbs.TrainerVerbsMixin.export>` writes a folder:

- ``model.jax_exported``: the model's eval-mode forward pass, serialized with
  :func:`jax.export.serialize`, its trained variables (params, batch statistics) baked in as
  constants, the batch dimension symbolic (any batch size);
- ``export.json``: the input shapes and dtypes, the output structure, which checkpoint, the
  versions, and how to load it.

Writing and loading need ``flatbuffers`` (``pip install 'flaxlight[export]'``, or plain
``pip install flatbuffers``) beside ``jax``; loading needs nothing else::

    exported = jax.export.deserialize(open("export/model.jax_exported", "rb").read())
    outputs = exported.call(x)

Examples:
    >>> trainer.export("export", which="best")                         # doctest: +SKIP
    >>> predict = load_exported("export")                              # doctest: +SKIP
    >>> predict(x_test).shape                                          # doctest: +SKIP
    (360, 10)
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np

__all__ = ["EXPORTED_FILE", "export_forward", "load_exported"]

EXPORTED_FILE = "model.jax_exported"
INFO_FILE = "export.json"


def _input_specs(example: Any, batch_size: int | None) -> Any:
    """ShapeDtypeStructs like ``example`` with the leading dimension ``b`` (symbolic) or ``batch_size``."""
    leaves = jax.tree.leaves(example)
    if batch_size is None:
        (batch,) = jax.export.symbolic_shape("b")
    else:
        batch = int(batch_size)
    for leaf in leaves:
        if np.ndim(leaf) == 0:
            raise ValueError("export needs inputs with a leading batch dimension; the example input has a scalar.")
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((batch, *np.shape(leaf)[1:]), np.asarray(leaf).dtype),
                        example)


def export_forward(forward: Callable[[Any], Any], example: Any, path: str | os.PathLike, *,
                   batch_size: int | None = None, info: dict[str, Any] | None = None,
                   several_inputs: bool = False) -> str:
    """Serialize ``forward`` (inputs -> outputs, variables closed over) for inputs shaped like
    ``example`` into the folder ``path``; returns the file written. ``several_inputs``:
    ``example`` is a tuple of inputs, ``forward`` takes that tuple, and the artifact takes them
    as separate arguments (``call(a, b)``).

    Examples:
        >>> export_forward(lambda x: x * 2.0, np.zeros((1, 3), np.float32), "doubler")   # doctest: +SKIP
        'doubler/model.jax_exported'
    """
    def export(size: int | None):
        specs = _input_specs(example, size)  # one batch dimension, shared by every input
        if several_inputs:
            return jax.export.export(jax.jit(lambda *inputs: forward(inputs)))(*specs)
        return jax.export.export(jax.jit(forward))(specs)

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
    specs = jax.tree.leaves(exported.in_avals)
    folder = os.fspath(path)
    serialized = _serialization(exported.serialize)
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, EXPORTED_FILE)
    with open(target, "wb") as f:
        f.write(serialized)
    description = {
        "inputs": [{"shape": [None if batch_size is None and d == 0 else int(s) for d, s in enumerate(leaf.shape)],
                    "dtype": str(leaf.dtype)} for leaf in specs],
        "outputs": [{"shape": [int(s) if isinstance(s, (int, np.integer)) else None for s in aval.shape],
                     "dtype": str(aval.dtype)} for aval in exported.out_avals],  # None: any batch size
        "jax": jax.__version__, "load": "jax.export.deserialize(open(path, 'rb').read()).call(x)",
        **dict(info or {}),
    }
    with open(os.path.join(folder, INFO_FILE), "w") as f:
        json.dump(description, f, indent=2)
    return target


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
    return _serialization(lambda: jax.export.deserialize(data)).call


def _serialization(run: Callable[[], Any]) -> Any:
    """``run()``; jax's missing-flatbuffers error with the extra to install."""
    try:
        return run()
    except ImportError as exc:
        raise ImportError(f"{exc}: pip install 'flaxlight[export]' (or flatbuffers).") from exc
