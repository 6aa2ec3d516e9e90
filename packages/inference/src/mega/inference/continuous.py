"""``ContinuousBatchingWorker``: the engine's thread, with sequences joining the running batch at
the next step rather than the next batch.

Each step: queued sequences are admitted (first come, first served) while the batch has fewer
than ``max_batch_size`` sequences and the paged KV cache (:mod:`mega.inference.paged_kv_cache`)
has blocks for the sequence's prompt and all the tokens it may generate (so a running sequence
never runs out); the admitted prompts are prefilled together, right-padded into as few
forwards as a token budget allows (one wanting prompt log-probabilities alone); the
sequences already running decode one token each in one forward; then every sequence with new
logits chooses its token, and those that finish leave the batch and free their blocks at once.

Sequences are independent: each sits at its own position with its own cache blocks, so a
sequence computes what it would alone (the same tokens as :class:`GenerationEngine` gives it;
sampling streams are per sequence, as there). One process only: tensor-parallel serving keeps
the lock-step :class:`~mega.inference.batching.BatchingWorker`.

``static_cache`` (``mega serve --static-kv-cache``, the default on CUDA) swaps the paged cache
for a :class:`~mega.inference.static_decode.SlotKVCache`: each sequence owns a slot of the
model's whole length (a one-block table, so admission and freeing are unchanged), and a decode
step runs over the first slots up to a batch-size bucket with fixed shapes, which on CUDA is a
captured graph replayed (:class:`~mega.inference.static_decode.DecodeSteps`).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mega.inference.batching import EngineWorker, Job
from mega.inference.engine import GenerationEngine, GenerationError, GenerationRequest, GenerationResult, _top
from mega.inference.metrics import ServerMetrics
from mega.inference.paged_kv_cache import BlockAllocator, PagedKVCache
from mega.inference.sampling import Sampler
from mega.inference.static_decode import DecodeSteps, SlotAllocator, SlotKVCache, bucket_for

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
PREFILL_TOKENS = 4096  # padded prompt tokens in one prefill forward (bounds its activations)


@dataclass
class _Sequence:
    job: Job
    index: int  # within its job
    request: GenerationRequest
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys are in the cache
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    logits: torch.Tensor | None = None  # [vocab] the next token's, once computed
    number: int = 0  # unique among the worker's sequences

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.generated


class ContinuousBatchingWorker(EngineWorker):
    thread_name = "mega-continuous-batching"

    def __init__(self, engine: GenerationEngine, max_batch_size: int = 32, max_num_tokens: int | None = None,
                 block_size: int = BLOCK_SIZE, metrics: ServerMetrics | None = None, static_cache: bool = False,
                 use_cuda_graphs: bool | None = None):
        if engine.tp_group is not None and engine.tp_group.size > 1:
            raise ValueError("continuous batching runs in one process; tensor-parallel serving batches in lock-step")
        super().__init__(engine, max_batch_size, metrics)
        self.max_num_tokens = max_num_tokens or max_batch_size * engine.max_positions
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be positive, got {self.max_num_tokens}")
        self._decode_steps: DecodeSteps | None = None
        if static_cache:
            slots = min(max_batch_size, self.max_num_tokens // engine.max_positions)
            if slots < 1:
                raise ValueError(f"the static KV cache gives each sequence the model's {engine.max_positions} "
                                 f"positions; max_num_tokens {self.max_num_tokens} holds none")
            self.allocator = SlotAllocator(slots, engine.max_positions)
            dtype = next(engine.model.parameters()).dtype
            self.cache = SlotKVCache(slots, engine.max_positions, engine.device, dtype)
            graphs = engine.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
            self._decode_steps = DecodeSteps(engine, self.cache, graphs)
        else:
            self.allocator = BlockAllocator(max(1, self.max_num_tokens // block_size), block_size)
            self.cache = PagedKVCache(self.allocator, max_batch_size, _head_repeats(engine))
        self._pending: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._numbered = 0
        self._sampler = Sampler([], engine.device)

    def check(self, request: GenerationRequest) -> None:
        """A sequence longer than the whole cache could never be admitted."""
        tokens = len(request.prompt) + request.max_new_tokens
        if self.allocator.blocks_for(tokens) > self.allocator.num_blocks:
            raise GenerationError(f"{tokens} tokens exceed the server's KV cache of {self.max_num_tokens} tokens "
                                  "(--max-num-tokens)")

    def submit(self, job: Job) -> None:
        with self._condition:
            for index, request in enumerate(job.requests):
                self._numbered += 1
                self._pending.append(_Sequence(job, index, request, number=self._numbered))
            self._condition.notify()

    # The worker thread.
    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._pending and not self._running and not self._stopping:
                    self._condition.wait()
                if self._stopping:
                    return
                admitted = self._admit()
            try:
                self._step(admitted)
            except Exception as error:  # the server lives on; the sequences of this step get the error
                log.exception("generation failed in a step of %d sequences", len(self._running) + len(admitted))
                for sequence in [*self._running, *admitted]:
                    self.allocator.free(sequence.blocks)
                    sequence.job.failed(error)
                self._running, self._sampler = [], Sampler([], self.engine.device)

    def _admit(self) -> list[_Sequence]:
        """Queued sequences that fit now, in order; cancelled ones are dropped."""
        admitted: list[_Sequence] = []
        now = time.monotonic()
        while self._pending and len(self._running) + len(admitted) < self.max_batch_size:
            sequence = self._pending[0]
            if sequence.request.cancelled:
                self._pending.popleft()
                self._finish(sequence, "cancelled")
                continue
            request = sequence.request
            if not self.allocator.can_hold(len(request.prompt) + request.max_new_tokens):
                break  # first come, first served: wait for blocks to free
            self._pending.popleft()
            sequence.blocks = self.allocator.allocate(len(request.prompt) + request.max_new_tokens)
            sequence.logprobs = [] if request.logprobs else None
            sequence.top_logprobs = [] if request.top_logprobs else None
            self.metrics.admitted(now - sequence.job.submitted_at)
            admitted.append(sequence)
        return admitted

    def _forward(self, sequences: list[_Sequence], tokens: torch.Tensor, logits_to_keep: int | torch.Tensor | None,
                 real: list[int] | None = None) -> torch.Tensor:
        """fp32 logits ``[kept, batch, vocab]`` of ``tokens`` ``[batch, new]`` continuing each sequence
        (``real``: right-padded prompts, row ``r``'s own tokens; see :meth:`PagedKVCache.bind`)."""
        device = self.engine.device
        cached = [s.cached for s in sequences]
        self.cache.bind([s.blocks for s in sequences], cached, tokens.shape[1], device, [s.number for s in sequences],
                        real)
        positions = torch.tensor(cached, device=device)[:, None] + torch.arange(tokens.shape[1], device=device)
        logits = self.engine.model(tokens, positions, inference_cache=self.cache, logits_to_keep=logits_to_keep)
        for row, sequence in enumerate(sequences):
            sequence.cached += tokens.shape[1] if real is None else real[row]
        return logits[..., : self.engine.vocab_size].float()

    def _prefill_together(self, sequences: list[_Sequence]) -> None:
        """Prompts (no prompt log-probabilities wanted) right-padded into one forward: one large
        matrix product instead of a small one per prompt, each row's logits taken at its own end."""
        lengths = [len(s.request.prompt) for s in sequences]
        tokens = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            tokens[row, : lengths[row]] = torch.tensor(sequence.request.prompt)
        ends = torch.tensor(lengths, device=self.engine.device) - 1
        logits = self._forward(sequences, tokens.to(self.engine.device), ends, real=lengths)[0]  # [batch, vocab]
        for row, sequence in enumerate(sequences):
            sequence.logits = logits[row]

    def _prefill_all(self, admitted: list[_Sequence]) -> None:
        """Prompt log-probabilities need every position's logits: those prefill alone; the others in
        groups of similar length (sorted, so little padding) of at most PREFILL_TOKENS padded tokens."""
        together = sorted((s for s in admitted if not s.request.logprobs and len(s.request.prompt) > 1),
                          key=lambda s: len(s.request.prompt))
        grouped = {id(s) for s in together}
        for sequence in admitted:
            if id(sequence) not in grouped:
                self._prefill(sequence)
        group: list[_Sequence] = []
        for sequence in together:
            if group and (len(group) + 1) * len(sequence.request.prompt) > PREFILL_TOKENS:
                self._prefill_group(group)
                group = []
            group.append(sequence)
        if group:
            self._prefill_group(group)

    def _prefill_group(self, group: list[_Sequence]) -> None:
        if len(group) == 1:
            self._prefill(group[0])
        else:
            self._prefill_together(group)

    def _prefill(self, sequence: _Sequence) -> None:
        request = sequence.request
        tokens = torch.tensor([request.prompt], device=self.engine.device)
        logits = self._forward([sequence], tokens, None if request.logprobs else 1)[:, 0]  # [kept, vocab]
        if request.logprobs and len(request.prompt) > 1:
            log_probs = F.log_softmax(logits[:-1], dim=-1)
            sequence.logprobs.extend(log_probs.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist())
            if sequence.top_logprobs is not None:
                sequence.top_logprobs.extend(_top(log_probs, request.top_logprobs))
        sequence.logits = logits[-1]

    @torch.inference_mode()  # no autograd graph: across steps it would keep every activation alive
    def _step(self, admitted: list[_Sequence]) -> None:
        decoding = [s for s in self._running if s.logits is None]
        if decoding:
            logits = self._decode(decoding)
            for row, sequence in enumerate(decoding):
                sequence.logits = logits[row]
        self._prefill_all(admitted)
        for sequence in admitted:
            if sequence.request.max_new_tokens == 0:  # scoring only: done with the prompt
                self._finish(sequence, "length")
                continue
            self._running.append(sequence)
            self._sampler.extend(Sampler([sequence.request.sampling], self.engine.device))
        with self._condition:
            queued = len(self._pending)
        self.metrics.step(len(self._running), self.max_batch_size, queued, len(self._running))
        self.batches_run += 1
        if self._running:
            self._choose()

    def _decode(self, decoding: list[_Sequence]) -> torch.Tensor:
        """fp32 logits ``[batch, vocab]`` of one new token for each of ``decoding``."""
        device = self.engine.device
        if self._decode_steps is None:
            tokens = torch.tensor([[s.tokens[-1]] for s in decoding], device=device)
            return self._forward(decoding, tokens, 1)[0]
        # The static cache: one step over the window of the first slots, up to a bucket (see
        # static_decode); slots in it that no sequence decodes compute a row nobody reads. Those
        # just admitted are prefilled after this step, over what it wrote at their position 0.
        slots = [s.blocks[0] for s in decoding]
        window = min(bucket_for(max(slots) + 1), self.cache.slots)
        tokens = torch.zeros(window, 1, dtype=torch.long)
        cached = torch.zeros(window, dtype=torch.long)
        for slot, sequence in zip(slots, decoding, strict=True):
            tokens[slot, 0], cached[slot] = sequence.tokens[-1], sequence.cached
            sequence.cached += 1
        logits = self._decode_steps(tokens.to(device), cached.to(device))
        return logits[torch.tensor(slots, device=device)]

    def _choose(self) -> None:
        """Every running sequence's next token; the finished ones leave the batch."""
        running = self._running
        logits = torch.stack([s.logits for s in running])
        drawing = [True] * len(running)
        chosen = self._sampler.sample(logits, drawing)
        self._sampler.observe(chosen, drawing)
        wants_logprobs = [row for row, s in enumerate(running) if s.logprobs is not None]
        log_probs = F.log_softmax(logits[wants_logprobs], dim=-1) if wants_logprobs else None
        chosen_list = chosen.tolist()
        finished: dict[int, str] = {}
        for k, row in enumerate(wants_logprobs):
            sequence = running[row]
            sequence.logprobs.append(log_probs[k, chosen_list[row]].item())
            if sequence.top_logprobs is not None:
                sequence.top_logprobs.extend(_top(log_probs[k: k + 1], sequence.request.top_logprobs))
        for row, sequence in enumerate(running):
            request = sequence.request
            sequence.generated.append(chosen_list[row])
            sequence.logits = None
            logprob = sequence.logprobs[-1] if sequence.logprobs is not None else None
            top = sequence.top_logprobs[-1] if sequence.top_logprobs is not None else None
            sequence.job.token(sequence.index, chosen_list[row], logprob, top)
            if self.engine.stop_checker.should_stop(request.stop, sequence.generated):
                finished[row] = "stop"
            elif request.cancelled:
                finished[row] = "cancelled"
            elif len(sequence.generated) >= request.max_new_tokens:
                finished[row] = "length"
        if finished:
            for row, reason in finished.items():
                self._finish(running[row], reason)
            # The last row takes a finished row's place, so the others stay where the cache's
            # decode views hold them (see PagedKVCache): a step re-gathers no one's keys.
            kept = list(range(len(running)))
            for row in sorted(finished, reverse=True):
                last = kept.pop()
                if last != row:
                    kept[row] = last
            self._running = [running[row] for row in kept]
            self._sampler.keep(kept)

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        self.allocator.free(sequence.blocks)
        sequence.blocks = []
        request = sequence.request
        sequence.job.finished(sequence.index, GenerationResult(
            tokens=sequence.tokens, prompt_length=len(request.prompt), finish_reason=reason,
            logprobs=sequence.logprobs, top_logprobs=sequence.top_logprobs))


def _head_repeats(engine: GenerationEngine) -> int:
    """Query heads per key head where the attention kernel repeats key heads itself (everywhere
    but CUDA's native grouped-query attention): the decode views then hold them repeated."""
    config = getattr(engine.model, "config", None)
    heads, groups = getattr(config, "num_attention_heads", None), getattr(config, "num_query_groups", None)
    if engine.device.type == "cuda" or not heads or not groups:
        return 1
    return heads // groups
