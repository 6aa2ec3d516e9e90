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

GATHER_HEADROOM_BLOCKS = 2  # decode steps a gathered view serves before it must grow


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
        self.padding: torch.Tensor | None = None
        self._last_decode: tuple | None = None  # (each row's first block, lengths) of the last decode step
        self.capacity = 0  # positions the layers' gathered views hold

    def bind(self, tables: Sequence[Sequence[int]], cached: Sequence[int], new_tokens: int,
             device: torch.device, ids: Sequence[int] | None = None) -> None:
        """The next forward's batch: row ``r`` holds ``cached[r]`` tokens in blocks ``tables[r]``
        and brings ``new_tokens`` more; ``ids`` name the rows' sequences (never reused), so a
        decode step of the same sequences can reuse the gathered keys."""
        size = self.allocator.block_size
        lengths = [c + new_tokens for c in cached]
        self.longest = max(lengths)
        # Decoding the same sequences as the step before, each one token further: the layers'
        # gathered keys are reused and extended in place (the steady state), not gathered again.
        self.decoding = new_tokens == 1
        identity = tuple(ids) if ids is not None else None
        self.reuse = (self.decoding and identity is not None and self._last_decode == (identity, list(cached))
                      and self.longest <= self.capacity)
        if self.decoding:
            self._last_decode = (identity, lengths)
        blocks = math.ceil(self.longest / size)
        if self.decoding and not self.reuse:
            blocks += GATHER_HEADROOM_BLOCKS
            self.capacity = blocks * size
        table = torch.zeros(len(tables), blocks, dtype=torch.long)
        for row, (own, length) in enumerate(zip(tables, lengths, strict=True)):
            used = math.ceil(length / size)
            table[row, :used] = torch.tensor(own[:used], dtype=torch.long)
        positions = torch.tensor(cached, dtype=torch.long)[:, None] + torch.arange(new_tokens)[None, :]
        write = table.gather(1, positions // size) * size + positions % size  # [b, new] token slots
        self.block_table = table.to(device)  # [b, blocks]: whole blocks are gathered, not single tokens
        self.write_slots = write.reshape(-1).to(device)
        self.positions = torch.tensor(cached, dtype=torch.long, device=device)  # of the new tokens (decoding)
        ragged = min(lengths) != self.longest  # equal lengths need no mask beyond the causal rule
        self.padding = (torch.arange(self.longest)[None, :] < torch.tensor(lengths)[:, None]).to(device) \
            if ragged else None
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
    """One layer's pools ``[blocks, block_size, kv heads, head_dim]``, allocated at its first keys."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.view_keys: torch.Tensor | None = None  # [b, capacity, heads, dim]: the decode batch's keys, gathered
        self.view_values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
        """Store ``key``/``value`` ``[new, batch, kv heads, head_dim]`` in the bound rows' slots;
        return each row's keys and values so far ``[longest, batch, heads, dim]`` and the mask."""
        cache = self.cache
        if self.keys is None:
            shape = (cache.allocator.num_blocks, cache.allocator.block_size, key.shape[2], key.shape[3])
            self.keys, self.values = key.new_zeros(shape), value.new_zeros(shape)
        new, batch, heads, dim = key.shape
        for pool, tensor in ((self.keys, key), (self.values, value)):
            pool.view(-1, heads, dim).index_copy_(0, cache.write_slots, tensor.transpose(0, 1).reshape(-1, heads, dim))
        if cache.reuse:  # the views hold every earlier key: add this step's
            rows = torch.arange(batch, device=key.device)
            self.view_keys[rows, cache.positions] = key[0]
            self.view_values[rows, cache.positions] = value[0]
        else:
            views = [pool[cache.block_table].view(batch, -1, heads, dim) for pool in (self.keys, self.values)]
            if not cache.decoding:  # a prefill: nothing to keep
                return (views[0][:, : cache.longest].transpose(0, 1), views[1][:, : cache.longest].transpose(0, 1),
                        AttentionMask(causal=True, padding=cache.padding))
            self.view_keys, self.view_values = views
        gathered = [view[:, : cache.longest].transpose(0, 1) for view in (self.view_keys, self.view_values)]
        # Causal, aligned at the end: a row's new tokens see its cache and each other in order
        # (several new tokens come from one prefill, whose rows are all of one length).
        return gathered[0], gathered[1], AttentionMask(causal=True, padding=cache.padding)
