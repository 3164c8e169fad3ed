"""Training runs for the multi-device tests, started as subprocesses (device counts are fixed at
JAX import). python distributed_script.py MODE OUT.npz LOG_DIR [--devices N] [--restore-from DIR]
[--process-id I --num-processes P --port PORT] [--uneven: epochs and validation end on a batch that does not
split over the devices]"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("mode")  # none | data_parallel | fsdp
parser.add_argument("out")
parser.add_argument("log_dir")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--restore-from")
parser.add_argument("--process-id", type=int)
parser.add_argument("--num-processes", type=int, default=1)
parser.add_argument("--port", type=int)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--uneven", action="store_true")
args = parser.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import RegressTrainer, TinyMLP, linear_data  # noqa: E402

import flaxlight  # noqa: E402
from flaxlight import distributed  # noqa: E402

if args.num_processes > 1:
    distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id)

num_train, num_val = (510, 130) if args.uneven else (512, 128)  # uneven: last batches of 30 and 2 examples
x, y = linear_data(num_train, 0, dim=16)
shard = {"shard_index": jax.process_index(), "num_shards": jax.process_count()} if args.num_processes > 1 else {}
train = flaxlight.ArrayLoader(x, y, batch_size=args.batch_size, shuffle=True, seed=0, **shard)
val = flaxlight.ArrayLoader(*linear_data(num_val, 1, dim=16), batch_size=32, **shard)
trainer = RegressTrainer(
    model_class=TinyMLP, model_hparams={"hidden_dims": [1024, 64], "batch_norm": True},
    optimizer_hparams={"optimizer": "sgd", "lr": 0.05}, exmp_input=x[:1],
    logger_params={"log_dir": args.log_dir}, enable_progress_bar=False, enable_model_summary=False,
    distributed=None if args.mode == "none" else args.mode, callbacks=[flaxlight.ModelCheckpoint(every_n_epochs=1)],
)
if args.restore_from:
    trainer = RegressTrainer.load_from_checkpoint(
        args.restore_from, exmp_input=x[:1], which="last", with_optimizer=True,
        distributed=None if args.mode == "none" else args.mode)
    metrics = trainer.eval_model(val, log_prefix="val/")
    before = metrics["val/loss"]
else:
    before = trainer.eval_model(val, log_prefix="val/")["val/loss"]  # before training: on the mesh too
    metrics = trainer.train_model(train, val, num_epochs=2)
kernel = trainer.state.params["Dense_0"]["kernel"]
sharding = str(getattr(kernel, "sharding", ""))
host = distributed.to_host if hasattr(distributed, "to_host") else None
from flaxlight.metrics import to_host  # noqa: E402

if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    params = multihost_utils.process_allgather(trainer.state.params, tiled=True)
else:
    params = jax.device_get(trainer.state.params)
if jax.process_index() == 0:
    np.savez(args.out, loss=metrics["val/loss"], before=before, sharding=sharding,
             **{f"p{i}": leaf for i, leaf in enumerate(jax.tree.leaves(params))})
