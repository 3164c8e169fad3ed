"""Steps/s of the same MLP written in flax.nnx and in flax.linen, trained by ``TrainerModule``.

flaxlight splits an NNX module once (``nnx.split``) and merges it inside the jitted train step,
so an NNX model should train as fast as the same Linen model (target: NNX within 5% of Linen).

Variants, all on the data of ``common.py`` (digits tiled to 16384 examples; the same
``flaxlight.ArrayLoader`` of numpy batches, adam, no gradient clipping):

- hand:  the hand-written loop of benchmark 1 (``common.HandLoop``, numpy batches) on the Linen
  model with a flax ``TrainState``; the loss sums stay on the device, read once per epoch;
- linen: ``TrainerModule.train_epoch`` with the Linen MLP;
- nnx:   ``TrainerModule.train_epoch`` with the NNX MLP (same layers, same initialisers).

Epochs are interleaved (hand, linen, nnx, then the reverse order, ...); a round is ~``--seconds``
of epochs per variant and gives one ratio per pair; the medians over rounds are reported. The
machine is shared and its speed drifts, so only ratios of interleaved runs mean anything.

Run:
    python benchmarks/nnx_vs_linen.py              # full run (7 rounds of ~1 s per variant)
    python benchmarks/nnx_vs_linen.py --quick      # smoke run (a few seconds per workload)
    python benchmarks/nnx_vs_linen.py --option prefetch=1   # trainer options for both trainers
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

import yaml
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Check, HandFunctions, Variant  # noqa: E402

DEFAULT_WORKLOADS = ["tiny-128", "mlp-256-128"]
TARGET = 0.95  # nnx / linen


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


def run_workload(name, args, log_root):
    workload = common.WORKLOADS[name]
    loader = common.make_loader(workload)
    steps = len(loader)
    din = workload.data()[0].shape[1]
    linen = common.make_trainer(workload, os.path.join(log_root, name, "linen"), **args.options)
    nnx_trainer = common.make_trainer(workload, os.path.join(log_root, name, "nnx"), model_class=NNXMLP,
                                      model_hparams={"din": din, "hidden_dims": list(workload.hidden)}, **args.options)
    assert nnx_trainer.model_adapter.kind == "nnx" and linen.model_adapter.kind == "linen"
    for trainer in (linen, nnx_trainer):
        common.ready_for_epochs(trainer, steps)
    hand = common.hand_timers(HandFunctions(linen.model.apply), linen, loader)
    variants = [Variant("hand", hand["numpy"], steps), Variant("linen", common.trainer_epoch(linen, loader), steps),
                Variant("nnx", common.trainer_epoch(nnx_trainer, loader), steps)]
    return common.time_workload(name, variants, args)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = common.timing_parser(__doc__, default_workloads=DEFAULT_WORKLOADS)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer option for both trainers, e.g. --option prefetch=1 (repeatable)")
    args = common.finish_args(parser.parse_args(argv))
    args.options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option takes KEY=VALUE, got {item!r}")
        args.options[key] = yaml.safe_load(value)
    load = common.print_header(
        "NNX vs Linen: the same MLP in both APIs through TrainerModule.train_epoch (steps/s, interleaved epochs)",
        f"{common.NUM_EXAMPLES} examples per epoch, {args.rounds} rounds, adam, gradient_clip=None"
        + "".join(f", {k}={v!r}" for k, v in args.options.items()))
    timings = common.run_workloads(args, "nnx-vs-linen", run_workload)

    variants = ["hand", "linen", "nnx"]
    pairs = [("nnx", "linen"), ("linen", "hand"), ("nnx", "hand")]
    checks = [Check(f"{n}: nnx / linen", t.ratio("nnx", "linen"), TARGET) for n, t in timings.items()]
    return common.report(timings, variants, pairs, checks, load)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
