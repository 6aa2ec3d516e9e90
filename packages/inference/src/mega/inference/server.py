"""The REST server: Megatron's ``PUT /api``; OpenAI-style ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``; ``/tokenize``, ``/detokenize``,
``/tokenizer_info``; ``GET /health`` (and ``/v1/health``); ``GET /metrics``.

The OpenAPI schema and its browsable page are at ``/openapi.json`` and ``/docs``. Invalid
requests get 400 with a message naming the field (Megatron's API answers with the message
string, as Megatron does; ``/v1`` with OpenAI's error object, for every status: 400, 401, 404,
405, 408, 413 and 500); bodies over ``max_body_bytes`` get 413. With an API key every route but
the health checks wants ``Authorization: Bearer KEY`` (compared in constant time; else 401 with
OpenAI's error object), checked before the body is read.

:func:`api_routers` is the one place that lists the routers; a new endpoint module adds its
router there.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from mega.core.version import __version__
from mega.inference.chat_api import chat_router
from mega.inference.megatron_api import megatron_router
from mega.inference.openai_api import completions_router
from mega.inference.service import InferenceService, RequestError
from mega.inference.tokenizer_api import tokenizer_router

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # 128 long prompts fit many times over


def create_app(service: InferenceService, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="mega text generation", version=__version__,
                  description=f"Serving {service.model_name}: Megatron's PUT /api and OpenAI-style completions.")
    routers = api_routers(service)
    for router in routers:
        app.include_router(router)

    @app.get("/health", summary="liveness (open without the API key)")
    @app.get("/v1/health", summary="liveness (open without the API key)")
    async def health() -> dict:
        return {"status": "ok", "model": service.model_name}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    paths = {route.path for router in routers for route in router.routes} | OPEN_PATHS | {"/metrics"}
    app.add_middleware(RequestMetrics, metrics=service.metrics, routes=paths)
    return app


def api_routers(service: InferenceService) -> list[APIRouter]:
    """Every router of the API (behind the API key, as every route but the health checks)."""
    return [megatron_router(service), completions_router(service), chat_router(service), tokenizer_router(service)]


# OpenAI's error types by status, for errors that name none.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 500: "server_error"}
OPEN_PATHS = {"/health", "/v1/health"}  # what a load balancer probes: never behind the API key


def openai_error(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def speaks_openai(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


def error_response(request: Request, error: RequestError) -> JSONResponse:
    if speaks_openai(request.url.path):
        content = openai_error(error.message, error.status, error.param, error.kind)
    else:
        content = error.message  # Megatron's server answers with the bare message
    return JSONResponse(content, status_code=error.status)


async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    return error_response(request, error)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """404 (no such route), 405 (wrong method)... as the API's own errors."""
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    text = message.get(error.status_code, str(error.detail))
    response = error_response(request, RequestError(text, status=error.status_code))
    for name, value in (error.headers or {}).items():
        response.headers[name] = value
    return response


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    log.error("request %s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(request, RequestError(f"the server failed: {type(error).__name__}: {error}", status=500))


def _is_union_member(part: str) -> bool:
    """A location part naming the member of a union pydantic tried (``str``, ``list[int]``...)."""
    return part in {"str", "int", "float", "bool"} or part.startswith(("list[", "dict[", "function-"))


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    errors = error.errors()
    first = errors[0]
    loc = [str(part) for part in first["loc"][1:]]  # loc[0] is "body"
    tried = [part for part in loc if _is_union_member(part)]
    path = ".".join(part if not part.isdigit() else f"[{part}]" for part in loc if not _is_union_member(part))
    path = path.replace(".[", "[")
    field = loc[0] if loc else None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        field, path, message = None, "", "the body is not valid JSON"
    elif first["type"] == "extra_forbidden":
        message = "unknown field (not part of this API)"
    elif first["type"] == "missing":
        message = "required field missing"
    elif tried:  # no member of a union matched: name them all, not just the first one tried
        members = [m for e in errors if e["loc"][1:2] == first["loc"][1:2]
                   for m in map(str, e["loc"][2:]) if _is_union_member(m)]
        path = field
        message = f"must be one of {', '.join(dict.fromkeys(members))} ({message.lower()})"
    elif not field and (named := re.match(r"(\w+): ", message)):  # a check of several fields names one
        field = path = named.group(1)
    if path and not message.startswith(path.split(".")[0].split("[")[0]):
        message = f"{path}: {message}"
    return error_response(request, RequestError(message, field))


class RequestMetrics:
    """Counts every HTTP request by route and status, and times it to the end of its answer
    (a stream's last event). Paths that are no route count as "other"."""

    def __init__(self, app, metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), 500

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.request(route, status, time.monotonic() - start)


class ApiKeyGuard:
    """Every route but :data:`OPEN_PATHS` wants ``Authorization: Bearer KEY``: compared in
    constant time (``hmac.compare_digest``), so the time taken says nothing of how much matched;
    else 401 with OpenAI's error object, before the body is read."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = "a valid API key is needed: Authorization: Bearer KEY" if given else \
            "no API key given: send Authorization: Bearer KEY"
        await _send_json(send, 401, openai_error(message, 401, code="invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")])


async def _send_json(send, status: int, content, headers=()) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


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
                return await self._refuse(scope, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the disconnect, as ASGI does
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, send) -> None:
        message = f"the request body exceeds {self.max_bytes} bytes (--max-request-bytes)"
        await _send_json(send, 413, openai_error(message, 413) if speaks_openai(scope["path"]) else message)
