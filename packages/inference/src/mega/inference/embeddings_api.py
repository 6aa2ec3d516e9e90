"""OpenAI-style ``POST /v1/embeddings`` for an encoder model, and the app ``mega serve`` runs
for one (``GET /v1/health`` too).

``input``: a string, a list of strings, a list of token ids or a list of token-id lists (at
most ``MAX_INPUTS``); ``encoding_format``: ``float`` (default) or ``base64`` (little-endian
fp32, as OpenAI sends it). An input longer than the model's positions, empty, or with ids
outside the vocabulary is a 400 naming it; nothing is computed for a request with a bad input.
One request's inputs run in length-sorted batches; requests take turns on the model.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from mega.core.version import __version__
from mega.inference.embeddings import Embedder, EmbeddingInputError
from mega.inference.server import MAX_BODY_BYTES, BodySizeLimit, error_response
from mega.inference.service import RequestError

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, texts, token ids, or lists of token ids to embed")
    model: str | None = Field(None, description="ignored: the server serves one model")
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


def embeddings_router(embedder: Embedder, model_name: str) -> APIRouter:
    router = APIRouter()
    lock = asyncio.Lock()  # one forward at a time; a request's inputs are batched already

    @router.post("/v1/embeddings", summary="embed texts or token ids (OpenAI-style)")
    async def embeddings(request: EmbeddingRequest) -> dict:
        inputs = [request.input] if isinstance(request.input, str) else request.input
        if not inputs:
            raise RequestError("input must not be empty", "input")
        if isinstance(inputs[0], int):  # one list of token ids is one input
            inputs = [inputs]
        if len(inputs) > MAX_INPUTS:
            raise RequestError(f"input has {len(inputs)} items, more than the {MAX_INPUTS} allowed", "input")
        try:
            sequences = embedder.token_ids(inputs)
        except EmbeddingInputError as error:
            raise RequestError(str(error), "input") from None
        async with lock:
            vectors = await asyncio.to_thread(embedder.embed, sequences)
        data = [{"object": "embedding", "index": index, "embedding": _encoded(vector, request.encoding_format)}
                for index, vector in enumerate(vectors)]
        tokens = sum(len(ids) for ids in sequences)
        return {"object": "list", "data": data, "model": model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return router


def _encoded(vector, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def create_embeddings_app(embedder: Embedder, model_name: str, api_key: str | None = None,
                          max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="mega embeddings", version=__version__,
                  description=f"Serving {model_name}: OpenAI-style POST /v1/embeddings.")
    guard = [Depends(_api_key_check(api_key))] if api_key else []
    app.include_router(embeddings_router(embedder, model_name), dependencies=guard)

    @app.get("/v1/health", summary="liveness")
    async def health() -> dict:
        return {"status": "ok", "model": model_name}

    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app


def _api_key_check(api_key: str):
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            raise RequestError("a valid API key is needed: Authorization: Bearer KEY", status=401)

    return check


async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    return error_response(request, error)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return error_response(request, RequestError("the body is not valid JSON"))
    field = ".".join(str(part) for part in first["loc"][1:2]) or None  # loc[0] is "body"
    message = ("input must be a string, a list of strings, a list of token ids or a list of token-id lists"
               if field == "input" else f"{field}: {first['msg']}")
    return error_response(request, RequestError(message, field))
