"""Steps/s of the same MLP written in flax.nnx and in flax.linen, trained by ``TrainerModule``.

flaxlight splits an NNX module once (``nnx.split``) and merges it inside the jitted train step,
so an NNX model should train as fast as the same Linen model (target: NNX within 5% of Linen).

Variants, all on scikit-learn's digits tiled to ~16k examples (batch 128, the same
``flaxlight.ArrayLoader`` of numpy batches, adam, no gradient clipping):

- hand:  a hand-written loop, ``jax.jit(step, donate_argnums=0)`` on the Linen model with a flax
  ``TrainState``; the loss sums stay on the device and are read once per epoch (the reference);
- linen: ``TrainerModule.train_epoch`` with the Linen MLP;
- nnx:   ``TrainerModule.train_epoch`` with the NNX MLP (same layers, same initialisers).

Epochs are interleaved (hand, linen, nnx, then the reverse order, ...); a round is ~``--seconds``
of epochs per variant and gives one ratio per pair; the medians over rounds are reported. The
machine is shared and its speed drifts, so only ratios of interleaved runs mean anything.

Run:
    python benchmarks/nnx_vs_linen.py              # full run (7 rounds of ~1 s per variant)
    python benchmarks/nnx_vs_linen.py --quick      # smoke run (a few seconds per workload)
    python benchmarks/nnx_vs_linen.py --option prefetch=0   # trainer options for both trainers
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
import time
from typing import Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from flax.training import train_state

import flaxlight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import MLP, Classifier, hand_epoch, load_data, make_hand_step  # noqa: E402  (same data, loss, hand loop)

# name: (hidden dims, batch size)
WORKLOADS = {
    "mlp-32-128": ((32, 32), 128),
    "mlp-256-128": ((256, 256), 128),
}
OPTIMIZER_HPARAMS = {"optimizer": "adam", "lr": 1e-3, "gradient_clip": None}
VARIANTS = ("hand", "linen", "nnx")


LinenMLP = MLP  # the hand loop and the Linen side share overhead.py's model


class NNXMLP(nnx.Module):
    def __init__(self, din: int, hidden_dims: Sequence[int], num_classes: int = 10, *, rngs: nnx.Rngs):
        self.layers = nnx.List()
        for dim in hidden_dims:
            self.layers.append(nnx.Linear(din, dim, rngs=rngs))
            din = dim
        self.head = nnx.Linear(din, num_classes, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


def make_trainer(model_class, model_hparams, x, log_dir, options):
    return Classifier(
        model_class=model_class,
        model_hparams=model_hparams,
        optimizer_hparams=OPTIMIZER_HPARAMS,
        exmp_input=x[:1],
        seed=42,
        logger_params={"log_dir": log_dir},
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def run_workload(name, hidden_dims, batch_size, data, args, log_root):
    x, y = data
    loader = flaxlight.ArrayLoader(x, y, batch_size=batch_size, shuffle=True, seed=0, drop_last=True)
    steps_per_epoch = len(loader)
    trainers = {
        "linen": make_trainer(LinenMLP, {"hidden_dims": list(hidden_dims)}, x, os.path.join(log_root, name, "linen"),
                              args.options),
        "nnx": make_trainer(NNXMLP, {"din": x.shape[1], "hidden_dims": list(hidden_dims)}, x,
                            os.path.join(log_root, name, "nnx"), args.options),
    }
    assert trainers["nnx"].model_adapter.kind == "nnx" and trainers["linen"].model_adapter.kind == "linen"
    total_epochs = 1000  # the run's length only shapes the schedule; every variant gets the same one
    for trainer in trainers.values():
        trainer.init_optimizer(total_epochs, steps_per_epoch)
    linen = trainers["linen"]
    params = jax.tree.map(jnp.copy, linen.state.params)
    hand_state = train_state.TrainState.create(apply_fn=linen.model.apply, params=params, tx=linen.state.tx)
    hand_step = make_hand_step(linen.model.apply)
    epoch_counter = [0]
    losses = {v: None for v in VARIANTS}

    def hand():
        nonlocal hand_state
        epoch_counter[0] += 1
        loader.set_epoch(epoch_counter[0])
        start = time.perf_counter()
        hand_state, losses["hand"] = hand_epoch(hand_step, hand_state, loader)
        return time.perf_counter() - start

    def through_trainer(kind):
        def run():
            epoch_counter[0] += 1
            loader.set_epoch(epoch_counter[0])
            start = time.perf_counter()
            metrics = trainers[kind].train_epoch(loader)
            elapsed = time.perf_counter() - start
            losses[kind] = metrics["train/loss"]
            return elapsed

        return run

    timers = {"hand": hand, "linen": through_trainer("linen"), "nnx": through_trainer("nnx")}
    for _ in range(args.warmup):  # compile every variant, then size a round to ~args.seconds
        for v in VARIANTS:
            timers[v]()
    epochs = args.epochs or max(1, round(args.seconds / min(hand() for _ in range(3))))

    rates = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        seconds = dict.fromkeys(VARIANTS, 0.0)
        for e in range(epochs):
            for v in VARIANTS if e % 2 == 0 else VARIANTS[::-1]:
                seconds[v] += timers[v]()
        for v in VARIANTS:
            rates[v].append(epochs * steps_per_epoch / seconds[v])
    pairs = {"nnx/linen": ("nnx", "linen"), "linen/hand": ("linen", "hand"), "nnx/hand": ("nnx", "hand")}
    ratios = {p: [n / d for n, d in zip(rates[a], rates[b])] for p, (a, b) in pairs.items()}
    return {
        "workload": name,
        "steps_per_epoch": steps_per_epoch,
        "epochs": epochs,
        "rates": {v: statistics.median(rs) for v, rs in rates.items()},
        "ratios": {p: statistics.median(rs) for p, rs in ratios.items()},
        "ratio_range": {p: (min(rs), max(rs)) for p, rs in ratios.items()},
        "final_loss": dict(losses),
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per workload (default 7)")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="target length of a round per variant, in seconds of the hand loop (default 1.0)")
    parser.add_argument("--epochs", type=int, default=0, help="epochs per round per variant (overrides --seconds)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up epochs per variant (default 2)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds of ~0.15 s, 1 warm-up epoch")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer option for both trainers, e.g. --option prefetch=0 (repeatable)")
    args = parser.parse_args(argv)
    args.options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option takes KEY=VALUE, got {item!r}")
        args.options[key] = yaml.safe_load(value)
    if args.quick:
        args.rounds, args.seconds, args.warmup = 3, 0.15, 1

    data = load_data()
    print(f"jax {jax.__version__}, flax {flax.__version__} on {jax.devices()[0].platform}, "
          f"{len(data[0])} examples, {args.rounds} rounds, adam, gradient_clip=None"
          + "".join(f", {k}={v!r}" for k, v in args.options.items()), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="flaxlight-nnx-vs-linen-") as log_root:
        for name in args.workloads:
            hidden_dims, batch_size = WORKLOADS[name]
            results.append(run_workload(name, hidden_dims, batch_size, data, args, log_root))
            res = results[-1]
            print(f"  {name}: rounds of {res['epochs']} epochs x {res['steps_per_epoch']} steps per variant; "
                  f"last train loss " + ", ".join(f"{v} {res['final_loss'][v]:.3f}" for v in VARIANTS), flush=True)

    pairs = ("nnx/linen", "linen/hand", "nnx/hand")
    header = (f"{'workload':<22}" + "".join(f"{v + ' steps/s':>16}" for v in VARIANTS)
              + "".join(f"{p:>12}" for p in pairs))
    print("\n" + header + "\n" + "-" * len(header))
    for res in results:
        hidden_dims, batch_size = WORKLOADS[res["workload"]]
        label = f"64-{'-'.join(map(str, hidden_dims))}-10 b{batch_size}"
        print(f"{label:<22}" + "".join(f"{res['rates'][v]:>16.0f}" for v in VARIANTS)
              + "".join(f"{res['ratios'][p]:>12.3f}" for p in pairs))
    print("\nratio = median over rounds of (steps/s of one variant / steps/s of the other); per-round range:")
    for res in results:
        print(f"  {res['workload']:<14}" + "  ".join(
            f"{p} [{lo:.3f}, {hi:.3f}]" for p, (lo, hi) in res["ratio_range"].items()))
    worst = min(res["ratios"]["nnx/linen"] for res in results)
    print(f"\nworst median nnx/linen ratio {worst:.3f} (target >= 0.95): {'OK' if worst >= 0.95 else 'BELOW TARGET'}")
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()
