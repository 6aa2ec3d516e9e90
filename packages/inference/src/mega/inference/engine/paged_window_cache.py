"""The paged cache of a model with sliding-window layers (gpt-oss's every other layer, Mistral's
``--sliding-window``): those layers keep, per sequence, a ring of blocks that holds the window,
so their memory per sequence is bounded by the window, not by the sequence's length.

A sequence gets two block tables at admission (:class:`WindowedBlocks`): the full-attention
layers' table of every position, as :class:`~mega.inference.engine.paged_kv_cache.PagedKVCache`
keeps it, and a ring of ``min(ring_blocks, blocks for its tokens)`` blocks of a second pool for the
sliding layers. Position ``p`` lives in ring block ``(p // block_size) % len(ring)``. A ring of
``ring_blocks = ceil((window + rolled_back) / block_size)`` blocks holds the last ``window +
rolled_back`` positions: everything a later forward reads, even after speculative decoding rolls a
sequence back by up to ``rolled_back`` positions (the drafts it rejected).

A forward reads a sliding layer's last ``window - 1`` positions before each row's new tokens out of
the ring *before* writing the new keys (a long chunk's new key may land where an earlier new query
still reads), and hands attention those keys then the new ones (all of a chunk, however longer
than the window), with a mask made of their positions: a query at ``q`` sees the keys at
``q - window < p <= q``. The mask carries the window (:attr:`SlidingPagedLayer.applies_window`),
so the attention adds none of its own (which would index keys as positions from 0). Of the new
keys, only those the ring can hold (the last ``len(ring) * block_size`` positions) are written.

The pool of the sliding layers has ``max_batch_size * ring_blocks`` blocks at most: a sequence
never holds more. Admission still reserves the full layers' blocks for every token a sequence
may reach, as the loop does for any paged cache.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from mega.core.kernels import AttentionMask
from mega.inference.engine.paged_kv_cache import BlockAllocator, CacheFullError, PagedKVCache

log = logging.getLogger(__name__)


def ring_blocks_for(windows: dict[int, int], block_size: int, rolled_back: int) -> int:
    """Blocks a sequence's ring needs on the sliding pool: the widest window and the positions a
    speculative step may roll back."""
    return math.ceil((max(windows.values()) + rolled_back) / block_size)


class WindowedBlocks(list):
    """A sequence's full-attention block table (the list), and its sliding layers' ring ``sliding``."""

    def __init__(self, full: Sequence[int], sliding: Sequence[int]):
        super().__init__(full)
        self.sliding = list(sliding)


class WindowedBlockAllocator(BlockAllocator):
    """The full layers' pool (this allocator, as the loop sees it) and the sliding layers' own
    ``sliding`` pool, of which a sequence takes a ring of at most ``ring_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int, sliding_blocks: int, ring_blocks: int):
        super().__init__(num_blocks, block_size)
        self.sliding = BlockAllocator(sliding_blocks, block_size)
        self.ring_blocks = ring_blocks

    def _ring_tokens(self, tokens: int) -> int:
        return min(tokens, self.ring_blocks * self.block_size)

    def can_hold(self, tokens: int) -> bool:
        return super().can_hold(tokens) and self.sliding.can_hold(self._ring_tokens(tokens))

    def allocate(self, tokens: int) -> WindowedBlocks:
        if not self.sliding.can_hold(self._ring_tokens(tokens)):
            raise CacheFullError(f"the sliding-window layers' pool has no room for another ring of "
                                 f"{self.sliding.blocks_for(self._ring_tokens(tokens))} blocks")
        full = super().allocate(tokens)
        return WindowedBlocks(full, self.sliding.allocate(self._ring_tokens(tokens)))

    def free(self, blocks: Sequence[int]) -> None:
        super().free(blocks)
        self.sliding.free(getattr(blocks, "sliding", ()))


class WindowedPagedKVCache(PagedKVCache):
    """The paged cache whose ``layer(n)`` is, for a sliding layer (``windows``: layer -> window),
    a :class:`SlidingPagedLayer` over the rings."""

    def __init__(self, allocator: WindowedBlockAllocator, windows: dict[int, int], max_rows: int = 0,
                 head_repeats: int = 1):
        super().__init__(allocator, max_rows, head_repeats)
        self.windows = dict(windows)
        self._sliding: dict[int, SlidingPagedLayer] = {}
        self._plans: dict[int, RingPlan] = {}

    def bind(self, tables, cached, new_tokens, device, ids=None, real=None, prefill=False) -> None:
        super().bind(tables, cached, new_tokens, device, ids, real, prefill)
        self._rings = [table.sliding for table in tables]
        self._bound = (list(cached), new_tokens, device, None if real is None else list(real))
        self._plans = {}  # made at the first layer of each window this forward

    def ring_plan(self, window: int) -> RingPlan:
        plan = self._plans.get(window)
        if plan is None:
            cached, new_tokens, device, real = self._bound
            plan = self._plans[window] = RingPlan(self._rings, cached, new_tokens, window, self.allocator.block_size,
                                                  real, device)
        return plan

    def layer(self, number: int):
        window = self.windows.get(number)
        if window is None:
            return super().layer(number)
        layer = self._sliding.get(number)
        if layer is None:
            layer = self._sliding[number] = SlidingPagedLayer(self, window)
        return layer


class RingPlan:
    """One forward's reads, writes and mask for the layers of one window: row ``r`` has
    ``cached[r]`` tokens in its ring ``rings[r]`` and brings ``new_tokens`` (``real[r]`` its own)."""

    def __init__(self, rings: Sequence[Sequence[int]], cached: Sequence[int], new_tokens: int, window: int,
                 block_size: int, real: Sequence[int] | None, device: torch.device):
        rows = len(rings)
        table = torch.zeros(rows, max(len(ring) for ring in rings), dtype=torch.long)
        for row, ring in enumerate(rings):
            table[row, : len(ring)] = torch.tensor(ring, dtype=torch.long)
        ring_lengths = torch.tensor([len(ring) for ring in rings], dtype=torch.long)[:, None]
        c = torch.tensor(list(cached), dtype=torch.long)[:, None]

        def slots(positions: torch.Tensor) -> torch.Tensor:  # token slots of positions >= 0 in the pool
            blocks = table.gather(1, torch.remainder(positions.clamp(min=0) // block_size, ring_lengths))
            return blocks * block_size + positions.clamp(min=0) % block_size

        # The positions before each row's new ones that its first new query sees (< 0: none).
        old = c - (window - 1) + torch.arange(window - 1)[None, :]  # [rows, window - 1]
        new = c + torch.arange(new_tokens)[None, :]  # [rows, new]
        keys = torch.cat([old, new], dim=1)[:, None, :]
        queries = new[:, :, None]
        self.visible = ((keys >= 0) & (keys <= queries) & (keys > queries - window))[:, None].to(device)
        self.read_slots = slots(old).to(device)  # positions < 0 read slot 0, hidden by the mask
        own = torch.full_like(c, new_tokens) if real is None else torch.tensor(list(real), dtype=torch.long)[:, None]
        k = torch.arange(new_tokens)[None, :]
        # A row's own new tokens that its ring holds after this forward: the last len(ring) blocks' worth.
        kept = (k < own) & (new >= c + own - ring_lengths * block_size)
        self.write_rows = kept.reshape(-1).nonzero().squeeze(1).to(device)  # into [rows * new]
        self.write_slots = slots(new)[kept].to(device)
        self._bias: dict[torch.dtype, torch.Tensor] = {}

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``[rows, 1, new, window - 1 + new]`` over the ring's keys then the new ones."""
        bias = self._bias.get(dtype)
        if bias is None:
            bias = self._bias[dtype] = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device
                                                   ).masked_fill_(~self.visible, torch.finfo(dtype).min)
        return bias


class SlidingPagedLayer:
    """One sliding layer's pools ``[sliding blocks, block_size, kv heads, head_dim]``, allocated at
    its first keys."""

    applies_window = True  # the mask it returns hides what is outside the window

    def __init__(self, cache: WindowedPagedKVCache, window: int):
        self.cache, self.window = cache, window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
        """Store ``key``/``value`` ``[new, rows, kv heads, head_dim]`` in the rings; return each row's
        last ``window - 1`` positions then its new keys ``[window - 1 + new, rows, heads, dim]`` and the
        mask."""
        new, rows, heads, dim = key.shape
        if self.keys is None:
            pool = self.cache.allocator.sliding
            shape = (pool.num_blocks, pool.block_size, heads, dim)
            self.keys, self.values = key.new_zeros(shape), value.new_zeros(shape)
        plan = self.cache.ring_plan(self.window)
        held = []
        for pool, tensor in ((self.keys, key), (self.values, value)):
            flat = pool.view(-1, heads, dim)
            fresh = tensor.transpose(0, 1)  # [rows, new, heads, dim]
            held.append(torch.cat([flat[plan.read_slots], fresh], dim=1).transpose(0, 1))  # read before writing
            flat.index_copy_(0, plan.write_slots, fresh.reshape(-1, heads, dim)[plan.write_rows])
        return held[0], held[1], AttentionMask(bias=plan.bias(key.dtype))


def sliding_window_cache_options(prefix_caching: bool) -> None:
    """What the loop's options ask that the rings cannot give (see the module)."""
    if prefix_caching:
        log.info("prefix caching is off for models with sliding-window layers: their paged cache keeps only "
                 "each sequence's window of keys on those layers, so a cached prompt prefix is not whole")
