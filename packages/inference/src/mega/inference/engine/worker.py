"""``BatchingWorker``: the one thread that runs the engine, on batches gathered from the queue.

HTTP handlers (asyncio) submit a :class:`Job` (one request's prompts) and await it. While the
engine runs a batch, new jobs queue up; when it is free, the worker takes every queued job that
fits in ``max_batch_size`` sequences and runs them as one engine batch. A job never splits
across batches, and each job's sequences are handed back the moment they finish, so a short
request batched with a long one does not wait for it.

Results and streamed tokens cross from the worker thread to the event loop through its mailbox
(:mod:`~mega.inference.loop_mailbox`: one wake-up for many tokens); a job whose client went away is cancelled, and its sequences leave the
batch at the next step.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence

from mega.inference.engine import GenerationEngine, GenerationRequest, GenerationResult
from mega.inference.loop_mailbox import mailbox_for
from mega.inference.metrics import ServerMetrics

log = logging.getLogger(__name__)

# What ``top -H``, ``ps -L`` and /proc/PID/task/TID/comm call the engine's thread on Linux (the
# serving benchmarks split the server's CPU time by it: the engine's host work, the HTTP's).
ENGINE_THREAD_OS_NAME = "mega-engine"


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (at most 15 bytes) where the operating system shows it
    (Linux; Python's own thread names stay inside Python)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_PR_SET_NAME = 15  # linux/prctl.h


class Job:
    """One request's sequences; created and awaited on the event loop."""

    def __init__(self, requests: Sequence[GenerationRequest], loop: asyncio.AbstractEventLoop, stream: bool = False):
        self.requests = list(requests)
        self.loop = loop
        self._mailbox = mailbox_for(loop)
        self.submitted_at = time.monotonic()
        self.results: list[GenerationResult | None] = [None] * len(self.requests)
        self.done: asyncio.Future = loop.create_future()
        # Streaming: ("token", index, token, logprob, top) and ("finished", index, result) in order.
        self.events: asyncio.Queue | None = asyncio.Queue() if stream else None

    def cancel(self) -> None:
        for request in self.requests:
            request.cancelled = True

    def expire(self, error: BaseException) -> None:
        """On the event loop: past its deadline, the job ends with ``error`` and its sequences
        leave the batch at the next step."""
        if not self.done.done():
            self.cancel()
            self._failed(error)

    @property
    def cancelled(self) -> bool:
        return all(request.cancelled for request in self.requests)

    # Called on the worker thread.
    def token(self, index: int, token: int, logprob: float | None, top=None) -> None:
        if self.events is not None:
            self._on_loop(self.events.put_nowait, ("token", index, token, logprob, top))

    def finished(self, index: int, result: GenerationResult) -> None:
        self._on_loop(self._finished, index, result)

    def failed(self, error: BaseException) -> None:
        self._on_loop(self._failed, error)

    def dropped(self) -> None:
        """Never run: every sequence was cancelled while it queued."""
        self._on_loop(self.done.cancel)

    def _on_loop(self, callback, *args) -> None:
        self._mailbox.post(callback, *args)  # a step's calls wake the loop once, not once each

    # Called on the event loop.
    def _finished(self, index: int, result: GenerationResult) -> None:
        self.results[index] = result
        if self.events is not None:
            self.events.put_nowait(("finished", index, result))
        if all(r is not None for r in self.results) and not self.done.done():
            self.done.set_result(self.results)

    def _failed(self, error: BaseException) -> None:
        if self.events is not None:
            self.events.put_nowait(("failed", error))
        if not self.done.done():
            self.done.set_exception(error)


class EngineWorker(abc.ABC):
    """The engine's one thread: started and stopped with the server. A subclass queues work in
    ``submit`` and runs it in ``_run``, which waits on ``_condition`` and returns once
    ``_stopping`` is set."""

    thread_name = "mega-engine-worker"

    def __init__(self, engine: GenerationEngine, max_batch_size: int, metrics: ServerMetrics | None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.engine, self.max_batch_size = engine, max_batch_size
        self.metrics = metrics or ServerMetrics()
        self._condition = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._named_run, name=self.thread_name, daemon=True)
        self.batches_run = 0  # engine steps (lock-step: whole batches), for tests and logs

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify()
        self._thread.join()

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request this worker could never run; by default every request the engine
        takes fits a batch (the continuous worker adds its KV-cache bound)."""
        return None

    @abc.abstractmethod
    def submit(self, job: Job) -> None:
        """Queue ``job`` (called on the event loop)."""

    def _named_run(self) -> None:
        name_os_thread(ENGINE_THREAD_OS_NAME)
        self._run()

    @abc.abstractmethod
    def _run(self) -> None:
        """The thread's body."""


class BatchingWorker(EngineWorker):
    """``before_batch(requests)`` runs on the worker thread before each engine batch (the
    tensor-parallel leader hands the batch to the other ranks there); ``generate`` runs it (the
    engine's by default, a :class:`~mega.inference.static_decode.StaticDecoder`'s on the static
    KV cache)."""

    thread_name = "mega-batching-worker"

    def __init__(self, engine: GenerationEngine, max_batch_size: int = 32,
                 before_batch: Callable[[list[GenerationRequest]], None] | None = None,
                 metrics: ServerMetrics | None = None, generate: Callable | None = None):
        super().__init__(engine, max_batch_size, metrics)
        self.before_batch = before_batch
        self._generate = generate  # None: the engine's own, looked up at each batch
        self._pending: collections.deque[Job] = collections.deque()

    def submit(self, job: Job) -> None:
        with self._condition:
            self._pending.append(job)
            self._condition.notify()

    def _next_batch(self) -> list[Job] | None:
        with self._condition:
            while not self._pending and not self._stopping:
                self._condition.wait()
            if self._stopping:
                return None
            batch, rows = [], 0
            while self._pending and (not batch or rows + len(self._pending[0].requests) <= self.max_batch_size):
                job = self._pending.popleft()
                if job.cancelled:  # its client left while it queued
                    job.dropped()
                    continue
                batch.append(job)
                rows += len(job.requests)
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if batch:
                self._run_batch(batch)

    def _run_batch(self, batch: list[Job]) -> None:
        owners = [(job, index) for job in batch for index in range(len(job.requests))]
        requests = [request for job in batch for request in job.requests]

        def on_token(row: int, token: int, logprob: float | None, top) -> None:
            job, index = owners[row]
            job.token(index, token, logprob, top)

        def on_finish(row: int, result: GenerationResult) -> None:
            self.metrics.generated(len(result.generated))
            job, index = owners[row]
            job.finished(index, result)

        now = time.monotonic()
        for job in batch:
            for _ in job.requests:
                self.metrics.admitted(now - job.submitted_at)
        with self._condition:
            queued = sum(len(job.requests) for job in self._pending)
        self.metrics.step(len(requests), self.max_batch_size, queued, 0)
        try:
            if self.before_batch is not None:
                self.before_batch(requests)
            generate = self._generate or self.engine.generate
            generate(requests, on_token=on_token, on_finish=on_finish)
        except Exception as error:  # the server lives on; these requests get the error
            log.exception("generation failed for a batch of %d sequences", len(requests))
            for job in batch:
                job.failed(error)
        self.batches_run += 1
