"""Benchmark 2: fused steps, flaxlight ``steps_per_execution=16`` vs hand-written loops.

Small models on a CPU spend most of a step in dispatch, so running 16 steps per dispatch
(``jax.lax.scan`` over a block of 16 stacked batches) is where throughput comes from. Variants,
all on the same data, model, initial parameters and optax transformation (see ``common.py``):

- hand-step: the hand-written per-step loop of benchmark 1 (jitted step, donated state, loss read
  once per epoch), fed numpy batches by the same ``flaxlight.ArrayLoader`` as the trainer;
- hand-scan: a hand-written ``jax.lax.scan`` of 16 steps per dispatch, fed like hand-step from
  the host: each block of 16 batches is one numpy gather of 16 x batch rows of the epoch's
  permutation, reshaped to (16, batch, ...) and transferred in one go (the data path flaxlight's
  ``steps_per_execution`` takes too: host-stacked blocks, one transfer per block);
- flaxlight-16: ``TrainerModule(..., steps_per_execution=16).train_epoch(loader)``;
- flaxlight: the same trainer without fusing (``steps_per_execution=1``), for reference;
- flaxlight-K for K in 2, 4, 8, 32 (with ``--all-k``, the default): the other fixed block lengths;
- flaxlight-auto: ``steps_per_execution="auto"`` (it measures and chooses during its warm-up
  epochs; the K it chose is printed).

16384 examples at batch 128 make 128 steps per epoch: 8 whole blocks, no ragged tail on either
side. Epochs are interleaved and the median over rounds of each ratio is reported. The fixed K
fastest in that run is then timed again alone with flaxlight-auto (the two interleaved, as many
rounds): the largest of six noisy rates is biased upwards where several K are close, and that
second, two-way ratio is the one checked.
Targets: flaxlight-16 / hand-step >= 1.4 (tiny MLP 64-32-32-10) and >= 1.3 (digits MLP
64-256-256-10); flaxlight-16 / hand-scan >= 0.97; flaxlight-auto >= 0.95 of the best fixed K.
hand-scan / hand-step is what fusing can give.

Run:
    python benchmarks/fused.py              # full run (7 rounds of ~1 s per variant)
    python benchmarks/fused.py --quick      # smoke run
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Check, HandFunctions, Variant  # noqa: E402

DEFAULT_WORKLOADS = ["tiny-128", "mlp-256-128"]
TARGETS = {"tiny-128": 1.4, "mlp-256-128": 1.3}  # flaxlight-16 / hand-step
TARGET_SCAN = 0.97  # flaxlight-16 / hand-scan
TARGET_AUTO = 0.95  # flaxlight-auto / the best fixed K
OTHER_K = (2, 4, 8, 32)


def run_workload(name, args, log_root):
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    steps = len(loader)
    fused = common.ready_for_epochs(
        common.make_trainer(workload, os.path.join(log_root, name + "-fused"), steps_per_execution=args.k), steps)
    single = common.ready_for_epochs(common.make_trainer(workload, os.path.join(log_root, name)), steps)
    hand = common.hand_timers(HandFunctions(fused.model.apply), fused, loader, k=args.k)
    variants = [Variant("hand-step", hand["numpy"], steps), Variant("hand-scan", hand["scan"], steps),
                Variant(f"flaxlight-{args.k}", common.trainer_epoch(fused, loader), steps),
                Variant("flaxlight", common.trainer_epoch(single, loader), steps)]
    if args.all_k:
        for k in OTHER_K:
            trainer = common.ready_for_epochs(
                common.make_trainer(workload, os.path.join(log_root, f"{name}-{k}"), steps_per_execution=k), steps)
            variants.append(Variant(f"flaxlight-{k}", common.trainer_epoch(trainer, loader), steps))
        auto = common.ready_for_epochs(
            common.make_trainer(workload, os.path.join(log_root, name + "-auto"), steps_per_execution="auto"), steps)
        variants.append(Variant("flaxlight-auto", common.trainer_epoch(auto, loader), steps))
    timing = common.time_workload(name, variants, args)
    if args.all_k:
        print(f"  {name}: steps_per_execution='auto' chose {auto.engine.block_length}")
        # "The best fixed K" picked from this run is the largest of six rates measured with noise; where
        # several K are within a few percent, that maximum is biased upwards. So the fastest fixed K is
        # timed again alone against "auto", interleaved, for the ratio the target is checked on.
        fixed = [v for v in variants if v.name.startswith("flaxlight") and v.name != "flaxlight-auto"]
        best = max(fixed, key=lambda v: timing.ratio(v.name, "hand-step"))
        alone = common.interleave([best, variants[-1]], rounds=args.rounds, seconds=args.seconds, warmup=1,
                                  epochs=args.epochs, stint=args.stint)
        timing.extra["auto_alone"] = (best.name, alone.ratio("flaxlight-auto", best.name))
        print(f"  {name}: flaxlight-auto / {best.name}, the two alone: {timing.extra['auto_alone'][1]:.3f}")
    return timing


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = common.timing_parser(__doc__, default_workloads=DEFAULT_WORKLOADS)
    parser.add_argument("--k", type=int, default=16, help="steps per execution / per scan (default 16)")
    parser.add_argument("--no-all-k", dest="all_k", action="store_false",
                        help="skip the other fixed block lengths and 'auto'")
    args = common.finish_args(parser.parse_args(argv))
    load = common.print_header(
        f"Benchmark 2: flaxlight steps_per_execution={args.k} vs hand-written per-step and lax.scan loops",
        f"{common.NUM_EXAMPLES} examples per epoch, {args.rounds} rounds, adam, gradient_clip=None; "
        f"hand-scan blocks are stacked on the host and transferred in one go")
    timings = common.run_workloads(args, "fused", run_workload)

    fused = f"flaxlight-{args.k}"
    fixed = ["flaxlight"] + [f"flaxlight-{k}" for k in sorted({args.k, *OTHER_K})] if args.all_k else []
    variants = ["hand-step", "hand-scan", fused, "flaxlight"] + (
        [v for v in fixed if v not in (fused, "flaxlight")] + ["flaxlight-auto"] if args.all_k else [])
    pairs = [(fused, "hand-step"), (fused, "hand-scan"), ("hand-scan", "hand-step"), ("flaxlight", "hand-step")]
    if args.all_k:
        pairs += [(k, "hand-step") for k in fixed if k not in (fused, "flaxlight")] + [("flaxlight-auto", "hand-step")]
    checks = []
    for name, t in timings.items():
        if name in TARGETS:
            checks.append(Check(f"{name}: {fused} / hand-step", t.ratio(fused, "hand-step"), TARGETS[name]))
        checks.append(Check(f"{name}: {fused} / hand-scan", t.ratio(fused, "hand-scan"), TARGET_SCAN))
        if args.all_k:
            best, alone = t.extra["auto_alone"]
            checks.append(Check(f"{name}: flaxlight-auto / best fixed ({best}), timed alone "
                                f"(in the {len(variants)}-way run: {t.ratio('flaxlight-auto', best):.3f})", alone,
                                TARGET_AUTO))
    return common.report(timings, variants, pairs, checks, load)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
