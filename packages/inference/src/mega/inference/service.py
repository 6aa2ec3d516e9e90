"""``InferenceService``: what both HTTP APIs share between parsing a request and answering it.

Tokenizing, checking each sequence against the model before it queues (a bad one is the
client's 400, never a failed batch), and handing the job to the batching worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from mega.inference.batching import BatchingWorker, Job
from mega.inference.engine import GenerationEngine, GenerationError, GenerationRequest, GenerationResult

# Megatron's limit on prompts per request; the OpenAI API takes the same.
MAX_PROMPTS = 128


class RequestError(ValueError):
    """An invalid request: answered with ``status`` and a message naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass
class InferenceService:
    engine: GenerationEngine
    worker: BatchingWorker
    tokenizer: object  # mega.core.tokenizer.Tokenizer
    model_name: str

    def tokenize(self, text: str, param: str, add_bos: bool = False) -> list[int]:
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

    def submit(self, requests: list[GenerationRequest], param: str, stream: bool = False) -> Job:
        """Queue ``requests`` (after checking each; ``param`` names the prompts' field)."""
        for index, request in enumerate(requests):
            try:
                self.engine.check(request)
            except GenerationError as error:
                where = f"{param}[{index}]" if len(requests) > 1 else param
                raise RequestError(f"{where}: {error}", param) from None
        job = Job(requests, asyncio.get_running_loop(), stream=stream)
        self.worker.submit(job)
        return job

    async def complete(self, requests: list[GenerationRequest], param: str) -> list[GenerationResult]:
        """The results of ``requests``, once all have finished."""
        job = self.submit(requests, param)
        try:
            return await job.done
        finally:
            job.cancel()  # a no-op once finished; frees the batch if the handler is cancelled
