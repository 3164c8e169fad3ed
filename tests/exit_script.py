"""Runs that used to abort the interpreter at exit (a compile thread still running), as a subprocess.

python exit_script.py LOG_DIR train|finished-run|cold-compile-error
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # conftest helpers
import jax.numpy as jnp  # noqa: E402
from conftest import RegressTrainer, TinyMLP, TinyNNX, linear_data  # noqa: E402

import flaxlight  # noqa: E402

log_dir, case = sys.argv[1], sys.argv[2]
x, y = linear_data(64, 0)
train = flaxlight.ArrayLoader(x, y, batch_size=32)
val = flaxlight.ArrayLoader(x, y, batch_size=32)
quiet = dict(logger_params={"log_dir": log_dir, "logger_type": "csv"}, enable_progress_bar=False,
             enable_model_summary=False, compilation_cache=False)

if case in ("train", "finished-run"):  # finished-run: resume a complete run, so no epoch trains
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=x[:1], **quiet)
    trainer.train_model(train, val, num_epochs=1, resume=case == "finished-run")
else:  # an NNX + BatchNorm model whose loss raises while the eval step compiles ahead
    class Failing(RegressTrainer):
        def loss_fn(self, params, batch, *, train, rng, state):
            if train:
                raise RuntimeError("the loss fails while tracing")
            return super().loss_fn(params, batch, train=train, rng=rng, state=state)

    trainer = Failing(model_class=TinyNNX, model_hparams={"batch_norm": True}, optimizer_hparams={},
                      exmp_input=x[:1], **quiet)
    try:
        trainer.train_model(train, val, num_epochs=1)
    except RuntimeError as exc:
        assert "fails while tracing" in str(exc)
print("clean exit")
