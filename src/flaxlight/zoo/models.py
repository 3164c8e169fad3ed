"""Models of the examples (flax.linen), registered by short name."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from flaxlight.registry import register_model

__all__ = ["MLPClassifier", "MLPRegressor"]


@register_model("mlp_regressor")
class MLPRegressor(nn.Module):
    """Dense layers with SiLU, then a linear output (the seed's sine regression model)."""

    hidden_dims: Sequence[int]
    output_dim: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        for dim in self.hidden_dims:
            x = nn.silu(nn.Dense(dim)(x))
        return nn.Dense(self.output_dim)(x)


@register_model("mlp_classifier")
class MLPClassifier(nn.Module):
    """Flatten, then Dense -> BatchNorm -> swish -> Dropout blocks, then logits."""

    hidden_dims: Sequence[int]
    num_classes: int
    dropout_prob: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        for dim in self.hidden_dims:
            x = nn.Dense(dim)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.swish(x)
            x = nn.Dropout(self.dropout_prob, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)
