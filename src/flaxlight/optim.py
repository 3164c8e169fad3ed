"""The optimizer interface: ``optimizer_hparams`` -> one optax transformation.

Keys (the seed's names): ``optimizer`` (any optax optimizer by name, default ``"adamw"``),
``lr`` (peak learning rate, default 1e-3), ``warmup`` (steps of linear warmup, default 0; the
schedule then decays by cosine to 1% of ``lr`` over the whole run), ``gradient_clip`` (global
norm, default 1.0; ``None`` turns clipping off), ``weight_decay``; every other key is passed to
the optax optimizer (``b1``, ``momentum``, ...). A ready ``optax.GradientTransformation`` may be
given instead of a dict and is used unchanged.

Example:
    >>> tx = make_optimizer({"optimizer": "adam", "lr": 1e-3, "warmup": 10}, total_steps=100)
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Mapping

import optax

__all__ = ["make_optimizer", "OPTIMIZER_NAMES"]

OPTIMIZER_NAMES = tuple(
    name
    for name in (
        "adabelief", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw",
        "adan", "amsgrad", "fromage", "lamb", "lars", "lion", "nadam", "nadamw", "noisy_sgd",
        "novograd", "optimistic_gradient_descent", "polyak_sgd", "radam", "rmsprop", "rprop",
        "sgd", "sm3", "yogi",
    )
    if hasattr(optax, name)
)

_RATE_ARG = "learning_rate"


def _optimizer_factory(name: str):
    if not isinstance(name, str) or name.lower() not in OPTIMIZER_NAMES:
        close = difflib.get_close_matches(str(name).lower(), OPTIMIZER_NAMES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown optimizer {name!r} in optimizer_hparams['optimizer'].{hint} "
            f"Valid names: {', '.join(OPTIMIZER_NAMES)}. Or pass a ready optax.GradientTransformation."
        )
    return getattr(optax, name.lower())


def make_schedule(lr: float, warmup: int, total_steps: int) -> optax.Schedule:
    """The seed's schedule: linear warmup from 0, then cosine decay to ``0.01 * lr``."""
    decay_steps = max(int(total_steps), int(warmup) + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup > 0 else lr,
        peak_value=lr,
        warmup_steps=int(warmup),
        decay_steps=decay_steps,
        end_value=0.01 * lr,
    )


def make_optimizer(optimizer_hparams: Mapping[str, Any] | optax.GradientTransformation, total_steps: int):
    """Build the optax transformation for ``total_steps`` optimizer updates.

    Example:
        >>> tx = make_optimizer({"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}, total_steps=1000)
    """
    if isinstance(optimizer_hparams, optax.GradientTransformation):
        return optimizer_hparams
    hparams = dict(optimizer_hparams or {})
    name = hparams.pop("optimizer", "adamw")
    factory = _optimizer_factory(name)
    lr = float(hparams.pop("lr", 1e-3))
    warmup = int(hparams.pop("warmup", 0))
    clip = hparams.pop("gradient_clip", 1.0)
    weight_decay = hparams.pop("weight_decay", None)

    accepted = inspect.signature(factory).parameters
    if weight_decay is not None and "weight_decay" in accepted:
        hparams["weight_decay"] = weight_decay
        weight_decay = None
    unknown = [key for key in hparams if key not in accepted]
    if unknown:
        valid = sorted(k for k in accepted if k != _RATE_ARG)
        raise ValueError(
            f"optimizer_hparams has key(s) {unknown} that optax.{name} does not take. "
            f"Keys for {name}: {valid}; flaxlight keys: optimizer, lr, warmup, gradient_clip, weight_decay."
        )
    chain = []
    if clip is not None:
        chain.append(optax.clip_by_global_norm(float(clip)))
    if weight_decay:
        chain.append(optax.add_decayed_weights(float(weight_decay)))
    chain.append(factory(make_schedule(lr, warmup, total_steps), **hparams))
    return optax.chain(*chain)
