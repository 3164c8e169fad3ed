"""Per-step overhead of flaxlight's ``TrainerModule.train_epoch`` against a hand-written loop.

Both sides train the same MLP (relu, cross-entropy, the same initial parameters) with the same
optax transformation (``flaxlight.make_optimizer``) on scikit-learn's digits tiled to ~16k
examples, and both consume the same ``flaxlight.ArrayLoader`` of numpy batches.

- hand:  ``state, acc = step(state, acc, batch)`` with ``jax.jit(step, donate_argnums=0)``; ``acc``
  sums ``loss * batch_size`` and the example count on the device and is read once per epoch.
- flaxlight: a ``TrainerModule`` subclass that only writes ``loss_fn``; ``init_optimizer`` once,
  then ``trainer.train_epoch(loader)`` (its default CSV/TensorBoard loggers included).
- flaxlight+all: the same model with the progress bar (tqdm to stderr; CI unset), the
  LearningRateMonitor, ThroughputMonitor, NaNGuard and Timer callbacks and CSV + TensorBoard
  loggers (issue 5's target: >= 0.95).

Epochs are interleaved (hand, flaxlight, flaxlight+all, then the reverse order, ...); a round is
~``--seconds`` of epochs per variant and gives a ratio ``flaxlight steps/s / hand steps/s``; the
median over rounds is reported.
Target: median ratio >= 0.97 for every workload. This is not a test: timings are noisy, and only
ratios of interleaved runs mean anything.

Run:
    python benchmarks/overhead.py              # full run (7 rounds of ~1 s per variant)
    python benchmarks/overhead.py --quick      # smoke run (a few seconds per workload)
    python benchmarks/overhead.py --rounds 11 --seconds 2 --workloads tiny-128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import flaxlight
from flaxlight.callbacks import LearningRateMonitor, NaNGuard, ThroughputMonitor, Timer

# name: (hidden dims, batch size)
WORKLOADS = {
    "mlp-256-128": ((256, 256), 128),
    "mlp-256-1024": ((256, 256), 1024),
    "tiny-128": ((32, 32), 128),
}
OPTIMIZER_HPARAMS = {"optimizer": "adam", "lr": 1e-3, "gradient_clip": None}
TILES = 9  # 1797 digits * 9 = 16173 examples


class MLP(nn.Module):
    hidden_dims: Sequence[int]
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        for dim in self.hidden_dims:
            x = nn.relu(nn.Dense(dim)(x))
        return nn.Dense(self.num_classes)(x)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Classifier(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        return cross_entropy(logits, y), ({}, updates)


def load_data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return np.tile(x, (TILES, 1)), np.tile(y, TILES)


# ---------------------------------------------------------------------------- the hand loop
def make_hand_step(apply_fn):
    def step(state, acc, batch):
        x, y = batch

        def loss_of(params):
            return cross_entropy(apply_fn({"params": params}, x), y)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        state = state.apply_gradients(grads=grads)
        n = x.shape[0]
        return state, {"loss": acc["loss"] + loss * n, "count": acc["count"] + n}

    return jax.jit(step, donate_argnums=0)


def hand_epoch(step, state, loader):
    acc = {"loss": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.float32)}
    for batch in loader:
        state, acc = step(state, acc, batch)
    host = jax.device_get(acc)
    return state, float(host["loss"]) / float(host["count"])


# ---------------------------------------------------------------------------- one workload
def run_workload(name, hidden_dims, batch_size, data, args, log_root):
    x, y = data
    loader = flaxlight.ArrayLoader(x, y, batch_size=batch_size, shuffle=True, seed=0, drop_last=True)
    steps_per_epoch = len(loader)
    trainer = Classifier(
        model_class=MLP,
        model_hparams={"hidden_dims": list(hidden_dims)},
        optimizer_hparams=OPTIMIZER_HPARAMS,
        exmp_input=x[:1],
        seed=42,
        logger_params={"log_dir": os.path.join(log_root, name)},
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # The run's length only shapes the (cosine) schedule; both sides get the same one.
    total_epochs = 1000
    trainer.init_optimizer(total_epochs, steps_per_epoch)
    # The same optax transformation (flaxlight.make_optimizer's, as the trainer built it) and the
    # same initial parameters.
    tx = trainer.state.tx
    params = jax.tree.map(jnp.copy, trainer.state.params)
    hand_state = train_state.TrainState.create(apply_fn=trainer.model.apply, params=params, tx=tx)
    hand_step = make_hand_step(trainer.model.apply)
    epoch_counter = [0]

    def hand():
        nonlocal hand_state
        epoch_counter[0] += 1
        loader.set_epoch(epoch_counter[0])
        start = time.perf_counter()
        hand_state, _ = hand_epoch(hand_step, hand_state, loader)
        return time.perf_counter() - start

    # The same model with every built-in callback that acts within an epoch (progress bar, LR,
    # throughput, NaN guard, timer) and two loggers (CSV + TensorBoard).
    full = Classifier(
        model_class=MLP, model_hparams={"hidden_dims": list(hidden_dims)}, optimizer_hparams=OPTIMIZER_HPARAMS,
        exmp_input=x[:1], seed=42, enable_progress_bar=True, enable_model_summary=False,
        logger_params={"log_dir": os.path.join(log_root, name + "-full"), "logger_type": ["csv", "tensorboard"]},
        callbacks=[LearningRateMonitor(), ThroughputMonitor(), NaNGuard(), Timer(24 * 3600)],
    )
    full.init_optimizer(total_epochs, steps_per_epoch)

    def flaxlight_(which):
        epoch_counter[0] += 1
        loader.set_epoch(epoch_counter[0])
        start = time.perf_counter()
        which.train_epoch(loader)
        return time.perf_counter() - start

    timers = {"hand": hand, "flaxlight": lambda: flaxlight_(trainer), "flaxlight+all": lambda: flaxlight_(full)}
    variants = ["hand", "flaxlight"] + (["flaxlight+all"] if args.bar else [])
    # Warm up (compile) every variant, then size a round to ~args.seconds of the hand loop per variant.
    for _ in range(args.warmup):
        for v in variants:
            timers[v]()
    epochs = args.epochs or max(1, round(args.seconds / min(hand() for _ in range(3))))

    # A round: `epochs` epochs of every variant, interleaved epoch by epoch (the order alternates),
    # so slow drifts of the machine hit all variants alike.
    # Also kept: each round's fastest epoch per variant, a steadier estimate on a busy machine.
    rates = {v: [] for v in variants}
    best_rates = {v: [] for v in variants}
    for _ in range(args.rounds):
        seconds = {v: [] for v in variants}
        for e in range(epochs):
            for v in variants if e % 2 == 0 else variants[::-1]:
                seconds[v].append(timers[v]())
        for v in variants:
            rates[v].append(epochs * steps_per_epoch / sum(seconds[v]))
            best_rates[v].append(steps_per_epoch / min(seconds[v]))

    def ratios_of(r):
        return {v: [f / h for f, h in zip(r[v], r["hand"])] for v in variants[1:]}

    ratios, best_ratios = ratios_of(rates), ratios_of(best_rates)
    return {
        "workload": name,
        "steps_per_epoch": steps_per_epoch,
        "epochs": epochs,
        "rates": {v: statistics.median(rs) for v, rs in rates.items()},
        "ratios": {v: statistics.median(rs) for v, rs in ratios.items()},
        "ratio_range": {v: (min(rs), max(rs)) for v, rs in ratios.items()},
        "best_ratios": {v: statistics.median(rs) for v, rs in best_ratios.items()},
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per workload (default 7)")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="target length of a round per variant, in seconds of the hand loop (default 1.0)")
    parser.add_argument("--epochs", type=int, default=0, help="epochs per round per variant (overrides --seconds)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up epochs per variant (default 2)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--no-bar", dest="bar", action="store_false",
                        help="skip the flaxlight variant with the built-in callbacks and two loggers on")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds of ~0.15 s, 1 warm-up epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 0.15, 1
    os.environ.pop("CI", None)  # bars stay tqdm bars (on stderr), as users see them

    data = load_data()
    load_before = os.getloadavg()[0]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores, load {load_before:.1f}), "
          f"{len(data[0])} examples, {args.rounds} rounds, adam, gradient_clip=None", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="flaxlight-overhead-") as log_root:
        for name in args.workloads:
            hidden_dims, batch_size = WORKLOADS[name]
            results.append(run_workload(name, hidden_dims, batch_size, data, args, log_root))
            res = results[-1]
            print(f"  {name}: rounds of {res['epochs']} epochs x {res['steps_per_epoch']} steps per variant", flush=True)

    variants = [v for v in ("flaxlight", "flaxlight+all") if v in results[0]["ratios"]]
    header = f"{'workload':<22}{'hand steps/s':>14}" + "".join(f"{v + ' steps/s':>24}{'ratio':>8}" for v in variants)
    print("\n" + header + "\n" + "-" * len(header))
    for res in results:
        hidden_dims, batch_size = WORKLOADS[res["workload"]]
        label = f"64-{'-'.join(map(str, hidden_dims))}-10 b{batch_size}"
        line = f"{label:<22}{res['rates']['hand']:>14.0f}"
        for v in variants:
            line += f"{res['rates'][v]:>24.0f}{res['ratios'][v]:>8.3f}"
        print(line)
    print("\nratio = median over rounds of (flaxlight steps/s / hand steps/s); per-round range, and the"
          "\nmedian ratio of each round's fastest epochs (steadier when the machine is busy):")
    for res in results:
        print(f"  {res['workload']:<14}" + "  ".join(
            f"{v} [{lo:.3f}, {hi:.3f}] fastest {res['best_ratios'][v]:.3f}"
            for v, (lo, hi) in res["ratio_range"].items()))
    load_after = os.getloadavg()[0]
    if max(load_before, load_after) > (os.cpu_count() or 1) + 1:  # this run itself adds ~1-2
        print(f"\nwarning: load average {load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores: "
              f"other processes compete for the CPU and the ratios are unreliable; rerun on an idle machine.")
    worst = min(r for res in results for r in res["ratios"].values())
    print(f"\nworst median ratio {worst:.3f} (target >= 0.97): {'OK' if worst >= 0.97 else 'BELOW TARGET'}")
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()
