"""OpenAI-style completions: ``POST /v1/completions``, whole or streamed as server-sent events.

Fields: ``prompt`` (a string, a list of up to 128 strings, a list of token ids, or a list of
lists of token ids), ``max_tokens`` (16; null: up to the model's positions), ``temperature``
(1.0; 0 is greedy), ``top_p`` (1.0), ``top_k`` (0: off; mega's extension), ``stop`` (up to 4
strings, left out of the text and of the logprobs), ``echo`` (the prompt before the
completion), ``logprobs`` (null, or how many most likely alternatives to list per token, up to
20), ``seed`` (sequence i draws from seed + i), ``n`` and ``best_of`` (``best_of`` sequences per
prompt, the ``n`` with the highest mean log-probability per token returned), ``logit_bias``,
``presence_penalty``, ``frequency_penalty``, ``stream``, ``stream_options.include_usage``,
``user`` (ignored), ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` (structured outputs,
:mod:`~mega.inference.engine.grammar`). ``suffix`` is refused unless empty: these models only continue text.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator, model_validator

from mega.inference.completion_text import TextStream, completion_text, tokens_covering
from mega.inference.engine import GenerationRequest, GenerationResult
from mega.inference.engine.stopping import StopRules
from mega.inference.http.openai_fields import (
    MAX_SEQUENCES,
    MAX_TOP_LOGPROBS,
    Flag,
    Integer,
    SamplingFields,
    Usage,
)
from mega.inference.http.service import MAX_PROMPTS, InferenceService
from mega.inference.http.sse import StreamWriter, data_line, sse_response

# The limits (how many, none empty) are checked after the shape, so their messages name them.
Prompt = str | list[str] | list[Integer] | list[list[Integer]]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description=f"a string, a list of up to {MAX_PROMPTS} strings, a list of token ids, or a "
                           f"list of up to {MAX_PROMPTS} such lists")
    suffix: str | None = Field(None, description="refused unless empty: the models only continue text")
    max_tokens: Integer | None = Field(16, ge=0, description="tokens to generate per sequence; null: up to the "
                                       "model's positions")
    echo: Flag = Field(False, description="return the prompt before the completion")
    logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="log-probabilities, with this many alternatives per token")
    best_of: Integer | None = Field(None, ge=1, le=MAX_SEQUENCES,
                                    description="sequences generated per prompt, the n best returned")

    @field_validator("prompt")
    @classmethod
    def _prompt_list(cls, prompt):
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("prompt: must not be empty (a string, strings, token ids or lists of token ids)")
        if not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"prompt: {len(prompt)} prompts, more than the {MAX_PROMPTS} a request may hold")
        if isinstance(prompt[0], list) and (empty := [i for i, ids in enumerate(prompt) if not ids]):
            raise ValueError(f"prompt[{empty[0]}]: an empty list of token ids (a prompt needs at least one)")
        return prompt

    @model_validator(mode="after")
    def _consistent(self):
        if self.suffix:
            raise ValueError("suffix: not supported (the models continue text left to right); leave it out")
        if self.best_of is not None and self.best_of < self.copies:
            raise ValueError(f"best_of: must be >= n ({self.copies}), got {self.best_of}")
        if self.stream and self.sequences_per_prompt > self.copies:
            raise ValueError("best_of: cannot stream when best_of > n")
        if len(self.prompts) * self.sequences_per_prompt > MAX_SEQUENCES:
            raise ValueError(f"n: {len(self.prompts)} prompts x {self.sequences_per_prompt} sequences each is more "
                             f"than {MAX_SEQUENCES}")
        return self

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return self.prompt

    @property
    def sequences_per_prompt(self) -> int:
        return self.best_of or self.copies


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
    async def complete(body: CompletionRequest, request: Request):
        model = service.check_model(body.model)
        prompts = await _prompt_ids(service, body)
        stop = StopRules(stop_ids=frozenset({service.tokenizer.eod}), stop_strings=tuple(body.stop))
        grammar = await service.grammar(body.constraint())
        requests = []
        for index, ids in enumerate(prompts):
            for copy in range(body.sequences_per_prompt):
                sequence = index * body.sequences_per_prompt + copy
                max_tokens = body.max_tokens if body.max_tokens is not None else service.max_positions - len(ids)
                requests.append(GenerationRequest(
                    prompt=ids, max_new_tokens=max_tokens, sampling=body.sampling(sequence, service.engine.vocab_size),
                    stop=stop, logprobs=body.logprobs is not None or body.sequences_per_prompt > body.copies,
                    top_logprobs=body.logprobs or 0, grammar=grammar,
                    prompt_logprobs=body.echo))  # the prompt's are shown only with echo
        header = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)
        if body.stream:
            job = service.submit(requests, "prompt", stream=True, model=model)
            prompt_texts = await service.off_loop(lambda: [service.detokenize(ids) for ids in prompts],
                                                  size=sum(len(ids) for ids in prompts))
            return sse_response(job, _CompletionWriter(service, body, requests, prompt_texts, header))
        results = await service.complete(requests, "prompt", request.receive, model=model)
        return await service.off_loop(_completion, service, body, prompts, results, header,
                                      size=sum(len(result.tokens) for result in results))

    return router


async def _prompt_ids(service: InferenceService, body: CompletionRequest) -> list[list[int]]:
    prompts = body.prompts
    many = len(prompts) > 1
    if prompts and isinstance(prompts[0], str):
        return await service.tokenize_all(prompts, "prompt")
    return [service.check_ids(ids, f"prompt[{i}]" if many else "prompt") for i, ids in enumerate(prompts)]


def _completion(service: InferenceService, body: CompletionRequest, prompts: list[list[int]],
                results: list[GenerationResult], header: dict) -> Completion:
    choices = []
    per_prompt = body.sequences_per_prompt
    for index, ids in enumerate(prompts):
        candidates = results[index * per_prompt: (index + 1) * per_prompt]
        if per_prompt > body.copies:
            candidates = sorted(candidates, key=_mean_logprob, reverse=True)[: body.copies]
        prompt_text = service.detokenize(ids)
        for copy, result in enumerate(candidates):
            choices.append(_choice(service, body, index * body.copies + copy, prompt_text, result))
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(r.generated) for r in results)
    return Completion(**header, choices=choices, usage=Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens))


def _mean_logprob(result: GenerationResult) -> float:
    generated = result.logprobs[result.prompt_length - 1:]
    return sum(generated) / len(generated) if generated else 0.0


def _choice(service: InferenceService, body: CompletionRequest, index: int, prompt_text: str,
            result: GenerationResult) -> Choice:
    rules = StopRules(stop_ids=frozenset({service.tokenizer.eod}), stop_strings=tuple(body.stop))
    text = completion_text(service.tokenizer, result.generated, rules)
    logprobs = None
    if body.logprobs is not None:
        generated = result.generated
        ended_by_token = bool(generated) and generated[-1] in rules.stop_ids
        if ended_by_token:
            generated = generated[:-1]
        kept = tokens_covering(service.tokenizer, generated, len(text))
        if ended_by_token and kept == len(generated):
            kept += 1  # the end-of-text token was generated (and scored) too, as OpenAI lists it
        first = 0 if body.echo else result.prompt_length
        tokens = result.tokens[first: result.prompt_length + kept]
        values = ([None] + result.logprobs)[first: first + len(tokens)]
        tops = ([None] + result.top_logprobs)[first: first + len(tokens)] if body.logprobs > 0 else None
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
        top_logprobs = [None if top is None else _top_dict(service, top) for top in tops]
    return Logprobs(tokens=texts, token_logprobs=values, top_logprobs=top_logprobs, text_offset=offsets)


def _top_dict(service: InferenceService, top: list[tuple[int, float]]) -> dict[str, float]:
    """Alternatives by their text; two tokens with the same text keep the likelier."""
    alternatives: dict[str, float] = {}
    for token, value in top:
        alternatives.setdefault(service.detokenize([token]), value)
    return alternatives


class _StreamedChoice:
    """One sequence of a stream: its text so far and the tokens whose logprobs are not sent yet.

    A token's logprobs go out with the event whose text reaches it (so text held back for a
    possible stop string holds its tokens back too); at the end, the tokens the whole text
    needs (:func:`tokens_covering`) and the end-of-text token that ended it, nothing after.
    """

    def __init__(self, service: InferenceService, rules: StopRules, offset: int):
        self.service, self.rules = service, rules
        self.text = TextStream(service.tokenizer, rules)
        self.ids: list[int] = []  # every generated token
        self.pending: list[tuple[int, float | None, list | None]] = []
        self.sent_tokens = 0  # tokens whose logprobs were sent
        self.offset = offset  # text offset of the next token, counted from the echoed prompt's start
        self.base = offset  # where the completion's text begins

    def logprobs(self, with_top: bool, final: bool = False) -> Logprobs:
        if final:
            text_ids = [t for t in self.ids if t not in self.rules.stop_ids]
            count = tokens_covering(self.service.tokenizer, text_ids, self.text.sent) - self.sent_tokens
            if len(self.ids) > len(text_ids) and count == len(text_ids) - self.sent_tokens:
                count += 1  # the end-of-text token that ended a text no stop string cut
        else:
            count = 0
            offset = self.offset
            for token, _, _ in self.pending:
                if offset - self.base >= self.text.sent:
                    break
                offset += len(self.service.detokenize([token]))
                count += 1
        ready, self.pending = self.pending[:max(count, 0)], self.pending[max(count, 0):]
        self.sent_tokens += len(ready)
        tokens, values, tops, offsets = [], [], [], []
        for token, value, top in ready:
            text = self.service.detokenize([token])
            tokens.append(text)
            values.append(value)
            tops.append(_top_dict(self.service, top) if top is not None else None)
            offsets.append(self.offset)
            self.offset += len(text)
        return Logprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops if with_top else None,
                        text_offset=offsets)


class _CompletionWriter(StreamWriter):
    """Server-sent events: text pieces as they are generated, each choice's finish, the usage
    (with ``stream_options.include_usage``)."""

    def __init__(self, service: InferenceService, body: CompletionRequest, requests: list[GenerationRequest],
                 prompt_texts: list[str], header: dict):
        self.body, self.requests, self.prompt_texts, self.header = body, requests, prompt_texts, header
        self.include_usage = body.include_usage
        self.with_top = bool(body.logprobs)
        self.choices = [_StreamedChoice(service, request.stop, len(prompt_texts[index // body.copies]))
                        for index, request in enumerate(requests)]

    def event(self, index: int, text: str, finish_reason=None, logprobs=None) -> str:
        # Completion's fields as a plain dict, as the chat route streams: building and dumping the
        # model per token cost the event loop more than the rest of the token's way out.
        choice = {"text": text, "index": index, "logprobs": None if logprobs is None else logprobs.model_dump(),
                  "finish_reason": finish_reason}
        chunk = {**self.header, "object": "text_completion", "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return data_line(chunk)

    def start(self) -> list[str]:
        if not self.body.echo:
            return []
        return [self.event(index, self.prompt_texts[index // self.body.copies]) for index in range(len(self.requests))]

    def token(self, index: int, token: int, logprob: float | None, top) -> list[str]:
        choice = self.choices[index]
        choice.ids.append(token)
        choice.pending.append((token, logprob, top))
        piece = choice.text.push(token)
        if not piece:
            return []
        logprobs = choice.logprobs(self.with_top) if self.body.logprobs is not None else None
        return [self.event(index, piece, logprobs=logprobs)]

    def finish(self, index: int, result: GenerationResult) -> list[str]:
        choice = self.choices[index]
        reason = "length" if result.finish_reason == "length" else "stop"
        piece = choice.text.finish()
        logprobs = choice.logprobs(self.with_top, final=True) if self.body.logprobs is not None else None
        return [self.event(index, piece, reason, logprobs)]

    def usage(self, completion_tokens: int) -> list[str]:
        prompt_tokens = sum(len(request.prompt) for request in self.requests)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
        return [data_line(Completion(**self.header, choices=[], usage=usage).model_dump())]
