"""The character Transformer of examples/char_transformer.py, tensor parallel on a ("data", "model") mesh.

Its attention and MLP weights carry sharding annotations (``nnx.with_partitioning``), Megatron
style: the first projection of each pair is split by columns over ``model`` (``(None, "model")``),
the second by rows (``("model", None)``), so each device holds a slice of every head and of the
MLP's hidden units, and XLA adds one all-reduce per pair. Batches are split over ``data``. The
trainer places every annotated weight (and its Adam moments) as annotated; the rest is replicated.

On a CPU, forced host devices show the placement and give the same numbers as one device; they do
not make it faster (the "devices" share the same cores). On GPUs or TPUs, pass ``--devices 0``
to use the real ones.

Run: python examples/transformer_tensor_parallel.py --devices 4 --mesh data=2,model=2 [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4,
                        help="forced CPU devices (set before JAX starts); 0: the machine's own devices")
    parser.add_argument("--mesh", default="data=2,model=2", help="axis sizes, e.g. data=2,model=2 (product = devices)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--log-dir", default=None, help="default: checkpoints/TensorParallelTransformer/version_N")
    parser.add_argument("--no-progress-bar", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if args.devices and "jax" not in sys.modules:  # a device count is fixed when JAX starts
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np
    from flax import nnx

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import char_transformer as ct

    def split(*names):  # a weight's initializer with its sharding annotation
        return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)

    class ParallelAttention(ct.CausalSelfAttention):
        def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
            super().__init__(dim, num_heads, rngs=rngs)
            self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, kernel_init=split(None, "model"), rngs=rngs)
            self.out = nnx.Linear(dim, dim, kernel_init=split("model", None), rngs=rngs)

    class ParallelBlock(ct.Block):
        def __init__(self, dim: int, num_heads: int, dropout_prob: float, *, rngs: nnx.Rngs):
            super().__init__(dim, num_heads, dropout_prob, rngs=rngs)
            self.attention = ParallelAttention(dim, num_heads, rngs=rngs)
            self.mlp_in = nnx.Linear(dim, 4 * dim, kernel_init=split(None, "model"), rngs=rngs)
            self.mlp_out = nnx.Linear(4 * dim, dim, kernel_init=split("model", None), rngs=rngs)

    class TensorParallelTransformer(ct.CharTransformer):
        def __init__(self, vocab_size: int, context: int = 64, dim: int = 96, num_heads: int = 4,
                     num_layers: int = 2, dropout_prob: float = 0.0, *, rngs: nnx.Rngs):
            super().__init__(vocab_size, context, dim, num_heads, num_layers, dropout_prob, rngs=rngs)
            self.blocks = nnx.List([ParallelBlock(dim, num_heads, dropout_prob, rngs=rngs) for _ in range(num_layers)])

    mesh = {name: int(size) for name, size in (part.split("=") for part in args.mesh.split(","))} \
        if len(jax.devices()) > 1 else None
    train_tokens, val_tokens = ct.split_tokens()
    _, vocab = ct.load_corpus()
    train = ct.RandomWindows(train_tokens, args.context, args.batch_size, args.steps_per_epoch)
    val = ct.consecutive_windows(val_tokens, args.context, max_windows=64)
    trainer = ct.LanguageModelTrainer(
        model_class=TensorParallelTransformer,
        model_hparams={"vocab_size": len(vocab), "context": args.context, "dim": args.dim, "num_heads": args.heads,
                       "num_layers": args.layers},
        optimizer_hparams={"optimizer": "adamw", "lr": 2e-3, "weight_decay": 0.01,
                           "warmup_steps": min(10, args.epochs * args.steps_per_epoch // 5)},
        exmp_input=np.zeros((1, args.context), np.int32),
        logger_params={"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": "checkpoints"},
        enable_progress_bar=not args.no_progress_bar, enable_model_summary=False,
        mesh=mesh, distributed="data_parallel" if mesh else None, monitor="val/bpc", mode="min",
    )
    metrics = trainer.train_model(train, val, num_epochs=args.epochs, batch_size=32)
    qkv = trainer.state.params["blocks"][0]["attention"]["qkv"]["kernel"]
    print(f"mesh {mesh or 'none (one device)'}: the first block's qkv kernel {qkv.shape} is placed as "
          f"{getattr(qkv.sharding, 'spec', qkv.sharding)}")
    print(f"validation: {metrics['val/bpc']:.3f} bits per character; logs: {trainer.log_dir}")
    return {"metrics": metrics, "params": jax.device_get(trainer.state.params),
            "shardings": jax.tree.map(lambda x: getattr(x, "sharding", None), trainer.state.params)}


if __name__ == "__main__":
    main()
