"""On-device metric accumulation: per-example weighted means, read on the host only when asked.

The accumulator is a small pytree ``{"totals": Totals}`` that flows through the jitted step:
one float32 vector of the scalar metrics' sums, the example count and the non-finite step count.
Each step adds ``value * batch_size`` to the sums, so a smaller last batch counts for exactly its
share. Nothing here touches the host until :func:`read_means`.

A step may also return **metric objects** next to its scalar means: anything with ``merge(other)``
and ``compute()`` that is a pytree (``clu.metrics``, metrax and the classes in
:mod:`flaxlight.metric_objects` have that shape). They are merged on the device over the epoch
(under ``"objects"`` in the accumulator) and computed once when the epoch's values are read.

Examples:
    >>> import jax.numpy as jnp
    >>> acc = init_accumulator({"loss": jnp.float32(0)})
    >>> acc = accumulate(acc, {"loss": jnp.float32(2.0)}, 3)
    >>> acc = accumulate(acc, {"loss": jnp.float32(4.0)}, 1)
    >>> read_means(acc, prefix="train/")
    {'train/loss': 2.5}
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

try:  # marks a read as jax.device_get does, so that jax.transfer_guard counts it as explicit
    from jax._src.config import explicit_device_get_scope as _explicit_scope
except ImportError:  # pragma: no cover - a JAX without it: the guard sees every read as implicit
    _explicit_scope = contextlib.nullcontext

__all__ = ["Totals", "init_accumulator", "accumulate", "all_finite", "step_finite", "read_means", "to_host",
           "batch_size", "majority_leading_dims", "name_direction", "HostSnapshot", "is_metric_object", "with_saved_objects",
           "flat_metrics", "result_shapes"]


def deliberate_reads() -> contextlib.AbstractContextManager:
    """A context whose device-to-host copies are the loop's own, deliberate reads (log points,
    checkpoint snapshots, predictions): ``jax.transfer_guard("disallow")``, which users set to
    catch accidental syncs, lets them pass as it lets ``jax.device_get`` pass, and still stops any
    other read; ``"disallow_explicit"`` stops these too.

    Examples:
        >>> with deliberate_reads():
        ...     host = np.asarray(jnp.arange(3))
    """
    return _explicit_scope()


def is_metric_object(value: Any) -> bool:
    """True for a metric object: it has ``merge`` and ``compute`` methods (clu, metrax, flaxlight's)."""
    return callable(getattr(value, "merge", None)) and callable(getattr(value, "compute", None))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=["names"])
@dataclasses.dataclass(frozen=True)
class Totals:
    """An epoch's scalar metric sums, its example count and its count of non-finite steps, as
    one float32 vector ``[sum of each of names..., examples, non-finite steps]``: one output of
    the jitted step (on XLA's CPU runtime each output costs a call a few microseconds) and one
    read on the host. ``names`` is static (part of the pytree's structure).

    Examples:
        >>> totals = Totals.zeros(["loss"])
        >>> totals = Totals(totals.names, totals.values + jnp.array([6.0, 3.0, 0.0]))
        >>> totals.read()
        ({'loss': 6.0}, 3.0, 0)
    """

    names: tuple[str, ...]
    values: Any

    @classmethod
    def zeros(cls, names) -> "Totals":
        names = tuple(names)
        return cls(names, jnp.zeros(len(names) + 2, jnp.float32))

    @property
    def count(self):
        """The examples summed (an array element)."""
        return self.values[-2]

    @property
    def nonfinite(self):
        """The steps whose loss (or update) was not finite (an array element)."""
        return self.values[-1]

    def read(self) -> tuple[dict[str, float], float, int]:
        """``(sums by name, examples, non-finite steps)`` as Python numbers (reads the vector)."""
        with deliberate_reads():
            values = np.asarray(self.values).tolist()
        return dict(zip(self.names, values)), values[-2], int(values[-1])


def flat_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A step's ``metrics`` with nested dicts flattened to ``outer/inner`` names (per-head metrics
    ``{"cls": {"acc": a}}`` are ``"cls/acc"``, logged as ``train/cls/acc``), as a metric object's
    dict result is. A value that is neither a number, an array, a metric object nor a dict (a
    list, a tuple, None) is refused naming it, and so are two spellings of one name. Static: it
    costs the jitted step nothing.

    Examples:
        >>> flat_metrics({"loss": 1.0, "cls": {"acc": 0.5, "top": {"k5": 0.9}}})
        {'loss': 1.0, 'cls/acc': 0.5, 'cls/top/k5': 0.9}
    """
    if all(not isinstance(value, Mapping) and _is_number_like(value) or is_metric_object(value)
           for value in metrics.values()):
        return dict(metrics)  # the common case: flat already
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}

    def put(name: str, value: Any, path: str) -> None:
        if isinstance(value, Mapping) and not is_metric_object(value):
            for key, item in value.items():
                put(f"{name}/{key}", item, f"{path}[{key!r}]")
            return
        _check_metric_value(name, value, path)
        if name in out:
            raise ValueError(f"Metrics {spelled[name]} and {path} both name {name!r} (nested dicts are flattened to "
                             f"'outer/inner' names): rename one of them.")
        out[name], spelled[name] = value, path

    for name, value in metrics.items():
        put(str(name), value, f"metrics[{name!r}]")
    return out


def _is_number_like(value: Any) -> bool:
    """A number, a numpy / JAX array or scalar, a tracer or a ShapeDtypeStruct (what a metric sum takes)."""
    return isinstance(value, (bool, int, float, np.number, np.bool_)) or (
        hasattr(value, "shape") and hasattr(value, "dtype"))


def _check_metric_value(name: str, value: Any, path: str) -> None:
    if is_metric_object(value) or _is_number_like(value):
        return
    if value is None:
        fix = (f"leave the key out when it has no value (a head switched off): build the dict and add "
               f"{name!r} only when there is one")
    elif isinstance(value, (list, tuple)):
        fix = (f"return one scalar per name, e.g. {{'{name}/0': ..., '{name}/1': ...}} (or a dict, "
               f"{{{name!r}: {{'a': ..., 'b': ...}}}}, flattened to '{name}/a', '{name}/b'), or stack them into an "
               f"array and reduce it")
    else:
        fix = "return a number or a scalar array (or a metric object, or a dict of them)"
    raise TypeError(f"Metric {name!r} ({path}) is {'None' if value is None else 'a ' + type(value).__name__}; step "
                    f"metrics must be scalars, metric objects (merge/compute) or dicts of them: {fix}.")


def init_accumulator(metrics_like: Mapping[str, Any]) -> dict:
    """Zeroed sums for the metric names in ``metrics_like`` (values or ShapeDtypeStructs; nested
    dicts flattened, see :func:`flat_metrics`); a metric object gets zeroed leaves of its own
    structure (replaced by the epoch's first value)."""
    metrics_like = flat_metrics(metrics_like)
    objects = {name: value for name, value in metrics_like.items() if is_metric_object(value)}
    for name, value in metrics_like.items():
        shape = getattr(value, "shape", ())
        if name not in objects and tuple(shape) != ():
            raise ValueError(
                f"Metric {name!r} has shape {tuple(shape)}; step metrics must be scalars or metric objects (or dicts "
                f"of them). Reduce it in the step, e.g. `{name}.mean()`, or return an object with merge/compute such "
                f"as flaxlight.metric_objects.ConfusionMatrix.")
    acc: dict[str, Any] = {"totals": Totals.zeros(name for name in metrics_like if name not in objects)}
    if objects:
        acc["objects"] = {name: jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), value)
                          for name, value in objects.items()}
    return acc


def all_finite(metrics: Mapping[str, Any]):
    """Pure: True when every metric of the step (the loss included) is finite."""
    values = [jnp.all(jnp.isfinite(jnp.asarray(v, jnp.float32))) for v in flat_metrics(metrics).values()
              if not is_metric_object(v)]
    return jnp.all(jnp.stack(values)) if values else jnp.bool_(True)


def step_finite(metrics: Mapping[str, Any]):
    """Pure: True when the step's ``"loss"`` is finite (every scalar metric, when there is none).

    Another metric may be NaN on a batch by its nature (a recall on a batch without the class);
    that makes its mean NaN, not the step damaged.

    Examples:
        >>> bool(step_finite({"loss": jnp.float32(0.5), "recall": jnp.float32(jnp.nan)}))
        True
    """
    metrics = flat_metrics(metrics)
    loss = metrics.get("loss")
    return all_finite({"loss": loss} if loss is not None and not is_metric_object(loss) else metrics)


def tree_finite(tree) -> jax.Array:
    """Pure: True when every float leaf of ``tree`` (e.g. the params) is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


finite_now = jax.jit(tree_finite)  # the same, in one dispatch (e.g. the params before a checkpoint)


def accumulate(acc: dict, metrics: Mapping[str, Any], weight, finite=None, *, drop_nonfinite: bool = False) -> dict:
    """Pure: add ``metrics`` (batch means) weighted by ``weight`` examples; count non-finite steps
    (``finite``: the step's own verdict, e.g. loss and updated params; default: the loss).

    ``drop_nonfinite=True`` (``NaNGuard("skip")``: such a step was not applied) leaves a
    non-finite step's metrics out: its values, its examples and its metric objects; it is still
    counted as non-finite. Otherwise a NaN step's values enter the sums (its NaN shows).

    Examples:
        >>> acc = init_accumulator({"loss": jnp.float32(0)})
        >>> acc = accumulate(acc, {"loss": jnp.float32(2.0)}, 4)
        >>> acc = accumulate(acc, {"loss": jnp.float32(jnp.nan)}, 4, jnp.bool_(False), drop_nonfinite=True)
        >>> acc["totals"].read()
        ({'loss': 8.0}, 4.0, 1)
    """
    weight, metrics = jnp.asarray(weight, jnp.float32), flat_metrics(metrics)
    totals = acc["totals"]
    finite = step_finite(metrics) if finite is None else finite
    bad = jnp.logical_not(finite).astype(jnp.float32)
    values = [jnp.asarray(metrics[name], jnp.float32) for name in totals.names]
    if drop_nonfinite:  # a skipped step weighs nothing (0 * NaN would still be NaN: zero the value too)
        weight = jnp.where(finite, weight, 0.0)
        values = [jnp.where(finite, value, 0.0) for value in values]
    # One vector: each output of a call costs XLA's CPU runtime a few us (jax 0.10). The count
    # depends on the step's result (plus 0 * 0-or-1, always exactly 0): an output that does not
    # depend on the rest of the step costs ~30 us per call there, a fifth of a small model's step.
    added = [value * weight for value in values] + [weight + 0.0 * bad, bad]
    out: dict[str, Any] = {"totals": Totals(totals.names, totals.values + jnp.stack(added))}
    if "objects" in acc:
        first = totals.count == 0  # the epoch's first counted step: its object replaces the zeroed one
        out["objects"] = {name: _merged(old, metrics[name], first) for name, old in acc["objects"].items()}
        if drop_nonfinite:
            out["objects"] = jax.tree.map(lambda merged, old: jnp.where(finite, merged, old),
                                          out["objects"], acc["objects"])
    return out


def _merged(old: Any, new: Any, first) -> Any:
    """``old.merge(new)``, or ``new`` itself on the epoch's first step (traced, no branch)."""
    merged = old.merge(new)
    return jax.tree.map(lambda m, n, o: jnp.where(first, n, m).astype(o.dtype), merged, new, old)


def is_typed_key(x) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``), which takes no arithmetic."""
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _copied(x):
    if is_typed_key(x):  # copy the key's data
        return jax.random.wrap_key_data(jax.random.key_data(x) + 0, impl=jax.random.key_impl(x))
    return x + jnp.zeros_like(x)


@jax.jit
def device_copy(tree):
    """A device-side copy in one dispatch (new buffers: safe from the step's donation); typed
    PRNG keys (``jax.random.key``, e.g. in ``optax.noisy_sgd``'s state) included."""
    return jax.tree.map(_copied, tree)


@jax.jit
def checked_copy(tree, checked):
    """``(device_copy(tree), tree_finite(checked))`` in one dispatch: a checkpoint's arrays and
    whether the parts it must not hold NaN/Inf in (``checked``: params, optimizer state) are finite."""
    return jax.tree.map(_copied, tree), tree_finite(checked)


@jax.jit
def fresh_zeros(tree):
    """Zeros shaped like ``tree`` in one dispatch."""
    return jax.tree.map(jnp.zeros_like, tree)


def placed_like(tree, state):
    """``tree`` committed to the one device ``state``'s arrays are committed to (a restored
    checkpoint's are; a fresh model's are not), else as it is: a jitted step then sees all its
    arguments placed alike from its first call on, and compiles once (jit keys its cache on that).

    Examples:
        >>> restored = jax.device_put(jnp.ones(2), jax.devices()[0])
        >>> placed_like(jnp.zeros(3), {"w": restored}).committed, placed_like(jnp.zeros(3), {"w": jnp.ones(2)}).committed
        (True, False)
    """
    device = committed_device(state)
    return tree if device is None else jax.device_put(tree, device)


def committed_device(tree) -> Any:
    """The single-device sharding ``tree``'s arrays are committed to (a restored checkpoint's
    are), else None (a fresh model's arrays, which jit places as it likes; a mesh's)."""
    ref = next((x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)), None)
    committed = ref is not None and getattr(ref, "committed", False)
    return ref.sharding if committed and isinstance(ref.sharding, jax.sharding.SingleDeviceSharding) else None


def to_host(tree):
    """``jax.device_get`` that also reads replicated arrays spread over several processes (on
    the CPU in one process, numpy reads the arrays in place: a few microseconds per leaf)."""
    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return x

    with deliberate_reads():
        if _one_process() and _arrays_in_host_memory():
            return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)
        return jax.device_get(jax.tree.map(get, tree))


def read_means(acc: dict, prefix: str = "") -> dict[str, float]:
    """Host sync: the weighted means as Python floats, keys prefixed (``"train/"``). Steps left
    out as skipped (``accumulate(..., drop_nonfinite=True)``) count for nothing; when every step
    was, each scalar mean is NaN (there is none), and metric objects are left out."""
    host = to_host(acc)  # a no-op for sums already on the host
    sums, count, nonfinite = host["totals"].read()
    if count == 0:  # no step counted: none ran, or every one was skipped as non-finite (then NaN)
        return {prefix + name: float("nan") for name in sums} if nonfinite else {}
    means: dict[str, Any] = {prefix + name: total / count for name, total in sums.items()}
    for name, value in host.get("objects", {}).items():
        _put_computed(means, prefix + name, value.compute())
    return means


def _put_computed(out: dict, key: str, value: Any) -> None:
    """An object's result under ``key``: a number (a one-element array included: an R² over a
    ``(B, 1)`` head) as a float, logged and monitorable as any; a larger array as numpy; a dict as
    ``key/sub``."""
    if isinstance(value, Mapping):
        for sub, item in value.items():
            _put_computed(out, f"{key}/{sub}", item)
        return
    array = np.asarray(value)
    out[key] = float(array.reshape(())) if array.size == 1 else array


def result_shapes(objects: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each metric object's result under the name :func:`read_means` gives it (a dict
    result as ``name/key``), from ``compute()`` traced on the objects' shapes (nothing runs); an
    object whose ``compute`` does not trace so is left out.

    Examples:
        >>> from flaxlight.metric_objects import ConfusionMatrix
        >>> result_shapes({"cm": jax.eval_shape(lambda: ConfusionMatrix.of(jnp.zeros(4, int), jnp.zeros(4, int), 3))})
        {'cm': (3, 3)}
    """
    out: dict[str, tuple[int, ...]] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for sub, item in value.items():
                put(f"{key}/{sub}", item)
        else:
            out[key] = tuple(getattr(value, "shape", ()))

    for name, value in objects.items():
        try:
            put(name, jax.eval_shape(lambda obj: obj.compute(), value))
        except Exception:  # noqa: BLE001 - known when the epoch's values are read
            continue
    return out


def with_saved_objects(template: dict, restored: dict) -> dict:
    """``restored`` (an accumulator read back from JSON, its objects as ``"saved_objects"``: leaf
    lists) with its metric objects rebuilt on ``template``'s structure (a zeroed accumulator)."""
    saved = restored.get("saved_objects")
    out = {key: value for key, value in restored.items() if key != "saved_objects"}
    if saved is None:
        return out
    objects = {}
    for name, zero in template.get("objects", {}).items():
        leaves, treedef = jax.tree.flatten(zero)
        objects[name] = jax.tree.unflatten(treedef, [jnp.asarray(np.asarray(value), leaf.dtype).reshape(leaf.shape)
                                                     for value, leaf in zip(saved[name], leaves)])
    out["objects"] = objects
    return out


def batch_size(batch: Any) -> int:
    """Number of examples in a batch: the leading dimension that most of its array leaves share,
    so a scalar (no leading dimension) or class weights of another length next to per-example
    arrays do not change it. Leaves that disagree with no majority (an ``(8, 4)`` array and a
    ``(10,)`` vector, one each) are an error naming them.

    Shapes only: inside ``jit`` this is a static Python int, so weighting costs nothing at run time.

    Examples:
        >>> batch_size({"cw": np.ones(10), "w": np.float32(0.5), "x": np.zeros((64, 3)), "y": np.zeros(64)})
        64
    """
    majority, leaves = majority_leading_dims(batch)
    if not leaves:
        raise ValueError(
            "Cannot tell the batch size: a batch must be a pytree (array, tuple, list or dict) of "
            f"arrays with a leading batch dimension; got {type(batch).__name__}."
        )
    if len(majority) > 1:
        shapes = ", ".join(f"{jax.tree_util.keystr(path) or '(the whole batch)'} {shape}" for path, shape in leaves)
        raise ValueError(
            f"Cannot tell the batch size: the batch's arrays disagree on their leading dimension and no one "
            f"dimension is shared by most of them ({shapes}). The metrics are weighted by the number of examples, "
            f"the leading dimension most arrays share: yield per-example arrays (one row per example), and keep "
            f"constants such as class weights in the model (model_hparams) or in your loss_fn."
        )
    return majority[0]


def majority_leading_dims(batch: Any, block: bool = False) -> tuple[list[int], list[tuple[Any, tuple[int, ...]]]]:
    """``(dims, leaves)``: the leading dimensions shared by the most array leaves of ``batch`` (one
    unless there is a tie), and ``(path, shape)`` of each leaf with a leading dimension. ``block``:
    a stack of batches (steps first), read along its second axis. The one count of examples that
    :func:`batch_size` (metrics' weights) and the device placement both use.

    Examples:
        >>> majority_leading_dims({"cw": np.ones(10), "x": np.zeros((64, 3)), "y": np.zeros(64)})[0]
        [64]
    """
    leaves = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = getattr(leaf, "shape", None)
        shape = tuple(int(n) for n in (shape if shape is not None else np.shape(leaf)))[1 if block else 0:]
        if shape:
            leaves.append((path, shape))
    counts = collections.Counter(shape[0] for _, shape in leaves)
    top = max(counts.values(), default=0)
    return [rows for rows, count in counts.items() if count == top], leaves


_MAXIMIZED_WORDS = frozenset(("acc", "accuracy", "f1", "auc", "auroc", "precision", "recall", "r2", "iou", "dice",
                              "bleu"))
_MINIMIZED_WORDS = frozenset(("loss", "error", "err", "mse", "mae", "rmse", "nll", "perplexity", "ppl", "bpc",
                              "inaccuracy", "wer", "cer", "fpr", "fnr", "eer", "ece"))
#: Names that tell only as a whole: a word too common to tell inside one (heat_map, brier_score, anomaly_score);
#: timm's top1 / top5 are accuracies (inside a name, top-k qualifies its word: err_top5 is an error).
_WHOLE_NAMES = {"map": "max", "score": "max", "val_metric": "min", "top1": "max", "top5": "max"}
#: Words that, after its loss or score word, make a name another quantity (loss_scale, acc_steps,
#: error_count, acc_drop, acc_stderr, acc_time, f1_support, acc_ci95): such a name tells nothing (a word
#: before it qualifies it: weight_loss is a loss).
_NOT_THE_METRIC = frozenset(("scale", "scaler", "weight", "weights", "factor", "coef", "coeff", "steps", "count",
                             "threshold", "thresh", "std", "var", "gap", "diff", "delta", "drop", "gain", "change",
                             "improvement", "reduction", "norm", "grad", "grads", "lr", "stderr", "sem", "stddev",
                             "stdev", "ci", "n", "support", "samples", "examples", "batches", "time", "seconds",
                             "sec", "secs", "ms", "latency", "runtime", "rank", "percentile"))
#: First words that make a name another quantity: sklearn's neg_mean_squared_error (maximized), num_*, 1-acc.
_OTHER_FIRST = frozenset(("neg", "negative", "minus", "num", "1"))
#: Words after which the rest qualifies the words before: recall_at_fpr_1, acc@5, std_of_acc, loss_per_token.
_QUALIFIED_BY = ("at", "of", "in", "per")


def _word_direction(word: str) -> str | None:
    if word in _MINIMIZED_WORDS or word.endswith("loss"):
        return "min"
    if word in _MAXIMIZED_WORDS or word.endswith(("acc", "accuracy")):
        return "max"
    return None


def _metric_words(name: str) -> list[str]:
    """The words of a name that say what it measures: without a trailing ``step`` / ``epoch``,
    what follows ``at`` / ``@`` (the point it is read at: recall_at_fpr_1) or ``of``, ``in``,
    ``per``, top-k (``top5``, ``top_k``) and numbers (``acc5`` is ``acc``)."""
    words = [word for word in re.split(r"[_\-.]+", name.replace("@", "_at_")) if word]
    if len(words) > 1 and words[-1] in ("step", "epoch"):
        words = words[:-1]
    cut = [index for index, word in enumerate(words) if word in _QUALIFIED_BY]
    kept = []
    for word in words[:cut[0] if cut else None]:
        stem = word.rstrip("0123456789")
        if stem in ("", "top", "topk", "k"):
            continue
        known = _word_direction(stem) or stem in _WHOLE_NAMES or stem in _NOT_THE_METRIC
        kept.append(stem if stem != word and known else word)
    return kept


def name_direction(metric: str) -> str | None:
    """``"max"`` when ``metric``'s name reads as a score to maximize (accuracy, F1, AUC, ...),
    ``"min"`` when it reads as a loss or an error, None when the name does not tell.

    Read from its last path component's words (split at ``_ - .``): the last word that is a known
    score or loss (or ends in ``loss``, ``acc``, ``accuracy``) tells, wherever it stands
    (``acc_digit``, ``digit_acc``, ``f1_macro``, ``top5_error``, ``err_top5``). Qualifiers do not:
    top-k (``top5``, ``top_k``), numbers, a trailing ``step`` or ``epoch`` (Lightning's
    ``loss_epoch``) and whatever follows ``at`` or ``@`` (``recall@10``, ``fpr_at_recall_95``). A
    word after it that makes the name another quantity (``loss_scale``, ``acc_steps``,
    ``error_count``, ``acc_stderr``, ``acc_time``, ``f1_support``, ...), a first word ``neg`` or
    ``num``, or a score word and a loss word together (``loss_acc``, ``acc_err``; but a loss of a
    score, ``f1_loss``, is a loss), and the name tells nothing: a warning missed is better than a
    wrong one. ``map``, ``score`` (and timm's ``top1``, ``top5``) tell only as the whole name (not
    ``heat_map``, ``brier_score``).

    Examples:
        >>> name_direction("val/acc"), name_direction("val/loss_digit"), name_direction("val/logits_norm")
        ('max', 'min', None)
        >>> name_direction("val/digit/f1_macro"), name_direction("val/err_top5"), name_direction("acc_stderr")
        ('max', 'min', None)
    """
    name = str(metric).rsplit("/", 1)[-1].lower()
    if name in _WHOLE_NAMES:
        return _WHOLE_NAMES[name]
    words = _metric_words(name)
    if not words or re.split(r"[_\-.@]+", name, maxsplit=1)[0] in _OTHER_FIRST:
        return None
    if "_".join(words) in _WHOLE_NAMES:  # map@50, map_50
        return _WHOLE_NAMES["_".join(words)]
    told = [(index, _word_direction(word)) for index, word in enumerate(words) if _word_direction(word)]
    if not told:
        return None
    index, direction = told[-1]
    if not _NOT_THE_METRIC.isdisjoint(words[index + 1:]):
        return None
    if any(other != direction for _, other in told) and not words[index].endswith("loss"):
        return None  # a score and a loss or an error: which one the name measures does not show
    return direction


@functools.cache
def _arrays_in_host_memory() -> bool:
    """Whether the default device is the CPU, whose arrays numpy reads in place."""
    return jax.devices()[0].platform == "cpu"


@functools.cache
def _one_process() -> bool:
    return jax.process_count() == 1


def _host_array(x: Any) -> np.ndarray:
    """One array on the host (a process's own copy of a replicated array spread over processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    with deliberate_reads():
        return np.asarray(x)


class HostSnapshot:
    """A copy of an accumulator on its way to the host, started without waiting.

    Take one at a log point; by the next log point the values are on the host and reading them
    costs no device sync on the training thread. No device work is launched: the step's own
    output arrays are kept and copied.
    """

    def __init__(self, acc: dict):
        # The training step returns new sums every step (it does not donate them), so holding
        # these arrays is enough: no device work. On an accelerator their copies start here; on
        # the CPU they are in host memory already (a copy would only cost time).
        # Metric objects are read at epoch ends only: interval means are for the scalar sums.
        self._totals: Totals = acc["totals"]
        if not _arrays_in_host_memory():
            with deliberate_reads():
                self._totals.values.copy_to_host_async()

    def ready(self) -> bool:
        """Whether the step that made these sums has finished (asks; never waits)."""
        is_ready = getattr(self._totals.values, "is_ready", None)  # numpy sums (restored) are ready
        return True if is_ready is None else bool(is_ready())

    def sums_and_count(self) -> tuple[dict[str, float], float, int]:
        """``(sums, examples, non-finite steps)`` on the host."""
        totals = self._totals
        return totals.read() if _one_process() else Totals(totals.names, _host_array(totals.values)).read()
