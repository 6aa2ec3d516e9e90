"""OpenAI-style chat: ``POST /v1/chat/completions``, whole or streamed, for tokenizers that carry a
chat template (see :mod:`mega.inference.chat_template`); without one, a 400 that says so.

The conversation is rendered by the template (with the prompt that opens the assistant's
turn) and tokenized; the reply is generated as a completion of that text and stops at the
tokenizer's end of document or a ``stop`` string. Fields: those of completions that apply
(``temperature``, ``top_p``, ``top_k``, ``n``, ``stop``, ``seed``, ``logit_bias``, penalties,
``stream``, ``stream_options``), ``max_tokens`` or ``max_completion_tokens`` (default: up to the
model's positions), ``logprobs`` and ``top_logprobs``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mega.inference.chat_template import ChatTemplateError, template_messages
from mega.inference.completion_text import TextStream, completion_text
from mega.inference.engine import GenerationRequest, GenerationResult
from mega.inference.engine.stopping import StopRules
from mega.inference.http import openai_fields
from mega.inference.http.errors import RequestError
from mega.inference.http.openai_fields import MAX_TOP_LOGPROBS, Flag, Integer, SamplingFields
from mega.inference.http.service import InferenceService
from mega.inference.http.sse import StreamWriter, data_line, sse_response


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        return template_messages([self.model_dump(exclude_none=True)])[0]


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1, description="the conversation so far")
    max_tokens: Integer | None = Field(None, ge=0, description="tokens to generate (default: up to the model's "
                                       "positions)")
    max_completion_tokens: Integer | None = Field(None, ge=0, description="the same as max_tokens")
    logprobs: Flag = Field(False, description="log-probabilities of the reply's tokens")
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                         description="with logprobs: this many alternatives per token")

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def chat_router(service: InferenceService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", summary="OpenAI-style chat completion",
                 responses={200: {"content": {"text/event-stream": {}}, "description": "a chat.completion; with "
                                  "stream: server-sent events of chat.completion.chunk, then [DONE]"}})
    async def chat(body: ChatRequest, request: Request):
        openai_fields.check_model(service.model_name, body.model)
        template = service.chat_template
        if template is None:
            raise RequestError("messages: the tokenizer of this model has no chat template (chat_template in "
                               "tokenizer_config.json); use /v1/completions", "messages")
        messages = [m.as_template_input() for m in body.messages]

        def render() -> list[int]:
            try:
                text = template.render(messages)
            except ChatTemplateError as error:
                raise RequestError(f"messages: {error}", "messages") from None
            return service.tokenize(text, "messages")

        prompt = await service.off_loop(render)
        stop = StopRules(stop_ids=frozenset({service.tokenizer.eod}), stop_strings=tuple(body.stop))
        limit = body.token_limit if body.token_limit is not None else max(service.max_positions - len(prompt), 0)
        requests = [GenerationRequest(prompt=prompt, max_new_tokens=limit,
                                      sampling=body.sampling(copy, service.engine.vocab_size), stop=stop,
                                      logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0)
                    for copy in range(body.copies)]
        header = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=service.model_name)
        if body.stream:
            job = service.submit(requests, "messages", stream=True)
            return sse_response(job, _ChatWriter(service, body, requests, header))
        results = await service.complete(requests, "messages", request.receive)
        return await service.off_loop(_response, service, body, results, header, stop)

    return router


def _token_logprobs(service: InferenceService, token: int, value: float, top) -> dict:
    text = service.detokenize([token])
    entry = {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", errors="replace"))}
    alternatives = []
    for alternative, alternative_value in top or []:
        alternative_text = service.detokenize([alternative])
        alternatives.append({"token": alternative_text, "logprob": alternative_value,
                             "bytes": list(alternative_text.encode("utf-8", errors="replace"))})
    return {**entry, "top_logprobs": alternatives}


def _response(service: InferenceService, body: ChatRequest, results: list[GenerationResult], header: dict,
              stop: StopRules) -> dict:
    choices = []
    for index, result in enumerate(results):
        text = completion_text(service.tokenizer, result.generated, stop)
        logprobs = None
        if body.logprobs:
            generated = [t for t in result.generated if t not in stop.stop_ids]
            start = result.prompt_length - 1
            tops = result.top_logprobs[start:] if result.top_logprobs is not None else [None] * len(generated)
            content, offset = [], 0
            for token, value, top in zip(generated, result.logprobs[start:], tops, strict=False):
                if offset >= len(text):  # past a stop string
                    break
                content.append(_token_logprobs(service, token, value, top))
                offset += len(content[-1]["token"])
            logprobs = {"content": content}
        choices.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                        "finish_reason": "length" if result.finish_reason == "length" else "stop"})
    prompt_tokens = results[0].prompt_length
    completion_tokens = sum(len(r.generated) for r in results)
    usage = openai_fields.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens)
    return {**header, "object": "chat.completion", "choices": choices, "usage": usage.model_dump()}


class _ChatWriter(StreamWriter):
    """chat.completion.chunk events: the role first, then text pieces (their logprobs with
    them), each choice's finish, the usage (with ``stream_options.include_usage``)."""

    def __init__(self, service: InferenceService, body: ChatRequest, requests: list[GenerationRequest], header: dict):
        self.service, self.body, self.requests, self.header = service, body, requests, header
        self.include_usage = body.include_usage
        self.streams = [TextStream(service.tokenizer, request.stop) for request in requests]
        self.pending: list[list[dict]] = [[] for _ in requests]

    def event(self, choices: list[dict], usage=None) -> str:
        chunk = {**self.header, "object": "chat.completion.chunk", "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return data_line(chunk)

    def start(self) -> list[str]:
        return [self.event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for index in range(len(self.requests))]

    def token(self, index: int, token: int, logprob: float | None, top) -> list[str]:
        if self.body.logprobs and token not in self.requests[index].stop.stop_ids:
            self.pending[index].append(_token_logprobs(self.service, token, logprob, top))
        piece = self.streams[index].push(token)
        if not piece:
            return []
        logprobs = {"content": self.pending[index]} if self.body.logprobs else None
        self.pending[index] = []
        return [self.event([{"index": index, "delta": {"content": piece}, "logprobs": logprobs,
                             "finish_reason": None}])]

    def finish(self, index: int, result: GenerationResult) -> list[str]:
        piece = self.streams[index].finish()
        delta = {"content": piece} if piece else {}
        return [self.event([{"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": "length" if result.finish_reason == "length" else "stop"}])]

    def usage(self, completion_tokens: int) -> list[str]:
        prompt_tokens = len(self.requests[0].prompt)
        usage = openai_fields.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                    total_tokens=prompt_tokens + completion_tokens)
        return [self.event([], usage.model_dump())]
