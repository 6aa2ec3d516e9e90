"""``EncoderDecoderEngine``: generation with an encoder-decoder model (the ``t5`` family).

The prompt is the encoder's input. Every prompt of a batch is encoded once (right-padded, the
padding masked); then the decoder runs in lock-step from the start token: every sequence's
decoder input is the same length at every step, so the self-attention KV cache needs no padding,
and each decoder layer computes its cross-attention keys and values of the encoder output on
the first step and keeps them (:class:`mega.models.t5.model.DecoderCache`). Finished sequences
leave the batch, their encoder output and their caches at once.

It takes the decoder engine's requests and gives its results (:mod:`mega.inference.engine`), so
``mega generate``, ``mega serve`` and tensor-parallel serving use it unchanged: a result's
``tokens`` are the prompt then the generated tokens; its ``logprobs`` (of ``tokens[1:]``) are
None at the prompt's positions, which the decoder does not predict.

A model qualifies by having ``encode(tokens, padding)`` and ``decode(tokens, encoder_output,
encoder_padding, cache, logits_to_keep)`` (see :func:`is_encoder_decoder`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

import torch

from mega.core.parallel import Group
from mega.inference.engine.generation_engine import EngineBase
from mega.inference.engine.metrics import ServerMetrics
from mega.inference.engine.requests import (
    FinishCallback,
    GenerationError,
    GenerationRequest,
    GenerationResult,
    TokenCallback,
    ending,
)
from mega.inference.engine.worker import EngineWorker, QueuedSequence
from mega.models.t5.model import DecoderCache

# T5's decoder starts from the padding token (Hugging Face's decoder_start_token_id).
DECODER_START_TOKEN = 0
PAD_TOKEN = 0


def is_encoder_decoder(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "encode", None)) and callable(getattr(model, "decode", None))


class EncoderDecoderEngine(EngineBase):
    """Generates with ``model`` (whole, eval mode, tensor-parallel over ``tp_group`` or not).
    ``max_positions`` bounds both the prompt and the tokens to generate (T5's relative positions
    set no hard limit; the model was trained at its sequence lengths)."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int, tokenizer=None,
                 tp_group: Group | None = None, decoder_start_token: int = DECODER_START_TOKEN):
        if not is_encoder_decoder(model):
            raise GenerationError(f"{type(model).__name__} has no encode/decode: it is not an encoder-decoder model")
        super().__init__(model, vocab_size=vocab_size, max_positions=max_positions, tokenizer=tokenizer,
                         tp_group=tp_group)
        self.decoder_start_token = decoder_start_token
        self.cache_class = DecoderCache

    def check(self, request: GenerationRequest) -> None:
        self.check_prompt(request)
        if request.max_new_tokens < 1:
            raise GenerationError(f"an encoder-decoder model generates at least one token, got max_new_tokens "
                                  f"{request.max_new_tokens}")
        for what, count in (("prompt tokens", len(request.prompt)), ("tokens to generate", request.max_new_tokens)):
            if count > self.max_positions:
                raise GenerationError(f"{count} {what} exceed {self.length_limit}")

    def generate(self, requests: Sequence[GenerationRequest], on_token: TokenCallback | None = None,
                 on_finish: FinishCallback | None = None) -> list[GenerationResult]:
        """Run ``requests`` as one batch to their ends (callbacks name a request by its index)."""
        return EncoderDecoderWorker(self, max_batch_size=len(requests)).run_to_completion(requests, on_token, on_finish)


class EncoderDecoderWorker(EngineWorker):
    """Batches of up to ``max_batch_size`` queued sequences, each encoded once, then decoded from
    the start token one step at a time; the next batch starts when this one has ended."""

    thread_name = "mega-encoder-decoder"

    def __init__(self, engine: EncoderDecoderEngine, max_batch_size: int = 32, metrics: ServerMetrics | None = None):
        super().__init__(engine, max_batch_size, metrics)
        self._pending: collections.deque[QueuedSequence] = collections.deque()
        self._decode_step = engine.decode_step(on_token=self._on_token, on_finish=self._answer)
        self._tokens = self._encoder_output = self._padding = self._cache = None
        self._starting: list[QueuedSequence] = []  # admitted, not joined yet (a failed encode answers them too)

    def _queue(self, request: GenerationRequest, job, index: int, number: int) -> None:
        sequence = QueuedSequence(request, job=job, index=index)
        # The decoder predicts no prompt token: those positions' log-probabilities are None.
        if request.logprobs:
            sequence.logprobs = [None] * (len(request.prompt) - 1)
        if request.top_logprobs:
            sequence.top_logprobs = [None] * (len(request.prompt) - 1)
        self._pending.append(sequence)

    def _has_work(self) -> bool:
        return bool(self._pending or self._decode_step.sequences)

    def _admit(self) -> list[QueuedSequence]:
        """The next batch, once the running one has ended; cancelled sequences end here."""
        admitted: list[QueuedSequence] = []
        if self._decode_step.sequences:
            return admitted
        now = time.monotonic()
        while self._pending and len(admitted) < self.max_batch_size:
            sequence = self._pending.popleft()
            reason = ending(stopped=False, at_length=False, cancelled=sequence.request.cancelled)
            if reason is not None:
                sequence.finish_reason = reason
                self._answer(sequence)
                continue
            self.metrics.admitted(now - sequence.job.submitted_at)
            admitted.append(sequence)
        return admitted

    def _adopt(self, request: GenerationRequest, number: int) -> QueuedSequence:
        self._queue(request, None, 0, number)
        return self._pending.pop()

    def _fail(self, error: BaseException) -> None:
        for sequence in [*self._decode_step.in_flight, *self._starting]:
            sequence.job.failed(error)
        self._decode_step.reset()
        self._starting = []

    @torch.inference_mode()
    def _step(self, admitted: list[QueuedSequence]) -> None:
        if admitted:
            self._starting = admitted
            self._start(admitted)
            self._starting = []
        step = self._decode_step
        if not step.sequences:
            return
        engine, device = self.engine, self.engine.device
        logits = engine.real_logits(engine.model.decode(self._tokens, self._encoder_output, self._padding,
                                                        self._cache, logits_to_keep=1)[-1])
        outcome = step(logits)
        self.batches_run += 1
        if not step.sequences:
            return
        if len(outcome.kept) != len(outcome.chosen):  # finished rows leave the encoder output and the caches
            rows = torch.tensor(outcome.kept, dtype=torch.long, device=device)
            self._encoder_output, self._padding = self._encoder_output[:, rows], self._padding[rows]
            self._cache.keep(rows)
        self._tokens = outcome.next_tokens[:, None]

    def _start(self, batch: list[QueuedSequence]) -> None:
        """Encode the batch's prompts (right-padded, the padding masked) and start its decoder."""
        engine, device = self.engine, self.engine.device
        longest = max(len(s.request.prompt) for s in batch)
        prompts = torch.full((len(batch), longest), PAD_TOKEN, dtype=torch.long, device=device)
        padding = torch.zeros(len(batch), longest, dtype=torch.bool, device=device)
        for row, sequence in enumerate(batch):
            prompts[row, : len(sequence.request.prompt)] = torch.tensor(sequence.request.prompt, device=device)
            padding[row, : len(sequence.request.prompt)] = True
        self._cache = engine.cache_class(max(s.request.max_new_tokens for s in batch))
        self._encoder_output, self._padding = engine.model.encode(prompts, padding), padding
        joined = self._decode_step.join(batch)  # every request generates at least one token (checked)
        if len(joined) != len(batch):  # those cancelled since admission leave before the first step
            rows = torch.tensor(joined, dtype=torch.long, device=device)
            self._encoder_output, self._padding = self._encoder_output[:, rows], self._padding[rows]
        self._tokens = torch.full((len(joined), 1), engine.decoder_start_token, dtype=torch.long, device=device)
