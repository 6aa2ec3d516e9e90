"""The decoder-only LMs' pre-norm transformer layer, and their stack of the layers one pipeline
stage holds (a :class:`~mega.models.blocks.layer_stack.LayerStack`)."""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ParallelContext
from mega.models.blocks.attention import SelfAttention
from mega.models.blocks.fusions import bias_dropout_add
from mega.models.blocks.layer_stack import LayerStack, PreNormLayer
from mega.models.blocks.mla import MultiLatentAttention
from mega.models.blocks.mlp import MLP, fused_norm_mlp
from mega.models.blocks.norms import build_norm, fused_norm_aliases
from mega.models.config import TransformerConfig
from mega.models.moe.layer import MoELayer


class TransformerLayer(PreNormLayer):
    """x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x))); with
    ``--layernorm-placement post``, x + dropout(norm(attention(x))) and so on.

    With a ``norm_linear`` kernel the norms live inside QKV and fc1 (no ``input_layernorm`` /
    ``pre_mlp_layernorm`` modules), with a ``norm_mlp`` kernel the second norm lives inside the
    one-module MLP; ``parameter_aliases`` maps their weights to the canonical names, so
    checkpoints do not depend on the kernels.
    """

    def __init__(self, config: TransformerConfig, kernels: Kernels, number: int = 0,
                 context: ParallelContext | None = None):
        post = config.layernorm_placement == "post"  # OLMo2: no input norms for a kernel to fuse
        fused = not post and kernels.get("norm_linear") is not None
        fused_mlp = None if post or getattr(config, "num_experts", None) else fused_norm_mlp(config, kernels)
        super().__init__(
            input_layernorm=None if fused or post else build_norm(config, kernels),
            self_attention=build_attention(config, kernels, context),
            pre_mlp_layernorm=None if fused or post or fused_mlp is not None else build_norm(config, kernels),
            mlp=fused_mlp if fused_mlp is not None else build_mlp(config, kernels, number, context),
            hidden_dropout=config.hidden_dropout,
            post_attention_layernorm=build_norm(config, kernels) if post else None,
            post_mlp_layernorm=build_norm(config, kernels) if post else None,
        )
        self.fused_mlp = fused_mlp is not None  # the plan then splits the MLP module whole
        self.bias_dropout_fusion = config.bias_dropout_fusion
        if fused or fused_mlp is not None:
            self.parameter_aliases = fused_norm_aliases(config, norm_linear=fused, norm_mlp=fused_mlp is not None)

    def dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + dropout(x)``, one kernel with --bias-dropout-fusion (mega.models.blocks.fusions)."""
        if self.bias_dropout_fusion:
            return bias_dropout_add(x, None, residual, self.hidden_dropout.p, self.training)
        return super().dropout_add(x, residual)


def build_attention(config: TransformerConfig, kernels: Kernels, context: ParallelContext | None = None) -> nn.Module:
    """Self-attention, or multi-latent attention where the config asks for it (``deepseek-v3``),
    each taking the layout's ``context`` (groups, sequence parallelism, dropout stream)."""
    if getattr(config, "multi_latent_attention", False):
        return MultiLatentAttention(config, kernels, context)
    return SelfAttention(config, kernels, context)


def build_mlp(config: TransformerConfig, kernels: Kernels, number: int = 0,
              context: ParallelContext | None = None) -> nn.Module:
    """A dense MLP, or a mixture of experts when the config has experts and layer ``number`` is
    one of its MoE layers (``--moe-layer-freq``; the ``mixtral`` family: every layer; it takes
    the layout's ``context``)."""
    if getattr(config, "num_experts", None) and config.is_moe_layer(number):
        return MoELayer(config, kernels, context)
    return MLP(config, kernels)


def transformer_block(config: TransformerConfig, layer_numbers: range, final_norm: bool,
                      kernels: Kernels, context: ParallelContext | None = None) -> LayerStack:
    """The decoder layers numbered ``layer_numbers`` (global numbers, the parameter names'
    ``decoder.layers.N``), and the final norm on the last stage. Called with the hidden state,
    the positions and, when generating, ``cache=`` the model's :class:`KVCache`."""
    layers = {number: TransformerLayer(config, kernels, number, context) for number in layer_numbers}
    stream = context.stack_dropout_tracker if context is not None else None
    return LayerStack(layers, build_norm(config, kernels) if final_norm else None, rng_stream=stream)
