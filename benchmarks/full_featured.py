"""Benchmark 3: ``train_model`` with every default on, against a hand loop doing the same train + val.

The path a user takes first: ``train_model(train_loader, val_loader)`` on a trainer built with the
defaults (best + last checkpoints by ``ModelCheckpoint()``, CSV + TensorBoard loggers, the tqdm
progress bar on stderr), fed the user's own :class:`flaxlight.ArrayLoader`. Same data, model and
optimizer as benchmark 1 (``common.py``), plus a validation set (the first 2048 training rows with
Gaussian noise, so the validation accuracy keeps moving and new best checkpoints keep coming).

Variants:

- hand: a hand-written donated ``jax.jit`` loop: per epoch, a training pass over numpy batches,
  then a jitted evaluation pass summing loss and correct answers on the device, read once;
- default: ``train_model(train, val)`` with every default;
- no-ckpt: the same with ``enable_checkpointing=False`` (what checkpoints cost, by difference).

What is timed: whole ``train_model`` runs, each in a freshly built trainer (construction untimed);
an ``EpochClock`` callback takes the time between consecutive epoch starts (one epoch's training,
its validation and all its end-of-epoch work: checkpoint saves, log writes, bar updates). The
first period is dropped (``train_model`` traces the step for the optimizer it builds), so a run of
N epochs gives N - 2 steady periods; the hand loop runs N - 2 epochs of train + val. Rounds
interleave the variants; the median over rounds of each ratio of steps/s is reported.

Checked in every run with checkpoints: the best checkpoint on disk, restored and evaluated, scores
exactly the best ``val/acc`` that ``train_model`` reported, and the last checkpoint holds the final
step.

Targets: default / hand >= 0.95 on the 111 ms and 365 ms epochs (mlp-256-128, wide-512-1024) and
>= 0.90 on the 19 ms epoch (tiny-128).

Run:
    python benchmarks/full_featured.py              # full run (5 rounds, runs of ~4 s of steady epochs:
                                                    # the default checkpoint budget writes every ~3 s)
    python benchmarks/full_featured.py --quick      # smoke run
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Check, HandFunctions, Variant  # noqa: E402

import flaxlight  # noqa: E402
from flaxlight.callbacks import ProgressBar  # noqa: E402

DEFAULT_WORKLOADS = ["tiny-128", "mlp-256-128", "wide-512-1024"]
QUICK_WORKLOADS = ["tiny-128", "mlp-256-128"]
TARGETS = {"tiny-128": 0.90}  # the others: 0.95
VAL_ROWS, VAL_BATCH = 2048, 512
SETTINGS = {  # variant: trainer settings on top of every default
    "default": dict(progress_bar=True),
    "no-ckpt": dict(progress_bar=True, enable_checkpointing=False),
}


class ClassifierWithAccuracy(common.Classifier):
    """The trainer under test: loss and accuracy (the default monitor is then ``val/acc``)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        return common.cross_entropy(logits, y), ({"acc": (logits.argmax(-1) == y).mean()}, updates)


def validation_data(workload: common.Workload) -> tuple[np.ndarray, np.ndarray]:
    x, y = workload.data()
    noise = np.random.default_rng(1).normal(0.0, 0.5, size=x[:VAL_ROWS].shape).astype(x.dtype)
    return x[:VAL_ROWS] + noise, y[:VAL_ROWS]


class HandValidation:
    """The hand loop's evaluation: a jitted step summing loss and correct answers, read once."""

    def __init__(self, apply_fn, loader: flaxlight.ArrayLoader):
        def step(params, acc, batch):
            x, y = batch
            logits = apply_fn({"params": params}, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
            return {"loss": acc["loss"] + loss, "correct": acc["correct"] + (logits.argmax(-1) == y).sum(),
                    "count": acc["count"] + y.shape[0]}

        self.step, self.loader = jax.jit(step), loader

    def __call__(self, params) -> dict[str, float]:
        acc = {"loss": jnp.zeros(()), "correct": jnp.zeros((), jnp.int32), "count": jnp.zeros((), jnp.int32)}
        for batch in self.loader:
            acc = self.step(params, acc, batch)
        host = jax.device_get(acc)  # the validation's one read
        return {"val/loss": float(host["loss"]) / int(host["count"]), "val/acc": int(host["correct"]) / int(host["count"])}


def check_best_checkpoint(trainer, best: dict, val_loader, witnessed: dict) -> None:
    """Restore the best checkpoint and evaluate it: its ``val/acc`` must be the best reported."""
    last_on_disk = trainer.global_step in trainer.checkpointer.all_steps()
    trainer.load_model()  # the best checkpoint (the trainer's own choice)
    restored = trainer.eval_model(val_loader, log_prefix="val/")
    witnessed["runs"] += 1
    witnessed["best equal"] += restored["val/acc"] == best["val/acc"]
    witnessed["last on disk"] += last_on_disk


def run_workload(name, args, log_root):
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    val_loader = flaxlight.ArrayLoader(*validation_data(workload), batch_size=VAL_BATCH)
    steps = len(loader)
    reference = common.ready_for_epochs(common.make_trainer(  # the hand loop's params and optax transformation
        workload, os.path.join(log_root, name, "hand"), logger_type="csv", enable_checkpointing=False), steps)
    hand_loop = common.HandLoop(HandFunctions(reference.model.apply), reference)
    hand_val = HandValidation(reference.model.apply, val_loader)

    def hand_epoch():
        hand_loop.epoch_numpy(loader)
        return hand_val(hand_loop.state.params)

    hand_epoch()  # compile
    epoch_seconds = []
    for _ in range(3):
        start = time.perf_counter()
        hand_epoch()
        epoch_seconds.append(time.perf_counter() - start)
    steady = args.run_epochs - 2 if args.run_epochs else max(2, round(args.seconds / min(epoch_seconds)))
    num_epochs = steady + 2
    witnessed = {"runs": 0, "best equal": 0, "last on disk": 0}
    runs = [0]

    def flaxlight_run(variant):
        def run(_):
            clock = common.EpochClock()
            settings = dict(SETTINGS[variant])
            runs[0] += 1
            # The bar a terminal shows (stderr here is not a terminal, so "auto" would print lines).
            trainer = common.make_trainer(workload, os.path.join(log_root, name, f"{variant}-{runs[0]}"),
                                          callbacks=[clock, ProgressBar(style="bars")],
                                          trainer_class=ClassifierWithAccuracy, **settings)
            best = trainer.train_model(loader, val_loader, num_epochs=num_epochs)
            periods = clock.periods()[1:]
            assert len(periods) == num_epochs - 2, (len(periods), num_epochs)
            if settings.get("enable_checkpointing", True):
                check_best_checkpoint(trainer, best, val_loader, witnessed)
            return sum(periods)

        return run

    def hand(epoch):
        start = time.perf_counter()
        for e in range(steady):
            loader.set_epoch(e + 1)
            hand_epoch()
        return time.perf_counter() - start

    variants = [Variant("hand", hand, steady * steps)] + [Variant(v, flaxlight_run(v), steady * steps) for v in SETTINGS]
    timing = common.time_workload(name, variants, args, unit=f"run(s) of {num_epochs} epochs ({steady} timed)",
                                  epochs=1)
    timing.extra.update(num_epochs=num_epochs, epoch_ms=1000 * min(epoch_seconds), checkpoints=witnessed)
    return timing


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = common.timing_parser(__doc__, default_workloads=DEFAULT_WORKLOADS, warmup=1, seconds=4.0, rounds=5)
    parser.add_argument("--run-epochs", type=int, default=0,
                        help="epochs per train_model run (default: ~--seconds of steady epochs, + 2)")
    args = common.finish_args(parser.parse_args(argv), QUICK_WORKLOADS)
    os.environ.pop("CI", None)  # bars stay tqdm bars (on stderr), as users see them
    load = common.print_header(
        "Benchmark 3: train_model(train, val) with every default (checkpoints, CSV + TensorBoard, bar) vs a hand loop",
        f"{common.NUM_EXAMPLES} training examples and {VAL_ROWS} validation examples per epoch, {args.rounds} rounds "
        f"of one run per variant, steady-state epochs (epoch start to epoch start, the first epoch of a run dropped)")
    timings = common.run_workloads(args, "full-featured", run_workload)
    extras = {n: t.extra for n, t in timings.items()}

    variants = ["hand"] + list(SETTINGS)
    pairs = [("default", "hand"), ("no-ckpt", "hand"), ("default", "no-ckpt")]
    problems = [n for n, e in extras.items() if e["checkpoints"]["best equal"] != e["checkpoints"]["runs"]
                or e["checkpoints"]["last on disk"] != e["checkpoints"]["runs"]]
    notes = [f"warning: a best checkpoint did not score the best reported val/acc, or the last step was not on "
             f"disk, in {', '.join(problems)}"] if problems else \
        ["in every default run, the best checkpoint on disk scored exactly the best reported val/acc, "
         "and the final step was on disk"]
    checks = [Check(f"{n}: default / hand", t.ratio("default", "hand"), TARGETS.get(n, 0.95))
              for n, t in timings.items()]
    return common.report(timings, variants, pairs, checks, load, notes=notes, extra={
        n: {"epoch ms (hand)": e["epoch_ms"],
            "best ckpt = best score": f"{e['checkpoints']['best equal']}/{e['checkpoints']['runs']}"}
        for n, e in extras.items()})


if __name__ == "__main__":
    main()
    sys.stdout.flush()
