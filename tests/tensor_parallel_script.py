"""Runs for tests/test_tensor_parallel.py, as subprocesses (device counts are fixed at JAX import).

python tensor_parallel_script.py OUT.npz LOG_DIR --devices N [--mesh data=2,model=2] [--restore-from DIR]
    [--epochs E] [--resume] [--nnx] [--load-defaults] [--crash-after E] [-- OUT.npz LOG_DIR ... -- ...]

Several runs on the same device count may follow each other in one process (a JAX start-up each
costs seconds), separated by ``--``; each is the run its arguments describe, in order, and all take
the first run's --devices.
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("log_dir")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--mesh", default="")
parser.add_argument("--distributed", default="data_parallel")
parser.add_argument("--restore-from")
parser.add_argument("--nnx", action="store_true")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--load-defaults", action="store_true", help="restore with load_from_checkpoint's defaults only")
parser.add_argument("--crash-after", type=int, help="raise at the end of this epoch, after its checkpoint is written")


def _split_runs(argv):
    runs, current = [], []
    for arg in argv:
        if arg == "--":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    return [run for run in runs + [current] if run]


RUNS = [parser.parse_args(run) for run in _split_runs(sys.argv[1:])]
assert all(run.devices == RUNS[0].devices for run in RUNS), "runs in one process share its device count"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={RUNS[0].devices}"

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import CrashAfterEpoch, linear_data  # noqa: E402

import flaxlight  # noqa: E402


class AnnotatedMLP(nn.Module):
    """Megatron-style: the first kernel split by columns, the second by rows over "model"; the
    output layer annotated with logical names (mapped by sharding_rules)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        init = nn.initializers.lecun_normal()
        x = nn.relu(nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "model")))(x))
        x = nn.relu(nn.Dense(32, kernel_init=nn.with_partitioning(init, ("model", None)))(x))
        return nn.Dense(1, kernel_init=nn.with_logical_partitioning(init, ("hidden", "out")))(x)


class AnnotatedNNX(nnx.Module):
    """The same split in NNX: sharding metadata on the variables (nnx.with_partitioning)."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
        self.down = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.down(nnx.relu(self.up(x)))))


class Regressor(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        out, updates = state.apply_model(params, x, train=train, rng=rng)
        return optax.l2_loss(out, y).mean(), ({}, updates)


def main(args):
    mesh = dict((k, int(v)) for k, v in (part.split("=") for part in args.mesh.split(","))) if args.mesh else None
    options = dict(mesh=mesh, distributed=args.distributed if args.devices > 1 else None,
                   sharding_rules=[("hidden", "model"), ("out", None)])
    x, y = linear_data(256, 0, dim=16)
    if args.restore_from:
        trainer = Regressor.load_from_checkpoint(args.restore_from, exmp_input=x[:1], which="last",
                                                 with_optimizer=True, **({} if args.load_defaults else options))
    else:
        trainer = Regressor(model_class=AnnotatedNNX if args.nnx else AnnotatedMLP, model_hparams={},
                            exmp_input=x[:1], optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                            logger_params={"log_dir": args.log_dir}, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[flaxlight.ModelCheckpoint(every_n_epochs=1)]
                            + ([CrashAfterEpoch(args.crash_after)] if args.crash_after else []), **options)
        trainer.train_model((x, y), None, num_epochs=args.epochs, batch_size=32, resume=args.resume)
    params = trainer.state.params
    shardings = {name: str(getattr(params[name]["kernel"], "sharding", "")) for name in params}
    first = "up" if args.nnx else "Dense_0"
    mu = next((leaf for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.state.opt_state)
               if all(part in jax.tree_util.keystr(path) for part in (".mu", first, "kernel"))), None)
    np.savez(args.out, shardings=repr(shardings), mu_sharding=str(getattr(mu, "sharding", "")),
             **{f"p{i}": leaf for i, leaf in enumerate(jax.tree.leaves(jax.device_get(params)))})


for run in RUNS:
    main(run)
