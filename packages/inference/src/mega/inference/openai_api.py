"""OpenAI-style completions: ``POST /v1/completions``, whole or streamed as server-sent events.

Fields: ``prompt`` (a string or up to 128), ``max_tokens`` (16), ``temperature`` (1.0; 0 is
greedy), ``top_p`` (1.0), ``top_k`` (0: off; mega's extension), ``stop`` (up to 4 strings, left
out of the text), ``echo`` (the prompt before the completion), ``logprobs`` (null, or how many
most likely alternatives to list per token, up to 20), ``seed`` (prompt i draws from seed + i),
``stream``. ``n`` must be 1; other OpenAI fields are accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from mega.inference.completion_text import TextStream, completion_text
from mega.inference.engine import GenerationRequest, GenerationResult
from mega.inference.sampling import GREEDY, SamplingParams
from mega.inference.service import MAX_PROMPTS, InferenceService
from mega.inference.stopping import StopRules

Number = Annotated[float, Strict()]
Integer = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="accepted for compatibility; the server has one model")
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: Integer = Field(16, ge=0, description="tokens to generate per prompt")
    temperature: Number = Field(1.0, ge=0.0, le=100.0, description="0 is greedy")
    top_p: Number = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 is off")
    top_k: Integer = Field(0, ge=0, description="sample from the k most likely tokens; 0 is off")
    stop: str | list[str] | None = Field(None, validate_default=True,
                                         description=f"up to {MAX_STOP_STRINGS} stop strings")
    echo: Flag = Field(False, description="return the prompt before the completion")
    logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="log-probabilities, with this many alternatives per token")
    seed: Integer | None = Field(None, description="seed of the sampling (prompt i: seed + i)")
    stream: Flag = Field(False, description="send the completion as server-sent events")
    n: Integer = Field(1, ge=1, le=1, description="completions per prompt (only 1)")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt

    def sampling(self, index: int) -> SamplingParams:
        if self.temperature == 0 or self.top_k == 1:
            return GREEDY
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed)


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class Choice(BaseModel):
    text: str
    index: int
    logprobs: Logprobs | None
    finish_reason: Literal["stop", "length"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


def completions_router(service: InferenceService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", response_model=Completion, response_model_exclude_none=False,
                 summary="OpenAI-style text completion",
                 responses={200: {"content": {"text/event-stream": {}}, "description": "with stream: "
                                  "server-sent events of Completion chunks, then [DONE]"}})
    async def complete(body: CompletionRequest):
        stop = StopRules(stop_ids=frozenset({service.tokenizer.eod}), stop_strings=tuple(body.stop))
        requests = [
            GenerationRequest(prompt=service.tokenize(prompt, "prompt"), max_new_tokens=body.max_tokens,
                              sampling=body.sampling(index), stop=stop, logprobs=body.logprobs is not None,
                              top_logprobs=body.logprobs or 0)
            for index, prompt in enumerate(body.prompts)
        ]
        header = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=service.model_name)
        if body.stream:
            job = service.submit(requests, "prompt", stream=True)
            return StreamingResponse(_events(service, body, requests, job, header), media_type="text/event-stream")
        results = await service.complete(requests, "prompt")
        choices = [_choice(service, body, index, result) for index, result in enumerate(results)]
        prompt_tokens = sum(r.prompt_length for r in results)
        completion_tokens = sum(len(r.generated) for r in results)
        return Completion(**header, choices=choices, usage=Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens))

    return router


def _choice(service: InferenceService, body: CompletionRequest, index: int, result: GenerationResult) -> Choice:
    rules = StopRules(stop_ids=frozenset({service.tokenizer.eod}), stop_strings=tuple(body.stop))
    text = completion_text(service.tokenizer, result.generated, rules)
    prompt_text = body.prompts[index]
    logprobs = None
    if body.logprobs is not None:
        generated = result.generated
        if generated and generated[-1] in rules.stop_ids:
            generated = generated[:-1]
        first = 0 if body.echo else result.prompt_length
        tokens = result.tokens[first: result.prompt_length + len(generated)]
        values = ([None] + result.logprobs)[first: first + len(tokens)]
        tops = None
        if body.logprobs > 0:
            tops = ([None] + result.top_logprobs)[first: first + len(tokens)]
        logprobs = _logprobs(service, tokens, values, tops, 0 if body.echo else len(prompt_text))
    return Choice(text=(prompt_text if body.echo else "") + text, index=index, logprobs=logprobs,
                  finish_reason="length" if result.finish_reason == "length" else "stop")


def _logprobs(service: InferenceService, tokens, values, tops, offset: int) -> Logprobs:
    texts = [service.detokenize([t]) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top_logprobs = None
    if tops is not None:
        top_logprobs = [None if top is None else {service.detokenize([t]): v for t, v in top} for top in tops]
    return Logprobs(tokens=texts, token_logprobs=values, top_logprobs=top_logprobs, text_offset=offsets)


async def _events(service: InferenceService, body: CompletionRequest, requests: list[GenerationRequest], job, header):
    """Server-sent events: text pieces as they are generated, each choice's finish, [DONE]."""

    def event(index: int, text: str, finish_reason=None, logprobs=None) -> str:
        choice = Choice(text=text, index=index, logprobs=logprobs, finish_reason=finish_reason)
        return f"data: {json.dumps(Completion(**header, choices=[choice]).model_dump(exclude={'usage'}))}\n\n"

    streams = [TextStream(service.tokenizer, request.stop) for request in requests]
    pending: list[list[tuple[int, float | None]]] = [[] for _ in requests]  # tokens not sent yet
    try:
        if body.echo:
            for index, prompt in enumerate(body.prompts):
                yield event(index, prompt)
        unfinished = len(requests)
        while unfinished:
            kind, *details = await job.events.get()
            if kind == "failed":
                yield f"data: {json.dumps({'error': {'message': str(details[0]), 'type': 'server_error'}})}\n\n"
                return
            index = details[0]
            if kind == "token":
                token, logprob = details[1], details[2]
                pending[index].append((token, logprob))
                piece = streams[index].push(token)
                if piece:
                    yield event(index, piece, logprobs=_streamed_logprobs(service, body, pending[index]))
            else:
                unfinished -= 1
                result = details[1]
                reason = "length" if result.finish_reason == "length" else "stop"
                yield event(index, streams[index].finish(), reason, _streamed_logprobs(service, body, pending[index]))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client left (or all is done: then it changes nothing)


def _streamed_logprobs(service: InferenceService, body: CompletionRequest, pending: list) -> Logprobs | None:
    """The log-probabilities of the tokens since the last event (alternatives are not streamed)."""
    if body.logprobs is None:
        return None
    tokens, values = [t for t, _ in pending], [v for _, v in pending]
    pending.clear()
    return _logprobs(service, tokens, values, None, 0)
