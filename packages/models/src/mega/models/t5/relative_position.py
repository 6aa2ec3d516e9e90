"""T5's relative-position attention bias: a learned scalar per (bucket, head) added to the scores.

The offset ``key - query`` falls in a bucket: half the buckets count small distances exactly,
the other half cover distances up to ``max_distance`` on a logarithmic scale (farther ones share
the last bucket). The encoder is bidirectional, so half the buckets serve keys after the query;
the decoder is causal, so only keys at or before the query get buckets.

One table per stack, held by the stage that holds the stack's first layer (Hugging Face keeps it
in layer 0; Megatron-Core names it ``encoder_relative_pos_emb`` / ``decoder_relative_pos_emb``),
``[buckets, heads]``. Tensor parallelism splits it by heads (``partition_dim`` 1), so each rank
computes the bias of its own heads.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(offset: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """The bucket of each ``key - query`` offset (an integer tensor), as T5 assigns them."""
    bucket = torch.zeros_like(offset)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (offset > 0).long() * num_buckets  # keys after the query: upper half
        distance = offset.abs()
    else:
        distance = (-offset).clamp_min(0)  # keys after the query are masked anyway
    exact = num_buckets // 2
    # log(distance / exact) / log(max_distance / exact) spreads [exact, max_distance) over the rest.
    scaled = torch.log(distance.float().clamp_min(1) / exact) / math.log(max_distance / exact)
    far = (exact + (scaled * (num_buckets - exact)).long()).clamp_max(num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """``relative_attention_bias``: the table; ``forward(queries, keys, query_offset)`` returns the
    additive bias ``[1, heads (this rank's), queries, keys]`` for queries at positions
    ``query_offset ...`` (a generation step continues after the cached ones) over keys ``0 ...``."""

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int, bidirectional: bool):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, queries: int, keys: int, query_offset: int = 0) -> torch.Tensor:
        table = self.relative_attention_bias.weight
        query_positions = torch.arange(query_offset, query_offset + queries, device=table.device)
        key_positions = torch.arange(keys, device=table.device)
        buckets = relative_position_bucket(key_positions[None, :] - query_positions[:, None],
                                           bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                                           max_distance=self.max_distance)
        return table[buckets].permute(2, 0, 1).unsqueeze(0)  # [q, k, heads] -> [1, heads, q, k]
