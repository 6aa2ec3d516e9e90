"""The REST server: Megatron's ``PUT /api``, OpenAI-style ``POST /v1/completions``, ``GET /v1/health``.

The OpenAPI schema and its browsable page are at ``/openapi.json`` and ``/docs``. Invalid
requests get 400 with a message naming the field (Megatron's API answers with the message
string, as Megatron does; ``/v1`` with OpenAI's error object); bodies over ``max_body_bytes``
get 413. With an API key, the generation routes want ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import hmac
import json

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from mega.core.version import __version__
from mega.inference.megatron_api import megatron_router
from mega.inference.openai_api import completions_router
from mega.inference.service import InferenceService, RequestError

MAX_BODY_BYTES = 4 << 20  # 128 long prompts fit many times over


def create_app(service: InferenceService, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="mega text generation", version=__version__,
                  description=f"Serving {service.model_name}: Megatron's PUT /api and OpenAI-style completions.")
    guard = [Depends(_api_key_check(api_key))] if api_key else []
    app.include_router(megatron_router(service), dependencies=guard)
    app.include_router(completions_router(service), dependencies=guard)

    @app.get("/v1/health", summary="liveness")
    async def health() -> dict:
        return {"status": "ok", "model": service.model_name}

    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app


def _api_key_check(api_key: str):
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise RequestError("a valid API key is needed: Authorization: Bearer KEY", status=401)

    return check


def error_response(request: Request, error: RequestError) -> JSONResponse:
    if request.url.path.startswith("/v1/"):
        kind = "authentication_error" if error.status == 401 else "invalid_request_error"
        content = {"error": {"message": error.message, "type": kind, "param": error.param, "code": None}}
    else:
        content = error.message  # Megatron's server answers with the bare message
    return JSONResponse(content, status_code=error.status)


async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    return error_response(request, error)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"][1:]) or None  # loc[0] is "body"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        field, message = None, "the body is not valid JSON"
    if field and not message.startswith(field.split(".")[0]):
        message = f"{field}: {message}"
    return error_response(request, RequestError(message, field))


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
            return await self._refuse(send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the disconnect, as ASGI does
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = json.dumps(f"the request body exceeds {self.max_bytes} bytes").encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
