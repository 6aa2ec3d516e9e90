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

from mega.core.parallel import Group
from mega.inference.decode_step import DecodingSequence
from mega.inference.engine import (
    EngineBase,
    FinishCallback,
    GenerationError,
    GenerationRequest,
    GenerationResult,
    TokenCallback,
)
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

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], on_token: TokenCallback | None = None,
                 on_finish: FinishCallback | None = None) -> list[GenerationResult]:
        for request in requests:
            self.check(request)
        return _encoder_decoder_run(self, list(requests), on_token, on_finish)


def _encoder_decoder_run(engine: EncoderDecoderEngine, requests: list[GenerationRequest],
                         on_token: TokenCallback | None, on_finish: FinishCallback | None) -> list[GenerationResult]:
    """Encode every prompt once, then decode from the start token; each step's logits go to the
    shared :class:`~mega.inference.decode_step.DecodeStep`, and finished rows leave the encoder
    output, its padding and the caches."""
    device, model = engine.device, engine.model
    longest = max(len(r.prompt) for r in requests)
    prompts = torch.full((len(requests), longest), PAD_TOKEN, dtype=torch.long, device=device)
    padding = torch.zeros(len(requests), longest, dtype=torch.bool, device=device)
    for row, request in enumerate(requests):
        prompts[row, : len(request.prompt)] = torch.tensor(request.prompt, device=device)
        padding[row, : len(request.prompt)] = True
    # The decoder predicts no prompt token: those positions' log-probabilities are None.
    sequences = [DecodingSequence(r, logprobs=[None] * (len(r.prompt) - 1) if r.logprobs else None,
                                  top_logprobs=[None] * (len(r.prompt) - 1) if r.top_logprobs else None)
                 for r in requests]
    step = engine.batch_step(sequences, on_token, on_finish)
    cache = engine.cache_class(max(r.max_new_tokens for r in requests))
    encoder_output = model.encode(prompts, padding)
    step.join(sequences)  # every request generates at least one token (checked)
    tokens = torch.full((len(requests), 1), engine.decoder_start_token, dtype=torch.long, device=device)
    while step.sequences:
        logits = engine.real_logits(model.decode(tokens, encoder_output, padding, cache, logits_to_keep=1)[-1])
        outcome = step(logits)
        if not step.sequences:
            break
        if len(outcome.kept) != len(outcome.chosen):
            rows = torch.tensor(outcome.kept, dtype=torch.long, device=device)
            encoder_output, padding = encoder_output[:, rows], padding[rows]
            cache.keep(rows)
        tokens = outcome.next_tokens[:, None]
    return [s.result() for s in sequences]
