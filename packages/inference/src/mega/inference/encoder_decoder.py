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

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mega.core.parallel import Group
from mega.core.parallel.collectives import gather_along
from mega.inference.engine import (
    FINISH_REASONS,
    FINISHED_BY_CANCEL,
    FINISHED_BY_LENGTH,
    FINISHED_BY_STOP,
    EngineBase,
    FinishCallback,
    GenerationError,
    GenerationRequest,
    GenerationResult,
    TokenCallback,
    agree,
)
from mega.inference.sampling import Sampler

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
        from mega.models.t5.model import DecoderCache

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
                raise GenerationError(f"{count} {what} exceed the model's {self.max_positions} positions")

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], on_token: TokenCallback | None = None,
                 on_finish: FinishCallback | None = None) -> list[GenerationResult]:
        for request in requests:
            self.check(request)
        return _EncoderDecoderRun(self, list(requests), on_token, on_finish).results()


class _EncoderDecoderRun:
    def __init__(self, engine: EncoderDecoderEngine, requests: list[GenerationRequest], on_token, on_finish):
        self.engine, self.requests, self.on_token, self.on_finish = engine, requests, on_token, on_finish
        device = engine.device
        longest = max(len(r.prompt) for r in requests)
        self.prompts = torch.full((len(requests), longest), PAD_TOKEN, dtype=torch.long, device=device)
        self.padding = torch.zeros(len(requests), longest, dtype=torch.bool, device=device)
        for row, request in enumerate(requests):
            self.prompts[row, : len(request.prompt)] = torch.tensor(request.prompt, device=device)
            self.padding[row, : len(request.prompt)] = True
        self.active = list(range(len(requests)))
        self.cache = engine.cache_class(max(r.max_new_tokens for r in requests))
        self.sampler = Sampler([r.sampling for r in requests], device)
        self.generated: list[list[int]] = [[] for _ in requests]
        self.logprobs = [[None] * (len(r.prompt) - 1) if r.logprobs else None for r in requests]
        self.top_logprobs = [[None] * (len(r.prompt) - 1) if r.top_logprobs else None for r in requests]
        self.finished: dict[int, GenerationResult] = {}

    def results(self) -> list[GenerationResult]:
        model = self.engine.model
        encoder_output = model.encode(self.prompts, self.padding)
        padding = self.padding
        tokens = torch.full((len(self.requests), 1), self.engine.decoder_start_token, dtype=torch.long,
                            device=self.prompts.device)
        while self.active:
            logits = model.decode(tokens, encoder_output, padding, self.cache, logits_to_keep=1)[-1]
            group = self.engine.tp_group
            if group is not None and group.size > 1:
                logits = gather_along(logits, group, dim=-1)
            chosen, keep = self._step(logits[..., : self.engine.vocab_size].float())
            if keep is not None and self.active:
                rows = torch.tensor(keep, dtype=torch.long, device=chosen.device)
                encoder_output, padding, chosen = encoder_output[:, rows], padding[rows], chosen[rows]
            tokens = chosen[:, None]
        return [self.finished[i] for i in range(len(self.requests))]

    def _step(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
        """Choose each row's next token; retire the rows that end; return the tokens and the rows
        kept (None: all)."""
        active, engine = self.active, self.engine
        finish = [0] * len(active)
        if engine.is_leader:
            drawing = [True] * len(active)  # every decoder token is generated: none is the prompt's
            chosen = self.sampler.sample(logits, drawing)
            self.sampler.observe(chosen, drawing)  # frequency/presence penalties count it
            if any(self.logprobs[i] is not None for i in active):
                log_probs = F.log_softmax(logits, dim=-1)
                values = log_probs.gather(-1, chosen[:, None]).squeeze(-1).tolist()
            for row, i in enumerate(active):
                request, generated = self.requests[i], self.generated[i]
                generated.append(int(chosen[row]))
                if self.logprobs[i] is not None:
                    self.logprobs[i].append(values[row])
                    if self.top_logprobs[i] is not None:
                        top, ids = log_probs[row].topk(request.top_logprobs)
                        self.top_logprobs[i].append(list(zip(ids.tolist(), top.tolist(), strict=True)))
                if self.on_token is not None:
                    logprob = self.logprobs[i][-1] if self.logprobs[i] is not None else None
                    top = self.top_logprobs[i][-1] if self.top_logprobs[i] is not None else None
                    self.on_token(i, generated[-1], logprob, top)
                if engine.stop_checker.should_stop(request.stop, generated):
                    finish[row] = FINISHED_BY_STOP
                elif request.cancelled:
                    finish[row] = FINISHED_BY_CANCEL
                elif len(generated) >= request.max_new_tokens:
                    finish[row] = FINISHED_BY_LENGTH
            chosen, finish = agree(self.engine.tp_group, chosen, finish)
        else:
            nothing = torch.empty(len(active), dtype=torch.long, device=logits.device)
            chosen, finish = agree(self.engine.tp_group, nothing, finish)
            for row, i in enumerate(active):
                self.generated[i].append(int(chosen[row]))
        if not any(finish):
            return chosen, None
        keep = [row for row, flag in enumerate(finish) if not flag]
        for row, flag in enumerate(finish):
            if flag:
                i = active[row]
                self.finished[i] = result = self._result(i, flag)
                if self.on_finish is not None and engine.is_leader:
                    self.on_finish(i, result)
        self.active = [active[row] for row in keep]
        if self.active:
            self.cache.keep(torch.tensor(keep, dtype=torch.long, device=chosen.device))
            self.sampler.keep(keep)
        return chosen, keep

    def _result(self, i: int, flag: int) -> GenerationResult:
        request = self.requests[i]
        return GenerationResult(tokens=list(request.prompt) + self.generated[i], prompt_length=len(request.prompt),
                                finish_reason=FINISH_REASONS[flag], logprobs=self.logprobs[i],
                                top_logprobs=self.top_logprobs[i])
