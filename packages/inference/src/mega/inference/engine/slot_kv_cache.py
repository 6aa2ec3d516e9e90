"""Decoding with a static KV cache: every decode step has the same shapes, so on CUDA it can be
captured once per batch-size bucket as a CUDA graph and replayed (decoding small batches on a
GPU is bound by kernel launches, not by memory bandwidth).

:class:`SlotKVCache` holds ``[slots, max_length, kv heads, head_dim]`` per layer, allocated
once; a sequence owns one slot (one row) for its life. A forward writes each row's new keys at
that row's own positions and attends over the slot's whole ``max_length`` with an additive mask
(key ``k`` is visible to the row's ``q``-th new token when ``k <= cached + q``). Rows may sit at
different positions, so prompts of any lengths are prefilled together (right-padded: a row's
padding keys are overwritten by its own later tokens before anything attends to them) and
decoded together.

A decode step runs over a *window*, the first ``bucket`` slots, whatever sits in them (a free
slot computes a throw-away row): its shapes depend on the bucket only, and the
tensors the step reads (the window's positions and mask) are updated in place, so
:class:`DecodeGraphs` captures one CUDA graph per bucket and replays it. A speculative verify step
is the same window with K+1 new tokens per row (each row's last token and its drafts, each row at
its own cached length: the mask's causal rule is per row), captured per (bucket, K+1).

The decoder loop (:class:`~mega.inference.engine.continuous.ContinuousBatchingWorker`, through
:class:`~mega.inference.engine.kv_caches.SlotSequenceCache`) gives each running sequence one slot. On
CPU the steps run eagerly (or through torch.compile), which is how the tests check they give the paged cache's
tokens. The CUDA-graph capture follows PyTorch's documented ``torch.cuda.graph`` API and has run on an H200
(issue 35; the verify step's capture, the same code keyed by its width, has not run on a GPU yet).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from mega.core.kernels import AttentionMask
from mega.inference.engine.paged_kv_cache import BlockAllocator
from mega.inference.engine.requests import GenerationError
from mega.inference.engine.sampling import Sampler
from mega.inference.engine.sliding_window_ring import RingLayer, ring_mask_and_writes

if TYPE_CHECKING:
    from mega.inference.engine.generation_engine import GenerationEngine

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def static_kv_cache_wanted(requested: bool | None, device: torch.device, applies: bool, requirement: str) -> bool:
    """``--static-kv-cache`` as ``requested``, or by default on CUDA where it ``applies``: on a
    GPU small decode steps are bound by kernel launches, which the captured graph removes; on
    CPU it brings nothing. Asked for where it cannot run: an error naming the ``requirement``."""
    if requested is None:
        return applies and device.type == "cuda"
    if requested and not applies:
        raise GenerationError(f"--static-kv-cache runs {requirement}")
    return requested


def bucket_for(batch: int) -> int:
    return next((b for b in BUCKETS if b >= batch), batch)


class SlotAllocator(BlockAllocator):
    """The slots of a :class:`SlotKVCache` as one-block tables of ``max_length`` tokens (so the
    continuous batcher admits and frees them as it does paged blocks), the lowest free slot
    first: running sequences stay in a short window, and a decode step runs a small bucket."""

    def free(self, blocks: Sequence[int]) -> None:
        super().free(blocks)
        self._free.sort(reverse=True)  # allocate pops from the end


class SlotKVCache:
    """The model-facing cache (``layer(number)``, ``length``): one slot of ``max_length``
    positions per sequence. Bind the rows of the next forward first: :meth:`bind_window` (the
    first ``n`` slots, in place: what a captured graph reads) or :meth:`bind` (any slots).

    ``windows``: layer number -> its sliding window, for layers whose attention sees only the last
    ``window`` positions: their slots are rings of ``window`` positions
    (:mod:`mega.inference.engine.sliding_window_ring`), so their memory is bounded by the window."""

    def __init__(self, slots: int, max_length: int, device: torch.device, dtype: torch.dtype,
                 windows: dict[int, int] | None = None):
        self.slots, self.max_length, self.device, self.dtype = slots, max_length, device, dtype
        self.windows = {number: window for number, window in (windows or {}).items() if window < max_length}
        self._layers: dict[int, _SlotLayer | RingLayer] = {}
        # (rows, new tokens) -> cached, mask, positions, then each ring's mask and writes
        self._windows: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # window -> mask, writes
        self.rows: torch.Tensor | None = None  # the bound rows' slots; None: the window of the first rows
        self.cached = torch.zeros(0, dtype=torch.long, device=device)
        self.mask_bias: torch.Tensor | None = None
        self.positions = torch.zeros(0, 0, dtype=torch.long, device=device)

    def bind_window(self, cached: torch.Tensor, new_tokens: int) -> None:
        """Slot ``r < len(cached)`` has ``cached[r]`` tokens and brings ``new_tokens``. The
        positions and mask are written into buffers kept per (rows, new tokens)."""
        rows = len(cached)
        if rows > self.slots:
            raise ValueError(f"a window of {rows} rows exceeds the cache's {self.slots} slots")
        fresh = (cached, self._mask(cached, new_tokens), self._positions(cached, new_tokens),
                 *self._ring_tensors(cached, new_tokens, None))
        buffers = self._windows.get((rows, new_tokens))
        if buffers is None:
            buffers = self._windows[(rows, new_tokens)] = tuple(t.clone() for t in fresh)
        else:
            for buffer, tensor in zip(buffers, fresh, strict=True):
                buffer.copy_(tensor)
        self.rows = None
        self._use(buffers)

    def use_window(self, rows: int, new_tokens: int) -> None:
        """Point at the window buffers a captured step last wrote (a replay writes them itself)."""
        self.rows = None
        self._use(self._windows[(rows, new_tokens)])

    def _use(self, buffers: tuple[torch.Tensor, ...]) -> None:
        self.cached, self.mask_bias, self.positions = buffers[:3]
        rings = buffers[3:]
        self.rings = {window: (rings[2 * i], rings[2 * i + 1]) for i, window in enumerate(self._ring_windows())}

    def _ring_windows(self) -> list[int]:
        return sorted(set(self.windows.values()))

    def _ring_tensors(self, cached: torch.Tensor, new_tokens: int, real: torch.Tensor | None) -> list[torch.Tensor]:
        """Each ring window's mask and writes (made once per forward, as the mask is)."""
        return [tensor for window in self._ring_windows()
                for tensor in ring_mask_and_writes(cached, new_tokens, window, real, self.dtype)]

    def bind(self, tables: Sequence[Sequence[int]], cached: Sequence[int], new_tokens: int,
             device: torch.device | None = None, ids: Sequence[int] | None = None,
             real: Sequence[int] | None = None, prefill: bool = False) -> None:
        """The paged cache's signature (a slot is a one-block table), for the continuous batcher's
        prefills: row ``r`` is slot ``tables[r][0]``. ``ids`` and ``prefill`` do not matter here
        (a slot is its own view); ``real`` rows
        need no care in a whole slot (padding keys are overwritten before they are seen, see the
        module); a ring keeps a padded row's own keys only (its padding would overwrite positions
        still seen)."""
        self.rows = torch.tensor([table[0] for table in tables], dtype=torch.long, device=self.device)
        cached = torch.tensor(list(cached), dtype=torch.long, device=self.device)
        own = torch.tensor(list(real), dtype=torch.long, device=self.device) if real is not None else None
        self._use((cached, self._mask(cached, new_tokens), self._positions(cached, new_tokens),
                   *self._ring_tensors(cached, new_tokens, own)))

    def _positions(self, cached: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """``[rows, new]``: where each row's new keys go. Made once per forward, not per layer (on
        a GPU every small op of a decode step is a kernel of its graph). Padding past the end of
        a slot (a long prompt's neighbours) lands on its last position."""
        positions = cached[:, None] + torch.arange(new_tokens, device=self.device)[None, :]
        return positions.clamp_(max=self.max_length - 1)

    def _mask(self, cached: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """``[rows, 1 (heads), new, max_length]``: 0 where key ``k <= cached + q``, else -inf-like."""
        keys = torch.arange(self.max_length, device=self.device)
        queries = torch.arange(new_tokens, device=self.device)
        visible = keys[None, None, :] <= (cached[:, None, None] + queries[None, :, None])
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return bias.masked_fill_(~visible, torch.finfo(self.dtype).min)[:, None]

    @property
    def length(self) -> int:
        return int(self.cached.max())

    @torch.inference_mode()  # the pools are inference tensors (written under the decode loop's inference mode)
    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Slot ``target``'s first ``length`` positions become slot ``source``'s (a shared prompt
        prefix, :mod:`mega.inference.engine.slot_prefix_cache`)."""
        if self.windows:
            raise GenerationError("a ring of a sliding-window layer holds a slot's last positions, not a prefix "
                                  "to share: prefix caching takes whole slots")
        for layer in self._layers.values():
            if layer.keys is not None:
                layer.keys[target, :length] = layer.keys[source, :length]
                layer.values[target, :length] = layer.values[source, :length]

    def layer(self, number: int) -> _SlotLayer | RingLayer:
        layer = self._layers.get(number)
        if layer is None:
            window = self.windows.get(number)
            layer = self._layers[number] = _SlotLayer(self) if window is None else RingLayer(self, window)
        return layer


class _SlotLayer:
    def __init__(self, cache: SlotKVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None  # [slots, max_length, kv heads, head_dim]
        self.values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
        """Store ``key``/``value`` ``[new, rows, kv heads, head_dim]``; return the rows' whole
        slots ``[max_length, rows, heads, dim]`` and the mask that hides what is not theirs yet."""
        cache = self.cache
        new, rows, heads, dim = key.shape
        if self.keys is None:
            shape = (cache.slots, cache.max_length, heads, dim)
            self.keys, self.values = key.new_zeros(shape), value.new_zeros(shape)
        positions = cache.positions
        held = []
        for pool, tensor in ((self.keys, key), (self.values, value)):
            if cache.rows is None:  # the window: a slice, so a captured graph writes the same memory
                window = pool[:rows]
                window.scatter_(1, positions[:, :, None, None].expand(rows, new, heads, dim), tensor.transpose(0, 1))
                held.append(window.transpose(0, 1))
            else:
                pool[cache.rows[:, None], positions] = tensor.transpose(0, 1)
                held.append(pool[cache.rows].transpose(0, 1))
        return held[0], held[1], AttentionMask(bias=cache.mask_bias)


class DecodeGraphs:
    """The forwards over the cache's window of the first ``n`` slots (``n`` a bucket), from
    ``tokens [n, new]`` and ``cached [n]``: a decode step (one new token; :meth:`__call__` gives
    fp32 logits ``[n, vocab]``, :meth:`greedy` each slot's most likely token ``[n]``, the sampler's
    :meth:`~mega.inference.engine.sampling.Sampler.greedy_choice` computed inside the step) and a
    speculative verify step (K+1 new tokens, each row's last token and its drafts: :meth:`verify`,
    every position's logits or most likely token). With ``use_cuda_graphs`` each kind of step is
    captured once per (``n``, new tokens), the window's positions and mask included, and replayed
    after: a replay is two copies (into the static tokens and cached lengths) and one launch."""

    def __init__(self, engine: GenerationEngine, cache: SlotKVCache, use_cuda_graphs: bool,
                 compile_backend: str | Callable | None = None):
        self.engine, self.cache, self.use_cuda_graphs = engine, cache, use_cuda_graphs
        self._graphs: dict[tuple[int, int, bool], tuple] = {}  # (rows, new tokens, greedy) -> graph and buffers
        self._pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None  # graphs share memory
        # --compile: the step's forward through torch.compile (fused kernels, which a captured
        # graph then replays). Only the fixed-shape steps: their shapes change with the bucket (and
        # decode or verify) alone (the batch dimension turns dynamic at the second bucket), where
        # prefills of every prompt length would recompile without end.
        # The engine compiles its forward once (GenerationEngine.compiled_forward), for every worker.
        self._forward = engine.forward if compile_backend is None else engine.compiled_forward(compile_backend)
        self.compile_backend = compile_backend

    @torch.inference_mode()  # the pools are inference tensors, as under the decode loops
    def warm_up(self, new_tokens: int = 1) -> None:
        """Run every window size the cache can decode (``new_tokens`` 1) or verify (K+1), greedy
        and not, before the first request, so each compiles (``--compile``) and, on CUDA, is
        captured now: compiling takes seconds that would otherwise stall the first requests of each
        size. Every row is a free slot at its last position, what a step computes for a free slot
        anyway."""
        device = self.engine.device
        windows = sorted({min(bucket, self.cache.slots) for bucket in BUCKETS})
        warmed = {(self.compile_backend, rows, new_tokens) for rows in windows}
        if not self.use_cuda_graphs and warmed <= self.engine.warmed_windows:
            return  # an earlier worker over this engine compiled them all, and there is nothing to capture
        for number, rows in enumerate(windows):
            if self.engine.lora is not None:  # served LoRA adapters: every row the base's
                self.engine.lora.bind([0] * rows)
            tokens = torch.zeros(rows, new_tokens, dtype=torch.long, device=device)
            cached = torch.full((rows,), self.cache.max_length - 1, dtype=torch.long, device=device)
            if number == 0:  # an eager step first allocates the pools, outside what compiles
                self.cache.bind_window(cached, new_tokens)
                self.engine.forward(tokens, self.cache.positions, self.cache, new_tokens)
            self._run(tokens, cached, greedy=True)
            self._run(tokens, cached, greedy=False)
        self.engine.warmed_windows |= warmed

    def _eager(self, tokens: torch.Tensor, cached: torch.Tensor, greedy: bool) -> torch.Tensor:
        new = tokens.shape[1]
        self.cache.bind_window(cached, new)
        # The window's positions (clamped at a slot's end: a free slot's K+1 verify tokens past it).
        logits = self._forward(tokens, self.cache.positions, self.cache, new)  # [new, rows, vocab]
        return Sampler.greedy_choice(logits) if greedy else logits

    def __call__(self, tokens: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        logits = self._run(tokens, cached, greedy=False)[0]
        return logits.clone() if self.use_cuda_graphs else logits  # the graph's buffer is rewritten

    def greedy(self, tokens: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        """Each slot's greedy token; on CUDA a view of the graph's output, valid until the next
        step (feeding it back as the next ``tokens`` is safe: it is copied in first)."""
        return self._run(tokens, cached, greedy=True)[0]

    def verify(self, tokens: torch.Tensor, cached: torch.Tensor, greedy: bool) -> torch.Tensor:
        """A verify step over ``tokens`` ``[n, K+1]``: fp32 logits ``[K+1, n, vocab]``, or with
        ``greedy`` each position's most likely token ``[K+1, n]`` (on CUDA a view of the graph's
        output, valid until the next step)."""
        out = self._run(tokens, cached, greedy)
        return out.clone() if self.use_cuda_graphs and not greedy else out

    def _run(self, tokens: torch.Tensor, cached: torch.Tensor, greedy: bool) -> torch.Tensor:
        if not self.use_cuda_graphs:
            return self._eager(tokens, cached, greedy)
        key = (len(cached), tokens.shape[1], greedy)
        if key not in self._graphs:
            self._graphs[key] = self._capture(tokens, cached, greedy)
        graph, static_tokens, static_cached, output = self._graphs[key]
        static_tokens.copy_(tokens)
        static_cached.copy_(cached)
        graph.replay()
        self.cache.use_window(len(cached), tokens.shape[1])
        return output

    def _capture(self, tokens: torch.Tensor, cached: torch.Tensor, greedy: bool) -> tuple:
        # The warm-up runs the real step (it writes the keys the replay writes again), so the
        # slots of running sequences in the window are never touched with anything else.
        static_tokens, static_cached = tokens.clone(), cached.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._eager(static_tokens, static_cached, greedy)  # allocates the cache's pools outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._eager(static_tokens, static_cached, greedy)
        return graph, static_tokens, static_cached, output
