"""Scaling on 1, 2 and 4 forced CPU devices: steps/s of the same training run on each mesh.

Each device count is a subprocess (the count is fixed when JAX starts). The model is the MLP of
tests/tensor_parallel_script.py scaled up (hidden 1024), its first two kernels annotated for a
``model`` axis; the mesh is ``{"data": N}`` (data parallel) and, for 4, also ``{"data": 2, "model": 2}``.

Forced host devices measure correctness and overhead, not speed: the "devices" share this
machine's cores, so more of them cannot be faster here. Run it on GPUs or TPUs (``--real``) for
a scaling figure.

Run: python benchmarks/scaling.py [--epochs 3] [--real] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LAYOUTS = [(1, ""), (2, "data=2"), (4, "data=4"), (4, "data=2,model=2")]


def worker(devices: int, mesh_text: str, epochs: int, real: bool) -> dict:
    if not real:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import tempfile

    import flax.linen as nn
    import numpy as np
    import optax

    import flaxlight

    class AnnotatedMLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            init = nn.initializers.lecun_normal()
            x = nn.relu(nn.Dense(1024, kernel_init=nn.with_partitioning(init, (None, "model")))(x))
            x = nn.relu(nn.Dense(256, kernel_init=nn.with_partitioning(init, ("model", None)))(x))
            return nn.Dense(10)(x)

    class Classifier(flaxlight.TrainerModule):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y = batch
            logits, updates = state.apply_model(params, x, train=train, rng=rng)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), ({}, updates)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8192, 256)).astype(np.float32), rng.integers(0, 10, 8192).astype(np.int32)
    mesh = {k: int(v) for k, v in (p.split("=") for p in mesh_text.split(","))} if mesh_text else None
    if mesh and "model" not in mesh:
        mesh["model"] = 1
    trainer = Classifier(model_class=AnnotatedMLP, model_hparams={}, exmp_input=x[:1],
                         optimizer_hparams={"optimizer": "adam", "lr": 1e-3}, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         logger_params={"log_dir": tempfile.mkdtemp(), "logger_type": "csv"},
                         mesh=mesh, distributed="data_parallel" if mesh else None)
    loader = flaxlight.ArrayLoader(x, y, batch_size=256, shuffle=True, seed=0)
    trainer.train_model(loader, None, num_epochs=1)  # compiles
    start = time.perf_counter()
    trainer.train_model(loader, None, num_epochs=epochs, overwrite=True)
    seconds = time.perf_counter() - start
    return {"devices": devices, "mesh": mesh_text or "one device", "steps_per_s": epochs * len(loader) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--real", action="store_true", help="use the machine's devices (GPU/TPU), not forced CPU ones")
    parser.add_argument("--quick", action="store_true", help="smoke run: one epoch per layout (as `make bench` passes)")
    parser.add_argument("--worker", nargs=2, metavar=("DEVICES", "MESH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.epochs = 1
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1], args.epochs, args.real)))
        return
    rows = []
    for devices, mesh in LAYOUTS:
        command = [sys.executable, __file__, "--epochs", str(args.epochs), "--worker", str(devices), mesh]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        out = subprocess.run(command + (["--real"] if args.real else []), env=env, capture_output=True, text=True,
                             check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]["steps_per_s"]
    print(f"{'devices':>7}  {'mesh':<16} {'steps/s':>8}  {'vs 1 device':>11}")
    for row in rows:
        print(f"{row['devices']:>7}  {row['mesh']:<16} {row['steps_per_s']:>8.1f}  {row['steps_per_s'] / base:>11.2f}")
    if not args.real:
        print("forced host devices share this machine's cores: these figures check overhead, not speed.")


if __name__ == "__main__":
    main()
