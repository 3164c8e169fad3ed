"""A training run for the checkpoint-writer tests, started as a real subprocess.

python writer_script.py LOG_DIR OUT.npz [--resume] [--signal kill|term] [--at STEP]
                        [--when queued|writing] [--report FILE]

Trains a BatchNorm + dropout MLP for 4 epochs (8 steps each), checkpointing every 5 steps and
every epoch (best 2 by val/loss, plus the last), and saves the final arrays to OUT.npz.

``--signal`` sends SIGKILL or SIGTERM to this process right after ``ModelCheckpoint`` queued
checkpoint ``--at`` on the background writer (``ModelCheckpoint`` hears every hook after the other
callbacks, so the signal comes from a ``ModelCheckpoint`` subclass): ``--when queued`` at once,
``--when writing`` once orbax's temporary folder ``<step>.orbax-checkpoint-tmp`` of that step
exists (the write is in flight). ``--report`` gets, just before the signal, a JSON line saying
what the checkpoints folder held then.
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # conftest helpers
from conftest import RegressTrainer, TinyMLP, linear_data  # noqa: E402

import flaxlight  # noqa: E402

NUM_EPOCHS = 4
MODEL_HPARAMS = {"hidden_dims": [16, 16], "batch_norm": True, "dropout_prob": 0.2}
OPTIMIZER_HPARAMS = {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 1e-4, "warmup": 5}


class SignallingCheckpoint(flaxlight.ModelCheckpoint):
    """A ModelCheckpoint that signals its own process right after queueing checkpoint ``at``."""

    def __init__(self, at, signum, when, report, **kwargs):
        super().__init__(**kwargs)
        self.at, self.signum, self.when, self.report, self.sent = at, signum, when, report, False

    def _save(self, trainer, step, best_metrics, **kwargs):
        super()._save(trainer, step, best_metrics, **kwargs)
        if step != self.at or self.sent:
            return
        self.sent = True
        folder = trainer.checkpointer.directory
        listing = os.listdir(folder) if os.path.isdir(folder) else []
        if self.when == "writing":  # wait for orbax's temporary folder of this step: the write is under way
            deadline = time.monotonic() + 10
            while f"{step}.orbax-checkpoint-tmp" not in listing and str(step) not in listing \
                    and time.monotonic() < deadline:
                time.sleep(0.0002)
                listing = os.listdir(folder) if os.path.isdir(folder) else []
        if self.report:
            with open(self.report, "w") as f:
                json.dump({"step": step, "listing": sorted(listing), "queued": trainer.checkpointer.all_steps()}, f)
        os.kill(os.getpid(), self.signum)
        if self.signum == signal.SIGKILL:
            time.sleep(60)  # never reached


def make_trainer(log_dir, callbacks=()):
    x, _ = linear_data(256, 0)
    return RegressTrainer(
        model_class=TinyMLP, model_hparams=dict(MODEL_HPARAMS), optimizer_hparams=dict(OPTIMIZER_HPARAMS),
        exmp_input=x[:1], logger_params={"log_dir": str(log_dir), "logger_type": "csv"},
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), log_every_n_steps=3,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--signal", choices=["kill", "term"])
    parser.add_argument("--at", type=int)
    parser.add_argument("--when", choices=["queued", "writing"], default="queued")
    parser.add_argument("--report")
    args = parser.parse_args()

    x, y = linear_data(256, 0)
    train = flaxlight.ArrayLoader(x, y, batch_size=32, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(*linear_data(96, 1), batch_size=32)
    kwargs = dict(monitor="val/loss", save_top_k=2, every_n_steps=5)
    if args.signal:
        signum = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
        checkpoint = SignallingCheckpoint(args.at, signum, args.when, args.report, **kwargs)
    else:
        checkpoint = flaxlight.ModelCheckpoint(**kwargs)
    trainer = make_trainer(args.log_dir, [checkpoint])
    trainer.train_model(train, val, num_epochs=NUM_EPOCHS, resume=args.resume)
    import jax

    leaves = jax.tree.leaves((trainer.state.params, trainer.state.batch_stats, trainer.state.opt_state,
                              trainer.state.rng, trainer.state.step))
    np.savez(args.out, **{f"p{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)})


if __name__ == "__main__":
    main()
