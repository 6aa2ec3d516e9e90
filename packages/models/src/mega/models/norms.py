"""The normalisation layers: LayerNorm (with bias, as Megatron always has) or RMSNorm (no bias),
from the selected norm kernel."""

from __future__ import annotations

from torch import nn

from mega.core.kernels import Kernels
from mega.models.config import TransformerConfig


def build_norm(config: TransformerConfig, kernels: Kernels) -> nn.Module:
    return kernels.norm(config.normalization, config.hidden_size, config.layernorm_epsilon)


def input_linear(config: TransformerConfig, kernels: Kernels, out_features: int, bias: bool) -> nn.Module:
    """The linear layer a norm feeds (QKV, fc1): with a ``norm_linear`` kernel selected, the norm
    fused into it (its weights under ``layer_norm_weight``/``layer_norm_bias``), else plain."""
    fused = kernels.get("norm_linear")
    if fused is None:
        return kernels.linear(config.hidden_size, out_features, bias=bias)
    return fused(config.normalization, config.hidden_size, out_features, bias, config.layernorm_epsilon)


def fused_norm_aliases(config: TransformerConfig) -> dict[str, str]:
    """Where a fused norm's weights live canonically, relative to the transformer layer."""
    kinds = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    return {f"{linear}.layer_norm_{kind}": f"{norm}.{kind}" for kind in kinds
            for linear, norm in (("self_attention.linear_qkv", "input_layernorm"), ("mlp.linear_fc1", "pre_mlp_layernorm"))}
