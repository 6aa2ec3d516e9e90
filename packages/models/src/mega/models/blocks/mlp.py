"""The feed-forward block: GELU (exact or tanh-approximated), ReLU, squared ReLU or SwiGLU
(``config.mlp_activation``, from ``--activation`` or Megatron's flags).

With SwiGLU ``linear_fc1`` holds the gate and up projections stacked ``[gate; up]`` (Megatron's
layout); tensor parallelism splits each half on its own, so ``chunk(2)`` separates them on a
sharded layer too. The linear layers and the activation come from the selected kernels.

A ``norm_mlp`` kernel (Transformer Engine's LayerNormMLP) replaces the norm before the MLP and
the MLP together with one module (:func:`fused_norm_mlp`), when it computes the same activation.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.parallel.grad_accumulation_fusion import Linear as FusionAwareLinear
from mega.core.parallel.layers import ColumnParallelLinear
from mega.models.blocks import fusions
from mega.models.blocks.norms import input_linear
from mega.models.config import TransformerConfig


def activation_name(config: TransformerConfig) -> str:
    return config.mlp_activation


def fused_norm_mlp(config: TransformerConfig, kernels: Kernels) -> nn.Module | None:
    """The norm before the MLP and the MLP in one module, from the selected ``norm_mlp`` kernel;
    None when there is none or it does not compute this activation exactly (TE's "gelu" is the
    tanh approximation, so GPT's exact GELU keeps the unfused MLP)."""
    factory = kernels.get("norm_mlp")
    name = activation_name(config)
    if factory is None or name not in factory.activations:
        return None
    return factory(config.normalization, config.hidden_size, config.ffn_hidden_size, name, config.add_bias_linear,
                   config.layernorm_epsilon)


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, kernels: Kernels):
        super().__init__()
        fc1_size = config.ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = input_linear(config, kernels, fc1_size, bias=config.add_bias_linear)
        self.activation = kernels.activation(activation_name(config))
        self.linear_fc2 = kernels.linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)
        self.bias_activation = fused_bias_activation(config, kernels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fc1 = self.linear_fc1
        if self.bias_activation is not None and isinstance(fc1, LINEARS_LEAVING_THEIR_BIAS):
            return self.linear_fc2(self.bias_activation(fc1(hidden, add_bias=False), fc1.bias))
        return self.linear_fc2(self.activation(fc1(hidden)))


# The linear layers that can leave their bias to the activation (mega's; a kernel's may not).
LINEARS_LEAVING_THEIR_BIAS = (FusionAwareLinear, ColumnParallelLinear)


def fused_bias_activation(config: TransformerConfig, kernels: Kernels):
    """fc1's bias and the torch activation in one function (--bias-gelu-fusion,
    --bias-swiglu-fusion, :mod:`mega.models.blocks.fusions`); None where unfused."""
    if not config.add_bias_linear or kernels.selection.get("activation") != "torch":
        return None
    name = activation_name(config)
    if name == "swiglu":
        return fusions.bias_swiglu if config.bias_swiglu_fusion else None
    if name not in ("gelu", "gelu_tanh") or not config.bias_gelu_fusion:
        return None  # the other activations (relu, squared_relu) have no fused bias form
    return functools.partial(fusions.bias_gelu, approximate="tanh" if name == "gelu_tanh" else "none")
