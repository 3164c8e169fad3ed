"""A ClassificationTrainer trained by several processes on localhost (tests/test_distributed.py):
python classify_processes_script.py PROCESS_ID NUM_PROCESSES PORT LOG_DIR [--label-offset K]
prints ``accuracy <val/acc>`` after three epochs of data-parallel training."""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("process_id", type=int)
parser.add_argument("num_processes", type=int)
parser.add_argument("port", type=int)
parser.add_argument("log_dir")
parser.add_argument("--label-offset", type=int, default=0)
args = parser.parse_args()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import numpy as np  # noqa: E402

import flaxlight  # noqa: E402
from flaxlight import distributed  # noqa: E402
from flaxlight.zoo import ClassificationTrainer, MLPClassifier  # noqa: E402

distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32) + args.label_offset  # two classes (shifted: labels out of range)
shard = {"shard_index": args.process_id, "num_shards": args.num_processes}
trainer = ClassificationTrainer(model_class=MLPClassifier, model_hparams={"hidden_dims": [16], "num_classes": 2},
                                optimizer_hparams={"optimizer": "adam", "lr": 5e-2}, exmp_input=x[:1],
                                logger_params={"log_dir": args.log_dir}, enable_progress_bar=False,
                                enable_model_summary=False, distributed="data_parallel")
metrics = trainer.train_model(flaxlight.ArrayLoader(x[:192], y[:192], batch_size=32, shuffle=True, **shard),
                              flaxlight.ArrayLoader(x[192:], y[192:], batch_size=32, **shard), num_epochs=3)
print("accuracy", metrics["val/acc"], flush=True)
