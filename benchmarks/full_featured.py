"""Benchmark 3: what checkpoints, TensorBoard and the progress bar cost per epoch of ``train_model``.

Variants, on the same data, model and optimizer as benchmark 1 (``common.py``):

- plain: flaxlight's leanest run, ``enable_checkpointing=False``, no progress bar, the CSV logger
  only (benchmark 1's plain trainer also writes TensorBoard, its default when tensorboardX is
  installed; here TensorBoard counts as one of the features under test);
- full: a ``ModelCheckpoint(every_n_epochs=1)`` (asynchronous orbax save of the whole train state
  at every epoch end, the last one kept), CSV + TensorBoard loggers, the tqdm progress bar on
  (to stderr, CI unset);
- full-no-ckpt: full without the checkpoint callback, to tell its cost from the loggers' and bar's;
- hand: benchmark 1's hand-written loop fed numpy batches (for reference).

What is timed, and why: checkpoints are written by ``train_model`` at epoch ends (ModelCheckpoint's
``on_epoch_end``), so the flaxlight variants run ``train_model(loader, None, num_epochs=N)`` as
a user would, each run in a freshly built trainer (construction untimed). An ``EpochClock``
callback takes the time between consecutive epoch starts: each period is one epoch's training
plus all its end-of-epoch work (the checkpoint save, including any wait for the previous save;
logger flushes; bar updates). The first period of a run is dropped (``train_model`` re-jits the
step for the optimizer it builds; from the second run on that is a persistent-cache hit, but
still a trace), so a run of N epochs gives N - 2 steady periods; the hand loop runs N - 2 epochs.
Runs are interleaved (plain, full, ..., then the reverse order), one run per variant per round,
and the median over rounds of each ratio of steps/s is reported. The ratio of whole
``train_model`` calls (setup, first epoch, final checkpoint wait and log finalisation included)
is printed too, for information. Every checkpoint is checked to have been taken at its epoch's
end, and the last to be on disk after the run.

Target: full / plain >= 0.95 per workload (steady-state epochs).

Run:
    python benchmarks/full_featured.py              # full run (7 rounds, runs of ~1 s of steady epochs)
    python benchmarks/full_featured.py --quick      # smoke run
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
from common import Check, HandFunctions, Variant  # noqa: E402

import flaxlight  # noqa: E402
from flaxlight.callbacks import ModelCheckpoint  # noqa: E402

DEFAULT_WORKLOADS = ["tiny-128", "mlp-256-128", "wide-512-1024"]
QUICK_WORKLOADS = ["tiny-128", "mlp-256-128"]
TARGET = 0.95
SETTINGS = {  # variant: trainer settings
    "plain": dict(logger_type="csv", enable_checkpointing=False, progress_bar=False),
    "full": dict(logger_type=["csv", "tensorboard"], progress_bar=True, checkpoint=True),
    "full-no-ckpt": dict(logger_type=["csv", "tensorboard"], progress_bar=True, enable_checkpointing=False),
}


class CheckpointWitness(flaxlight.Callback):
    """Was every epoch's checkpoint taken? Checked when the next epoch starts and at the end (a
    ModelCheckpoint hears of each moment after the other callbacks, so not at the epoch's end)."""

    def __init__(self, checkpoint: ModelCheckpoint):
        self.checkpoint = checkpoint
        self.taken = self.missed = 0
        self.pending: int | None = None

    def on_epoch_end(self, trainer, epoch):
        self.pending = trainer.global_step

    def _check(self):
        if self.pending is not None:
            if self.checkpoint.last_step == self.pending:
                self.taken += 1
            else:
                self.missed += 1
            self.pending = None

    def on_train_epoch_start(self, trainer, epoch):
        self._check()

    def on_fit_end(self, trainer):
        self._check()


def run_workload(name, args, log_root):
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    steps = len(loader)
    reference = common.ready_for_epochs(common.make_trainer(  # the hand loop's params and optax transformation
        workload, os.path.join(log_root, name, "hand"), logger_type="csv", enable_checkpointing=False), steps)
    hand_loop = common.HandLoop(HandFunctions(reference.model.apply), reference)
    hand_loop.epoch_numpy(loader)  # compile
    epoch_seconds = []
    for _ in range(3):
        start = time.perf_counter()
        hand_loop.epoch_numpy(loader)
        epoch_seconds.append(time.perf_counter() - start)
    steady = args.run_epochs - 2 if args.run_epochs else max(2, round(args.seconds / min(epoch_seconds)))
    num_epochs = steady + 2
    whole: dict[str, list[float]] = {v: [] for v in SETTINGS}
    witnessed = {"taken": 0, "missed": 0, "on_disk": 0, "runs": 0}
    runs = [0]

    def build(variant):
        def make(clock):
            settings = dict(SETTINGS[variant])
            callbacks = [clock]
            if settings.pop("checkpoint", False):
                checkpoint = ModelCheckpoint(every_n_epochs=1)
                callbacks = [checkpoint, CheckpointWitness(checkpoint), clock]
            runs[0] += 1
            return common.make_trainer(workload, os.path.join(log_root, name, f"{variant}-{runs[0]}"),
                                       callbacks=callbacks, **settings)

        return make

    def check_checkpoints(trainer):
        witness = next((cb for cb in trainer.callbacks if isinstance(cb, CheckpointWitness)), None)
        if witness is not None:
            witnessed["taken"] += witness.taken
            witnessed["missed"] += witness.missed
            witnessed["on_disk"] += trainer.global_step in trainer.checkpointer.all_steps()
            witnessed["runs"] += 1

    def hand(epoch):
        start = time.perf_counter()
        for e in range(steady):
            loader.set_epoch(e + 1)
            hand_loop.epoch_numpy(loader)
        return time.perf_counter() - start

    variants = [Variant("hand", hand, steady * steps)] + [
        Variant(v, common.train_model_timer(build(v), loader, num_epochs, after=check_checkpoints, whole=whole[v]),
                steady * steps) for v in SETTINGS]
    timing = common.time_workload(name, variants, args, unit=f"run(s) of {num_epochs} epochs ({steady} timed)",
                                  epochs=1)
    warm = args.warmup  # the warm-up runs are not in `whole`'s ratios
    whole_ratio = statistics.median(f / p for f, p in zip(whole["full"][warm:], whole["plain"][warm:]))
    timing.extra.update(whole_ratio=whole_ratio, num_epochs=num_epochs, checkpoints=witnessed)
    return timing


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = common.timing_parser(__doc__, default_workloads=DEFAULT_WORKLOADS, warmup=1)
    parser.add_argument("--run-epochs", type=int, default=0,
                        help="epochs per train_model run (default: ~--seconds of steady epochs, + 2)")
    args = common.finish_args(parser.parse_args(argv), QUICK_WORKLOADS)
    os.environ.pop("CI", None)  # bars stay tqdm bars (on stderr), as users see them
    load = common.print_header(
        "Benchmark 3: train_model with a checkpoint every epoch + TensorBoard + progress bar vs plain",
        f"{common.NUM_EXAMPLES} examples per epoch, {args.rounds} rounds of one train_model run per variant, "
        f"steady-state epochs (epoch-start to epoch-start, the first epoch of a run dropped)")
    timings = common.run_workloads(args, "full-featured", run_workload)
    extras = {n: t.extra for n, t in timings.items()}

    variants = ["hand"] + list(SETTINGS)
    pairs = [("full", "plain"), ("full-no-ckpt", "plain"), ("plain", "hand"), ("full", "hand")]
    problems = [n for n, e in extras.items()
                if e["checkpoints"]["missed"] or e["checkpoints"]["on_disk"] != e["checkpoints"]["runs"]]
    notes = [f"warning: a checkpoint was missing at an epoch end or after a run in {', '.join(problems)}"] if problems \
        else ["every epoch of every full run was checkpointed at its end, and each run's last checkpoint is on disk"]
    checks = [Check(f"{n}: full / plain", t.ratio("full", "plain"), TARGET) for n, t in timings.items()]
    return common.report(timings, variants, pairs, checks, load, notes=notes, extra={
        n: {"whole runs full/plain": e["whole_ratio"],
            "epochs checkpointed": f"{e['checkpoints']['taken']}/{e['checkpoints']['taken'] + e['checkpoints']['missed']}"}
        for n, e in extras.items()})


if __name__ == "__main__":
    main()
    sys.stdout.flush()
