"""Cost of checkpointing and of resuming, measured against the same trainer in one run.

1. Steady-state throughput of ``train_model`` with a checkpoint written every epoch (the
   default ModelCheckpoint: asynchronous orbax saves) vs ``enable_checkpointing=False``, CSV
   logger only, no progress bar: each run in a fresh trainer, timed by ``common.train_model_timer``
   (epoch start to epoch start, so each period includes one save; the first period of a run
   dropped); runs alternate, the median ratio of steps/s is reported (target: at most 3% slower).
   benchmarks/full_featured.py measures the same with TensorBoard and the progress bar on too.
2. Start-up: a cold start (build the trainer, train one epoch) vs a resume (build the trainer,
   restore the newest checkpoint, train one epoch), each in a fresh trainer, compilation cache warm.

Run:
    python benchmarks/checkpointing.py              # 5 rounds of runs of 6 epochs
    python benchmarks/checkpointing.py --quick      # smoke run
    python benchmarks/checkpointing.py --rounds 7 --run-epochs 8 --workloads tiny-128
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Check, Variant  # noqa: E402

DEFAULT_WORKLOADS = ["mlp-256-128"]
TARGET = 0.97
VARIANTS = {"no checkpoints": False, "checkpoint every epoch": True}  # name: enable_checkpointing


def run_workload(name, args, root):
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    steps = len(loader)
    runs = [0]

    def build(enable_checkpointing):
        def make(clock):
            runs[0] += 1
            return common.make_trainer(workload, os.path.join(root, name, f"run-{runs[0]}"), logger_type="csv",
                                       callbacks=[clock], enable_checkpointing=enable_checkpointing)

        return make

    variants = [Variant(v, common.train_model_timer(build(ckpt), loader, args.run_epochs), (args.run_epochs - 2) * steps)
                for v, ckpt in VARIANTS.items()]
    timing = common.time_workload(name, variants, args, unit=f"run(s) of {args.run_epochs} epochs", epochs=1)

    starts: dict[str, list[float]] = {"cold start": [], "resume": []}
    for r in range(args.rounds):
        log_dir = os.path.join(root, name, f"resume-{r}")
        start = time.perf_counter()
        common.make_trainer(workload, log_dir, logger_type="csv").train_model(loader, None, num_epochs=1)
        starts["cold start"].append(time.perf_counter() - start)
        start = time.perf_counter()
        common.make_trainer(workload, log_dir, logger_type="csv").train_model(loader, None, num_epochs=2, resume=True)
        starts["resume"].append(time.perf_counter() - start)
    timing.extra["start_seconds"] = {k: statistics.median(v) for k, v in starts.items()}
    return timing


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = common.timing_parser(__doc__, default_workloads=DEFAULT_WORKLOADS, rounds=5, warmup=1)
    parser.add_argument("--run-epochs", type=int, default=6, help="epochs per train_model run (default 6; >= 3)")
    args = common.finish_args(parser.parse_args(argv))
    if args.quick:
        args.rounds, args.run_epochs = 2, 4
    if args.run_epochs < 3:
        parser.error("--run-epochs must be >= 3 (the first epoch period of a run is not counted)")
    load = common.print_header(
        "Checkpointing: train_model with a checkpoint every epoch vs none, and cold start vs resume",
        f"{common.NUM_EXAMPLES} examples per epoch, {args.rounds} rounds, runs of {args.run_epochs} epochs, "
        f"CSV logger, no progress bar")
    timings = common.run_workloads(args, "checkpointing", run_workload)

    pair = ("checkpoint every epoch", "no checkpoints")
    checks = [Check(f"{n}: checkpoint every epoch / none", t.ratio(*pair), TARGET) for n, t in timings.items()]
    return common.report(
        timings, list(VARIANTS), [pair], checks, load,
        extra={n: {"cold start s": t.extra["start_seconds"]["cold start"], "resume s": t.extra["start_seconds"]["resume"]}
               for n, t in timings.items()},
        notes=["start-up: seconds to build a trainer and train one epoch (resume: after restoring the newest checkpoint)"])


if __name__ == "__main__":
    main()
    sys.stdout.flush()
