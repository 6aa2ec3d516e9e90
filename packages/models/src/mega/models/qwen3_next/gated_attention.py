"""Qwen3-Next's full attention: grouped-query attention with zero-centred QK-norms, RoPE on the
first ``--rotary-percent`` of each head's channels, and an output gate: the query projection
gives each head a gate beside its query, and the attention's output is multiplied by its
sigmoid before ``linear_proj`` (Megatron's ``--attention-output-gate``).

``linear_qkv`` is Megatron's per-group layout with the gates inside: for each key/value group,
each of its query heads as ``[query; gate]``, then the key head, then the value head. Tensor
parallelism splits it into whole groups (a plain column split), so the local heads are read from
the activation's width, as :class:`~mega.models.blocks.attention.SelfAttention` does.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import CAUSAL, AttentionMask, Kernels
from mega.core.model_family import ParallelContext
from mega.models.blocks.attention import CoreAttention
from mega.models.blocks.rope import RotaryAngles, layer_cos_sin
from mega.models.qwen3_next.config import HybridLinearAttentionConfig
from mega.models.qwen3_next.norms import ZeroCenteredRMSNorm


def partial_rotary_cos_sin(config: HybridLinearAttentionConfig, seq_length: int, position_ids: torch.Tensor | None,
                           device: torch.device) -> RotaryAngles:
    """cos and sin ``[seq, batch or 1, 1, rotary_dim / 2]`` of the rotated channels (their own
    frequencies: ``base^(-2i / rotary_dim)``, as transformers' partial rotary factor)."""
    dim = config.rotary_dim
    inv_freq = 1.0 / config.rotary_base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if position_ids is None:
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)[:, None]
    else:
        positions = position_ids.to(device=device, dtype=torch.float32).t()
    angles = (positions[..., None] * inv_freq)[:, :, None, :]
    return angles.cos(), angles.sin()


class GatedSelfAttention(nn.Module):
    def __init__(self, config: HybridLinearAttentionConfig, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.config, self.kernels = config, kernels
        d = config.kv_channels
        self.head_dim, self.queries_per_group = d, config.num_attention_heads // config.num_query_groups
        size = 2 * config.query_projection_size + 2 * config.kv_projection_size
        self.linear_qkv = kernels.linear(config.hidden_size, size, bias=False)
        self.q_layernorm = ZeroCenteredRMSNorm(d, config.layernorm_epsilon)
        self.k_layernorm = ZeroCenteredRMSNorm(d, config.layernorm_epsilon)
        self.core_attention = CoreAttention(config, kernels, context)
        self.linear_proj = kernels.linear(config.query_projection_size, config.hidden_size, bias=False)
        kernels.get("rotary")  # resolved now, as the attention kernel is

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary = self.config.rotary_dim
        if rotary == x.shape[-1]:
            return self.kernels.rotary(x, cos, sin)
        return torch.cat([self.kernels.rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None, inference_cache=None,
                mask: AttentionMask = CAUSAL, rotary_angles: RotaryAngles | None = None) -> torch.Tensor:
        qkv = self.linear_qkv(hidden)
        seq, batch, _ = qkv.shape
        d, per_group = self.head_dim, self.queries_per_group
        qkv = qkv.view(seq, batch, -1, (2 * per_group + 2) * d)  # [s, b, local groups, ...]
        query_gate, key, value = qkv.split([2 * per_group * d, d, d], dim=-1)
        query, gate = query_gate.unflatten(-1, (per_group, 2, d)).unbind(-2)  # [s, b, groups, per group, d] each
        query = self.q_layernorm(query)
        key = self.k_layernorm(key)
        cos, sin = layer_cos_sin(self.config, partial_rotary_cos_sin, rotary_angles, seq, position_ids, qkv.device)
        query = self._rotate(query, cos[:, :, None], sin[:, :, None]).flatten(2, 3)  # [s, b, heads, d]
        key = self._rotate(key, cos, sin)
        if inference_cache is not None:
            key, value, mask = inference_cache.append(key, value)
            mask = mask if isinstance(mask, AttentionMask) else AttentionMask(causal=mask)
        context = self.core_attention(query, key, value, mask)  # [s, b, heads * d]
        return self.linear_proj(context * torch.sigmoid(gate.reshape(seq, batch, -1)))
