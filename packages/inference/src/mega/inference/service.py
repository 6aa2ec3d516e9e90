"""``InferenceService``: what the HTTP APIs share between parsing a request and answering it.

Tokenizing (in a worker thread, so a huge prompt never stalls the event loop), checking each
sequence against the model before it queues (a bad one is the client's 400, never a failed
batch), and handing the job to the engine's worker (its one loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from mega.inference.engine import GenerationEngine, GenerationError, GenerationRequest, GenerationResult
from mega.inference.engine.worker import EngineWorker, Job

# Megatron's limit on prompts per request; the OpenAI API takes the same.
MAX_PROMPTS = 128

T = TypeVar("T")


class RequestError(ValueError):
    """An invalid request: answered with ``status`` and a message naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


@dataclass
class InferenceService:
    engine: GenerationEngine
    worker: EngineWorker
    tokenizer: object  # mega.core.tokenizer.Tokenizer
    model_name: str
    chat_template: object | None = None  # mega.inference.chat_template.ChatTemplate
    request_timeout: float | None = None  # seconds a request may take (--request-timeout), else none

    @property
    def metrics(self):
        """The worker's :class:`~mega.inference.metrics.ServerMetrics`."""
        return self.worker.metrics

    @property
    def max_positions(self) -> int:
        return self.engine.max_positions

    def tokenize(self, text: str, param: str, add_bos: bool = False) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # JSON can carry a lone surrogate ("\ud800")
            raise RequestError(f"{param}: not valid Unicode text ({error.reason} at character {error.start})",
                               param) from None
        try:
            ids = self.tokenizer.tokenize(text)
        except ValueError as error:  # text the tokenizer cannot read (NullTokenizer: not ids)
            raise RequestError(f"{param}: {error}", param) from None
        if add_bos:
            # Megatron's add_BOS prepends the end-of-document token where there is no BOS.
            bos = self.tokenizer.bos if self.tokenizer.bos is not None else self.tokenizer.eod
            ids = [bos, *ids]
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(list(ids))

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        """Token ids a client gave, each checked against the vocabulary."""
        vocab = self.engine.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise RequestError(f"{param}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param)
        return list(ids)

    async def off_loop(self, function: Callable[..., T], *args) -> T:
        """``function(*args)`` on a worker thread: tokenizing or detokenizing megabytes takes
        seconds, during which health checks and every stream would otherwise wait."""
        return await asyncio.to_thread(function, *args)

    async def tokenize_all(self, texts: Sequence[str], param: str, add_bos: bool = False) -> list[list[int]]:
        many = len(texts) > 1

        def work() -> list[list[int]]:
            return [self.tokenize(text, f"{param}[{i}]" if many else param, add_bos) for i, text in enumerate(texts)]

        return await self.off_loop(work)

    def submit(self, requests: list[GenerationRequest], param: str, stream: bool = False) -> Job:
        """Queue ``requests`` (after checking each; ``param`` names the prompts' field)."""
        for index, request in enumerate(requests):
            try:
                self.engine.check(request)
                self.worker.check(request)
            except GenerationError as error:
                where = f"{param}[{index}]" if len(requests) > 1 else param
                raise RequestError(f"{where}: {error}", param) from None
        loop = asyncio.get_running_loop()
        job = Job(requests, loop, stream=stream)
        if self.request_timeout is not None:
            error = RequestError(f"the request took longer than the server's {self.request_timeout:g} s "
                                 "(--request-timeout)", status=408, kind="timeout")
            loop.call_later(self.request_timeout, job.expire, error)
        self.worker.submit(job)
        return job

    async def complete(self, requests: list[GenerationRequest], param: str) -> list[GenerationResult]:
        """The results of ``requests``, once all have finished."""
        job = self.submit(requests, param)
        try:
            return await job.done
        finally:
            job.cancel()  # a no-op once finished; frees the batch if the handler is cancelled
