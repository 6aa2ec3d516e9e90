"""gpt-oss's attention: grouped-query self-attention with biases, YaRN rotary, a sliding window on
some layers (:meth:`GptOssConfig.layer_window`) and attention sinks.

A sink is one learned logit per head, ``softmax_offset`` (Megatron-Core's name), that joins the
softmax over the keys as one more column and is then dropped: each query's weights sum to less
than one, so a head may attend to (almost) nothing. It is written out in torch (scores, the
mask, the sink column, softmax, values): no fused kernel takes the extra column. Under tensor
parallelism each rank holds the offsets of its own heads (the family's plan splits them as it
splits the query heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.kernels import AttentionMask, Kernels
from mega.core.model_family import ParallelContext
from mega.models.blocks.attention import CoreAttention, SelfAttention
from mega.models.blocks.mla import scaled_cos_sin, yarn_inverse_frequencies, yarn_mscale
from mega.models.torch_kernels import explicit_mask


def gpt_oss_cos_sin(config, seq_length: int, position_ids: torch.Tensor | None, device: torch.device):
    """RoPE's cos and sin over the whole head, with YaRN's frequencies and attention factor
    mscale(factor) where ``--rope-type yarn`` (transformers' gpt-oss: no mscale keys)."""
    inv_freq = yarn_inverse_frequencies(config, device, config.kv_channels)
    factor = yarn_mscale(config.rotary_scaling_factor) if config.rope_type == "yarn" else 1.0
    return scaled_cos_sin(inv_freq, factor, seq_length, position_ids, device)


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor,
                   mask: AttentionMask, scale: float, dropout_p: float) -> torch.Tensor:
    """softmax([q k^T * scale + mask, sink]) without the sink's column, times v.

    ``query`` [b, heads, q, d], ``key``/``value`` [b, groups, k, d] (heads group-major), ``sinks``
    [heads]; returns [b, heads, q, d]."""
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    additive = explicit_mask(mask, query, key)
    if additive is None and mask.causal:  # (queries and keys of one length)
        q_len, k_len = query.shape[2], key.shape[2]
        hidden = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).triu(k_len - q_len + 1)
        additive = torch.zeros(hidden.shape, dtype=scores.dtype, device=query.device)
        additive.masked_fill_(hidden, torch.finfo(scores.dtype).min)
    if additive is not None:
        scores = scores + additive
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(value.dtype), value)


class SinkCoreAttention(CoreAttention):
    """The attention core with a learned sink logit per head (``softmax_offset``)."""

    def __init__(self, config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__(config, kernels, context)
        self.softmax_offset = nn.Parameter(torch.zeros(config.num_attention_heads))

    def attend(self, query, key, value, mask, dropout_p):
        return sink_attention(query, key, value, self.softmax_offset, mask, self.softmax_scale, dropout_p)


class GptOssAttention(SelfAttention):
    """Self-attention of layer ``number``: its window (None on full layers), YaRN's angles, sinks
    with ``--softmax-type learnable``."""

    cos_sin = staticmethod(gpt_oss_cos_sin)

    def __init__(self, config, kernels: Kernels, number: int, context: ParallelContext | None = None):
        super().__init__(config, kernels, context)
        self.sliding_window = config.layer_window(number)
        if config.softmax_type == "learnable":
            self.core_attention = SinkCoreAttention(config, kernels, context)
