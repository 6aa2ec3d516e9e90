"""``EngineWorker``: the engine's one thread, and the loop every entry point runs to the end.

A subclass is a scheduler: it queues sequences, admits some each step (:meth:`_admit`) and runs
one step over the admitted and the running ones (:meth:`_step`). The decoder-only one is
:class:`~mega.inference.engine.continuous.ContinuousBatchingWorker`, T5's
:class:`~mega.inference.engine.encoder_decoder.EncoderDecoderWorker`. The same steps run three
ways:

- on the server's thread (:meth:`start`): HTTP handlers (asyncio) :meth:`submit` a :class:`Job`
  (one request's prompts) and await it; results and streamed tokens cross to the event loop
  through its mailbox (:mod:`~mega.inference.engine.loop_mailbox`: one wake-up for many tokens);
  a job whose client went away is cancelled, and its sequences end by the one rule of
  :func:`~mega.inference.engine.requests.ending`;
- on the caller's thread (:meth:`run_to_completion`): ``mega generate``, ``mega eval`` and
  :meth:`GenerationEngine.generate <mega.inference.engine.generation_engine.GenerationEngine.generate>`
  submit their requests and step until every one has finished;
- on a follower rank of a tensor group (:meth:`follow`): the steps the leader runs, with the
  sequences it admitted (it hands them over before each step, :mod:`~mega.inference.engine.tp_serving`).
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mega.core.parallel import Group
from mega.inference.engine.decode_step import DecodingSequence
from mega.inference.engine.loop_mailbox import mailbox_for
from mega.inference.engine.metrics import ServerMetrics
from mega.inference.engine.requests import FinishCallback, GenerationRequest, GenerationResult, TokenCallback
from mega.inference.engine.tp_serving import lead, receive

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


@dataclass(eq=False, kw_only=True)
class QueuedSequence(DecodingSequence):
    """A sequence a worker runs: whose job it answers, and which of the job's requests it is."""

    job: Job | Collector | None  # None on a follower rank of a tensor group
    index: int  # within its job


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


class Collector:
    """A caller's requests run to completion on its own thread: the :class:`Job` interface the
    worker answers, its callbacks called at once."""

    def __init__(self, requests: Sequence[GenerationRequest], on_token: TokenCallback | None,
                 on_finish: FinishCallback | None):
        self.requests = list(requests)
        self.results: list[GenerationResult | None] = [None] * len(self.requests)
        self.on_token, self.on_finish = on_token, on_finish
        self.submitted_at = time.monotonic()

    def token(self, index: int, token: int, logprob: float | None, top=None) -> None:
        if self.on_token is not None:
            self.on_token(index, token, logprob, top)

    def finished(self, index: int, result: GenerationResult) -> None:
        self.results[index] = result
        if self.on_finish is not None:
            self.on_finish(index, result)

    def failed(self, error: BaseException) -> None:
        raise error


class EngineWorker(abc.ABC):
    """The scheduler of one engine; :meth:`start` runs it on its own thread, stopped with the server."""

    thread_name = "mega-engine-worker"

    def __init__(self, engine, max_batch_size: int, metrics: ServerMetrics | None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.engine, self.max_batch_size = engine, max_batch_size
        self.metrics = metrics or ServerMetrics()
        self._condition = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._named_run, name=self.thread_name, daemon=True)
        self.batches_run = 0  # steps, for tests and logs
        self._numbered = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify()
        self._thread.join()

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request this worker could never run (beyond the engine's own checks)."""
        return None

    def submit(self, job) -> None:
        """Queue ``job``'s sequences (a :class:`Job` on the event loop, or a :class:`Collector`)."""
        with self._condition:
            for index, request in enumerate(job.requests):
                self._numbered += 1
                self._queue(request, job, index, self._numbered)
            self._condition.notify()

    @property
    def tp_group(self) -> Group | None:
        group = self.engine.tp_group
        return group if group is not None and group.size > 1 else None

    def run_to_completion(self, requests: Sequence[GenerationRequest], on_token: TokenCallback | None = None,
                          on_finish: FinishCallback | None = None, lead_followers: bool = False) -> list[GenerationResult]:
        """Every request's result, stepping on this thread until all have finished (callbacks
        name a request by its index). ``lead_followers``: hand each step's admissions to the
        tensor group's followers (running :meth:`follow`); without it every rank runs this same
        call, which agrees only where every request is admitted at the first step (a batch and
        cache sized for all of them, as :meth:`GenerationEngine.generate` makes)."""
        for request in requests:
            self.engine.check(request)
            self.check(request)
        collector = Collector(requests, on_token, on_finish)
        self.submit(collector)
        while self._has_work():
            admitted = self._admit()
            if lead_followers and self.tp_group is not None:
                lead([s.request for s in admitted], self.tp_group)
            self._step(admitted)
        return collector.results

    def follow(self) -> None:
        """On a follower rank of the tensor group: run every step the leader runs, with the
        sequences it admitted, until the leader stops."""
        while (requests := receive(self.tp_group)) is not None:
            admitted = []
            for request in requests:
                self._numbered += 1
                admitted.append(self._adopt(request, self._numbered))
            self._step(admitted)

    @staticmethod
    def _on_token(sequence, token: int, logprob: float | None, top) -> None:
        sequence.job.token(sequence.index, token, logprob, top)

    def _answer(self, sequence) -> None:
        """A sequence ended: the leader answers its job (a follower has none)."""
        if sequence.job is not None:
            self.metrics.generated(len(sequence.generated))
            sequence.job.finished(sequence.index, sequence.result())

    def _named_run(self) -> None:
        name_os_thread(ENGINE_THREAD_OS_NAME)
        self._run()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._has_work() and not self._stopping:
                    self._condition.wait()
                if self._stopping:
                    return
                admitted = self._admit()
            if self.tp_group is not None:  # the followers step with the same sequences admitted
                lead([s.request for s in admitted], self.tp_group)
            try:
                self._step(admitted)
            except Exception as error:  # the server lives on; the sequences of this step get the error
                log.exception("generation failed in a step")
                self._fail(error)

    @abc.abstractmethod
    def _queue(self, request: GenerationRequest, job, index: int, number: int) -> None:
        """Queue one sequence (under the lock)."""

    @abc.abstractmethod
    def _has_work(self) -> bool:
        """Whether anything is queued or running."""

    @abc.abstractmethod
    def _admit(self) -> list:
        """The queued sequences that join at the next step (under the lock); a cancelled one
        ends here, by the one rule, without taking room."""

    @abc.abstractmethod
    def _adopt(self, request: GenerationRequest, number: int):
        """On a follower: the sequence the leader admitted, admitted here alike."""

    @abc.abstractmethod
    def _step(self, admitted: list) -> None:
        """One step: the admitted sequences start, the running ones decode one token."""

    @abc.abstractmethod
    def _fail(self, error: BaseException) -> None:
        """A step failed: every sequence in it gets ``error``, and leaves."""
