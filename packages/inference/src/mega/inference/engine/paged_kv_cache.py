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
    """The model-facing cache (``layer(number)``, ``length``) over the block pools.

    Decoding attends over each row's keys gathered out of the blocks into a dense per-layer view
    ``[rows, capacity, heads, dim]``. The view outlives a step: row ``r`` keeps the keys of the
    sequence it last held, so the next decode step only patches the rows whose sequence changed
    (a row moved from elsewhere in the view, or a sequence new to decoding gathered from its
    blocks) and writes each row's one new key. A batcher that keeps its rows in place (a finished
    row replaced by the last one) so copies a few rows per step, not every row's every key.
    """

    def __init__(self, allocator: BlockAllocator, max_rows: int = 0, head_repeats: int = 1):
        self.allocator = allocator
        self.max_rows = max_rows  # rows the views are made for (more rows make them grow)
        # Grouped-query attention: the views hold every key head repeated for its query heads,
        # as the attention kernel would repeat them (on CPU) at every step; repeating only the
        # keys that enter a view saves re-copying the whole view each step.
        self.head_repeats = head_repeats
        self._layers: dict[int, PagedLayer] = {}
        self.write_slots: torch.Tensor | None = None
        self.written: torch.Tensor | None = None  # which new tokens are stored (None: all)
        self.padding: torch.Tensor | None = None
        self.view_ids: list = []  # the sequence each view row holds (its keys up to view_lengths)
        self.view_lengths: list[int] = []
        self.capacity = 0  # positions the layers' views hold
        self.plan: ViewPlan | None = None

    def bind(self, tables: Sequence[Sequence[int]], cached: Sequence[int], new_tokens: int,
             device: torch.device, ids: Sequence[int] | None = None, real: Sequence[int] | None = None,
             prefill: bool = False) -> None:
        """The next forward's batch: row ``r`` holds ``cached[r]`` tokens in blocks ``tables[r]``
        and brings ``new_tokens`` more; ``ids`` name the rows' sequences (never reused), so
        decode steps can reuse what the layers' views hold. ``real``: prompts prefilled together,
        right-padded to ``new_tokens``: row ``r``'s first ``real[r]`` new tokens are its own, the
        rest padding whose keys are neither stored nor attended to. ``prefill``: the new tokens are
        prompt tokens even where there is one per row (a one-token prompt, or the last token after
        a cached prefix): they read their blocks once, as any prefill does, and leave the decode
        views alone (a decode step's views are made for every row the batch may hold, and
        rebuilding them for such a prompt cost more than its whole forward)."""
        size = self.allocator.block_size
        if real is not None and (any(cached) or max(real) != new_tokens):
            raise ValueError("padded rows are for prompts prefilled together: nothing cached, the longest unpadded")
        padded = real is not None
        real = [new_tokens] * len(cached) if real is None else list(real)
        lengths = [c + n for c, n in zip(cached, real, strict=True)]
        self.longest = max(lengths)
        self.decoding = new_tokens == 1 and not prefill
        blocks = math.ceil(self.longest / size)
        if self.decoding:
            self.plan = self._plan(tables, cached, lengths, device, ids)
            blocks = self.capacity // size
        table = _padded_table(tables, lengths, size, blocks)
        positions = torch.tensor(cached, dtype=torch.long)[:, None] + torch.arange(new_tokens)[None, :]
        write = table.gather(1, positions // size) * size + positions % size  # [b, new] token slots
        self.block_table = table.to(device)  # [b, blocks]: whole blocks are gathered, not single tokens
        own = torch.arange(new_tokens)[None, :] < torch.tensor(real)[:, None]  # [b, new]: not padding
        self.written = None if bool(own.all()) else own.reshape(-1).nonzero().squeeze(1).to(device)
        self.write_slots = write[own].to(device)
        self.positions = torch.tensor(cached, dtype=torch.long, device=device)  # of the new tokens (decoding)
        ragged = min(lengths) != self.longest  # equal lengths need no mask beyond the causal rule
        self.padding = (torch.arange(self.longest)[None, :] < torch.tensor(lengths)[:, None]).to(device) \
            if ragged else None
        # Several new tokens on rows of several cached lengths (a speculative verify step): the
        # causal rule aligned at the longest row's end would show a shorter row's queries its own
        # later tokens, so each row's rule comes from its own length (key k <= cached + q).
        self.visible = None
        if ragged and not padded and new_tokens > 1:
            self.visible = (torch.arange(self.longest)[None, None, :] <= positions[:, :, None])[:, None].to(device)
            self.padding = None  # in the rule: a row's keys end at cached + new - 1
        self._bias: torch.Tensor | None = None
        self.cached = list(cached)

    def mask(self, dtype: torch.dtype) -> AttentionMask:
        """The bound batch's attention mask: causal, aligned at the end, with the padding of
        shorter rows; or each row's own causal rule as an additive bias ``[rows, 1, new, longest]``
        (made once per forward, at its first layer)."""
        if self.visible is None:
            return AttentionMask(causal=True, padding=self.padding)
        if self._bias is None or self._bias.dtype != dtype:
            bias = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            self._bias = bias.masked_fill_(~self.visible, torch.finfo(dtype).min)
        return AttentionMask(bias=self._bias)

    def _plan(self, tables, cached, lengths, device, ids) -> ViewPlan:
        """What the layers' views need before this decode step: rebuilt whole (the first step,
        or a sequence outgrew them), or only some rows moved or gathered."""
        size = self.allocator.block_size
        rows = len(cached)
        where = {} if ids is None else {sid: (row, length) for row, (sid, length)
                                        in enumerate(zip(self.view_ids, self.view_lengths, strict=True))}
        rebuild = ids is None or self.longest > self.capacity or rows > len(self.view_ids)
        if rebuild:
            self.capacity = (math.ceil(self.longest / size) + GATHER_HEADROOM_BLOCKS) * size
            plan = ViewPlan(rebuild=True)
        else:
            moves, fills = [], []
            for row, (sid, length) in enumerate(zip(ids, cached, strict=True)):
                held = where.get(sid)
                if held == (row, length):
                    continue
                if held is not None and held[1] == length:
                    moves.append((row, held[0]))
                else:
                    fills.append(row)
            plan = ViewPlan(rebuild=False)
            if moves:
                plan.move_to = torch.tensor([m[0] for m in moves], device=device)
                plan.move_from = torch.tensor([m[1] for m in moves], device=device)
            if fills:
                table = _padded_table([tables[row] for row in fills], [lengths[row] for row in fills], size,
                                      self.capacity // size)
                plan.fill_rows, plan.fill_table = torch.tensor(fills, device=device), table.to(device)
        if ids is None:
            self.view_ids, self.view_lengths = [], []
            return plan
        # After this step row r holds ids[r]; rows past the batch keep what they held, except a
        # sequence that moved into the batch's rows (its old row is stale from now on).
        rest = max(self.view_rows(rows) - rows, 0)
        old_ids = [None] * rest if rebuild else self.view_ids[rows: rows + rest]
        old_lengths = [0] * rest if rebuild else self.view_lengths[rows: rows + rest]
        batch_ids = set(ids)
        self.view_ids = list(ids) + [None if sid in batch_ids else sid for sid in old_ids]
        self.view_lengths = list(lengths) + old_lengths
        return plan

    def view_rows(self, batch: int) -> int:
        return max(self.max_rows, batch)

    @property
    def length(self) -> int:
        return max(self.cached, default=0)

    def layer(self, number: int) -> PagedLayer:
        layer = self._layers.get(number)
        if layer is None:
            layer = self._layers[number] = PagedLayer(self)
        return layer


def _padded_table(tables: Sequence[Sequence[int]], lengths: Sequence[int], size: int, blocks: int) -> torch.Tensor:
    """``[rows, blocks]``: each row's blocks holding its ``length`` tokens, then zeros (one
    tensor made from one list: a tensor per row cost more than the step's small products)."""
    rows = []
    for own, length in zip(tables, lengths, strict=True):
        used = min(math.ceil(length / size), len(own))
        rows.append([*own[:used], *([0] * (blocks - used))])
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), blocks)


class ViewPlan:
    """How a decode step brings the views up to date (see :meth:`PagedKVCache._plan`)."""

    def __init__(self, rebuild: bool):
        self.rebuild = rebuild
        self.move_to: torch.Tensor | None = None  # rows that take the keys another row holds
        self.move_from: torch.Tensor | None = None
        self.fill_rows: torch.Tensor | None = None  # rows gathered from their blocks
        self.fill_table: torch.Tensor | None = None


class PagedLayer:
    """One layer's pools ``[blocks, block_size, kv heads, head_dim]``, allocated at its first keys."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.views: list[torch.Tensor] | None = None  # keys, values [rows, capacity, heads, dim] for decoding

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
        """Store ``key``/``value`` ``[new, batch, kv heads, head_dim]`` in the bound rows' slots;
        return each row's keys and values so far ``[longest, batch, heads, dim]`` and the mask."""
        cache = self.cache
        if self.keys is None:
            shape = (cache.allocator.num_blocks, cache.allocator.block_size, key.shape[2], key.shape[3])
            self.keys, self.values = key.new_zeros(shape), value.new_zeros(shape)
        new, batch, heads, dim = key.shape
        pools = (self.keys, self.values)
        for pool, tensor in zip(pools, (key, value), strict=True):
            rows = tensor.transpose(0, 1).reshape(-1, heads, dim)
            if cache.written is not None:  # padded prompts: only their own tokens' keys are kept
                rows = rows[cache.written]
            pool.view(-1, heads, dim).index_copy_(0, cache.write_slots, rows)
        # A row's new tokens see its cache and each other in order (see PagedKVCache.mask).
        mask = cache.mask(key.dtype)
        if not cache.decoding:  # a prefill: its own rows' blocks, nothing kept
            views = [pool[cache.block_table].view(batch, -1, heads, dim)[:, : cache.longest] for pool in pools]
            return views[0].transpose(0, 1), views[1].transpose(0, 1), mask
        plan, repeats = cache.plan, cache.head_repeats

        def widen(tensor: torch.Tensor) -> torch.Tensor:  # [..., kv heads, dim] -> [..., query heads, dim]
            return tensor.repeat_interleave(repeats, dim=-2) if repeats > 1 else tensor

        if plan.rebuild or self.views is None:
            shape = (cache.view_rows(batch), cache.capacity, heads * repeats, dim)
            # Uninitialised: rows up to the batch are written whole below, and a later row is
            # written whole (moved or gathered) before any step reads it.
            self.views = [pool.new_empty(shape) for pool in pools]
            for view, pool in zip(self.views, pools, strict=True):
                view[:batch] = widen(pool[cache.block_table].view(batch, -1, heads, dim))
        else:
            for view, pool in zip(self.views, pools, strict=True):
                if plan.move_to is not None:
                    view[plan.move_to] = view[plan.move_from]  # the right side is a copy: moves may chain
                if plan.fill_rows is not None:
                    view[plan.fill_rows] = widen(pool[plan.fill_table].view(len(plan.fill_rows), -1, heads, dim))
        rows = torch.arange(batch, device=key.device)
        self.views[0][rows, cache.positions] = widen(key[0])
        self.views[1][rows, cache.positions] = widen(value[0])
        return (self.views[0][:batch, : cache.longest].transpose(0, 1),
                self.views[1][:batch, : cache.longest].transpose(0, 1), mask)
