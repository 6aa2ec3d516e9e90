"""The KV caches the decoder loop runs on, behind one interface.

:class:`PagedSequenceCache` (:mod:`.paged_kv_cache`): blocks shared by sequences of any lengths, memory
following the tokens held. :class:`SlotSequenceCache` (:mod:`.slot_kv_cache`): a slot of the model's
whole length per sequence, so a decode step has fixed shapes per batch-size bucket and, on CUDA,
replays a captured graph (``--static-kv-cache``, the default on CUDA). :class:`RecurrentSequenceCache`
(:mod:`.recurrent_state_cache`): the paged cache with a fixed-size state per sequence for the
recurrent layers of a model that has them (Qwen3-Next's Gated DeltaNet).

The loop (:class:`~mega.inference.engine.continuous.ContinuousBatchingWorker`) sees only what
both give: an ``allocator`` that admits a sequence (blocks, or a slot as a one-block table) and
frees it, :meth:`SequenceCache.forward` for any new tokens of some sequences (every prefill, whole
or chunked), and :meth:`SequenceCache.decode` for one new token of every decoding sequence (which
a slot cache's captured step may choose itself: :attr:`SequenceCache.chooses_on_device`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mega.inference.engine.host_copy import to_device
from mega.inference.engine.lora_registry import slot_of
from mega.inference.engine.paged_kv_cache import BlockAllocator, PagedKVCache
from mega.inference.engine.paged_window_cache import (
    WindowedBlockAllocator,
    WindowedPagedKVCache,
    ring_blocks_for,
)
from mega.inference.engine.prefix_cache import PrefixCachingAllocator
from mega.inference.engine.recurrent_state_cache import RecurrentStateCache, StateSlotAllocator
from mega.inference.engine.sampling import Sampler
from mega.inference.engine.slot_kv_cache import DecodeGraphs, SlotAllocator, SlotKVCache, bucket_for
from mega.inference.engine.slot_prefix_cache import PrefixCachingSlotAllocator


class SequenceCache:
    """The KV cache as the loop's sequences see it: the model-facing ``cache`` (a
    :class:`PagedKVCache` or a :class:`SlotKVCache`) and the ``allocator`` of its blocks (or
    slots). A sequence it runs has ``blocks`` (its table) and ``cached`` (tokens whose keys are
    stored)."""

    chooses_on_device = False  # whether decode(greedy=True) may give the tokens instead of logits
    graphs: DecodeGraphs | None = None
    # Called after each forward with (sequences, their cached counts before it, real): the MTP
    # proposer (speculative drafts from the model's own hidden states) learns which positions
    # the forward computed for whom.
    observer: Callable[[Sequence, list[int], list[int] | None], None] | None = None

    def __init__(self, engine, cache, allocator: BlockAllocator):
        self.engine, self.cache, self.allocator = engine, cache, allocator

    @property
    def prefix_caching(self) -> bool:
        return isinstance(self.allocator, (PrefixCachingAllocator, PrefixCachingSlotAllocator))

    def forward(self, sequences: Sequence, tokens: torch.Tensor, logits_to_keep: int | torch.Tensor | None,
                real: list[int] | None = None, prefill: bool = False) -> torch.Tensor:
        """Fp32 logits ``[kept, batch, vocab]`` of ``tokens`` ``[batch, new]`` continuing each
        sequence (``real``: right-padded prompts, row ``r``'s own tokens; ``prefill``: prompt
        tokens, one per row or more; see :meth:`PagedKVCache.bind`); each sequence's ``cached``
        moves past them."""
        device = self.engine.device
        if self.engine.lora is not None:  # each row its LoRA adapter
            self.engine.lora.bind([slot_of(s) for s in sequences])
        cached = [s.cached for s in sequences]
        self.cache.bind([s.blocks for s in sequences], cached, tokens.shape[1], device, [s.number for s in sequences],
                        real, prefill)
        positions = torch.tensor(cached, device=device)[:, None] + torch.arange(tokens.shape[1], device=device)
        if real is not None:
            # A right-padded row's padding takes its last real position: its outputs and keys are
            # dropped, and RoPE kinds that read the row's length (dynamic NTK) see the row's own.
            last = torch.tensor([c + r - 1 for c, r in zip(cached, real, strict=True)], device=device)
            positions = torch.minimum(positions, last[:, None])
        logits = self.engine.forward(tokens, positions, self.cache, logits_to_keep)
        if self.observer is not None:
            self.observer(sequences, cached, real)
        for row, sequence in enumerate(sequences):
            sequence.cached += tokens.shape[1] if real is None else real[row]
        return logits

    def decode(self, decoding: Sequence, prefilling: Sequence, fed: torch.Tensor, greedy: bool) -> torch.Tensor:
        """One new token for each of ``decoding`` (``fed`` ``[rows]``, still on the device): fp32
        logits ``[rows, vocab]``, or with ``greedy`` the chosen tokens ``[rows]``. ``prefilling``:
        the sequences admitted whose prompts are not all cached yet."""
        return self.forward(decoding, fed[:, None], 1)[0]

    def verify(self, decoding: Sequence, fed: torch.Tensor, greedy: bool) -> torch.Tensor:
        """A speculative verify step: ``fed`` ``[rows, K+1]`` (each row's last token and its drafts)
        continuing each of ``decoding``, in one forward whatever the rows' cached lengths (each
        row's new tokens see its own keys by its own causal rule, in either cache's mask). Fp32
        logits ``[K+1, rows, vocab]``, or with ``greedy`` each position's most likely token
        ``[K+1, rows]``; each sequence's ``cached`` moves past all K+1 (the caller rolls it back to
        the tokens kept)."""
        logits = self.forward(decoding, fed, None)
        return Sampler.greedy_choice(logits) if greedy else logits

    def expect_verify(self, new_tokens: int) -> None:
        """Verify steps of ``new_tokens`` (K+1) will run (a cache that compiles its steps compiles
        them now)."""


class PagedSequenceCache(SequenceCache):
    def __init__(self, engine, max_batch_size: int, max_num_tokens: int, block_size: int, prefix_caching: bool):
        allocator_class = PrefixCachingAllocator if prefix_caching else BlockAllocator
        allocator = allocator_class(max(1, max_num_tokens // block_size), block_size)
        super().__init__(engine, PagedKVCache(allocator, max_batch_size, engine.kv_head_repeats), allocator)


class WindowedSequenceCache(SequenceCache):
    """The paged cache of a model with sliding-window layers (``engine.layer_windows``): their keys
    in rings of the window plus ``rolled_back`` positions (speculative decoding's drafts) per
    sequence, on a pool of ``max_batch_size`` rings. Never prefix caching: a cached prefix's keys
    behind the window are gone from its rings."""

    def __init__(self, engine, max_batch_size: int, max_num_tokens: int, block_size: int, rolled_back: int = 0):
        windows = engine.layer_windows
        num_blocks = max(1, max_num_tokens // block_size)
        ring_blocks = ring_blocks_for(windows, block_size, rolled_back)
        allocator = WindowedBlockAllocator(num_blocks, block_size, min(num_blocks, max_batch_size * ring_blocks),
                                           ring_blocks)
        cache = WindowedPagedKVCache(allocator, windows, max_batch_size, engine.kv_head_repeats)
        super().__init__(engine, cache, allocator)


class RecurrentSequenceCache(SequenceCache):
    """The paged cache with a recurrent-state slot per sequence, for a model with recurrent layers
    (``model.recurrent_layers``; :mod:`.recurrent_state_cache`): never prefix caching."""

    def __init__(self, engine, max_batch_size: int, max_num_tokens: int, block_size: int):
        allocator = StateSlotAllocator(max(1, max_num_tokens // block_size), block_size, max_batch_size)
        cache = RecurrentStateCache(allocator, engine.model.recurrent_layers, max_batch_size, engine.kv_head_repeats)
        super().__init__(engine, cache, allocator)


class SlotSequenceCache(SequenceCache):
    """``slots`` slots of the engine's positions; decode steps over the window of the first slots
    up to a bucket, through :class:`DecodeGraphs` (captured on CUDA with ``use_cuda_graphs``,
    compiled with ``compile_backend``)."""

    chooses_on_device = True

    def __init__(self, engine, slots: int, block_size: int, prefix_caching: bool, use_cuda_graphs: bool | None = None,
                 compile_backend: str | Callable | None = None, rolls_back: bool = False):
        # Sliding-window layers keep rings of their window: not with prefix caching, which copies
        # whole slots' prefixes, nor where rejected drafts roll a slot back (``rolls_back``, speculative
        # decoding: a ring has overwritten the positions the rolled-back slot still sees).
        windows = {} if prefix_caching or rolls_back else engine.layer_windows
        cache = SlotKVCache(slots, engine.max_positions, engine.device, engine.dtype, windows)
        allocator = (PrefixCachingSlotAllocator(cache, block_size) if prefix_caching
                     else SlotAllocator(slots, engine.max_positions))
        super().__init__(engine, cache, allocator)
        graphs = engine.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.graphs = DecodeGraphs(engine, cache, graphs, compile_backend)
        self.verify_tokens = 0  # K+1 of the speculative verify steps (expect_verify)
        if compile_backend is not None:  # compiled now, not while the first requests wait
            self.graphs.warm_up()

    def decode(self, decoding: Sequence, prefilling: Sequence, fed: torch.Tensor, greedy: bool) -> torch.Tensor:
        tokens, rows, cached = self._window(decoding, prefilling, 1)
        tokens[rows, 0] = fed
        if greedy:  # gathered from the step's output before the next step rewrites it
            return self.graphs.greedy(tokens, cached)[rows]
        return self.graphs(tokens, cached)[rows]

    def verify(self, decoding: Sequence, fed: torch.Tensor, greedy: bool) -> torch.Tensor:
        # The decode step's window with K+1 new tokens per row: one fixed-shape forward per
        # (bucket, K+1), captured on CUDA. MTP drafts read the target's hidden states through a
        # forward hook, which a graph replay does not run: with an observer, one eager forward.
        if self.observer is not None:
            return super().verify(decoding, fed, greedy)
        # Fewer drafts than K (a row near its token limit) still run the K+1 step, its last
        # columns a padding nobody reads, where every slot has room for it: one shape (one graph,
        # one compilation) per bucket.
        new = fed.shape[1]
        width = new
        if self.verify_tokens > new and max(s.cached for s in decoding) + self.verify_tokens <= self.cache.max_length:
            width = self.verify_tokens
        tokens, rows, cached = self._window(decoding, (), width)
        tokens[rows, :new] = fed
        for sequence in decoding:
            sequence.cached -= width - new
        return self.graphs.verify(tokens, cached, greedy)[:new, rows]

    def expect_verify(self, new_tokens: int) -> None:
        self.verify_tokens = new_tokens
        if self.graphs.compile_backend is not None and self.observer is None:  # compiled now, as the decode steps
            self.graphs.warm_up(new_tokens)

    def _window(self, decoding: Sequence, prefilling: Sequence, new_tokens: int):
        """A step of ``new_tokens`` per row over the window of the first slots, up to a bucket
        (see slot_kv_cache): the window's tokens ``[window, new]`` (zeros, for the caller to fill),
        the decoding sequences' rows in it and every row's cached length, on the device; each
        decoding sequence's ``cached`` moves past its new tokens. Slots in the window that no
        sequence decodes compute a row nobody reads, at the slot's last position (a free slot's
        cached prefix, slot_prefix_cache, stays intact). Those admitted (``prefilling``: their
        prompts part cached or not) have it write at their next position, which their prefill
        overwrites after this step (their ring, on a sliding-window layer, holds no later
        positions; without rings, as under speculation, the slot's last position does as well)."""
        device, cache = self.engine.device, self.cache
        slots = [s.blocks[0] for s in decoding]
        window = min(bucket_for(max(slots) + 1), cache.slots)
        cached = [cache.max_length - 1] * window
        for sequence in prefilling:
            if sequence.blocks[0] < window:
                cached[sequence.blocks[0]] = sequence.cached
        for slot, sequence in zip(slots, decoding, strict=True):
            cached[slot] = sequence.cached
            sequence.cached += new_tokens
        if self.engine.lora is not None:  # each row its LoRA adapter; the base's for rows nobody reads
            adapters = [0] * window
            for slot, sequence in zip(slots, decoding, strict=True):
                adapters[slot] = slot_of(sequence)
            self.engine.lora.bind(adapters)
        tokens = torch.zeros(window, new_tokens, dtype=torch.long, device=device)
        return tokens, to_device(slots, device), to_device(cached, device)
