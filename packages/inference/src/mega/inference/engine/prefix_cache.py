"""Prefix caching for the paged KV cache: a block that holds a prompt's full ``block_size``
tokens is keyed by the hash of every token up to its end, so a later prompt that starts with
the same tokens takes the block as it is and prefills only the rest.

:class:`PrefixCachingAllocator` is the paged cache's :class:`~mega.inference.engine.paged_kv_cache.BlockAllocator`
with reference counts: a block is shared by every running sequence whose prompt starts with its
prefix, and one nobody holds stays cached (its keys intact) until its space is needed, the least
recently released first. Keys are SHA-256 chains (a block's key hashes its parent's key and its
own tokens), so two prefixes never share a block by a hash collision in practice, and a block
matches only where every earlier block matched too.

A shared block is never written: a sequence writes its keys from its first uncached position on,
into blocks of its own. At least two prompt tokens are always prefilled (the last one's logits
start the generation; two keep the prefill off the decode path), and a request that wants its
prompt's log-probabilities prefills the whole prompt (the cached part has no logits to give).
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence

from mega.inference.engine.paged_kv_cache import BlockAllocator, CacheFullError


def prefix_keys(prompt: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The key of each of ``prompt``'s full blocks: the hash of every token up to its end (after
    ``salt``: what else its keys depend on, a LoRA adapter)."""
    keys, parent = [], salt
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", prompt[start: start + block_size]).tobytes()).digest()
        keys.append(parent)
    return keys


class PrefixCachingAllocator(BlockAllocator):
    """Blocks with reference counts and a prefix index; unreferenced indexed blocks are evicted
    least recently used first when a sequence needs room."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self._references = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached
        self.evicted_blocks = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self._block_of)

    def match(self, keys: Sequence[bytes], prompt_length: int) -> list[int]:
        """The cached blocks ``prompt``'s first blocks can share (not yet taken), leaving at
        least one prompt token to prefill (its logits choose the first new token)."""
        usable = max(prompt_length - 1, 0) // self.block_size
        matched = []
        for key in keys[:usable]:
            block = self._block_of.get(key)
            if block is None:
                break
            matched.append(block)
        return matched

    def allocate_with_prefix(self, keys: Sequence[bytes], prompt_length: int, tokens: int) -> tuple[list[int], int] | None:
        """Blocks for a sequence of ``tokens`` whose prompt's block keys are ``keys``: the cached
        blocks it shares, then new ones; and how many tokens are cached. None: no room now."""
        matched = self.match(keys, prompt_length)
        needed = self.blocks_for(tokens) - len(matched)
        idle_matched = sum(1 for block in matched if block in self._evictable)
        if needed > self.free_blocks - idle_matched:
            return None
        for block in matched:
            self._evictable.pop(block, None)
            self._references[block] += 1
        self.queried_tokens += prompt_length
        self.hit_tokens += len(matched) * self.block_size
        return matched + self.allocate(needed * self.block_size), len(matched) * self.block_size

    def allocate(self, tokens: int) -> list[int]:
        count = self.blocks_for(tokens)
        if count > self.free_blocks:
            raise CacheFullError(f"{tokens} tokens need {count} blocks; {self.free_blocks} are free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:  # reuse the least recently released cached block: its prefix is forgotten
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.evicted_blocks += 1
            self._references[block] = 1
            blocks.append(block)
        return blocks

    def register(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Index a prefilled prompt's full blocks (``blocks[i]`` holds the tokens of ``keys[i]``);
        a prefix already indexed keeps its block."""
        for key, block in zip(keys, blocks, strict=False):
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key], self._key_of[block] = block, key

    def free(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self._references[block] -= 1
            if self._references[block] > 0:
                continue
            if block in self._key_of:
                self._evictable[block] = None  # cached for a later prompt, until its space is needed
            else:
                self._free.append(block)
