"""Benchmark 4: flaxlight against Keras 3 on JAX (``model.fit``), the nearest peer a user would try.

Keras is not a dependency of flaxlight: run this in the benchmark venv (``make bench-env``, then
``.venv-bench/bin/python benchmarks/keras_peer.py``; ``make bench`` runs every benchmark there).

The same workload on both sides (``common.py``): the same data as numpy arrays, an MLP of Dense
relu layers of the same sizes, sparse categorical cross-entropy from logits, Adam with a constant
learning rate of 1e-3 (flaxlight's ``schedule="constant"``; Keras' default Adam), the same batch
size, shuffled every epoch. (Initial weights differ: Keras draws glorot-uniform, flax
lecun-normal; the work per step is the same.) Variants:

- hand: the hand-written loop of benchmark 1 (jitted step, donated state, numpy batches);
- flaxlight / flaxlight-16: ``train_epoch`` with ``steps_per_execution`` 1 / 16;
- keras / keras-16: ``model.compile(..., steps_per_execution=1 / 16, jit_compile=True)``, then
  ``model.fit(x, y, batch_size=B, epochs=1, shuffle=True, verbose=0)`` per interleaved epoch.
  Keras on JAX runs ``steps_per_execution`` as a Python loop over its jitted step (fewer callback
  calls, not fewer dispatches).

What is timed for Keras: a callback takes the time from ``on_epoch_begin`` to ``on_epoch_end``
inside each ``fit`` call, which holds everything Keras does per epoch (the shuffle and iterator,
the steps, the state sync, the metric read) but not what it does once per ``fit`` call (the
data adapter, callback list, final sync), which a user training N epochs in one ``fit`` pays
once. That per-call overhead is printed separately. flaxlight and the hand loop are timed per
``train_epoch`` / epoch call (each includes their per-epoch work). Epochs are 16384 examples,
so fixed per-epoch costs are small. Epochs are interleaved; medians over rounds are reported.

Targets (tiny MLP 64-32-32-10 at batch 128, where per-step overhead shows; for the larger
models compute dominates and the ratios are printed for information): flaxlight / keras >= 2.3,
flaxlight-16 / keras-16 >= 1.9.

The default path (``--no-default-path`` skips it): whole runs as each library's user writes them
first, every default on. flaxlight-default: a fresh trainer, ``train_model(loader, None,
num_epochs=N)`` with its default checkpoints, CSV + TensorBoard loggers and a progress bar;
keras-default: a fresh model, ``compile(optimizer, loss)`` and ``fit(x, y, batch_size=B,
epochs=N)`` with Keras' defaults (its progress bar, ``jit_compile="auto"``, shuffling). Both
bars write to /dev/null. Timed: epoch start to epoch start, the first epoch of a run (compiling)
dropped. Target: flaxlight-default ahead of keras-default on every row (ratio > 1).

Run:
    python benchmarks/keras_peer.py              # full run (3 workloads, 7 rounds of ~1 s per variant)
    python benchmarks/keras_peer.py --quick      # smoke run (tiny MLP only)
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported (here and anywhere)

import contextlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Sequence  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Check, HandFunctions, Variant  # noqa: E402

DEFAULT_WORKLOADS = ["tiny-128", "mlp-256-128", "wide-512-1024"]
QUICK_WORKLOADS = ["tiny-128"]
TARGETS = {"tiny-128": {("flaxlight", "keras"): 2.3, ("flaxlight-16", "keras-16"): 1.9}}
TARGET_DEFAULT = 1.0  # flaxlight-default / keras-default, every row
OPTIMIZER_HPARAMS = {**common.OPTIMIZER_HPARAMS, "schedule": "constant"}  # Keras' Adam: a constant rate
K = 16


def import_keras():
    try:
        import keras
    except ImportError:
        sys.exit("keras_peer.py needs Keras 3: run `make bench-env` and use .venv-bench/bin/python "
                 "(Keras is not a dependency of flaxlight).")
    if keras.backend.backend() != "jax":
        sys.exit(f"Keras runs on {keras.backend.backend()!r}; set KERAS_BACKEND=jax before importing it.")
    return keras


def keras_timer(keras, workload: common.Workload, steps_per_execution: int, fit_overheads: list[float]):
    """A timer for ``model.fit(epochs=1)``: returns the in-fit epoch time and the loss; the
    rest of the ``fit`` call (its once-per-call setup) goes to ``fit_overheads``."""
    x, y = workload.data()
    model = keras.Sequential(
        [keras.Input((x.shape[1],))] + [keras.layers.Dense(h, activation="relu") for h in workload.hidden]
        + [keras.layers.Dense(common.NUM_CLASSES)])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution, jit_compile=True)

    class EpochWindow(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.begin

    window = EpochWindow()

    def run(_):
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=workload.batch_size, epochs=1, shuffle=True, verbose=0,
                            callbacks=[window])
        fit_overheads.append(time.perf_counter() - start - window.seconds)
        return window.seconds, float(history.history["loss"][-1])

    return run


def keras_default_run(keras, workload: common.Workload, num_epochs: int):
    """A timer over whole default ``fit`` runs of a fresh model: the steady epoch periods."""
    x, y = workload.data()

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.starts = []

        def on_epoch_begin(self, epoch, logs=None):
            self.starts.append(time.perf_counter())

        def on_train_end(self, logs=None):
            self.starts.append(time.perf_counter())

    def run(_):
        model = keras.Sequential(
            [keras.Input((x.shape[1],))] + [keras.layers.Dense(h, activation="relu") for h in workload.hidden]
            + [keras.layers.Dense(common.NUM_CLASSES)])
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        clock = Clock()
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            model.fit(x, y, batch_size=workload.batch_size, epochs=num_epochs, callbacks=[clock])
        return clock.starts[-1] - clock.starts[1]  # epochs 2..N, each with its end-of-epoch work

    return run


def flaxlight_default_run(name: str, workload: common.Workload, loader, num_epochs: int, log_root: str):
    """A timer over whole default ``train_model`` runs of a fresh trainer: the steady epoch periods."""
    from flaxlight.callbacks import ProgressBar

    runs = [0]

    class Clock(common.EpochClock):
        def on_fit_end(self, trainer):
            self.starts.append(time.perf_counter())

    def run(_):
        runs[0] += 1
        clock = Clock()
        trainer = common.make_trainer(workload, os.path.join(log_root, f"{name}-default-{runs[0]}"),
                                      optimizer_hparams=OPTIMIZER_HPARAMS, callbacks=[clock, ProgressBar(style="bars")])
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            trainer.train_model(loader, None, num_epochs=num_epochs)
        return clock.starts[-1] - clock.starts[1]

    return run


def run_default_path(name, args, log_root):
    keras = import_keras()
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    num_epochs = 2 + max(2, round(args.seconds * 2 * 1000 / (len(loader) * STEP_MS.get(name, 1.0))))
    steady = (num_epochs - 1) * len(loader)
    variants = [Variant("flaxlight-default", flaxlight_default_run(name, workload, loader, num_epochs, log_root),
                        steady),
                Variant("keras-default", keras_default_run(keras, workload, num_epochs), steady)]
    return common.time_workload(name, variants, args, unit=f"run(s) of {num_epochs} epochs", epochs=1, warmup=1)


STEP_MS = {"tiny-128": 0.25, "mlp-256-128": 1.2, "wide-512-1024": 30.0}  # rough, to size the default-path runs


def run_workload(name, args, log_root):
    keras = import_keras()
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    steps = len(loader)
    trainers = {
        v: common.ready_for_epochs(common.make_trainer(workload, os.path.join(log_root, name, v),
                                                       optimizer_hparams=OPTIMIZER_HPARAMS, steps_per_execution=k),
                                   steps)
        for v, k in (("flaxlight", 1), ("flaxlight-16", K))}
    hand = common.hand_timers(HandFunctions(trainers["flaxlight"].model.apply), trainers["flaxlight"], loader)
    overheads = {"keras": [], "keras-16": []}
    variants = [Variant("hand", hand["numpy"], steps)]
    variants += [Variant(v, common.trainer_epoch(t, loader), steps) for v, t in trainers.items()]
    variants += [Variant("keras", keras_timer(keras, workload, 1, overheads["keras"]), steps),
                 Variant("keras-16", keras_timer(keras, workload, K, overheads["keras-16"]), steps)]
    timing = common.time_workload(name, variants, args)
    warm = args.warmup
    timing.extra["keras_fit_call_overhead_s"] = {v: statistics.median(o[warm:]) for v, o in overheads.items()}
    return timing


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = common.timing_parser(__doc__, default_workloads=DEFAULT_WORKLOADS)
    parser.add_argument("--no-default-path", dest="default_path", action="store_false",
                        help="skip the whole-run comparison with every default on")
    parser.add_argument("--default-path-only", action="store_true", help="only the whole-run comparison")
    args = common.finish_args(parser.parse_args(argv), QUICK_WORKLOADS)
    os.environ.pop("CI", None)  # bars stay bars, as users see them
    keras = import_keras()
    load = common.print_header(
        "Benchmark 4: flaxlight vs Keras 3 model.fit on JAX (steps/s, ratios of interleaved epochs)",
        f"keras {keras.__version__}; {common.NUM_EXAMPLES} examples per epoch, {args.rounds} rounds, "
        f"adam 1e-3 constant, shuffled numpy arrays on both sides")
    if args.default_path_only:
        return default_path(args, load)
    timings = common.run_workloads(args, "keras-peer", run_workload)

    variants = ["hand", "flaxlight", "flaxlight-16", "keras", "keras-16"]
    pairs = [("flaxlight", "keras"), ("flaxlight-16", "keras-16"), ("flaxlight", "hand"), ("keras", "hand"),
             ("keras-16", "hand"), ("flaxlight-16", "hand")]
    checks = [Check(f"{n}: {a} / {b}", timings[n].ratio(a, b), target)
              for n in timings for (a, b), target in TARGETS.get(n, {}).items()]
    overhead = "\n".join(f"  {n:<14} " + ", ".join(f"{v} {s * 1000:.1f} ms" for v, s in t.extra["keras_fit_call_overhead_s"].items())
                         for n, t in timings.items())
    results = common.report(timings, variants, pairs, checks, load, range_pairs=pairs[:2], notes=[
        "Keras' once-per-fit-call overhead (not in the rates above; paid once per fit(), here once per epoch):\n"
        + overhead])
    return results + default_path(args, load) if args.default_path else results


def default_path(args, load: float) -> list[dict]:
    print("\nThe default path: whole runs, every default on (see the docstring)")
    defaults = common.run_workloads(args, "keras-default", run_default_path)
    pairs = [("flaxlight-default", "keras-default")]
    checks = [Check(f"{n}: flaxlight-default / keras-default", t.ratio(*pairs[0]), TARGET_DEFAULT)
              for n, t in defaults.items()]
    return common.report(defaults, ["flaxlight-default", "keras-default"], pairs, checks, load)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
