"""LoRA adapters loaded and unloaded while serving, as vLLM's endpoints: ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``, behind the API
key as every route. They answer only where ``mega serve`` was started with
``--allow-runtime-lora-updates`` (vLLM asks ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), else 403 naming
the flag. Errors name the problem: a name taken (400), a directory that is no adapter for this base
(400), no free slot (400, ``--max-loras``), an unknown name (404). An adapter that running requests
hold is unloaded at once for new requests and its slot freed when they are answered
(:mod:`~mega.inference.engine.lora_registry`).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from mega.inference.engine.lora_registry import AdapterError, UnknownAdapter
from mega.inference.http.errors import RequestError
from mega.inference.http.openai_fields import Flag
from mega.inference.http.service import InferenceService


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="the name requests give as model")
    lora_path: str = Field(min_length=1, description="a mega LoRA checkpoint or a PEFT adapter directory, on the "
                           "server's disk")
    load_inplace: Flag = Field(False, description="replace the adapter of that name (the new weights take a free "
                               "slot; its running requests finish on the old one)")


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="the adapter to stop serving")
    lora_int_id: int | None = Field(None, description="accepted and ignored (vLLM's)")


def lora_router(service: InferenceService) -> APIRouter:
    router = APIRouter()

    def registry():
        if service.adapters is None:
            raise RequestError("this server serves no LoRA adapters: start mega serve with --enable-lora (or "
                               "--lora-modules)", status=400)
        if not service.adapters.allow_runtime_updates:
            raise RequestError("loading and unloading LoRA adapters while serving is off: start mega serve with "
                               "--allow-runtime-lora-updates", status=403, kind="permission_error")
        return service.adapters

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, summary="serve a LoRA adapter beside "
                 "the base, chosen by requests' model (needs --allow-runtime-lora-updates)")
    async def load(body: LoadAdapterRequest) -> PlainTextResponse:
        adapters = registry()
        if body.lora_name == service.model_name:
            raise RequestError(f"lora_name: {body.lora_name!r} is the base model's name", "lora_name")
        try:
            await service.off_loop(adapters.load, body.lora_name, body.lora_path, body.load_inplace)
        except AdapterError as error:
            raise RequestError(str(error), "lora_path" if "lora_path" in str(error) else "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, summary="stop serving a LoRA adapter "
                 "(its running requests finish on it; needs --allow-runtime-lora-updates)")
    async def unload(body: UnloadAdapterRequest) -> PlainTextResponse:
        adapters = registry()
        try:
            held = adapters.unload(body.lora_name)
        except UnknownAdapter as error:
            raise RequestError(str(error), "lora_name", status=404, kind="model_not_found") from None
        later = " (its running requests finish on it first)" if held else ""
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully{later}.")

    return router
