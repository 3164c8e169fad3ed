"""A small causal Transformer language model (flax.nnx) on Python's own help text, character level.

The corpus is ``pydoc_data.topics`` (the text of ``help('topics')``, about 465k characters; it
ships with Python). The last 10% is the validation text. Training batches are random windows of
``--context`` characters; the model predicts every next character. The reported figure is the
validation loss in bits per character (bpc; predicting uniformly over the vocabulary would cost
``log2(vocab size)`` = 6.7 bpc). ``generate()`` samples text from the trained model
(``trainer.bind_model()`` returns a live NNX module carrying the trained weights).

The model takes a ``train`` argument (passed by the trainer, ``True`` in the train step), which
switches its dropout layers; see examples/digits_cnn_nnx.py for the other NNX convention
(``model.train()`` / ``model.eval()``).

Run: python examples/char_transformer.py [--epochs 12] [--log-dir DIR]
Sample from a trained run: python examples/char_transformer.py --sample-from LOG_DIR --prompt "The "
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flaxlight

VAL_FRACTION = 0.1


# ---------------------------------------------------------------------------- the text
@functools.lru_cache(maxsize=1)
def load_corpus() -> tuple[str, tuple[str, ...]]:
    """The help topics joined in key order, and its sorted characters (the vocabulary)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    return text, tuple(sorted(set(text)))


def encode(text: str, vocab: Sequence[str]) -> np.ndarray:
    index = {char: i for i, char in enumerate(vocab)}
    return np.array([index[char] for char in text if char in index], np.int32)


def decode(ids, vocab: Sequence[str]) -> str:
    return "".join(vocab[int(i)] for i in ids)


def split_tokens() -> tuple[np.ndarray, np.ndarray]:
    """The corpus as ids: the first 90% for training, the rest for validation."""
    text, vocab = load_corpus()
    tokens = encode(text, vocab)
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    return tokens[:cut], tokens[cut:]


class RandomWindows:
    """``num_batches`` batches of ``batch_size`` random windows: ``(inputs, targets)`` int32 arrays
    of shape ``(batch_size, context)``, targets shifted by one character. The windows of an epoch
    are a pure function of ``(seed, epoch)`` (the trainer calls ``set_epoch``), so a resumed run
    sees the same batches."""

    def __init__(self, tokens: np.ndarray, context: int, batch_size: int, num_batches: int, seed: int = 0):
        if len(tokens) <= context + 1:
            raise ValueError(f"The text ({len(tokens)} characters) is shorter than a window ({context + 1}).")
        self.tokens, self.context, self.batch_size = tokens, context, batch_size
        self.num_batches, self.seed, self.epoch = num_batches, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        offsets = np.arange(self.context + 1)
        for _ in range(self.num_batches):
            starts = rng.integers(0, len(self.tokens) - self.context - 1, size=self.batch_size)
            windows = self.tokens[starts[:, None] + offsets]
            yield windows[:, :-1], windows[:, 1:]


def consecutive_windows(tokens: np.ndarray, context: int, max_windows: int | None = None):
    """Non-overlapping windows covering ``tokens`` (for validation): ``(inputs, targets)``."""
    count = (len(tokens) - 1) // context
    if max_windows:
        count = min(count, max_windows)
    inputs = tokens[: count * context].reshape(count, context)
    targets = tokens[1 : count * context + 1].reshape(count, context)
    return inputs, targets


# ---------------------------------------------------------------------------- the model (NNX)
class CausalSelfAttention(nnx.Module):
    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be a multiple of num_heads={num_heads}.")
        self.num_heads = num_heads
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        batch, length, dim = x.shape
        heads = lambda t: t.reshape(batch, length, self.num_heads, dim // self.num_heads)
        q, k, v = map(heads, jnp.split(self.qkv(x), 3, axis=-1))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.reshape(batch, length, dim))


class Block(nnx.Module):
    """Pre-norm Transformer block: x + attention(LN(x)), then x + MLP(LN(x)), dropout on both."""

    def __init__(self, dim: int, num_heads: int, dropout_prob: float, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attention = CausalSelfAttention(dim, num_heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_prob, rngs=rngs)

    def __call__(self, x, train: bool):
        x = x + self.dropout(self.attention(self.norm1(x)), deterministic=not train)
        y = self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))
        return x + self.dropout(y, deterministic=not train)


class CharTransformer(nnx.Module):
    """Token + learned position embeddings, ``num_layers`` blocks, a final LayerNorm and logits."""

    def __init__(self, vocab_size: int, context: int = 64, dim: int = 96, num_heads: int = 4,
                 num_layers: int = 2, dropout_prob: float = 0.0, *, rngs: nnx.Rngs):
        self.context = context
        self.token_embedding = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.position_embedding = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, dim)))
        self.blocks = nnx.List([Block(dim, num_heads, dropout_prob, rngs=rngs) for _ in range(num_layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab_size, rngs=rngs)

    def __call__(self, tokens, train: bool = False):
        x = self.token_embedding(tokens) + self.position_embedding[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, train)
        return self.head(self.norm(x))


class LanguageModelTrainer(flaxlight.TrainerModule):
    """Next-character cross-entropy; ``bpc`` is the same loss in bits per character."""

    def loss_fn(self, params, batch, *, train, rng, state):
        inputs, targets = batch
        logits, updates = state.apply_model(params, inputs, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss, ({"bpc": loss / math.log(2)}, updates)


# ---------------------------------------------------------------------------- sampling
@functools.partial(jax.jit, static_argnames=("graphdef", "length", "temperature"))
def _sample(graphdef, state, window, position, key, *, length: int, temperature: float):
    """``length`` sampled ids continuing ``window`` (whose first ``position`` ids are filled)."""
    context = window.shape[0]

    def next_char(carry, key):
        window, position = carry
        logits = nnx.merge(graphdef, state)(window[None], train=False)[0, jnp.minimum(position, context) - 1]
        char = jax.random.categorical(key, logits / temperature) if temperature > 0 else jnp.argmax(logits)
        char = char.astype(window.dtype)
        window = jnp.where(position < context, window.at[jnp.minimum(position, context - 1)].set(char),
                           jnp.roll(window, -1).at[context - 1].set(char))  # full: slide by one
        return (window, position + 1), char

    _, chars = jax.lax.scan(next_char, (window, position), jax.random.split(key, length))
    return chars


def generate(trainer_or_model: Any, prompt: str = "\n", length: int = 200, temperature: float = 0.8,
             seed: int = 0) -> str:
    """Sample ``length`` characters after ``prompt`` from a trained model.

    ``trainer_or_model`` is a trainer (its ``bind_model()`` is used) or a live ``CharTransformer``.
    ``temperature`` scales the logits (0: always the most likely character). The model sees the
    last ``context`` characters; the whole loop is one jitted ``lax.scan`` over the module's
    state (``nnx.split`` here, ``nnx.merge`` inside), compiled once per length and temperature.
    """
    model = trainer_or_model.bind_model() if isinstance(trainer_or_model, flaxlight.TrainerModule) else trainer_or_model
    _, vocab = load_corpus()
    ids = encode(prompt, vocab)[-model.context :]
    if len(ids) == 0:
        ids = encode("\n", vocab)
    window = np.zeros(model.context, np.int32)
    window[: len(ids)] = ids
    graphdef, state = nnx.split(model)
    chars = _sample(graphdef, state, jnp.asarray(window), jnp.int32(len(ids)), jax.random.PRNGKey(seed),
                    length=int(length), temperature=float(temperature))
    return prompt + decode(np.asarray(chars), vocab)


# ---------------------------------------------------------------------------- the script
def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--log-dir", default=None, help="default: checkpoints/CharTransformer/version_N")
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument("--no-summary", action="store_true", help="do not print the model table")
    parser.add_argument("--steps-per-epoch", type=int, default=125)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="characters the model sees")
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--val-windows", type=int, default=0, help="validate on this many windows (0: all)")
    parser.add_argument("--sample-length", type=int, default=300, help="characters sampled after training")
    parser.add_argument("--prompt", default="The ")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--sample-from", default=None, metavar="LOG_DIR",
                        help="do not train: load the best model of a run and sample from it")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.sample_from:
        exmp = np.zeros((1, 1), np.int32)
        trainer = LanguageModelTrainer.load_from_checkpoint(args.sample_from, exmp_input=exmp,
                                                            enable_progress_bar=False, enable_model_summary=False)
        print(generate(trainer, args.prompt, args.sample_length, args.temperature, args.seed))
        return {}

    train_tokens, val_tokens = split_tokens()
    _, vocab = load_corpus()
    train = RandomWindows(train_tokens, args.context, args.batch_size, args.steps_per_epoch, seed=args.seed)
    val = flaxlight.ArrayLoader(*consecutive_windows(val_tokens, args.context, args.val_windows or None),
                                batch_size=256)
    logger_params = {"log_dir": args.log_dir} if args.log_dir else {"base_log_dir": "checkpoints"}
    total_steps = args.epochs * args.steps_per_epoch
    trainer = LanguageModelTrainer(
        model_class=CharTransformer,
        model_hparams={"vocab_size": len(vocab), "context": args.context, "dim": args.dim, "num_heads": args.heads,
                       "num_layers": args.layers, "dropout_prob": args.dropout},
        optimizer_hparams={"optimizer": "adamw", "lr": args.lr, "weight_decay": 0.01,
                           "warmup_steps": min(100, total_steps // 10), "b2": 0.99},
        exmp_input=np.zeros((1, args.context), np.int32),
        seed=args.seed,
        logger_params=logger_params,
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=not args.no_summary,
        monitor="val/bpc", mode="min",
    )
    metrics = trainer.train_model(train, val, num_epochs=args.epochs)
    metrics["uniform_bpc"] = math.log2(len(vocab))
    print(f"validation: {metrics['val/bpc']:.3f} bits per character (uniform over {len(vocab)} characters: "
          f"{metrics['uniform_bpc']:.2f}); {total_steps} steps of {args.batch_size}x{args.context} characters")
    if args.sample_length:
        trainer.load_model()  # the best checkpoint
        metrics["sample"] = generate(trainer, args.prompt, args.sample_length, args.temperature, args.seed)
        print(f"--- sample (temperature {args.temperature}) ---\n{metrics['sample']}\n---")
    print(f"logs and checkpoint: {trainer.log_dir}")
    return metrics


if __name__ == "__main__":
    main()
