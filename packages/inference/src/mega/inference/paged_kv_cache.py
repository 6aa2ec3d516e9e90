"""``PagedKVCache``: keys and values in fixed-size blocks shared by sequences of any lengths.

Continuous batching runs sequences that are each at their own position: a new one is
prefilled alone while the others wait at theirs, then all decode together one token each. The
cache is one pool of ``num_blocks * block_size`` token slots per layer; a sequence owns a list
of blocks (its block table), taken from the free list when it is admitted and returned when it
finishes, so memory follows the tokens actually held, not ``batch x longest``.

Before each forward the batcher :meth:`bind`\\ s the batch: each row's block table and how many
tokens it has cached. A layer's :meth:`PagedLayer.append` writes the new keys into the rows'
slots and hands attention every row's keys so far, gathered and padded to the longest, with a
padding mask (and the causal rule for a prefill's own tokens): the same attention the model
runs without a cache, over exactly each sequence's own tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mega.core.kernels import AttentionMask


class CacheFullError(RuntimeError):
    """Not enough free blocks for a sequence."""


class BlockAllocator:
    """The free list of a pool's blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs blocks: got {num_blocks} blocks of {block_size} tokens")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def can_hold(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self._free)

    def allocate(self, tokens: int) -> list[int]:
        count = self.blocks_for(tokens)
        if count > len(self._free):
            raise CacheFullError(f"{tokens} tokens need {count} blocks; {len(self._free)} are free")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """The model-facing cache (``layer(number)``, ``length``) over the block pools."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self._layers: dict[int, PagedLayer] = {}
        self.write_slots: torch.Tensor | None = None
        self.read_slots: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None

    def bind(self, tables: Sequence[Sequence[int]], cached: Sequence[int], new_tokens: int,
             device: torch.device) -> None:
        """The next forward's batch: row ``r`` holds ``cached[r]`` tokens in blocks ``tables[r]``
        and brings ``new_tokens`` more."""
        size = self.allocator.block_size
        lengths = [c + new_tokens for c in cached]
        longest = max(lengths)
        read = torch.zeros(len(tables), longest, dtype=torch.long)
        for row, (table, length) in enumerate(zip(tables, lengths, strict=True)):
            positions = torch.arange(length)
            read[row, :length] = torch.tensor(table, dtype=torch.long)[positions // size] * size + positions % size
        starts = torch.tensor(cached, dtype=torch.long)[:, None] + torch.arange(new_tokens)[None, :]
        self.write_slots = read.gather(1, starts).to(device)  # [b, new]
        self.read_slots = read.to(device)  # [b, longest]
        ragged = min(lengths) != longest  # equal lengths need no mask beyond the causal rule
        self.padding = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).to(device) if ragged else None
        self.cached = list(cached)

    @property
    def length(self) -> int:
        return max(self.cached, default=0)

    def layer(self, number: int) -> PagedLayer:
        layer = self._layers.get(number)
        if layer is None:
            layer = self._layers[number] = PagedLayer(self)
        return layer


class PagedLayer:
    """One layer's pools ``[slots, kv heads, head_dim]``, allocated at its first keys."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
        """Store ``key``/``value`` ``[new, batch, kv heads, head_dim]`` in the bound rows' slots;
        return each row's keys and values so far ``[longest, batch, heads, dim]`` and the mask."""
        cache = self.cache
        if self.keys is None:
            slots = cache.allocator.num_blocks * cache.allocator.block_size
            self.keys = key.new_zeros(slots, key.shape[2], key.shape[3])
            self.values = value.new_zeros(slots, value.shape[2], value.shape[3])
        new, batch = key.shape[0], key.shape[1]
        write = cache.write_slots.reshape(-1)
        self.keys[write] = key.transpose(0, 1).reshape(batch * new, *key.shape[2:])
        self.values[write] = value.transpose(0, 1).reshape(batch * new, *value.shape[2:])
        keys = self.keys[cache.read_slots].transpose(0, 1)  # [longest, b, heads, dim]
        values = self.values[cache.read_slots].transpose(0, 1)
        # Causal, aligned at the end: a row's new tokens see its cache and each other in order.
        return keys, values, AttentionMask(causal=True, padding=cache.padding)
