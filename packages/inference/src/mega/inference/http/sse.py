"""The one server-sent-events loop of the streaming routes (completions and chat).

A route gives a :class:`StreamWriter` that turns the job's events into ``data:`` lines; the
loop reads the job's events in order, ends the stream with OpenAI's error object if the
generation fails, sends the usage when asked, then ``[DONE]``; and cancels the job however the
stream ends (a client that leaves closes the generator: its sequences leave the running batch at
the next step).
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

DONE = "data: [DONE]\n\n"


def data_line(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def failed_event(error) -> str:
    """The server-sent event that ends a stream whose generation failed (OpenAI's error object)."""
    body = {"message": f"generation failed: {error}", "type": "server_error", "param": None, "code": None}
    return data_line({"error": body})


class StreamWriter(abc.ABC):
    """What a streaming route sends for each event; each method returns the lines to send."""

    include_usage = False

    def start(self) -> list[str]:
        return []

    @abc.abstractmethod
    def token(self, index: int, token: int, logprob: float | None, top) -> list[str]:
        """The lines for one generated token of sequence ``index``."""

    @abc.abstractmethod
    def finish(self, index: int, result) -> list[str]:
        """The lines for sequence ``index``'s end."""

    def usage(self, completion_tokens: int) -> list[str]:
        return []


async def stream_events(job, writer: StreamWriter) -> AsyncIterator[str]:
    try:
        for line in writer.start():
            yield line
        unfinished, completion_tokens = len(job.requests), 0
        while unfinished:
            kind, *details = await job.events.get()
            if kind == "failed":
                yield failed_event(details[0])
                return
            if kind == "token":
                lines = writer.token(*details)
            else:
                unfinished -= 1
                completion_tokens += len(details[1].generated)
                lines = writer.finish(*details)
            for line in lines:
                yield line
        if writer.include_usage:
            for line in writer.usage(completion_tokens):
                yield line
        yield DONE
    finally:
        job.cancel()  # the client left (or all is done: then it changes nothing)


def sse_response(job, writer: StreamWriter) -> StreamingResponse:
    """The streamed answer; the job is cancelled after it however it ended (also when the client
    left before the first event, when the generator never ran to its ``finally``)."""
    return StreamingResponse(stream_events(job, writer), media_type="text/event-stream",
                             background=BackgroundTask(job.cancel))
