"""Sliding-window attention (Mistral's ``sliding_window``): a query at position ``p`` sees the keys
at positions ``p - window + 1 .. p`` only.

The window is one more additive bias on whatever mask the attention has (causal, padding,
packed documents, a cache's own bias), so every attention kernel that takes a bias honours it.
Keys are indexed by position: a whole sequence in training (packed documents each keep their
own index difference, which is what the window measures), or a cache's keys, which every cache
of the package stores from position 0 (the generate loop's :class:`~mega.models.blocks.kv_cache.KVCache`,
and the engine's slot and paged caches).
"""

from __future__ import annotations

import dataclasses

import torch

from mega.core.kernels import AttentionMask


def query_positions(position_ids: torch.Tensor | None, queries: int, keys: int, cached: bool,
                    device: torch.device) -> torch.Tensor:
    """``[batch or 1, queries]`` positions of the queries: a cache's callers say them
    (``position_ids``, each row its own in a batch of several lengths); without a cache (or
    without ids) the queries are the last ``queries`` of the keys."""
    if cached and position_ids is not None:
        return position_ids.reshape(-1, queries).to(device)
    return torch.arange(keys - queries, keys, device=device)[None]


def with_sliding_window(mask: AttentionMask, window: int, positions: torch.Tensor, keys: int,
                        dtype: torch.dtype) -> AttentionMask:
    """``mask`` with every key further back than ``window`` positions hidden from each query (and,
    where ``mask`` is causal, every key ahead of it)."""
    distance = positions[:, :, None] - torch.arange(keys, device=positions.device)  # [b or 1, q, k]
    bias = torch.zeros(distance.shape, dtype=dtype, device=positions.device)
    # Causality folds into the bias too: a kernel given a bias may take it as the whole mask.
    hidden = (distance >= window) | (distance < 0) if mask.causal else distance >= window
    bias.masked_fill_(hidden, torch.finfo(dtype).min)
    bias = bias[:, None]  # [b or 1, 1, q, k]: every head alike
    if mask.bias is not None:
        bias = torch.maximum(mask.bias.to(dtype) + bias, bias.new_tensor(torch.finfo(dtype).min))
    return dataclasses.replace(mask, bias=bias)
