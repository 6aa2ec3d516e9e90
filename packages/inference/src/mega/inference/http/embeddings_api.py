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
from typing import Literal

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mega.inference.embeddings import Embedder, EmbeddingInputError
from mega.inference.http.app import create_base_app
from mega.inference.http.errors import RequestError
from mega.inference.http.guards import MAX_BODY_BYTES
from mega.inference.http.openai_fields import check_model
from mega.inference.http.prompt_chars import PromptCharLimit

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
INPUT_SHAPES = "input must be a string, a list of strings, a list of token ids or a list of token-id lists"


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it, as on every route

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, texts, token ids, or lists of token ids to embed")
    model: str | None = Field(None, description="the served model's name; may be left out")
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = Field(None, description="accepted and ignored")

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(INPUT_SHAPES) from None


def embeddings_router(embedder: Embedder, model_name: str) -> APIRouter:
    router = APIRouter()
    lock = asyncio.Lock()  # one forward at a time; a request's inputs are batched already
    limit = PromptCharLimit(embedder.tokenizer, embedder.max_positions)

    @router.post("/v1/embeddings", summary="embed texts or token ids (OpenAI-style)")
    async def embeddings(request: EmbeddingRequest) -> dict:
        check_model(model_name, request.model)
        inputs = [request.input] if isinstance(request.input, str) else request.input
        if not inputs:
            raise RequestError("input must not be empty", "input")
        if isinstance(inputs[0], int):  # one list of token ids is one input
            inputs = [inputs]
        if len(inputs) > MAX_INPUTS:
            raise RequestError(f"input has {len(inputs)} items, more than the {MAX_INPUTS} allowed", "input")

        def token_ids() -> list[list[int]]:  # on a worker thread: tokenizing megabytes takes seconds
            for index, item in enumerate(inputs):
                if isinstance(item, str):
                    limit.check(item, "input", f"input[{index}]", f"the model's {embedder.max_positions} positions")
            try:
                return embedder.token_ids(inputs)
            except EmbeddingInputError as error:
                raise RequestError(str(error), "input") from None

        sequences = await asyncio.to_thread(token_ids)
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
                          max_body_bytes: int = MAX_BODY_BYTES, metrics=None) -> FastAPI:
    return create_base_app("mega embeddings", f"Serving {model_name}: OpenAI-style POST /v1/embeddings.", model_name,
                           [embeddings_router(embedder, model_name)], metrics, api_key, max_body_bytes)
