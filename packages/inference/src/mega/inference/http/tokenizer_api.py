"""The served model and its tokenizer: ``GET /v1/models``, ``GET /v1/models/{id}`` (OpenAI's),
and ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (as vLLM names them), so
a client can count and build token-id prompts with exactly the server's tokenizer.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from mega.inference.http.errors import RequestError
from mega.inference.http.openai_fields import Flag, Integer
from mega.inference.http.service import InferenceService


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mega"
    max_model_len: int
    parent: str | None = Field(None, description="an adapter's base model (as vLLM lists a LoRA adapter)")
    root: str | None = Field(None, description="a LoRA adapter's directory (as vLLM lists it)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str = Field(description="text to tokenize")
    add_special_tokens: Flag = Field(False, description="prepend the beginning-of-sequence token (as add_BOS)")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Integer] = Field(description="token ids to turn into text")


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    vocab_size: int
    eos_token_id: int
    bos_token_id: int | None
    pad_token_id: int | None
    max_model_len: int
    has_chat_template: bool


def tokenizer_router(service: InferenceService) -> APIRouter:
    router = APIRouter()
    started = int(time.time())

    def cards() -> list[ModelCard]:
        base = ModelCard(id=service.model_name, created=started, max_model_len=service.max_positions,
                         parent=service.base_model_name)
        adapters = service.adapters.adapters if service.adapters is not None else []
        return [base, *(ModelCard(id=a.name, created=started, max_model_len=service.max_positions,
                                  parent=service.model_name, root=a.path) for a in adapters)]

    @router.get("/v1/models", response_model=ModelList, summary="the served model (OpenAI's list) and the LoRA "
                "adapters served beside it (parent: their base); a merged adapter names its base as parent")
    async def models() -> ModelList:
        return ModelList(data=cards())

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, summary="one model by its id")
    async def model(model_id: str) -> ModelCard:
        name = service.check_model(model_id)
        for card in cards():
            if card.id == name:
                return card
        raise RequestError(f"model: {model_id!r} was unloaded just now", "model", status=404, kind="model_not_found")

    @router.post("/tokenize", response_model=TokenizeResponse, summary="text to token ids")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        [ids] = await service.tokenize_all([body.prompt], "prompt", add_bos=body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=service.max_positions)

    @router.post("/detokenize", response_model=DetokenizeResponse, summary="token ids to text")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ids = service.check_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=await service.off_loop(service.detokenize, ids))

    @router.get("/tokenizer_info", response_model=TokenizerInfo, summary="the tokenizer's vocabulary and special tokens")
    async def tokenizer_info() -> TokenizerInfo:
        tokenizer = service.tokenizer
        return TokenizerInfo(tokenizer_class=type(tokenizer).__name__, vocab_size=tokenizer.vocab_size,
                             eos_token_id=tokenizer.eod, bos_token_id=tokenizer.bos, pad_token_id=tokenizer.pad,
                             max_model_len=service.max_positions, has_chat_template=service.chat_template is not None)

    return router
