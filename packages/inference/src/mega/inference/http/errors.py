"""The errors of both servers, answered the same way everywhere.

:class:`RequestError` is a request the server refuses (its status, the field it names, headers
such as ``Retry-After``). Routes under ``/v1``, ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` (and every path no route serves) answer with OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` on every status (400, 401, 404, 405, 408, 413,
429, 500); Megatron's ``PUT /api`` with the bare message string, as Megatron's server does.
:func:`install_error_handlers` puts the handlers on an app; the validation handler is the one
rule for unknown fields: a field no request model declares is a 400 naming it.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

# OpenAI's error types by status, for errors that name none.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}
# Megatron's API: errors are the bare message, as its server sends them.
MEGATRON_PATHS = ("/api",)


class RequestError(ValueError):
    """An invalid request: answered with ``status`` and a message naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.headers = headers or {}


def openai_error(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def speaks_openai(path: str) -> bool:
    """Every path but Megatron's answers errors with OpenAI's object (unknown paths too)."""
    return path not in MEGATRON_PATHS


def error_body(path: str, error: RequestError, openai: bool = False):
    if openai or speaks_openai(path):
        return openai_error(error.message, error.status, error.param, error.kind)
    return error.message  # Megatron's server answers with the bare message


def error_response(request: Request, error: RequestError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers=error.headers)


async def send_error(scope, send, error: RequestError, openai: bool = False) -> None:
    """Answer ``error`` from ASGI middleware, before (or without) reading the body (``openai``:
    with OpenAI's error object on every path, as the API key's 401 is answered)."""
    body = json.dumps(error_body(scope["path"], error, openai)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)


async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    return error_response(request, error)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """404 (no such route), 405 (wrong method)... as the API's own errors."""
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    text = message.get(error.status_code, str(error.detail))
    return error_response(request, RequestError(text, status=error.status_code, headers=dict(error.headers or {})))


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    log.error("request %s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(request, RequestError(f"the server failed: {type(error).__name__}: {error}", status=500))


def _is_union_member(part: str) -> bool:
    """A location part naming the member of a union pydantic tried (``str``, ``list[int]``...)."""
    return part in {"str", "int", "float", "bool"} or part.startswith(("list[", "dict[", "function-"))


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(request, validation_message(error.errors()))


def validation_message(errors: list[dict]) -> RequestError:
    """pydantic's first error as one message naming the field (for a union: every member tried)."""
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
    return RequestError(message, field)
