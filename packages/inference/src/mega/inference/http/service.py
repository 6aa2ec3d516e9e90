"""``InferenceService``: what the HTTP APIs share between parsing a request and answering it.

Tokenizing (in a worker thread, so a huge prompt never stalls the event loop, after a
character pre-check so a prompt that cannot fit ``--max-model-len`` is never tokenized at all),
checking each sequence against the model before it queues (a bad one is the client's 400, never
a failed batch), admitting it (:mod:`~mega.inference.http.admission`), handing the job to the
engine's worker (its one loop), and cancelling it when its client goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from mega.inference.engine import GenerationEngine, GenerationError, GenerationRequest, GenerationResult
from mega.inference.engine.grammar import Constraint, Grammar, GrammarCompiler, GrammarError
from mega.inference.engine.lora_registry import AdapterRegistry, ServedAdapter, UnknownAdapter
from mega.inference.engine.worker import EngineWorker, Job
from mega.inference.http.admission import Admission
from mega.inference.http.errors import RequestError
from mega.inference.http.prompt_chars import PromptCharLimit

# Megatron's limit on prompts per request; the OpenAI API takes the same.
MAX_PROMPTS = 128
# Characters (or tokens) of text work done on the event loop itself: for this little a hop to a
# worker thread and back costs more than the work (and, on a busy machine, a wait for the thread).
INLINE_WORK = 4096

T = TypeVar("T")


CLIENT_GONE = 499  # nginx's "client closed request": what the metrics count for a client that left


@dataclass
class InferenceService:
    engine: GenerationEngine
    worker: EngineWorker
    tokenizer: object  # mega.core.tokenizer.Tokenizer
    model_name: str
    base_model_name: str | None = None  # with an adapter merged in: the base it adapts (/v1/models' parent)
    chat_template: object | None = None  # mega.inference.chat_template.ChatTemplate
    request_timeout: float | None = None  # seconds a request may take (--request-timeout), else none
    max_queued_sequences: int | None = None  # --max-num-queued-reqs, else no bound
    reasoning_parser: str | None = None  # --reasoning-parser: <think> text to reasoning_content
    adapters: AdapterRegistry | None = None  # LoRA adapters chosen per request by model (--lora-modules)
    admission: Admission = field(init=False)
    grammars: GrammarCompiler = field(init=False)  # structured outputs
    prompt_chars: PromptCharLimit = field(init=False)

    def __post_init__(self):
        self.admission = Admission(self.max_queued_sequences)
        self.prompt_chars = PromptCharLimit(self.tokenizer, self.max_positions)
        self.grammars = GrammarCompiler(self.tokenizer, self.engine.vocab_size)

    @property
    def metrics(self):
        """The worker's :class:`~mega.inference.engine.metrics.ServerMetrics`."""
        return self.worker.metrics

    @property
    def max_positions(self) -> int:
        return self.engine.max_positions

    def check_model(self, name: str | None) -> str:
        """The name a request's ``model`` is answered under: the base's (also when left out) or a
        served adapter's; anything else is a 404 naming what is served (OpenAI's ``model_not_found``)."""
        if name is None or name == self.model_name:
            return self.model_name
        if self.adapters is not None and name in self.adapters:
            return name
        served = ", ".join(repr(n) for n in [self.model_name, *(a.name for a in self.adapters.adapters)]) \
            if self.adapters is not None else repr(self.model_name)
        raise RequestError(f"model: the model {name!r} does not exist; this server serves {served}", "model",
                           status=404, kind="model_not_found")

    def _acquire(self, model: str | None) -> ServedAdapter | None:
        """The adapter ``model`` names, held until its request is answered (None: the base)."""
        if model is None or model == self.model_name or self.adapters is None:
            return None
        try:
            return self.adapters.acquire(model)
        except UnknownAdapter:  # unloaded since the request was read
            self.check_model(model)
            raise

    def render_metrics(self) -> str:
        return self.metrics.render(in_flight=self.admission.in_flight)

    def tokenize(self, text: str, param: str, add_bos: bool = False) -> list[int]:
        self.prompt_chars.check(text, param)  # a prompt that cannot fit is never tokenized
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # JSON can carry a lone surrogate ("\ud800")
            raise RequestError(f"{param}: not valid Unicode text ({error.reason} at character {error.start})",
                               param) from None
        try:
            ids = encode(self.tokenizer, text)
        except ValueError as error:  # text the tokenizer cannot read (NullTokenizer: not ids)
            raise RequestError(f"{param}: {error}", param) from None
        if add_bos:
            # Megatron's add_BOS prepends the end-of-document token where there is no BOS.
            bos = self.tokenizer.bos if self.tokenizer.bos is not None else self.tokenizer.eod
            ids = [bos, *ids]
        return ids

    async def grammar(self, asked: tuple[Constraint, str] | None) -> Grammar | None:
        """A request's constraint (and the field that asked it) compiled, on a worker thread; a
        constraint the grammar engine cannot compile is the client's 400 naming the field."""
        if asked is None:
            return None
        constraint, param = asked

        def compile_it() -> Grammar:
            try:
                return self.grammars.compile(constraint, param)
            except GrammarError as error:
                raise RequestError(str(error), param) from None

        return await self.off_loop(compile_it)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(list(ids))

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        """Token ids a client gave, each checked against the vocabulary."""
        vocab = self.engine.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise RequestError(f"{param}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param)
        return list(ids)

    async def off_loop(self, function: Callable[..., T], *args, size: int | None = None) -> T:
        """``function(*args)`` on a worker thread: tokenizing or detokenizing megabytes takes
        seconds, during which health checks and every stream would otherwise wait. ``size``: the
        characters or tokens it handles; up to ``INLINE_WORK`` it runs here at once."""
        if size is not None and size <= INLINE_WORK:
            return function(*args)
        return await asyncio.to_thread(function, *args)

    async def tokenize_all(self, texts: Sequence[str], param: str, add_bos: bool = False) -> list[list[int]]:
        many = len(texts) > 1

        def work() -> list[list[int]]:
            return [self.tokenize(text, f"{param}[{i}]" if many else param, add_bos) for i, text in enumerate(texts)]

        return await self.off_loop(work)  # always off the loop: a slow tokenizer must never stall it

    def submit(self, requests: list[GenerationRequest], param: str, stream: bool = False,
               model: str | None = None) -> Job:
        """Queue ``requests`` (after checking each and admitting them; ``param`` names the
        prompts' field) under ``model`` (a served adapter's name: their rows take it)."""
        for index, request in enumerate(requests):
            try:
                self.engine.check(request)
                self.worker.check(request)
            except GenerationError as error:
                where = f"{param}[{index}]" if len(requests) > 1 else param
                raise RequestError(f"{where}: {error}", param) from None
        adapter = self._acquire(model)
        try:
            self.admission.admit(len(requests), param)
        except RequestError:
            if adapter is not None:
                self.adapters.release(adapter)
            raise
        for request in requests:
            request.adapter = adapter
        loop = asyncio.get_running_loop()
        job = Job(requests, loop, stream=stream)
        self.admission.release_when_done(job.done, len(requests))
        if adapter is not None:
            job.done.add_done_callback(lambda _: self.adapters.release(adapter))
        if self.request_timeout is not None:
            error = RequestError(f"the request took longer than the server's {self.request_timeout:g} s "
                                 "(--request-timeout)", status=408, kind="timeout")
            loop.call_later(self.request_timeout, job.expire, error)
        self.worker.submit(job)
        return job

    async def complete(self, requests: list[GenerationRequest], param: str, receive=None,
                       model: str | None = None) -> list[GenerationResult]:
        """The results of ``requests``, once all have finished. With the request's ASGI
        ``receive`` (its body already read), a client that leaves first cancels them, as a
        stream's does: they leave the running batch at the next step."""
        job = self.submit(requests, param, model=model)
        gone = asyncio.ensure_future(_disconnect(receive)) if receive is not None else None
        try:
            if gone is None:
                return await job.done
            await asyncio.wait({job.done, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done.done():
                job.done.add_done_callback(_nobody_waits)
                raise RequestError("the client closed the connection", status=CLIENT_GONE)
            return job.done.result()
        finally:
            if gone is not None:
                gone.cancel()
            job.cancel()  # a no-op once finished; frees the batch if the handler is cancelled


def encode(tokenizer, text: str) -> list[int]:
    """``text``'s token ids, through the tokenizer's batch encoder where it has one: the library
    tokenizers' batch encoder releases the GIL while it works, their single ``encode`` holds it
    for the whole text, which would stall the event loop (health checks, every stream) from the
    worker thread for as long as a long prompt takes."""
    batch = getattr(tokenizer, "tokenize_batch", None)
    return list(batch([text])[0]) if batch is not None else tokenizer.tokenize(text)


def _nobody_waits(done: asyncio.Future) -> None:
    """Its client has gone: the outcome is read only so asyncio does not report it unread."""
    if not done.cancelled():
        done.exception()


async def _disconnect(receive) -> None:
    """Returns once the client has gone (after its body, ``receive`` waits for that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
