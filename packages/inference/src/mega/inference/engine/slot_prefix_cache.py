"""Prefix caching for the static KV cache: a slot keeps the keys of its prompt after its
sequence ends, and a later prompt that starts with the same tokens has them copied into its own
slot and prefills only the rest.

The paged cache shares blocks (:mod:`mega.inference.engine.prefix_cache`); a static cache slot is one
sequence's whole length and cannot be shared, but copying a prefix's keys and values from one
slot to another is one device copy per layer, far cheaper than the prefill it replaces. So a
slot's prompt is indexed by the same keys as the paged cache's (the SHA-256 chain of each full
``block_size``-token block, :func:`~mega.inference.engine.prefix_cache.prefix_keys`): while its
sequence runs (its prompt's positions are never written again) and after it ends, until the slot
is taken by another sequence. Free slots are taken lowest first, so the slot that held a prefix
the longest is forgotten last among the free ones.

A decode step's window computes a throw-away row for every free slot in it; the continuous
batcher puts that row at the slot's last position, which no indexed block covers, so a free
slot's prefix stays intact.
"""

from __future__ import annotations

from collections.abc import Sequence

from mega.inference.engine.slot_kv_cache import SlotAllocator, SlotKVCache


class PrefixCachingSlotAllocator(SlotAllocator):
    """The slots of ``cache`` with an index of the prompt prefixes their keys hold."""

    def __init__(self, cache: SlotKVCache, block_size: int):
        super().__init__(cache.slots, cache.max_length)
        self.cache, self.prefix_block = cache, block_size
        self._holders: dict[bytes, dict[int, None]] = {}  # key -> the slots holding its prefix
        self._keys_of: dict[int, list[bytes]] = {}
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached
        self.evicted_blocks = 0  # indexed blocks forgotten when their slot was taken

    def allocate_with_prefix(self, keys: Sequence[bytes], prompt_length: int, tokens: int) -> tuple[list[int], int] | None:
        """A slot for a sequence of ``tokens`` whose prompt's block keys are ``keys``, holding the
        longest cached prefix of it (copied from the slot that holds it; at least two prompt
        tokens left to prefill, as for the paged cache); and how many tokens are cached. None: no
        free slot now."""
        if not self.can_hold(tokens):
            return None
        slot = self._free[-1]  # the one allocate takes
        usable = max(prompt_length - 2, 0) // self.prefix_block
        source, matched = None, 0
        for depth, key in enumerate(keys[:usable], start=1):
            holders = self._holders.get(key)
            if not holders:
                break
            source, matched = (slot if slot in holders else next(iter(holders))), depth
        [taken] = self.allocate(tokens)
        cached = matched * self.prefix_block
        if source is not None and source != taken:
            self.cache.copy_prefix(source, taken, cached)
        self.queried_tokens += prompt_length
        self.hit_tokens += cached
        if source == taken:  # its own keys stay where they are: index them again
            self.register(keys[:matched], [taken])
            self.evicted_blocks -= matched
        return [taken], cached

    def allocate(self, tokens: int) -> list[int]:
        slots = super().allocate(tokens)
        for slot in slots:
            self._forget(slot)
        return slots

    def register(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Index a prefilled prompt's full blocks, held by its slot ``blocks[0]``; not a block
        that reaches the slot's last position (a throw-away row writes there)."""
        [slot] = blocks
        keys = list(keys[: (self.cache.max_length - 1) // self.prefix_block])
        self._forget(slot, evicted=False)
        self._keys_of[slot] = keys
        for key in keys:
            self._holders.setdefault(key, {})[slot] = None

    def _forget(self, slot: int, evicted: bool = True) -> None:
        for key in self._keys_of.pop(slot, []):
            holders = self._holders[key]
            del holders[slot]
            if not holders:
                del self._holders[key]
            self.evicted_blocks += evicted
