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


def fused_norm_aliases(config: TransformerConfig, norm_linear: bool, norm_mlp: bool) -> dict[str, str]:
    """Where fused norms' weights live canonically, relative to the transformer layer: the norms
    inside QKV and fc1 (``norm_linear``) and, with ``norm_mlp``, inside the one-module MLP, whose
    fc1 and fc2 are canonically ``mlp.linear_fc1`` and ``mlp.linear_fc2``."""
    kinds = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    holders = {"self_attention.linear_qkv": "input_layernorm"} if norm_linear else {}
    if norm_mlp:
        holders["mlp"] = "pre_mlp_layernorm"
    elif norm_linear:
        holders["mlp.linear_fc1"] = "pre_mlp_layernorm"
    aliases = {f"{holder}.layer_norm_{kind}": f"{norm}.{kind}" for kind in kinds for holder, norm in holders.items()}
    if norm_mlp:
        kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
        aliases |= {f"mlp.{fc}_{kind}": f"mlp.linear_{fc}.{kind}" for fc in ("fc1", "fc2") for kind in kinds}
    return aliases
