"""Benchmark 1: per-step overhead of ``TrainerModule.train_epoch`` against hand-written loops.

All sides train the same MLP (relu, cross-entropy, the same initial parameters) with the same
optax transformation (``flaxlight.make_optimizer``'s, as the trainer built it) on the data of
``common.py`` (digits tiled to 16384 examples; the 784-feature synthetic set for the 784-512-512-10
MLP). Variants:

- hand-np:  the hand-written loop (``common.HandLoop``: jitted step, donated state, loss summed on
  the device and read once per epoch) fed numpy batches by the same ``flaxlight.ArrayLoader`` the
  trainer gets: the same data path, so the ratio measures the trainer's loop overhead;
- hand-dev: the same step with the dataset on the device: per epoch one jitted gather of the
  permuted dataset into (steps, batch, ...) arrays, sliced inside the jitted step (what a careful
  user writes; ArrayLoader serves numpy batches, so this ratio also counts the per-step
  host-to-device copy that flaxlight's data path pays);
- flaxlight: a ``TrainerModule`` subclass that only writes ``loss_fn``; ``init_optimizer`` once,
  then ``trainer.train_epoch(loader)`` (its default CSV/TensorBoard loggers included);
- hand-user / flaxlight-user: the hand loop and the trainer fed a loader as users write one
  (``common.UserLoader``: a class yielding numpy batches of a shuffled epoch); flaxlight puts
  each batch on the device per step, as the hand loop does;
- flaxlight+all: the same with the progress bar (tqdm to stderr; CI unset), the
  LearningRateMonitor, ThroughputMonitor, NaNGuard and Timer callbacks and CSV + TensorBoard
  loggers (issue 5's target: >= 0.95 of hand-np).

Epochs are interleaved (see ``common.interleave``); a round is ~``--seconds`` of hand-np epochs per
variant and gives one ratio per pair; the median over rounds is reported.
Target: flaxlight / hand >= 0.97 for every workload, against both hand loops and with the user's
loader (flaxlight-user / hand-user) (the hand-dev ratio
below target says that a device-resident data path would pay off, not that the loop is slow).
This is not a test: timings are noisy, and only ratios of interleaved runs mean anything.

Run:
    python benchmarks/overhead.py              # full run (7 rounds of ~1 s per variant, 5 workloads)
    python benchmarks/overhead.py --quick      # smoke run (3 short rounds, 2 workloads)
    python benchmarks/overhead.py --rounds 11 --seconds 2 --workloads tiny-128
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Check, HandFunctions, Variant  # noqa: E402

from flaxlight.callbacks import LearningRateMonitor, NaNGuard, ThroughputMonitor, Timer  # noqa: E402

DEFAULT_WORKLOADS = ["tiny-128", "mlp-256-128", "mlp-256-1024", "wide-512-128", "wide-512-1024"]
QUICK_WORKLOADS = ["tiny-128", "wide-512-1024"]
TARGET, TARGET_ALL = 0.97, 0.95


def run_workload(name, args, log_root):
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    steps = len(loader)
    trainer = common.ready_for_epochs(common.make_trainer(workload, os.path.join(log_root, name)), steps)
    hand = common.hand_timers(HandFunctions(trainer.model.apply), trainer, loader)
    user = common.make_user_loader(workload)
    user_trainer = common.ready_for_epochs(common.make_trainer(workload, os.path.join(log_root, name + "-user")),
                                           steps)
    hand_user = common.HandLoop(HandFunctions(trainer.model.apply), trainer)
    variants = [Variant("hand-np", hand["numpy"], steps), Variant("hand-dev", hand["device"], steps),
                Variant("flaxlight", common.trainer_epoch(trainer, loader), steps),
                Variant("hand-user", common.epoch_timer(lambda: hand_user.epoch_numpy(user), user), steps),
                Variant("flaxlight-user", common.epoch_timer(lambda: user_trainer.train_epoch(user)["train/loss"], user),
                        steps)]
    if args.bar:
        # Every built-in callback that acts within an epoch, and two loggers.
        full = common.make_trainer(
            workload, os.path.join(log_root, name + "-all"), logger_type=["csv", "tensorboard"], progress_bar=True,
            callbacks=[LearningRateMonitor(), ThroughputMonitor(), NaNGuard(), Timer(24 * 3600)])
        variants.append(Variant("flaxlight+all", common.trainer_epoch(common.ready_for_epochs(full, steps), loader),
                                steps))
    return common.time_workload(name, variants, args)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = common.timing_parser(__doc__, default_workloads=DEFAULT_WORKLOADS)
    parser.add_argument("--no-bar", dest="bar", action="store_false",
                        help="skip the flaxlight variant with the built-in callbacks and two loggers on")
    args = common.finish_args(parser.parse_args(argv), QUICK_WORKLOADS)
    os.environ.pop("CI", None)  # bars stay tqdm bars (on stderr), as users see them
    load = common.print_header(
        "Benchmark 1: flaxlight train_epoch vs a hand-written jitted loop (steps/s, ratios of interleaved epochs)",
        f"{common.NUM_EXAMPLES} examples per epoch, {args.rounds} rounds, adam, gradient_clip=None")
    timings = common.run_workloads(args, "overhead", run_workload)

    flax_variants = ["flaxlight"] + (["flaxlight+all"] if args.bar else [])
    pairs = [(v, h) for v in flax_variants for h in ("hand-np", "hand-dev")] + [("flaxlight-user", "hand-user")]
    checks = []
    for name, t in timings.items():
        for hand in ("hand-np", "hand-dev"):
            checks.append(Check(f"{name}: flaxlight / {hand}", t.ratio("flaxlight", hand), TARGET))
        checks.append(Check(f"{name}: flaxlight-user / hand-user", t.ratio("flaxlight-user", "hand-user"), TARGET))
        if args.bar:
            checks.append(Check(f"{name}: flaxlight+all / hand-np", t.ratio("flaxlight+all", "hand-np"), TARGET_ALL))
    return common.report(timings, ["hand-np", "hand-dev"] + flax_variants + ["hand-user", "flaxlight-user"], pairs,
                         checks, load)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
