"""Decoding with a static KV cache: every decode step has the same shapes, so on CUDA it can be
captured once per batch-size bucket as a CUDA graph and replayed (decoding small batches on a
GPU is bound by kernel launches, not by memory bandwidth).

:class:`StaticKVCache` holds ``[slots, max_length, kv heads, head_dim]`` per layer, allocated
once; a step writes each row's new keys at that row's own positions and attends over the whole
``max_length`` with an additive mask (key ``k`` is visible to the row's ``q``-th new token when
``k <= cached + q``). Rows may sit at different positions, so prompts of any lengths are
prefilled together (right-padded; the padding is never attended) and decoded together.

:class:`StaticDecoder` runs greedy or sampled decoding on it. ``use_cuda_graphs`` (default: on
CUDA only) captures the decode step per bucket; on CPU the same step runs eagerly, which is how
the tests check it gives the lock-step engine's tokens. NOTE: the CUDA-graph capture has been
written against PyTorch's documented ``torch.cuda.graph`` API but not yet run (no GPU was
available); the static-cache step itself is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mega.core.kernels import AttentionMask
from mega.inference.engine import GenerationEngine, GenerationRequest, GenerationResult
from mega.inference.sampling import Sampler

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class StaticKVCache:
    def __init__(self, slots: int, max_length: int, device: torch.device):
        self.slots, self.max_length, self.device = slots, max_length, device
        self._layers: dict[int, _StaticLayer] = {}
        # Updated in place before each step (a captured graph reads these very tensors).
        self.cached = torch.zeros(slots, dtype=torch.long, device=device)
        self.mask_bias: torch.Tensor | None = None
        self.new_tokens = 0

    def bind(self, cached: torch.Tensor, new_tokens: int, dtype: torch.dtype) -> None:
        """Row ``r`` has ``cached[r]`` tokens and brings ``new_tokens``; the mask follows."""
        self.cached.copy_(cached)
        keys = torch.arange(self.max_length, device=self.device)
        queries = torch.arange(new_tokens, device=self.device)
        visible = keys[None, None, :] <= (self.cached[:, None, None] + queries[None, :, None])  # [b, q, k]
        bias = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(~visible, torch.finfo(dtype).min)
        if self.mask_bias is None or self.mask_bias.shape != bias[:, None].shape:
            self.mask_bias = bias[:, None]  # [b, 1 (heads), q, k]
        else:
            self.mask_bias.copy_(bias[:, None])
        self.new_tokens = new_tokens

    @property
    def length(self) -> int:
        return int(self.cached.max())

    def layer(self, number: int) -> _StaticLayer:
        layer = self._layers.get(number)
        if layer is None:
            layer = self._layers[number] = _StaticLayer(self)
        return layer


class _StaticLayer:
    def __init__(self, cache: StaticKVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor):
        cache = self.cache
        new, batch, heads, dim = key.shape
        if self.keys is None:
            shape = (cache.slots, cache.max_length, heads, dim)
            self.keys, self.values = key.new_zeros(shape), value.new_zeros(shape)
        positions = (cache.cached[:, None] + torch.arange(new, device=key.device)[None, :]).clamp_(max=cache.max_length - 1)
        index = positions[:, :, None, None].expand(batch, new, heads, dim)
        self.keys.scatter_(1, index, key.transpose(0, 1))
        self.values.scatter_(1, index, value.transpose(0, 1))
        return self.keys.transpose(0, 1), self.values.transpose(0, 1), AttentionMask(bias=cache.mask_bias)


def bucket_for(batch: int) -> int:
    return next((b for b in BUCKETS if b >= batch), batch)


class StaticDecoder:
    """Generates a batch with a :class:`StaticKVCache` (no stop strings or logprobs: the fast
    path for plain decoding); ``use_cuda_graphs`` replays a captured decode step per bucket."""

    def __init__(self, engine: GenerationEngine, use_cuda_graphs: bool | None = None):
        self.engine = engine
        self.use_cuda_graphs = engine.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._graphs: dict[int, tuple] = {}

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        engine, device = self.engine, self.engine.device
        for request in requests:
            engine.check(request)
        slots = bucket_for(len(requests))
        cache = StaticKVCache(slots, engine.max_positions, device)
        dtype = next(engine.model.parameters()).dtype
        lengths = [len(r.prompt) for r in requests]
        longest = max(lengths)
        prompts = torch.zeros(slots, longest, dtype=torch.long, device=device)
        for row, request in enumerate(requests):
            prompts[row, : len(request.prompt)] = torch.tensor(request.prompt)
        # Prefill every row at once (right-padded; a row's padding keys are overwritten by its own
        # later tokens before anything attends to them).
        cache.bind(torch.zeros(slots, dtype=torch.long, device=device), longest, dtype)
        positions = torch.arange(longest, device=device)[None, :].expand(slots, longest)
        logits = engine.model(prompts, positions, inference_cache=cache)
        rows = torch.arange(len(requests), device=device)
        last = logits[torch.tensor(lengths, device=device) - 1, rows][:, : engine.vocab_size].float()
        cached = torch.tensor(lengths + [0] * (slots - len(requests)), device=device)
        sampler = Sampler([r.sampling for r in requests], device)
        generated: list[list[int]] = [[] for _ in requests]
        finish = [None if r.max_new_tokens else "length" for r in requests]
        step = self._step_function(cache, slots, dtype)
        while any(reason is None for reason in finish):
            drawing = [reason is None for reason in finish]
            chosen = sampler.sample(last, drawing)
            sampler.observe(chosen, drawing)
            for row, token in enumerate(chosen.tolist()):
                if finish[row] is not None:
                    continue
                generated[row].append(token)
                request = requests[row]
                if engine.stop_checker.should_stop(request.stop, generated[row]):
                    finish[row] = "stop"
                elif len(generated[row]) >= request.max_new_tokens:
                    finish[row] = "length"
            if all(reason is not None for reason in finish):
                break
            tokens = torch.zeros(slots, 1, dtype=torch.long, device=device)
            tokens[: len(requests), 0] = chosen
            last = step(tokens, cached)[: len(requests)]
            cached = cached + 1
        return [GenerationResult(tokens=list(r.prompt) + g, prompt_length=len(r.prompt), finish_reason=reason)
                for r, g, reason in zip(requests, generated, finish, strict=True)]

    def _step_function(self, cache: StaticKVCache, slots: int, dtype: torch.dtype):
        """``step(tokens [slots, 1], cached [slots]) -> fp32 logits [slots, vocab]``."""
        engine = self.engine

        def eager(tokens: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
            cache.bind(cached, 1, dtype)
            logits = engine.model(tokens, cached[:, None], inference_cache=cache, logits_to_keep=1)
            return logits[-1, :, : engine.vocab_size].float()

        if not self.use_cuda_graphs:
            return eager
        # CUDA: capture one decode step on static input buffers, replay it for every step after.
        static_tokens = torch.zeros(slots, 1, dtype=torch.long, device=engine.device)
        static_cached = torch.zeros(slots, dtype=torch.long, device=engine.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager(static_tokens, static_cached)  # warm-up allocates the caches' buffers outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.new_tokens = 1
            static_logits = engine.model(static_tokens, static_cached[:, None], inference_cache=cache,
                                         logits_to_keep=1)[-1, :, : engine.vocab_size].float()

        def replay(tokens: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
            static_tokens.copy_(tokens)
            cache.bind(cached, 1, dtype)  # in place: the graph reads cache.cached and cache.mask_bias
            static_cached.copy_(cached)
            graph.replay()
            return static_logits.clone()

        return replay
