"""Megatron's text-generation API: ``PUT /api``, with its fields, defaults and rules.

Request: ``prompts`` (1 to 128 strings), ``tokens_to_generate`` (64, >= 0; 0 needs ``logprobs``),
``logprobs`` (false), ``temperature`` (1.0, in (0, 100]), ``top_k`` (0, <= 1000; 1 is greedy),
``top_p`` (0.0, <= 1; not with ``top_k``), ``add_BOS``, ``stop_on_eol``, ``stop_on_double_eol``,
``random_seed`` (>= 0; prompt i draws from seed + i), ``stop_token`` (default: the tokenizer's
end of document). The retired ``max_len``, ``sentences`` and ``beam_width`` are refused, and so
is any other field Megatron does not define (a misspelling is never silently ignored).
Response: ``text`` (prompt and generation), ``segments`` (each token's text), ``logprobs`` (of
every token after the first, or null) and ``tokens``, one entry per prompt.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from mega.inference.engine import GenerationRequest
from mega.inference.engine.sampling import SEED_LIMIT, SamplingParams
from mega.inference.engine.stopping import StopRules
from mega.inference.http.service import MAX_PROMPTS, InferenceService

Number = Annotated[float, Strict()]  # an int or a float, never a string or a bool
Integer = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]

RETIRED_FIELDS = {
    "max_len": "max_len is no longer used; replace it with tokens_to_generate",
    "sentences": "sentences is no longer used; replace it with prompts",
    "beam_width": "beam_width: beam search is not supported",
}


class MegatronRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(min_length=1, max_length=MAX_PROMPTS, description="texts to continue")
    tokens_to_generate: Integer = Field(64, ge=0, description="tokens to generate per prompt")
    logprobs: Flag = Field(False, description="return the log-probability of every token after the first")
    temperature: Number = Field(1.0, gt=0.0, le=100.0, description="softmax temperature, in (0, 100]")
    top_k: Integer = Field(0, ge=0, le=1000, description="sample from the k most likely tokens; 1 is greedy")
    top_p: Number = Field(0.0, ge=0.0, le=1.0, description="nucleus sampling; not together with top_k")
    add_BOS: Flag = Field(False, description="prepend the beginning-of-sequence token")
    stop_on_eol: Flag = Field(False, description="stop at a token holding a newline")
    stop_on_double_eol: Flag = Field(False, description="stop at two newlines in a row")
    random_seed: Integer | None = Field(None, ge=0, lt=SEED_LIMIT,
                                        description="seed of the sampling, in [0, 2**64) (prompt i: seed + i)")
    stop_token: Integer | None = Field(None, ge=0, description="token id that ends a generation "
                                       "(default: end of document)")

    @model_validator(mode="before")
    @classmethod
    def _no_retired_fields(cls, data):
        if isinstance(data, dict):
            for name, message in RETIRED_FIELDS.items():
                if name in data:
                    raise ValueError(message)
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_k > 0 and self.top_p > 0:
            raise ValueError("top_k and top_p: cannot set both top-k and top-p sampling")
        if self.tokens_to_generate == 0 and not self.logprobs:
            raise ValueError("tokens_to_generate: 0 tokens to generate needs logprobs=true")
        if not self.add_BOS and any(not prompt for prompt in self.prompts):
            raise ValueError("prompts: an empty prompt needs add_BOS=true")
        return self


class MegatronResponse(BaseModel):
    text: list[str]
    segments: list[list[str]]
    logprobs: list[list[float]] | None
    tokens: list[list[int]]


def megatron_router(service: InferenceService) -> APIRouter:
    router = APIRouter()

    @router.put("/api", response_model=MegatronResponse, summary="Megatron's text generation")
    async def generate(body: MegatronRequest, request: Request) -> MegatronResponse:
        stop_id = body.stop_token if body.stop_token is not None else service.tokenizer.eod
        stop = StopRules(stop_ids=frozenset({stop_id}), stop_on_eol=body.stop_on_eol,
                         stop_on_double_eol=body.stop_on_double_eol)
        prompts = await service.tokenize_all(body.prompts, "prompts", body.add_BOS)
        requests = [
            GenerationRequest(
                prompt=ids, max_new_tokens=body.tokens_to_generate,
                sampling=SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                        seed=None if body.random_seed is None else (body.random_seed + index) % SEED_LIMIT),
                stop=stop, logprobs=body.logprobs,
            )
            for index, ids in enumerate(prompts)
        ]
        results = await service.complete(requests, "prompts", request.receive)

        def response() -> MegatronResponse:
            return MegatronResponse(
                text=[service.detokenize(r.tokens) for r in results],
                segments=[[service.detokenize([t]) for t in r.tokens] for r in results],
                logprobs=[r.logprobs for r in results] if body.logprobs else None,
                tokens=[r.tokens for r in results],
            )

        return await service.off_loop(response)

    return router
