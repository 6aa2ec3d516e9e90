"""``ContinuousBatchingWorker``: the one decoder loop. Every entry point for decoder-only models
submits its requests here: ``mega serve``'s routes (Megatron's ``PUT /api``, the OpenAI ones)
through the worker's thread, ``mega generate`` and :meth:`GenerationEngine.generate` by running
it to completion on their own thread (:class:`~mega.inference.engine.worker.EngineWorker`).
Sequences join the running batch at the next step rather than the next batch.

Each step: queued sequences are admitted (first come, first served) while the batch has fewer
than ``max_batch_size`` sequences and the paged KV cache (:mod:`mega.inference.engine.paged_kv_cache`)
has blocks for the sequence's prompt and all the tokens it may generate (so a running sequence
never runs out); the admitted prompts are prefilled together, right-padded into as few
forwards as a token budget allows (those wanting prompt log-probabilities apart); the
sequences already running decode one token each in one forward; then every sequence with new
logits chooses its token, and those that finish leave the batch and free their blocks at once.

Sequences are independent: each sits at its own position with its own cache blocks, so a
sequence computes what it would alone (sampling streams are per sequence).

Under tensor parallelism (``torchrun``) the worker runs on the leader (rank 0 of the tensor
group), which before each step hands the sequences it admitted to the followers; each follower
runs the same steps over its own caches (:meth:`EngineWorker.follow`), and the
shared :class:`~mega.inference.engine.decode_step.DecodeStep` gives every rank the leader's tokens
and endings, so the ranks' batches never part.

The cache sits behind one interface (:mod:`~mega.inference.engine.kv_caches`): the prefill and
the decode step here are written once for both. ``static_cache`` (``--static-kv-cache``, the
default on CUDA) swaps the paged cache for a
:class:`~mega.inference.engine.slot_kv_cache.SlotKVCache`: each sequence owns a slot of the
model's whole length (a one-block table, so admission and freeing are unchanged), and a decode
step runs over the first slots up to a batch-size bucket with fixed shapes, which on CUDA is a
captured graph replayed (:class:`~mega.inference.engine.slot_kv_cache.DecodeGraphs`).

Endings follow the one rule of :func:`~mega.inference.engine.requests.ending` (stop, then
length, then cancellation): in the queue here (:meth:`ContinuousBatchingWorker._admit`), after
the prefill and after each token in the decode step.

``prefix_caching`` (``--enable-prefix-caching``, on by default for the paged cache): blocks that
hold a prompt's full blocks are kept, keyed by their prefix, and shared by later prompts that
start with it (:mod:`mega.inference.engine.prefix_cache`): those prefill only the rest.

``max_num_batched_tokens`` (``--max-num-batched-tokens``): a step computes at most that many
tokens, one per decoding sequence and the rest prompt tokens: a long prompt is prefilled in
chunks over several steps while the running sequences go on decoding, instead of stalling them
all for one long forward. Without it each admitted prompt is prefilled whole in its first step.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mega.inference.engine.decode_step import DecodeStep, record_logprobs
from mega.inference.engine.kv_caches import (
    PagedSequenceCache,
    RecurrentSequenceCache,
    SequenceCache,
    SlotSequenceCache,
    WindowedSequenceCache,
)
from mega.inference.engine.lora_registry import prefix_salt
from mega.inference.engine.metrics import ServerMetrics
from mega.inference.engine.paged_window_cache import sliding_window_cache_options
from mega.inference.engine.prefix_cache import prefix_keys
from mega.inference.engine.recurrent_state_cache import recurrent_cache_options
from mega.inference.engine.requests import GenerationError, GenerationRequest, ending
from mega.inference.engine.sampling import Sampler
from mega.inference.engine.slot_kv_cache import DecodeGraphs
from mega.inference.engine.speculative import Speculator, draw_rows
from mega.inference.engine.worker import EngineWorker, QueuedSequence

BLOCK_SIZE = 16
PREFILL_TOKENS = 4096  # padded prompt tokens in one prefill forward (bounds its activations)
PREFILL_LOGITS = 1 << 24  # fp32 logits a prefill for prompt log-probabilities keeps at most (64 MiB)


@dataclass(eq=False, kw_only=True)
class _Sequence(QueuedSequence):
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys are in the cache
    prefix_keys: list[bytes] = field(default_factory=list)  # of the prompt's full blocks (prefix caching)
    logits: torch.Tensor | None = None  # [vocab] the next token's, once computed
    number: int = 0  # unique among the worker's sequences


class ContinuousBatchingWorker(EngineWorker):
    thread_name = "mega-continuous-batching"

    def __init__(self, engine, max_batch_size: int = 32, max_num_tokens: int | None = None,
                 block_size: int = BLOCK_SIZE, metrics: ServerMetrics | None = None, static_cache: bool = False,
                 use_cuda_graphs: bool | None = None, prefix_caching: bool = False,
                 max_num_batched_tokens: int | None = None, compile_backend: str | Callable | None = None,
                 speculator: Speculator | None = None):
        if max_num_batched_tokens is not None and max_num_batched_tokens < max_batch_size:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_batch_size "
                             f"({max_batch_size}): every running sequence decodes a token per step")
        super().__init__(engine, max_batch_size, metrics)
        self.block_size = block_size  # of the paged cache, and of prompt prefixes cached
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefilled_tokens = 0  # prompt tokens computed (not taken from the prefix cache)
        self.max_num_tokens = max_num_tokens or max_batch_size * engine.max_positions
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be positive, got {self.max_num_tokens}")
        if getattr(engine.model, "recurrent_layers", ()):  # a state per sequence beside the keys
            recurrent_cache_options(static_cache, prefix_caching, speculator)
            self.kv: SequenceCache = RecurrentSequenceCache(engine, max_batch_size, self.max_num_tokens, block_size)
        elif static_cache:
            slots = min(max_batch_size, self.max_num_tokens // engine.max_positions)
            if slots < 1:
                raise ValueError(f"the static KV cache gives each sequence the model's {engine.max_positions} "
                                 f"positions; max_num_tokens {self.max_num_tokens} holds none")
            self.kv = SlotSequenceCache(engine, slots, block_size, prefix_caching, use_cuda_graphs, compile_backend,
                                        rolls_back=speculator is not None)
        elif engine.layer_windows:  # sliding layers keep their window's keys (paged_window_cache)
            sliding_window_cache_options(prefix_caching)
            self.kv = WindowedSequenceCache(engine, max_batch_size, self.max_num_tokens, block_size,
                                            rolled_back=speculator.num_tokens if speculator is not None else 0)
        else:
            self.kv = PagedSequenceCache(engine, max_batch_size, self.max_num_tokens, block_size, prefix_caching)
        self.cache, self.allocator = self.kv.cache, self.kv.allocator
        self._pending: collections.deque[_Sequence] = collections.deque()
        self._prefilling: list[_Sequence] = []  # admitted, their prompts not all cached yet
        self._chosen: torch.Tensor | None = None  # [decoding rows] tokens a greedy decode step chose
        self._decoded: torch.Tensor | None = None  # [decoding rows, vocab] the logits a decode step gave
        # The running sequences are the decode step's rows, in its order.
        self._decode_step = engine.decode_step(on_token=self._on_token, on_finish=self._finish)
        self.speculator = speculator
        if speculator is not None:
            if engine.tp_group is not None and engine.tp_group.size > 1:
                raise ValueError("speculative decoding runs on one rank: drop --num-speculative-tokens under torchrun")
            speculator.metrics = self.metrics
            speculator.attach(self.kv)  # MTP drafts read the hidden states of this cache's forwards
            self._decode_step.lag = 0  # drafts continue every token: the host reads each step's at once

    @property
    def _decode_steps(self) -> DecodeGraphs | None:
        """The static cache's decode forwards (captured graphs on CUDA); None on the paged cache."""
        return self.kv.graphs

    @property
    def _running(self) -> list[_Sequence]:
        return self._decode_step.sequences

    @property
    def prefix_caching(self) -> bool:
        return self.kv.prefix_caching

    def check(self, request: GenerationRequest) -> None:
        """A sequence longer than the whole cache could never be admitted."""
        tokens = len(request.prompt) + request.max_new_tokens
        if self.allocator.blocks_for(tokens) > self.allocator.num_blocks:
            raise GenerationError(f"{tokens} tokens exceed the server's KV cache of {self.max_num_tokens} tokens "
                                  "(--max-num-tokens)")

    def _queue(self, request: GenerationRequest, job, index: int, number: int) -> None:
        self._pending.append(_Sequence(request, job=job, index=index, number=number))

    def _has_work(self) -> bool:
        return bool(self._pending or self._running or self._prefilling)

    def _adopt(self, request: GenerationRequest, number: int) -> _Sequence:
        sequence = _Sequence(request, job=None, index=0, number=number)
        if not self._allocate(sequence):
            raise RuntimeError("a follower's KV cache cannot hold what the leader's admitted: the ranks disagree")
        self._prefilling.append(sequence)
        return sequence

    def _fail(self, error: BaseException) -> None:
        for sequence in [*self._decode_step.in_flight, *self._prefilling]:
            self.allocator.free(sequence.blocks)
            if self.speculator is not None:
                self.speculator.release(sequence)
            sequence.job.failed(error)
        self._decode_step.reset()
        self._prefilling, self._chosen, self._decoded = [], None, None

    def _admit(self) -> list[_Sequence]:
        """Queued sequences that fit now, in order; a cancelled one ends (nothing computed: by
        the one rule, only its cancellation can end it) and takes no room."""
        admitted: list[_Sequence] = []
        now = time.monotonic()
        while self._pending and len(self._running) + len(self._prefilling) < self.max_batch_size:
            sequence = self._pending[0]
            reason = ending(stopped=False, at_length=False, cancelled=sequence.request.cancelled)
            if reason is not None:
                self._pending.popleft()
                sequence.finish_reason = reason
                self._finish(sequence)
                continue
            if not self._allocate(sequence):
                break  # first come, first served: wait for blocks to free
            self._pending.popleft()
            self.metrics.admitted(now - sequence.job.submitted_at)
            self._prefilling.append(sequence)
            admitted.append(sequence)
        return admitted

    def _allocate(self, sequence: _Sequence) -> bool:
        """Blocks for the sequence's prompt and every token it may generate, sharing the cached
        blocks of its prompt's prefix (not where it wants its prompt's log-probabilities, which
        need the logits of every position); False: no room yet."""
        request = sequence.request
        tokens = len(request.prompt) + request.max_new_tokens
        if not self.prefix_caching:
            if not self.allocator.can_hold(tokens):
                return False
            sequence.blocks = self.allocator.allocate(tokens)
            return True
        sequence.prefix_keys = prefix_keys(request.prompt, self.block_size, prefix_salt(request))
        keys = [] if request.scores_prompt else sequence.prefix_keys
        allocated = self.allocator.allocate_with_prefix(keys, len(request.prompt), tokens)
        if allocated is None:
            return False
        sequence.blocks, sequence.cached = allocated
        return True

    def _prefill_together(self, sequences: list[_Sequence]) -> None:
        """Prompts (no prompt log-probabilities wanted) right-padded into one forward: one large
        matrix product instead of a small one per prompt, each row's logits taken at its own end."""
        lengths, tokens = self._padded_prompts(sequences)
        ends = torch.tensor(lengths, device=self.engine.device) - 1
        logits = self.kv.forward(sequences, tokens, ends, real=lengths)[0]  # [batch, vocab]
        for row, sequence in enumerate(sequences):
            sequence.logits = logits[row]

    def _prefill_scored_together(self, sequences: list[_Sequence]) -> None:
        """Prompts wanting their log-probabilities right-padded into one forward that keeps every
        position's logits (RL rollouts, scoring): each row records its own prompt's."""
        lengths, tokens = self._padded_prompts(sequences)
        logits = self.kv.forward(sequences, tokens, None, real=lengths)  # [longest, batch, vocab]
        for row, sequence in enumerate(sequences):
            record_logprobs(sequence, logits[: lengths[row] - 1, row], tokens[row, 1: lengths[row]])
            sequence.logits = logits[lengths[row] - 1, row]

    def _padded_prompts(self, sequences: list[_Sequence]) -> tuple[list[int], torch.Tensor]:
        """The prompts' lengths and the prompts right-padded ``[batch, longest]`` on the device."""
        lengths = [len(s.request.prompt) for s in sequences]
        longest = max(lengths)
        padded = [s.request.prompt + [0] * (longest - length) for s, length in zip(sequences, lengths, strict=True)]
        return lengths, torch.tensor(padded, device=self.engine.device)

    def _prefill_all(self, admitted: list[_Sequence]) -> None:
        """Whole prompts. A cached prefix starts past 0: those prefill alone; the others in groups
        of similar length (sorted, so little padding) of at most PREFILL_TOKENS padded tokens, those
        wanting their prompts' log-probabilities (every position's logits) apart from the others and
        keeping at most PREFILL_LOGITS logits."""
        together = sorted((s for s in admitted if len(s.request.prompt) > 1 and not s.cached),
                          key=lambda s: (s.request.scores_prompt, len(s.request.prompt)))
        grouped = {id(s) for s in together}
        for sequence in admitted:
            if id(sequence) not in grouped:
                self._prefill(sequence, len(sequence.request.prompt) - sequence.cached)
        group: list[_Sequence] = []
        for sequence in together:
            padded = (len(group) + 1) * len(sequence.request.prompt)
            scores = sequence.request.scores_prompt
            if group and (scores != group[0].request.scores_prompt or padded > PREFILL_TOKENS
                          or scores and padded * self.engine.vocab_size > PREFILL_LOGITS):
                self._prefill_group(group)
                group = []
            group.append(sequence)
        if group:
            self._prefill_group(group)

    def _prefill_chunks(self, budget: int) -> None:
        """Up to ``budget`` prompt tokens, first admitted first: each sequence's next chunk."""
        for sequence in self._prefilling:
            count = min(len(sequence.request.prompt) - sequence.cached, budget)
            if count <= 0:
                break
            self._prefill(sequence, count)
            budget -= count

    def _prefill_group(self, group: list[_Sequence]) -> None:
        if len(group) == 1:
            self._prefill(group[0], len(group[0].request.prompt))
            return
        self.prefilled_tokens += sum(len(s.request.prompt) for s in group)
        if group[0].request.scores_prompt:
            self._prefill_scored_together(group)
        else:
            self._prefill_together(group)

    def _prefill(self, sequence: _Sequence, count: int) -> None:
        """The next ``count`` prompt tokens after those cached (the logits of the last prompt
        token once it is reached; prompt log-probabilities as asked)."""
        prompt, start = sequence.request.prompt, sequence.cached
        end = start + count
        tokens = torch.tensor([prompt[start:end]], device=self.engine.device)
        scores = sequence.request.scores_prompt
        logits = self.kv.forward([sequence], tokens, None if scores else 1, prefill=True)[:, 0]
        self.prefilled_tokens += count
        if scores:  # of the tokens after each of these: the next chunk's first too
            targets = torch.tensor(prompt[start + 1: end + 1], device=self.engine.device)
            record_logprobs(sequence, logits[: len(targets)], targets)
        if end == len(prompt):
            sequence.logits = logits[-1]

    @torch.inference_mode()  # no autograd graph: across steps it would keep every activation alive
    def _step(self, admitted: list[_Sequence]) -> None:
        decoding = list(self._running)  # each chose its last token in the previous step
        # A speculating step draws the first tokens of the sequences joining too (draw_rows).
        speculating = self._may_speculate(admitted)
        if speculating:
            emitted = self.speculator.step(self.kv, decoding, self._decode_step.sampler) if decoding else []
        elif decoding:
            self._decode(decoding, greedy=self._greedy_step(admitted))
        if self.max_num_batched_tokens is None:
            self._prefill_all(admitted)
        else:
            self._prefill_chunks(self.max_num_batched_tokens - len(decoding))
        ready = [s for s in self._prefilling if s.cached == len(s.request.prompt)]
        if ready:
            self._prefilling = [s for s in self._prefilling if s.cached < len(s.request.prompt)]
            if self.prefix_caching:
                for sequence in ready:
                    self.allocator.register(sequence.prefix_keys, sequence.blocks)
                self.metrics.prefix_cache(self.allocator.queried_tokens, self.allocator.hit_tokens)
            self._decode_step.join(ready)  # those with nothing to generate (scoring only) finish here
        with self._condition:
            queued = len(self._pending)
        self.metrics.step(len(self._running), self.max_batch_size, queued, len(self._running))
        self.batches_run += 1
        if self._running:
            if speculating:
                self._advance(emitted)
            else:
                self._choose()

    def _may_speculate(self, admitted: list[_Sequence]) -> bool:
        """Whether this step speculates: a speculator is set and no row (nor one joining) asks
        log-probabilities or adjusts its logits (penalties change with every token accepted), and
        the rows are fewer than the speculator's ``disable_by_batch_size``; otherwise the step
        decodes one token per row. The verify forward is one for all rows
        (on the static cache a captured graph: SlotSequenceCache.verify)."""
        rows = (*self._running, *self._prefilling, *admitted)
        return self.speculator is not None and self.speculator.speculates_at(len(rows)) and all(
            s.logprobs is None and not s.request.sampling.adjusts_logits for s in rows)

    def _advance(self, emitted: list[list[int]]) -> None:
        """The speculative step's tokens for the rows that decoded, and for those that joined
        after them their token chosen from their prefill's logits."""
        running = self._running
        joined = running[len(emitted):]
        if joined:
            logits = torch.stack([s.logits if s.logits is not None else torch.zeros_like(joined[0].logits)
                                  for s in running])
            rows = range(len(emitted), len(running))
            chosen = draw_rows(self._decode_step.sampler, logits, rows)
            emitted = [*emitted, *([token] for token in chosen)]
        self._decode_step.advance(emitted)
        for sequence in running:
            sequence.logits = None

    def _greedy_step(self, admitted: list[_Sequence]) -> bool:
        """Whether this step's decode may choose the tokens itself (the static cache's step, every
        row greedy, and so every sequence that may join before the tokens are chosen)."""
        return (self.kv.chooses_on_device and self._decode_step.chooses_on_device
                and DecodeStep.may_choose_on_device(self._prefilling + admitted))

    def _decode(self, decoding: list[_Sequence], greedy: bool) -> None:
        """One new token's fp32 logits for each of ``decoding`` (``self._decoded``, ``[rows, vocab]``),
        or with ``greedy`` the tokens themselves, in the rows' order (``self._chosen``)."""
        # The rows' last tokens, still on the device (the host reads them a few steps later).
        out = self.kv.decode(decoding, self._prefilling, self._decode_step.next_tokens, greedy)
        if greedy:
            self._chosen = out
            return
        self._decoded = out  # kept whole: the step's rows are its rows, no split and stack again

    def _choose(self) -> None:
        """Every running sequence's next token; the finished ones leave the batch (the last row
        takes a finished row's place, so the others stay where the cache's decode views hold them).
        Where the decode step chose its rows' tokens, the rows just prefilled take their greedy
        choice of their logits too."""
        running, chosen, decoded = self._running, self._chosen, self._decoded
        if chosen is not None:  # the decoding rows come first; those that joined after them have logits
            joined = [Sampler.greedy_choice(s.logits) for s in running[len(chosen):]]
            self._decode_step(None, torch.cat([chosen, torch.stack(joined)]) if joined else chosen)
        elif decoded is not None:  # likewise the decoding rows' logits, then those of the rows that joined
            joined = [s.logits for s in running[len(decoded):]]
            self._decode_step(torch.cat([decoded, torch.stack(joined)]) if joined else decoded)
        else:
            self._decode_step(torch.stack([s.logits for s in running]))
        self._chosen = self._decoded = None
        for sequence in running:
            sequence.logits = None

    def _finish(self, sequence: _Sequence) -> None:
        """On every rank (a follower frees the same blocks); the leader answers the job."""
        self.allocator.free(sequence.blocks)
        sequence.blocks = []
        if self.speculator is not None:
            self.speculator.release(sequence)
        self._answer(sequence)
