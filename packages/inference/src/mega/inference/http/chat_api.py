"""OpenAI-style chat: ``POST /v1/chat/completions``, whole or streamed, for tokenizers that carry a
chat template (see :mod:`mega.inference.chat_template`); without one, a 400 that says so.

The conversation is rendered by the template (with the prompt that opens the assistant's
turn) and tokenized; the reply is generated as a completion of that text and stops at the
tokenizer's end of document or a ``stop`` string. Fields: those of completions that apply
(``temperature``, ``top_p``, ``top_k``, ``n``, ``stop``, ``seed``, ``logit_bias``, penalties,
``stream``, ``stream_options``), ``max_tokens`` or ``max_completion_tokens`` (default: up to the
model's positions), ``logprobs`` and ``top_logprobs``, the structured-output fields
(``response_format``, ``guided_*``), ``tools`` and ``tool_choice`` (calls parsed into
``tool_calls`` by :mod:`~mega.inference.http.tool_calls`; ``required`` and a named function
generated under a grammar), and reasoning text split into ``reasoning_content``
(:mod:`~mega.inference.http.reasoning`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mega.inference.chat_template import ChatTemplateError, template_messages
from mega.inference.completion_text import TextStream, completion_text
from mega.inference.engine import GenerationRequest, GenerationResult
from mega.inference.engine.stopping import StopRules
from mega.inference.http import openai_fields, reasoning, tool_calls
from mega.inference.http.errors import RequestError
from mega.inference.http.openai_fields import MAX_TOP_LOGPROBS, Flag, Integer, SamplingFields
from mega.inference.http.service import InferenceService
from mega.inference.http.sse import StreamWriter, data_line, sse_response


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class AssistantToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, description="an assistant's calls (round trips)")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    reasoning_content: str | None = Field(None, description="accepted and left out of the prompt")

    def as_template_input(self) -> dict:
        message = template_messages([self.model_dump(exclude_none=True)])[0]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # arguments as objects: the templates write them with tojson
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        return message


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionSpec(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: Flag | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1, description="the conversation so far")
    max_tokens: Integer | None = Field(None, ge=0, description="tokens to generate (default: up to the model's "
                                       "positions)")
    max_completion_tokens: Integer | None = Field(None, ge=0, description="the same as max_tokens")
    logprobs: Flag = Field(False, description="log-probabilities of the reply's tokens")
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                         description="with logprobs: this many alternatives per token")
    tools: list[Tool] | None = Field(None, description="functions the model may call (the template renders them)")
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        None, description="auto (default with tools), none, required, or a named function: a call always follows")
    parallel_tool_calls: Flag | None = Field(None, description="accepted (a forced call is one call)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in [t.function.name for t in self.tools]:
                raise ValueError(f"tool_choice: no tool is named {self.tool_choice.function.name!r}")
        if self.forces_call and self.constraint() is not None:
            raise ValueError("tool_choice: a forced call cannot also follow response_format or a guided_* field")
        return self

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def answer_constraint(self, format_name: str):
        """The grammar's constraint and the field that asked for it: a forced call's, else the
        response format's (or None)."""
        if not self.forces_call:
            return self.constraint()
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        tools = [t.model_dump() for t in self.tools]
        return tool_calls.forced_call(tools, format_name, name), "tool_choice"

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def chat_router(service: InferenceService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", summary="OpenAI-style chat completion",
                 responses={200: {"content": {"text/event-stream": {}}, "description": "a chat.completion; with "
                                  "stream: server-sent events of chat.completion.chunk, then [DONE]"}})
    async def chat(body: ChatRequest, request: Request):
        model = service.check_model(body.model)
        template = service.chat_template
        if template is None:
            raise RequestError("messages: the tokenizer of this model has no chat template (chat_template in "
                               "tokenizer_config.json); use /v1/completions", "messages")
        messages = [m.as_template_input() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.calls_tools else None
        texts = {}

        def render() -> list[int]:
            try:
                texts["prompt"] = template.render(messages, tools)
            except ChatTemplateError as error:
                raise RequestError(f"messages: {error}", "messages") from None
            return service.tokenize(texts["prompt"], "messages")

        prompt = await service.off_loop(render)
        thinks = service.reasoning_parser is not None or reasoning.THINK_OPEN in template.source
        answer = AnswerShape(tool_calls.format_of(template.source) if body.calls_tools else None, thinks,
                             thinks and reasoning.opened_by(texts["prompt"]))
        stop = StopRules(stop_ids=frozenset({service.tokenizer.eod}), stop_strings=tuple(body.stop))
        grammar = await service.grammar(body.answer_constraint(answer.tool_format or "llama3_json"))
        limit = body.token_limit if body.token_limit is not None else max(service.max_positions - len(prompt), 0)
        requests = [GenerationRequest(prompt=prompt, max_new_tokens=limit,
                                      sampling=body.sampling(copy, service.engine.vocab_size), stop=stop,
                                      logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0, grammar=grammar,
                                      prompt_logprobs=False)  # a reply's tokens' alone
                    for copy in range(body.copies)]
        header = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)
        if body.stream:
            job = service.submit(requests, "messages", stream=True, model=model)
            return sse_response(job, _ChatWriter(service, body, requests, header, answer))
        results = await service.complete(requests, "messages", request.receive, model=model)
        return await service.off_loop(_response, service, body, results, header, stop, answer)

    return router


@dataclass
class AnswerShape:
    """How a chat answer's text is split: calls in ``tool_format`` (None: no tools), reasoning
    (``reasoning``; ``opened``: the prompt opened the think block)."""

    tool_format: str | None
    reasoning: bool
    opened: bool = False

    def message(self, text: str) -> tuple[dict, bool]:
        """The answer's message fields, and whether it holds calls."""
        fields: dict = {}
        if self.reasoning:
            fields["reasoning_content"], text = reasoning.split(text, self.opened)
        calls = []
        if self.tool_format is not None:
            text, calls = tool_calls.parse(text, self.tool_format)
        fields["content"] = text if text or not calls else None
        if calls:
            fields["tool_calls"] = [call.as_openai(index) for index, call in enumerate(calls)]
        return fields, bool(calls)


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
              stop: StopRules, answer: AnswerShape) -> dict:
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
        fields, called = answer.message(text)
        reason = "length" if result.finish_reason == "length" else "tool_calls" if called else "stop"
        choices.append({"index": index, "message": {"role": "assistant", **fields}, "logprobs": logprobs,
                        "finish_reason": reason})
    prompt_tokens = results[0].prompt_length
    completion_tokens = sum(len(r.generated) for r in results)
    usage = openai_fields.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens)
    return {**header, "object": "chat.completion", "choices": choices, "usage": usage.model_dump()}


class _ChatWriter(StreamWriter):
    """chat.completion.chunk events: the role first, then text pieces (their logprobs with
    them), each choice's finish, the usage (with ``stream_options.include_usage``)."""

    def __init__(self, service: InferenceService, body: ChatRequest, requests: list[GenerationRequest], header: dict,
                 answer: AnswerShape):
        self.service, self.body, self.requests, self.header, self.answer = service, body, requests, header, answer
        self.include_usage = body.include_usage
        self.streams = [TextStream(service.tokenizer, request.stop) for request in requests]
        self.pending: list[list[dict]] = [[] for _ in requests]
        self.thoughts = [reasoning.ReasoningStream(answer.opened) if answer.reasoning else None for _ in requests]
        self.calls = [_CallHolder(answer.tool_format) if answer.tool_format else None for _ in requests]

    def _deltas(self, index: int, piece: str, final: bool = False) -> list[dict]:
        """The piece as deltas: reasoning apart, a call's text held back to its end."""
        thoughts, calls = self.thoughts[index], self.calls[index]
        parts = thoughts.push(piece) if thoughts is not None else [("content", piece)] if piece else []
        if final and thoughts is not None:
            parts += thoughts.finish()
        deltas = []
        for field, text in parts:
            if field == "content" and calls is not None:
                text = calls.push(text)
            if text:
                deltas.append({field: text})
        if final and calls is not None:
            deltas += calls.finish()
        return deltas

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
        if self.thoughts[index] is None and self.calls[index] is None:
            deltas = [{"content": piece}]
        else:
            deltas = self._deltas(index, piece)
        if not deltas:
            return []
        logprobs = {"content": self.pending[index]} if self.body.logprobs else None
        self.pending[index] = []
        return [self.event([{"index": index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                             "finish_reason": None}]) for k, delta in enumerate(deltas)]

    def finish(self, index: int, result: GenerationResult) -> list[str]:
        deltas = self._deltas(index, self.streams[index].finish(), final=True) or [{}]
        called = any("tool_calls" in delta for delta in deltas)
        reason = "length" if result.finish_reason == "length" else "tool_calls" if called else "stop"
        return [self.event([{"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": reason if k == len(deltas) - 1 else None}])
                for k, delta in enumerate(deltas)]

    def usage(self, completion_tokens: int) -> list[str]:
        prompt_tokens = len(self.requests[0].prompt)
        usage = openai_fields.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                    total_tokens=prompt_tokens + completion_tokens)
        return [self.event([], usage.model_dump())]


class _CallHolder:
    """A streamed answer's content, held back from where a call may begin: the calls go out
    whole at the end (one ``tool_calls`` delta each), or the text if it holds none."""

    def __init__(self, format_name: str):
        self.format_name, self.start = format_name, tool_calls.call_start(format_name)
        self.sent, self.held = "", ""
        self.calling = False

    def push(self, text: str) -> str:
        """What may go out as content now."""
        self.held += text
        if self.calling:
            return ""
        if self.format_name == "llama3_json":  # a call is the whole answer: it starts with "{"
            if not (self.sent + self.held).strip():
                return ""
            if not self.sent and self.held.lstrip().startswith(("{", "<|python_tag|>")):
                self.calling = True
                return ""
            out, self.held = self.held, ""
            self.sent += out
            return out
        at = self.held.find(self.start)
        if at >= 0:
            out, self.held, self.calling = self.held[:at], self.held[at:], True
            self.sent += out
            return out
        keep = next((len(self.held) - i for i in range(len(self.held)) if self.start.startswith(self.held[i:])), 0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent += out
        return out

    def finish(self) -> list[dict]:
        held, self.held = self.held, ""
        if not held:
            return []
        content, calls = tool_calls.parse(held, self.format_name)
        if not calls:
            return [{"content": held}]
        deltas = [{"content": content}] if content else []
        return deltas + [{"tool_calls": [call.as_openai(index)]} for index, call in enumerate(calls)]
