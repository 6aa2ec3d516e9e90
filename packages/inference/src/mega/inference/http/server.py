"""The REST server: Megatron's ``PUT /api``; OpenAI-style ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``; ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``; ``/tokenize``, ``/detokenize``,
``/tokenizer_info``; ``GET /health`` (and ``/v1/health``); ``GET /metrics``.

The OpenAPI schema and its browsable page are at ``/openapi.json`` and ``/docs``. Invalid
requests get 400 with a message naming the field (Megatron's API answers with the message
string, as Megatron does; every other route with OpenAI's error object, for every status: 400,
401, 404, 405, 408, 413, 429 and 500); bodies over ``max_body_bytes`` get 413. With an API key
every route but the health checks wants ``Authorization: Bearer KEY``, checked before the body
is read (see :mod:`~mega.inference.http.app`, which the embeddings server shares).

:func:`api_routers` is the one place that lists the routers; a new endpoint module adds its
router there.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse

from mega.inference.http.app import create_base_app
from mega.inference.http.chat_api import chat_router
from mega.inference.http.guards import MAX_BODY_BYTES
from mega.inference.http.lora_api import lora_router
from mega.inference.http.megatron_api import megatron_router
from mega.inference.http.openai_api import completions_router
from mega.inference.http.service import InferenceService
from mega.inference.http.tokenizer_api import tokenizer_router

__all__ = ["MAX_BODY_BYTES", "api_routers", "create_app"]


def create_app(service: InferenceService, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    return create_base_app("mega text generation",
                           f"Serving {service.model_name}: Megatron's PUT /api and OpenAI-style completions.",
                           service.model_name, api_routers(service), service.metrics, api_key, max_body_bytes)


def api_routers(service: InferenceService) -> list[APIRouter]:
    """Every router of the API (behind the API key, as every route but the health checks)."""
    return [megatron_router(service), completions_router(service), chat_router(service), tokenizer_router(service),
            lora_router(service), metrics_router(service)]


def metrics_router(service: InferenceService) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.render_metrics(), media_type="text/plain; version=0.0.4")

    return router
