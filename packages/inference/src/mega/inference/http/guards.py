"""ASGI middleware both servers run, outermost first: the request metrics, the API key (checked
before anything of the body is read), the body limit (``--max-request-bytes``).

The API key guards every route but :data:`OPEN_PATHS` (the schema pages ``/docs``,
``/openapi.json`` and ``/redoc`` included): ``Authorization: Bearer KEY``, the scheme in any
case (RFC 9110 makes it case-insensitive), the key compared in constant time.
"""

from __future__ import annotations

import hmac
import time

from mega.inference.http.errors import RequestError, send_error
from mega.inference.http.memory import LARGE_BODY_BYTES, trim_soon

OPEN_PATHS = {"/health", "/v1/health"}  # what a load balancer probes: never behind the API key
MAX_BODY_BYTES = 4 << 20  # 128 long prompts fit many times over


class RequestMetrics:
    """Counts every HTTP request by route and status, and times it to the end of its answer
    (a stream's last event). Paths that are no route count as "other"; a client that left
    before its answer counts as 499 (nginx's "client closed request")."""

    def __init__(self, app, metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), 499

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except Exception:
            status = 500
            raise
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.request(route, status, time.monotonic() - start)


def bearer_token(scope) -> bytes | None:
    """The credentials of ``Authorization: Bearer ...`` (any case of the scheme), else None."""
    given = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, credentials = given.partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else None


class ApiKeyGuard:
    """Every route but :data:`OPEN_PATHS` wants ``Authorization: Bearer KEY``: compared in
    constant time (``hmac.compare_digest``), so the time taken says nothing of how much matched;
    else 401 with OpenAI's error object, before the body is read. ``is_route(scope)`` tells a
    path some route serves (in any method) from one none does, which is a plain 404."""

    def __init__(self, app, api_key: str, is_route):
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app, self.expected, self.is_route = app, api_key.encode(), is_route

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or not self.is_route(scope):
            return await self.app(scope, receive, send)
        given = bearer_token(scope)
        if given is not None and hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = "a valid API key is needed: Authorization: Bearer KEY" if given is not None else \
            "no API key given: send Authorization: Bearer KEY"
        await send_error(scope, send, RequestError(message, status=401, kind="invalid_api_key",
                                                   headers={"WWW-Authenticate": "Bearer"}), openai=True)


class BodySizeLimit:
    """Refuses (413) a request body larger than ``max_bytes``, counted as it arrives (a missing
    or false Content-Length does not get around it). The body is read here, then replayed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                del chunks
                if size >= LARGE_BODY_BYTES:
                    trim_soon()
                return await self._refuse(scope, send)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed, body
            if replayed:
                return await receive()  # after the body: wait for the disconnect, as ASGI does
            replayed = True
            message, body = {"type": "http.request", "body": body, "more_body": False}, b""
            return message

        try:
            await self.app(scope, replay, send)
        finally:
            if size >= LARGE_BODY_BYTES:
                trim_soon()

    async def _refuse(self, scope, send) -> None:
        await send_error(scope, send, RequestError(
            f"the request body exceeds {self.max_bytes} bytes (--max-request-bytes)", status=413))
