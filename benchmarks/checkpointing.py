"""Cost of checkpointing and of resuming, measured against the same trainer in one run.

1. Steady-state throughput of ``train_model`` with a checkpoint written every epoch (the
   default ModelCheckpoint: asynchronous orbax saves) vs ``enable_checkpointing=False``: the
   period between epoch starts, so each includes one save; runs alternate, the median ratio of
   steps/s is reported (target: at most 3% slower).
2. Start-up: a cold start (build the trainer, train one epoch) vs a resume (build the trainer,
   restore the newest checkpoint, train one epoch), each in a fresh trainer, compilation cache warm.

Run: python benchmarks/checkpointing.py [--rounds 5] [--epochs 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import MLP, Classifier, load_data  # noqa: E402

import flaxlight  # noqa: E402


class EpochClock(flaxlight.Callback):
    """Wall time between consecutive epoch starts (training + validation + the epoch's checkpoint)."""

    def __init__(self):
        self.starts: list[float] = []

    def on_train_epoch_start(self, trainer, epoch):
        self.starts.append(time.perf_counter())

    def periods(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def make_trainer(x, hidden, log_dir, **kwargs):
    return Classifier(model_class=MLP, model_hparams={"hidden_dims": [hidden, hidden]},
                      optimizer_hparams={"optimizer": "adam", "lr": 1e-3}, exmp_input=x[:1],
                      logger_params={"log_dir": str(log_dir), "logger_type": "csv"},
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)
    x, y = load_data()
    loader = flaxlight.ArrayLoader(x, y, batch_size=args.batch_size, shuffle=True, drop_last=True)
    root = Path(tempfile.mkdtemp())
    rates: dict[str, list[float]] = {"no checkpoints": [], "checkpoint every epoch": []}
    for r in range(args.rounds + 1):  # round 0 compiles (and fills the cache); not counted
        order = list(rates) if r % 2 else list(rates)[::-1]
        for variant in order:
            clock = EpochClock()
            trainer = make_trainer(x, args.hidden, root / f"{variant}-{r}", callbacks=[clock],
                                   enable_checkpointing=variant != "no checkpoints")
            trainer.train_model(loader, None, num_epochs=args.epochs)
            if r:  # steady state: epoch starts 2..N, each period includes the previous epoch's save
                rates[variant].append(len(loader) / statistics.median(clock.periods()[1:]))
    ratio = statistics.median(c / n for c, n in zip(rates["checkpoint every epoch"], rates["no checkpoints"]))

    starts: dict[str, list[float]] = {"cold start": [], "resume": []}
    for r in range(args.rounds):
        run = root / f"resume-{r}"
        start = time.perf_counter()
        make_trainer(x, args.hidden, run).train_model(loader, None, num_epochs=1)
        starts["cold start"].append(time.perf_counter() - start)
        start = time.perf_counter()
        make_trainer(x, args.hidden, run).train_model(loader, None, num_epochs=2, resume=True)
        starts["resume"].append(time.perf_counter() - start)

    print(f"MLP 64-{args.hidden}-{args.hidden}-10, batch {args.batch_size}, {len(loader)} steps/epoch, "
          f"{args.epochs} epochs per run, {args.rounds} rounds")
    for variant, values in rates.items():
        print(f"  {variant:24s} {statistics.median(values):8.0f} steps/s")
    print(f"  ratio (checkpointing / none): {ratio:.3f}")
    for variant, values in starts.items():
        print(f"  {variant:24s} {statistics.median(values):8.2f} s to build and train one epoch")
    return {"ratio": ratio, "rates": rates, "starts": starts}


if __name__ == "__main__":
    main()
