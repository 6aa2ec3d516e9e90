"""``KVCache``: the keys and values a stage's attention layers have computed, for generation.

Generation runs a batch in lock-step (Megatron's way): every sequence is at the same position,
prompts longer than the shortest are fed token by token. So a forward either fills an empty
cache with the batch's first tokens (causal attention among them) or appends one token per
sequence, which attends to everything cached; no padding mask is ever needed, and the attention
kernel backends keep their one ``causal`` switch.

Buffers are allocated on a layer's first use, shaped like the keys that layer produced, so the
same cache serves a full layer or a tensor-parallel shard (this rank's key/value heads), and
multi-head or grouped-query attention alike.
"""

from __future__ import annotations

import torch


class KVCacheError(ValueError):
    """The cache cannot take what a forward hands it (too long, or a chunk it cannot attend)."""


class LayerKVCache:
    """One layer's keys and values, ``[batch, kv heads, max_length, head_dim]`` each.

    Stored heads-first so that the prefix handed to attention is the kernels' own layout.
    """

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Store ``key``/``value`` ``[seq, batch, kv heads, head_dim]``; return every cached key
        and value in the same layout, and whether the new queries attend causally."""
        seq = key.shape[0]
        if self.length and seq != 1:
            raise KVCacheError(f"a filled cache appends one token per sequence, got {seq}")
        if self.length + seq > self.max_length:
            raise KVCacheError(f"{self.length + seq} positions exceed the cache's {self.max_length}")
        if self.keys is None:
            shape = (key.shape[1], key.shape[2], self.max_length, key.shape[3])
            self.keys = key.new_empty(shape)
            self.values = value.new_empty(shape)
        end = self.length + seq
        self.keys[:, :, self.length:end] = key.permute(1, 2, 0, 3)
        self.values[:, :, self.length:end] = value.permute(1, 2, 0, 3)
        self.length = end
        # Back to [seq, batch, heads, dim] as views: the attention core permutes them again.
        keys, values = (t[:, :, :end].permute(2, 0, 1, 3) for t in (self.keys, self.values))
        return keys, values, seq > 1

    def keep(self, rows: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


class KVCache:
    """The caches of every layer of a stage, by global layer number, for one batch."""

    def __init__(self, max_length: int):
        if max_length < 1:
            raise KVCacheError(f"a cache needs at least one position, got {max_length}")
        self.max_length = max_length
        self._layers: dict[int, LayerKVCache] = {}

    def layer(self, number: int) -> LayerKVCache:
        cache = self._layers.get(number)
        if cache is None:
            cache = self._layers[number] = LayerKVCache(self.max_length)
        return cache

    @property
    def length(self) -> int:
        """Positions cached so far (every layer holds as many after a whole forward)."""
        return max((cache.length for cache in self._layers.values()), default=0)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the sequences at batch indices ``rows`` (finished ones leave the batch)."""
        for cache in self._layers.values():
            cache.keep(rows)
