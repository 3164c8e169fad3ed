"""A training run for the resume tests, started as a real subprocess.

python resume_script.py LOG_DIR OUT.npz [--resume] [--kill-at STEP] [--sigterm-at STEP]
                        [--sigterm-in-eval EPOCH] [--kill-after-epoch EPOCH] [--loader array|custom]
Trains a BatchNorm + dropout MLP for 6 epochs (8 steps each), checkpointing every 5 steps and
every epoch, and saves the final parameters to OUT.npz.
"""

import argparse
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # conftest helpers
from conftest import RegressTrainer, TinyMLP, linear_data  # noqa: E402

import flaxlight  # noqa: E402


class SeededLoader:
    """A user's own loader: shuffles with a seed derived from the epoch set by the trainer."""

    def __init__(self, x, y, batch_size):
        self.x, self.y, self.batch_size, self.epoch = x, y, batch_size, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.x) // self.batch_size

    def __iter__(self):
        order = np.random.RandomState(1000 + self.epoch).permutation(len(self.x))
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[idx], self.y[idx]


class Saboteur(flaxlight.Callback):
    """Sends a real signal to this process at a given step."""

    every_n_steps = 1

    def __init__(self, step, signum):
        self.step, self.signum = step, signum

    def on_step(self, trainer, step):
        if step == self.step:
            trainer.checkpointer.wait()  # the step-25 checkpoint is on disk; SIGKILL can't be caught
            os.kill(os.getpid(), self.signum)


class KillAfterEpochRecords(flaxlight.Callback):
    """SIGKILL at the end of an epoch, once its records and the checkpoints queued so far are on disk."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, trainer, epoch):
        if epoch == self.epoch:
            trainer.logger.flush()
            trainer.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


class SignalDuringEval:
    """SIGTERM at the second batch of the ``epoch``-th validation (passes that reach a second batch:
    the trainer's look at the first batch before training is not one)."""

    def __init__(self, loader, epoch, trainer_ref):
        self.loader, self.epoch, self.trainer_ref, self.passes = loader, epoch, trainer_ref, 0

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == 1:
                self.passes += 1
                if self.passes == self.epoch:
                    os.kill(os.getpid(), signal.SIGTERM)
            yield batch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--sigterm-at", type=int)
    parser.add_argument("--sigterm-in-eval", type=int)
    parser.add_argument("--kill-after-epoch", type=int)
    parser.add_argument("--loader", default="array")
    args = parser.parse_args()

    x, y = linear_data(256, 0)
    if args.loader == "custom":
        train = SeededLoader(x, y, batch_size=32)
    else:
        train = flaxlight.ArrayLoader(x, y, batch_size=32, shuffle=True, seed=0)
    val = flaxlight.ArrayLoader(*linear_data(96, 1), batch_size=32)
    callbacks = [flaxlight.ModelCheckpoint(monitor="val/loss", save_top_k=2, every_n_steps=5)]
    if args.kill_at:
        callbacks.append(Saboteur(args.kill_at, signal.SIGKILL))
    if args.sigterm_at:
        callbacks.append(Saboteur(args.sigterm_at, signal.SIGTERM))
    if args.kill_after_epoch:
        callbacks.append(KillAfterEpochRecords(args.kill_after_epoch))
    if args.sigterm_in_eval:
        val = SignalDuringEval(val, args.sigterm_in_eval, None)
    trainer = RegressTrainer(
        model_class=TinyMLP,
        model_hparams={"hidden_dims": [16, 16], "batch_norm": True, "dropout_prob": 0.2},
        optimizer_hparams={"optimizer": "adamw", "lr": 1e-2, "weight_decay": 1e-4, "warmup": 5},
        exmp_input=x[:1], logger_params={"log_dir": args.log_dir, "logger_type": ["csv", "tensorboard"]},
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, log_every_n_steps=3,
    )
    trainer.train_model(train, val, num_epochs=6, resume=args.resume)
    leaves = {f"p{i}": np.asarray(leaf) for i, leaf in enumerate(
        __import__("jax").tree.leaves((trainer.state.params, trainer.state.batch_stats, trainer.state.opt_state)))}
    np.savez(args.out, **leaves)


if __name__ == "__main__":
    main()
