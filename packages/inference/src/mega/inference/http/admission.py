"""``Admission``: the bound on the waiting queue (``--max-num-queued-reqs``, vLLM's flag).

It counts the sequences admitted and not yet finished (waiting or running; a request of ``n``
prompts x ``best_of`` sequences counts that many, as vLLM counts them); one that would take the
count past the limit gets 429 with ``Retry-After`` at once instead of waiting without bound.
A sequence's place is given back when its job is done: finished, failed, timed out, or cancelled
once its client left (then the engine has dropped it).
"""

from __future__ import annotations

import asyncio

from mega.inference.http.errors import RequestError

RETRY_AFTER_S = 1  # what a refused client is told to wait: sequences finish within moments


class Admission:
    """Used on the event loop only (so counting needs no lock)."""

    def __init__(self, limit: int | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"the queue bound must be positive, got {limit}")
        self.limit, self.in_flight = limit, 0

    def admit(self, sequences: int, param: str) -> None:
        """Take ``sequences`` places, or refuse: 400 if they could never fit, else 429."""
        if self.limit is not None:
            if sequences > self.limit:
                raise RequestError(f"{param}: {sequences} sequences exceed the server's --max-num-queued-reqs "
                                   f"{self.limit}", param)
            if self.in_flight + sequences > self.limit:
                raise RequestError(f"the server is busy: {self.in_flight} sequences are waiting or running, at "
                                   f"most {self.limit} (--max-num-queued-reqs); retry later", status=429,
                                   kind="too_many_requests", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += sequences

    def release_when_done(self, done: asyncio.Future, sequences: int) -> None:
        def release(_):
            self.in_flight -= sequences

        done.add_done_callback(release)
