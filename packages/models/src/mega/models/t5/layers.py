"""T5's transformer layers: pre-norm self-attention (with the relative-position bias, if any,
and a padding mask), cross-attention to the encoder's output (decoder only), and the MLP.

Written for one device with Megatron-Core's module names; tensor parallelism splits the heads
(QKV, Q and KV column-parallel, output projections row-parallel), so the number of local heads
is read from the activations, never the config. Attention runs with the config's ``softmax_scale``:
1 for T5, which folds 1/sqrt(d) into its initialisation; 1/sqrt(d) for Megatron-Core's T5.

Generation (:mod:`mega.models.blocks.kv_cache`): self-attention appends to a per-layer cache;
cross-attention computes the encoder's keys and values once and keeps them in the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import AttentionMask, Kernels
from mega.core.model_family import ParallelContext
from mega.models.blocks.attention import CoreAttention
from mega.models.blocks.layer_stack import PreNormLayer
from mega.models.blocks.norms import build_norm
from mega.models.t5.config import T5Config

# --feed-forward-proj -> the activation kernel applied to fc1's output (its gate half when gated).
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gated-gelu": "gelu_tanh"}


def _heads(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[s, b, heads * d]`` -> ``[s, b, heads, d]``."""
    return tensor.view(*tensor.shape[:2], -1, head_dim)


class SelfAttention(nn.Module):
    """``linear_qkv`` holds, per head, its query, key and value rows (Megatron's layout with one
    query per key/value group)."""

    def __init__(self, config: T5Config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.head_dim = config.kv_channels
        self.linear_qkv = kernels.linear(config.hidden_size, 3 * config.query_projection_size, bias=config.add_bias_linear)
        self.core_attention = CoreAttention(config, kernels, context)
        self.linear_proj = kernels.linear(config.query_projection_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, hidden: torch.Tensor, mask: AttentionMask, cache=None) -> torch.Tensor:
        qkv = _heads(self.linear_qkv(hidden), 3 * self.head_dim)
        query, key, value = qkv.split(self.head_dim, dim=-1)
        if cache is not None:
            key, value, _ = cache.append(key, value)
        return self.linear_proj(self.core_attention(query, key, value, mask))


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values (``linear_kv``: per head, key rows then value
    rows, as Megatron-Core) from the encoder's output."""

    def __init__(self, config: T5Config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.head_dim = config.kv_channels
        self.linear_q = kernels.linear(config.hidden_size, config.query_projection_size, bias=config.add_bias_linear)
        self.linear_kv = kernels.linear(config.hidden_size, 2 * config.query_projection_size, bias=config.add_bias_linear)
        self.core_attention = CoreAttention(config, kernels, context)
        self.linear_proj = kernels.linear(config.query_projection_size, config.hidden_size, bias=config.add_bias_linear)

    def encoder_keys_values(self, encoder_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = _heads(self.linear_kv(encoder_output), 2 * self.head_dim)
        key, value = kv.split(self.head_dim, dim=-1)
        return key, value

    def forward(self, hidden: torch.Tensor, encoder_output: torch.Tensor | None, mask: AttentionMask,
                cache=None) -> torch.Tensor:
        query = _heads(self.linear_q(hidden), self.head_dim)
        if cache is not None:  # generating: the encoder's keys and values, computed on the first step
            if cache.cross is None:
                cache.cross = self.encoder_keys_values(encoder_output)
            key, value = cache.cross
        else:
            key, value = self.encoder_keys_values(encoder_output)
        return self.linear_proj(self.core_attention(query, key, value, mask))


class MLP(nn.Module):
    """``relu`` (T5 v1.0): fc2(relu(fc1 x)); ``gelu`` (Megatron-LM's T5): fc2(gelu(fc1 x)), exact
    GELU; ``gated-gelu`` (v1.1): fc1 holds ``[gate; up]`` and the output is
    fc2(gelu_tanh(gate) * up), Hugging Face's ``wi_0``/``wi_1``."""

    def __init__(self, config: T5Config, kernels: Kernels):
        super().__init__()
        self.gated = config.gated
        fc1_size = config.ffn_hidden_size * (2 if self.gated else 1)
        self.linear_fc1 = kernels.linear(config.hidden_size, fc1_size, bias=config.add_bias_linear)
        self.activation = kernels.activation(ACTIVATIONS[config.feed_forward_proj])
        self.linear_fc2 = kernels.linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        projected = self.linear_fc1(hidden)
        if self.gated:
            gate, up = projected.chunk(2, dim=-1)
            return self.linear_fc2(self.activation(gate) * up)
        return self.linear_fc2(self.activation(projected))


class EncoderLayer(PreNormLayer):
    """Called with the hidden state and the attention mask."""

    def __init__(self, config: T5Config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__(build_norm(config, kernels), SelfAttention(config, kernels, context), build_norm(config, kernels),
                         MLP(config, kernels), config.hidden_dropout)


class DecoderLayer(nn.Module):
    def __init__(self, config: T5Config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.input_layernorm = build_norm(config, kernels)
        self.self_attention = SelfAttention(config, kernels, context)
        self.pre_cross_attn_layernorm = build_norm(config, kernels)
        self.cross_attention = CrossAttention(config, kernels, context)
        self.pre_mlp_layernorm = build_norm(config, kernels)
        self.mlp = MLP(config, kernels)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden: torch.Tensor, encoder_output: torch.Tensor | None, self_mask: AttentionMask,
                cross_mask: AttentionMask, cache=None) -> torch.Tensor:
        attention = self.self_attention(self.input_layernorm(hidden), self_mask, cache)
        hidden = hidden + self.hidden_dropout(attention)
        cross = self.cross_attention(self.pre_cross_attn_layernorm(hidden), encoder_output, cross_mask, cache)
        hidden = hidden + self.hidden_dropout(cross)
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))
