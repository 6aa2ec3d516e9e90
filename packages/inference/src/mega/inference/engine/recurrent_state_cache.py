"""The cache of a model with recurrent layers (Qwen3-Next's Gated DeltaNet beside its full
attention): each sequence owns a fixed-size state per recurrent layer, slot-indexed, beside the
paged keys and values of its attention layers.

A recurrent layer's state (the convolution's last inputs and the delta rule's matrix, see
:mod:`mega.models.qwen3_next.gated_delta_net`) does not grow with the sequence: one slot per
running sequence holds it, from its first prefill to its end. :class:`StateSlotAllocator` hands a
sequence a slot with its blocks and takes it back with them, so the decoder loop
(:class:`~mega.inference.engine.continuous.ContinuousBatchingWorker`) admits and frees sequences as
for any paged cache. :class:`RecurrentStateCache` is the paged cache whose ``layer(n)`` is, for a
recurrent layer, that layer's state pools; a sequence's first forward (nothing cached) starts from
zeros, and right-padded prompts prefilled together keep only their own tokens' state (the layer
reads ``real_lengths``).

What a recurrent state cannot do is refused or turned off here, by name: sharing a cached
prompt prefix (the state after a prefix is not kept per block), the static slot cache's decode
window (a step over slots nobody decodes would advance their states), and speculative decoding
(a rejected draft cannot be taken back out of a state).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mega.inference.engine.paged_kv_cache import BlockAllocator, CacheFullError, PagedKVCache

log = logging.getLogger(__name__)

WHO = "models with recurrent linear-attention layers (the qwen3-next family)"


class StateSlotAllocator(BlockAllocator):
    """Blocks for the attention layers' keys, and one state slot per sequence (of ``slots``),
    known by the sequence's first block."""

    def __init__(self, num_blocks: int, block_size: int, slots: int):
        super().__init__(num_blocks, block_size)
        self.slots = slots
        self._free_slots = list(range(slots - 1, -1, -1))
        self.slot_of: dict[int, int] = {}

    def can_hold(self, tokens: int) -> bool:
        return bool(self._free_slots) and super().can_hold(tokens)

    def allocate(self, tokens: int) -> list[int]:
        if not self._free_slots:
            raise CacheFullError(f"all {self.slots} recurrent-state slots are taken")
        blocks = super().allocate(max(tokens, 1))
        self.slot_of[blocks[0]] = self._free_slots.pop()
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        if blocks:
            self._free_slots.append(self.slot_of.pop(blocks[0]))
        super().free(blocks)


class RecurrentStateCache(PagedKVCache):
    """The paged cache, and the state pools of the layers numbered ``recurrent_layers``."""

    def __init__(self, allocator: StateSlotAllocator, recurrent_layers: Sequence[int], max_rows: int = 0,
                 head_repeats: int = 1):
        super().__init__(allocator, max_rows, head_repeats)
        self.recurrent_layers = frozenset(recurrent_layers)
        self._states: dict[int, LayerRecurrentState] = {}
        self.state_rows = self.fresh = self.real_lengths = None

    def bind(self, tables, cached, new_tokens, device, ids=None, real=None, prefill=False) -> None:
        super().bind(tables, cached, new_tokens, device, ids, real, prefill)
        self.state_rows = torch.tensor([self.allocator.slot_of[table[0]] for table in tables], device=device)
        self.fresh = torch.tensor([count == 0 for count in cached], device=device)
        self.real_lengths = None if real is None else torch.tensor(list(real), device=device)

    def layer(self, number: int):
        if number not in self.recurrent_layers:
            return super().layer(number)
        state = self._states.get(number)
        if state is None:
            state = self._states[number] = LayerRecurrentState(self)
        return state


class LayerRecurrentState:
    """One recurrent layer's pools ``[slots, ...]``, made at its first read with the shapes the
    layer asks (a tensor-parallel rank's own heads); the delta rule's state in fp32."""

    def __init__(self, cache: RecurrentStateCache):
        self.cache = cache
        self.conv: torch.Tensor | None = None
        self.state: torch.Tensor | None = None

    @property
    def real_lengths(self) -> torch.Tensor | None:
        return self.cache.real_lengths

    def read(self, conv_shape: tuple[int, ...], state_shape: tuple[int, ...],
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rows, fresh = self.cache.state_rows, self.cache.fresh
        if self.conv is None:
            slots = self.cache.allocator.slots
            self.conv = torch.zeros(slots, *conv_shape[1:], dtype=dtype, device=rows.device)
            self.state = torch.zeros(slots, *state_shape[1:], dtype=torch.float32, device=rows.device)
        conv, state = self.conv[rows], self.state[rows]
        if bool(fresh.any()):  # a sequence's first forward: whatever its slot held before is not its own
            conv = conv.masked_fill(fresh[:, None, None], 0)
            state = state.masked_fill(fresh[:, None, None, None], 0)
        return conv, state

    def write(self, conv: torch.Tensor, state: torch.Tensor) -> None:
        rows = self.cache.state_rows
        self.conv[rows] = conv.to(self.conv.dtype)
        self.state[rows] = state.float()


def recurrent_cache_options(static_cache: bool, prefix_caching: bool, speculator) -> None:
    """What the loop's options ask that a recurrent state cannot give (see the module)."""
    if speculator is not None:
        raise ValueError(f"speculative decoding (--num-speculative-tokens) is not supported for {WHO}: "
                         "a rejected draft token cannot be taken back out of a recurrent state")
    if static_cache:
        log.warning("the static KV cache (--static-kv-cache) is not used for %s: their recurrent states "
                    "decode on the paged cache", WHO)
    if prefix_caching:
        log.info("prefix caching is off for %s: a recurrent state after a prompt prefix is not kept", WHO)
