"""What the benchmarks share: data, models, the hand-written loops, the timing harness, the tables.

Data (both 16384 examples, so steps per epoch are whole multiples of 16 at batch 128 and 1024:
128 and 16 steps; a fused block of 16 steps never leaves a ragged tail):

- ``digits``: scikit-learn's 1797 8x8 digits scaled to [0, 1], tiled and cut to 16384 (64 features);
- ``synthetic``: 784 standard-normal features, labels from a random linear teacher (argmax of
  ``x @ W``, fixed numpy seed): learnable, MNIST-shaped, no download.

Workloads (MLP with relu; input-hidden-hidden-10; adam 1e-3, no gradient clipping):

=============== ============ ================ =====
name            data         model            batch
=============== ============ ================ =====
tiny-128        digits       64-32-32-10      128
mlp-256-128     digits       64-256-256-10    128   (the "digits MLP")
mlp-256-1024    digits       64-256-256-10    1024
wide-512-128    synthetic    784-512-512-10   128
wide-512-1024   synthetic    784-512-512-10   1024
=============== ============ ================ =====

The hand-written loops (:class:`HandLoop`) are what a careful JAX user writes: a ``jax.jit`` step
with the train state donated, the loss summed on the device and read once per epoch, the same
optax transformation and initial parameters as the trainer they are compared with. Their example
count is made to depend on the step's loss, as flaxlight's is: on XLA's CPU runtime a step output
that does not depend on the rest of the step costs ~30 us per call (jax 0.10.2), 25-30% of the
tiny MLP's step, and the written-naively loop would lose by that much:

- ``numpy``:  the step is fed numpy batches (the same :class:`flaxlight.ArrayLoader` the trainer
  gets, so both sides pay the same host gather and host-to-device copy per step);
- ``device``: the dataset lives on the device; per epoch one jitted gather of the permuted dataset
  into ``(steps, batch, ...)`` arrays; the step takes those arrays and the step index and slices
  inside the jit (indexing them from Python costs one more dispatch per step, ~2.5x slower on the
  tiny MLP; iterating them with ``zip`` is no faster than numpy batches);
- ``scan``:   blocks of ``k`` batches gathered on the host (one numpy gather of ``k * batch`` rows,
  reshaped), transferred in one go and trained by one ``jax.lax.scan`` of ``k`` steps per
  dispatch; any steps left over (none here) run one by one.

Timing (:func:`interleave`): every variant is warmed up (compiled), then a round runs ``epochs``
calls of every variant interleaved in stints of ``--stint`` calls (default 8; at most
``epochs``), the order reversed every other stint, so drifts of a shared machine hit all
variants alike. A round gives one steps/s per variant; ratios are taken within a round and the
median over rounds is reported (with the per-round range). Stints, not single calls: work a
call leaves running when it returns (the trainer prepares its next epoch's data at the end of
an epoch) would otherwise be timed as the next variant's; with stints of 8 a variant pays for
7 of its own 8 tails. Until session 7 the calls alternated one by one (``--stint 1``), which
read the fused tiny-MLP trainer ~10% faster than a user running its epochs back to back.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import functools
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import flaxlight

NUM_EXAMPLES = 16384
NUM_CLASSES = 10
OPTIMIZER_HPARAMS = {"optimizer": "adam", "lr": 1e-3, "gradient_clip": None}


# ---------------------------------------------------------------------------------------- data
@functools.lru_cache(maxsize=None)
def digits_data(num_examples: int = NUM_EXAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits in [0, 1], tiled and cut to ``num_examples`` (float32, int32)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    tiles = -(-num_examples // len(digits.target))
    x = np.tile((digits.data / 16.0).astype(np.float32), (tiles, 1))[:num_examples]
    y = np.tile(digits.target.astype(np.int32), tiles)[:num_examples]
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


@functools.lru_cache(maxsize=None)
def synthetic_data(num_examples: int = NUM_EXAMPLES, features: int = 784, seed: int = 0):
    """Standard-normal features, labels = argmax of a random linear teacher (learnable)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_examples, features), dtype=np.float32)
    teacher = rng.standard_normal((features, NUM_CLASSES)).astype(np.float32) / np.sqrt(features)
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return x, y


DATASETS = {"digits": digits_data, "synthetic": synthetic_data}


@dataclasses.dataclass(frozen=True)
class Workload:
    dataset: str
    hidden: tuple[int, ...]
    batch_size: int

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        return DATASETS[self.dataset]()

    @property
    def label(self) -> str:
        features = self.data()[0].shape[1]
        return f"{features}-{'-'.join(map(str, self.hidden))}-{NUM_CLASSES} b{self.batch_size}"


WORKLOADS = {
    "tiny-128": Workload("digits", (32, 32), 128),
    "mlp-256-128": Workload("digits", (256, 256), 128),
    "mlp-256-1024": Workload("digits", (256, 256), 1024),
    "wide-512-128": Workload("synthetic", (512, 512), 128),
    "wide-512-1024": Workload("synthetic", (512, 512), 1024),
}


def make_loader(workload: Workload, seed: int = 0) -> flaxlight.ArrayLoader:
    x, y = workload.data()
    return flaxlight.ArrayLoader(x, y, batch_size=workload.batch_size, shuffle=True, seed=seed, drop_last=True)


class UserLoader:
    """A loader as users write one: a class whose ``__iter__`` yields numpy ``(x, y)`` batches of
    a shuffled epoch (numpy permutation, fancy indexing), with ``__len__`` and ``set_epoch``.
    flaxlight knows nothing of it (no device epochs): each batch is put on the device per step."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0):
        self.x, self.y, self.batch_size, self.seed, self.epoch = x, y, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.x) // self.batch_size

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.x))
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[idx], self.y[idx]


def make_user_loader(workload: Workload, seed: int = 0) -> UserLoader:
    x, y = workload.data()
    return UserLoader(x, y, workload.batch_size, seed=seed)


# ---------------------------------------------------------------------------------------- models
class MLP(nn.Module):
    hidden_dims: Sequence[int]
    num_classes: int = NUM_CLASSES

    @nn.compact
    def __call__(self, x, train: bool = False):
        for dim in self.hidden_dims:
            x = nn.relu(nn.Dense(dim)(x))
        return nn.Dense(self.num_classes)(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Classifier(flaxlight.TrainerModule):
    """The trainer under test: only ``loss_fn`` is written."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        return cross_entropy(logits, y), ({}, updates)


def make_trainer(workload: Workload, log_dir: str, *, model_class=MLP, model_hparams=None,
                 optimizer_hparams: Mapping[str, Any] = OPTIMIZER_HPARAMS, logger_type=None,
                 progress_bar: bool = False, trainer_class: type[Classifier] = Classifier, **options) -> Classifier:
    """A :class:`Classifier` for ``workload``; ``options`` are trainer options (callbacks=...).

    ``logger_type=None`` keeps flaxlight's default loggers (CSV, plus TensorBoard when
    tensorboardX is installed).
    """
    x, _ = workload.data()
    logger_params = {"log_dir": log_dir}
    if logger_type is not None:
        logger_params["logger_type"] = logger_type
    options.setdefault("enable_model_summary", False)
    return trainer_class(
        model_class=model_class,
        model_hparams=model_hparams if model_hparams is not None else {"hidden_dims": list(workload.hidden)},
        optimizer_hparams=dict(optimizer_hparams), exmp_input=x[:1], seed=42, logger_params=logger_params,
        enable_progress_bar=progress_bar, **options)


def ready_for_epochs(trainer: flaxlight.TrainerModule, steps_per_epoch: int, total_epochs: int = 1000):
    """``init_optimizer`` once, so that ``train_epoch`` can be called directly (the run's length
    only shapes the learning-rate schedule; the hand loops get the same transformation)."""
    trainer.init_optimizer(total_epochs, steps_per_epoch)
    return trainer


def trainer_epoch(trainer: flaxlight.TrainerModule, loader) -> Callable[[int], tuple[float, float]]:
    """A timer: ``trainer.train_epoch`` -> (seconds, mean loss), on epochs 1, 2, 3, ... of its
    own copy of ``loader``, in order, as ``train_model`` runs them (the trainer prepares the
    next epoch's device data at the end of each epoch; interleaved variants sharing one epoch
    counter would make it guess wrong every time)."""
    own = copy.copy(loader)
    epochs = itertools.count(1)

    def run(_):
        own.set_epoch(next(epochs))
        start = time.perf_counter()
        metrics = trainer.train_epoch(own)
        return time.perf_counter() - start, metrics["train/loss"]

    return run


class EpochClock(flaxlight.Callback):
    """Wall time between consecutive epoch starts (an epoch's training + its end-of-epoch work:
    validation, checkpoint, logger flush)."""

    def __init__(self):
        self.starts: list[float] = []

    def on_train_epoch_start(self, trainer, epoch):
        self.starts.append(time.perf_counter())

    def periods(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def train_model_timer(build: Callable[[EpochClock], flaxlight.TrainerModule], loader, num_epochs: int,
                      after: Callable[[flaxlight.TrainerModule], None] | None = None,
                      whole: list[float] | None = None) -> Callable[[int], float]:
    """A timer over whole ``train_model`` runs: ``build(clock)`` makes a fresh trainer (untimed)
    with ``clock`` among its callbacks; the run trains ``num_epochs`` epochs without validation and
    the timer returns the sum of its steady epoch periods: epoch start to epoch start, the first
    period dropped (``train_model`` re-jits the step for the optimizer it builds), so
    ``num_epochs - 2`` epochs, each with its end-of-epoch work. ``whole`` collects the duration of
    each ``train_model`` call; ``after(trainer)`` runs after each run (checks)."""

    def run(_):
        clock = EpochClock()
        trainer = build(clock)
        start = time.perf_counter()
        trainer.train_model(loader, None, num_epochs=num_epochs)
        if whole is not None:
            whole.append(time.perf_counter() - start)
        if after is not None:
            after(trainer)
        periods = clock.periods()[1:]
        assert len(periods) == num_epochs - 2, (len(periods), num_epochs)
        return sum(periods)

    return run


# ---------------------------------------------------------------------------------------- hand loops
class HandFunctions:
    """The jitted functions of the hand-written loops for one model (compiled once, shared)."""

    def __init__(self, apply_fn: Callable):
        def body(state, acc, batch):
            x, y = batch
            loss, grads = jax.value_and_grad(lambda p: cross_entropy(apply_fn({"params": p}, x), y))(state.params)
            n = x.shape[0]
            # `+ 0 * isnan(loss)`: the count depends on the step's result, as flaxlight's does. A step
            # output XLA's CPU runtime can compute apart from the rest of the step costs ~30 us per
            # call (jax 0.10), which would handicap the hand loop on the small models.
            count = acc["count"] + n + 0.0 * jnp.isnan(loss).astype(jnp.float32)
            return state.apply_gradients(grads=grads), {"loss": acc["loss"] + loss * n, "count": count}

        def step_at(state, acc, xs, ys, i):  # batch i of device-resident (steps, batch, ...) arrays
            return body(state, acc, (xs[i], ys[i]))

        def block(state, acc, xs, ys):  # len(xs) steps in one dispatch
            return jax.lax.scan(lambda carry, batch: (body(*carry, batch), None), (state, acc), (xs, ys))[0]

        def gather(x, y, idx):
            return x[idx], y[idx]

        self.step = jax.jit(body, donate_argnums=0)
        self.step_at = jax.jit(step_at, donate_argnums=0)
        self.block = jax.jit(block, donate_argnums=0)
        self.gather = jax.jit(gather)


class HandLoop:
    """One hand-written training run: a flax ``TrainState`` with the trainer's params and tx."""

    def __init__(self, functions: HandFunctions, trainer: flaxlight.TrainerModule):
        self.fns = functions
        params = jax.tree.map(jnp.copy, trainer.state.params)  # the same initial parameters
        self.state = train_state.TrainState.create(apply_fn=trainer.model.apply, params=params, tx=trainer.state.tx)
        self._device_data = None

    @staticmethod
    def _zeros():
        return {"loss": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.float32)}

    @staticmethod
    def _mean(acc) -> float:
        host = jax.device_get(acc)  # the epoch's one read
        return float(host["loss"]) / float(host["count"])

    def epoch_numpy(self, batches) -> float:
        state, acc, step = self.state, self._zeros(), self.fns.step
        for batch in batches:
            state, acc = step(state, acc, batch)
        self.state = state
        return self._mean(acc)

    def epoch_device(self, x, y, order: np.ndarray, batch_size: int) -> float:
        if self._device_data is None or self._device_data[0] is not x:
            self._device_data = (x, jax.device_put(x), jax.device_put(y))  # once: the dataset on the device
        _, xd, yd = self._device_data
        steps = len(order) // batch_size
        xs, ys = self.fns.gather(xd, yd, order[: steps * batch_size].reshape(steps, batch_size))
        state, acc, step_at = self.state, self._zeros(), self.fns.step_at
        for i in range(steps):
            state, acc = step_at(state, acc, xs, ys, i)
        self.state = state
        return self._mean(acc)

    def epoch_scan(self, x, y, order: np.ndarray, batch_size: int, k: int) -> float:
        steps = len(order) // batch_size
        state, acc, block, step = self.state, self._zeros(), self.fns.block, self.fns.step
        rows = k * batch_size
        for b in range(steps // k):
            idx = order[b * rows : (b + 1) * rows]
            state, acc = block(state, acc, x[idx].reshape(k, batch_size, *x.shape[1:]), y[idx].reshape(k, batch_size))
        for s in range(steps // k * k, steps):
            idx = order[s * batch_size : (s + 1) * batch_size]
            state, acc = step(state, acc, (x[idx], y[idx]))
        self.state = state
        return self._mean(acc)


def epoch_timer(run: Callable[[], float], loader) -> Callable[[int], tuple[float, float]]:
    """A timer ``epoch -> (seconds, loss)``: ``run()`` (which returns the loss) on ``loader``'s epoch."""
    def timed(epoch):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        loss = run()
        return time.perf_counter() - start, loss

    return timed


def hand_timers(functions: HandFunctions, trainer, loader, k: int = 16) -> dict[str, Callable]:
    """Timers ``epoch -> (seconds, loss)`` of the three hand loops, each with its own state,
    reading epoch ``e``'s order from ``loader`` (the same permutation the trainer gets)."""
    x, y = loader.data
    loops = {kind: HandLoop(functions, trainer) for kind in ("numpy", "device", "scan")}

    def timed(fn):
        return epoch_timer(fn, loader)

    return {
        "numpy": timed(lambda: loops["numpy"].epoch_numpy(loader)),
        "device": timed(lambda: loops["device"].epoch_device(x, y, loader.order(), loader.batch_size)),
        "scan": timed(lambda: loops["scan"].epoch_scan(x, y, loader.order(), loader.batch_size, k)),
    }


# ---------------------------------------------------------------------------------------- timing
@dataclasses.dataclass
class Variant:
    """``run(epoch)`` does one timed unit (an epoch, a run) and returns its seconds, or
    ``(seconds, loss)``; ``steps`` is the number of optimizer steps that unit trains."""

    name: str
    run: Callable[[int], Any]
    steps: int


@dataclasses.dataclass
class Timing:
    epochs: int  # calls per variant per round
    rates: dict[str, list[float]]  # steps/s of each round
    best: dict[str, list[float]]  # steps/s of each round's fastest call
    losses: dict[str, float | None]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # a script's own results, also returned

    def rate(self, name: str) -> float:
        return statistics.median(self.rates[name])

    def _per_round(self, a: str, b: str, best: bool = False) -> list[float]:
        rates = self.best if best else self.rates
        return [x / y for x, y in zip(rates[a], rates[b])]

    def ratio(self, a: str, b: str) -> float:
        """Median over rounds of (steps/s of ``a`` / steps/s of ``b``)."""
        return statistics.median(self._per_round(a, b))

    def ratio_range(self, a: str, b: str) -> tuple[float, float]:
        per_round = self._per_round(a, b)
        return min(per_round), max(per_round)

    def best_ratio(self, a: str, b: str) -> float:
        """The same ratio from each round's fastest calls (steadier on a busy machine)."""
        return statistics.median(self._per_round(a, b, best=True))


def interleave(variants: Sequence[Variant], *, rounds: int, seconds: float, warmup: int, epochs: int = 0,
               reference: str | None = None, stint: int = 1) -> Timing:
    """Warm every variant up, size a round to ~``seconds`` of ``reference`` (default: the first
    variant) unless ``epochs`` is given, then run ``rounds`` interleaved rounds; within a round a
    variant runs ``stint`` calls in a row before the next one runs (as a user's run does)."""
    counter = [0]

    def call(v: Variant):
        counter[0] += 1
        out = v.run(counter[0])
        seconds_, loss = out if isinstance(out, tuple) else (out, None)
        if loss is not None:
            losses[v.name] = loss
        return seconds_

    losses: dict[str, float | None] = {v.name: None for v in variants}
    for _ in range(warmup):
        for v in variants:
            call(v)
    if not epochs:
        ref = next(v for v in variants if v.name == (reference or variants[0].name))
        epochs = max(1, round(seconds / min(call(ref) for _ in range(3))))
    rates: dict[str, list[float]] = {v.name: [] for v in variants}
    best: dict[str, list[float]] = {v.name: [] for v in variants}
    stint = min(stint, epochs)
    stints = itertools.count()  # the order flips every stint, also across rounds of one stint
    for _ in range(rounds):
        taken: dict[str, list[float]] = {v.name: [] for v in variants}
        for _ in range(max(1, round(epochs / stint))):
            for v in variants if next(stints) % 2 == 0 else variants[::-1]:
                taken[v.name] += [call(v) for _ in range(stint)]
        for v in variants:
            rates[v.name].append(len(taken[v.name]) * v.steps / sum(taken[v.name]))
            best[v.name].append(v.steps / min(taken[v.name]))
    return Timing(epochs=len(taken[variants[0].name]), rates=rates, best=best, losses=losses)


def time_workload(name: str, variants: Sequence[Variant], args, unit: str = "epochs", **overrides) -> Timing:
    """``interleave`` with the command line's ``--rounds/--seconds/--warmup/--epochs`` (``overrides``
    replace them), then one progress line for the workload."""
    settings = dict(rounds=args.rounds, seconds=args.seconds, warmup=args.warmup, epochs=args.epochs,
                    stint=args.stint)
    settings.update(overrides)
    timing = interleave(variants, **settings)
    describe_run(name, WORKLOADS[name], timing, unit)
    return timing


def run_workloads(args, prefix: str, run_workload: Callable[[str, Any, str], Timing]) -> dict[str, Timing]:
    """``run_workload(name, args, log_root)`` for every workload of ``args``, in one temporary
    folder (logs and checkpoints go there and are removed at the end)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"flaxlight-{prefix}-") as log_root:
        return {name: run_workload(name, args, log_root) for name in args.workloads}


# ---------------------------------------------------------------------------------------- command line
def timing_parser(doc: str, *, default_workloads: Sequence[str], choices: Sequence[str] | None = None,
                  rounds: int = 7, seconds: float = 1.0, warmup: int = 2) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds per workload (default {rounds})")
    parser.add_argument("--seconds", type=float, default=seconds,
                        help=f"target length of a round per variant, in seconds of the reference (default {seconds})")
    parser.add_argument("--epochs", type=int, default=0, help="calls per round per variant (overrides --seconds)")
    parser.add_argument("--stint", type=int, default=8,
                        help="calls of one variant in a row before the next variant runs (default 8)")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed warm-up calls per variant (default {warmup})")
    parser.add_argument("--workloads", nargs="+", choices=list(choices or WORKLOADS), default=None,
                        help=f"default: {' '.join(default_workloads)}")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds of ~0.15 s, 1 warm-up call")
    parser.set_defaults(default_workloads=list(default_workloads))
    return parser


def finish_args(args, quick_workloads: Sequence[str] | None = None):
    """Apply ``--quick`` (3 rounds of ~0.15 s, 1 warm-up; ``quick_workloads`` unless named)."""
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 0.15, 1
    if args.workloads is None:
        args.workloads = list(quick_workloads) if args.quick and quick_workloads else args.default_workloads
    return args


# ---------------------------------------------------------------------------------------- reporting
def machine_line() -> str:
    load = os.getloadavg()
    return (f"{platform.node() or 'machine'}: {os.cpu_count()} cores, load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
            f"jax {jax.__version__} on {jax.devices()[0].platform}, flax {flax.__version__}, "
            f"flaxlight {flaxlight.__version__}, python {platform.python_version()}")


def print_header(title: str, details: str = "") -> float:
    """Print the benchmark's title and the machine; return the load average now."""
    print(f"{title}\n{machine_line()}" + (f"\n{details}" if details else ""), flush=True)
    return os.getloadavg()[0]


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    """Rows of text and numbers (floats: no decimals from 100, one from 10, else three)."""
    def fmt(value):
        if isinstance(value, float):
            return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"
        return "" if value is None else str(value)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths)))
    print("\n" + (title + "\n" if title else "") + line + "\n" + "-" * len(line))
    for row in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


@dataclasses.dataclass
class Check:
    label: str
    value: float
    target: float

    @property
    def ok(self) -> bool:
        return self.value >= self.target

    def as_dict(self) -> dict:
        return {"label": self.label, "value": self.value, "target": self.target, "ok": self.ok}

    def line(self) -> str:
        return f"  {self.label:<58} {self.value:6.3f}  (target >= {self.target:.2f})  {'OK' if self.ok else 'BELOW TARGET'}"


def print_checks(checks: Sequence[Check], load_before: float) -> None:
    """The targets (OK / BELOW TARGET), then a warning when the machine was busy."""
    if checks:
        print("\ntargets (median ratios of interleaved rounds):")
        for check in checks:
            print(check.line())
        missed = sum(not c.ok for c in checks)
        print(f"  {len(checks) - missed} of {len(checks)} OK" + (f", {missed} BELOW TARGET" if missed else ""))
    load_after = os.getloadavg()[0]
    if max(load_before, load_after) > (os.cpu_count() or 1) + 1:  # this run itself adds ~1-2
        print(f"\nwarning: load average {load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores: "
              f"other processes compete for the CPU and the ratios are unreliable; rerun on an idle machine.")
    print(flush=True)


def summarize(timings: Mapping[str, Timing], pairs: Sequence[tuple[str, str]], checks: Sequence[Check]) -> list[dict]:
    """What ``main`` returns: per workload the median rates and ratios, its checks (a check
    belongs to a workload when its label starts with ``"<workload>:"``) and ``Timing.extra``."""
    return [{"workload": name, "epochs": t.epochs, "rates": {v: t.rate(v) for v in t.rates},
             "ratios": {f"{a}/{b}": t.ratio(a, b) for a, b in pairs},
             "ratio_range": {f"{a}/{b}": t.ratio_range(a, b) for a, b in pairs},
             "checks": [c.as_dict() for c in checks if c.label.startswith(name + ":")], **t.extra}
            for name, t in timings.items()]


def report(timings: Mapping[str, Timing], variants: Sequence[str], pairs: Sequence[tuple[str, str]],
           checks: Sequence[Check], load_before: float, *, extra: Mapping[str, Mapping[str, Any]] | None = None,
           range_pairs: Sequence[tuple[str, str]] | None = None, notes: Sequence[str] = ()) -> list[dict]:
    """Every script's ending: the table, the per-round ranges, ``notes``, the targets and the
    load warning; returns :func:`summarize`'s results."""
    print_rates(timings, variants, pairs, extra)
    print_ranges(timings, range_pairs or pairs)
    for note in notes:
        print("\n" + note)
    print_checks(checks, load_before)
    return summarize(timings, pairs, checks)


def print_ranges(timings: Mapping[str, Timing], pairs: Sequence[tuple[str, str]]) -> None:
    """Per workload: each ratio's per-round range and the ratio of the rounds' fastest calls."""
    print("\nper-round range of each ratio, and the median ratio of each round's fastest calls:")
    for name, timing in timings.items():
        parts = []
        for a, b in pairs:
            if a in timing.rates and b in timing.rates:
                lo, hi = timing.ratio_range(a, b)
                parts.append(f"{a}/{b} [{lo:.3f}, {hi:.3f}] fastest {timing.best_ratio(a, b):.3f}")
        print(f"  {name:<14} " + "; ".join(parts))


def print_rates(timings: Mapping[str, Timing], variants: Sequence[str], pairs: Sequence[tuple[str, str]],
                extra: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """The main table: per workload the median steps/s of ``variants``, the median ratio of each
    pair, then ``extra[workload]``'s columns, if any."""
    extra_columns = list(next(iter(extra.values()))) if extra else []
    columns = ["workload"] + [f"{v} /s" for v in variants] + [f"{a}/{b}" for a, b in pairs] + extra_columns
    rows = [[WORKLOADS[n].label] + [t.rate(v) for v in variants] + [t.ratio(a, b) for a, b in pairs]
            + [extra[n][c] for c in extra_columns] for n, t in timings.items()]
    print_table(columns, rows)


def describe_run(name: str, workload: Workload, timing: Timing, unit: str = "epochs") -> None:
    losses = ", ".join(f"{v} {loss:.3f}" for v, loss in timing.losses.items() if loss is not None)
    steps_per_epoch = NUM_EXAMPLES // workload.batch_size
    print(f"  {name} ({workload.label}): rounds of {timing.epochs} {unit} per variant, {steps_per_epoch} steps per epoch"
          + (f"; last train loss {losses}" if losses else ""), flush=True)
