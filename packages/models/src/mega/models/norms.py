"""The normalisation layers: LayerNorm (with bias, as Megatron always has) or RMSNorm (no bias)."""

from __future__ import annotations

from torch import nn

from mega.models.config import TransformerConfig


def build_norm(config: TransformerConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
