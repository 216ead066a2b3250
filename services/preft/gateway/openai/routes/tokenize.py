"""POST /tokenize and /detokenize (vLLM's extension routes): the base model's tokenizer, which every adapter shares.

A client counts a prompt's tokens (what rate limits and the context length charge) or a conversation's, rendered with
the chat template as the chat route renders it (tools included), and turns token ids back into text. `model` must be a
model the caller may use (404 otherwise, as on the generation routes).

Bounded like the generation routes: a text over the prompt byte limit (or more token ids than max_model_len) is
refused (413) before any work, each call takes one request from the tenant's requests/min bucket (none of its tokens:
counting a prompt is not generating it) before tokenizing, and long texts are tokenized within the tenant's slots off
the event loop (``prompt_guard``).
"""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from preft.common.errors import InvalidArgument
from preft.gateway.core.deps import (
    CallerDep,
    GuardDep,
    LimiterDep,
    ResolverDep,
    SettingsDep,
    TokenizerDep,
    json_body,
)
from preft.gateway.core.errors import PayloadTooLarge
from preft.gateway.core.openapi import errors
from preft.gateway.core.resolution import AdapterResolver
from preft.gateway.core.settings import CoreSettings
from preft.gateway.openai.response_models import Detokenized, Tokens
from preft.gateway.openai.schemas import EXAMPLE_MODEL, ChatMessage, TemplateKwargs
from preft.gateway.openai.tools import MAX_TOOLS, ToolSpec

router = APIRouter(tags=["tokenize"])


class TokenizeBody(BaseModel):
    """A prompt, or a conversation (with the tools the model would be shown)."""

    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"model": EXAMPLE_MODEL, "prompt": "Once upon a time"}]}
    )

    model: str = Field(min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: TemplateKwargs | None = None
    add_special_tokens: bool = Field(True, description="A prompt: with the tokenizer's special tokens (BOS)")


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"model": EXAMPLE_MODEL, "tokens": [1, 2, 3]}]}
    )

    model: str = Field(min_length=1, max_length=256)
    tokens: list[int] = Field(max_length=1_000_000)


async def _check_model(model: str, tenant: str, resolver: AdapterResolver, settings: CoreSettings) -> None:
    """404 where the caller may not use `model` (the base model or one of its adapters)."""
    if not settings.is_base_model(model):
        await resolver.find(tenant, model)


@router.post("/tokenize", response_model=Tokens, responses=errors(404, 429))
async def tokenize(
    caller: CallerDep,
    resolver: ResolverDep,
    settings: SettingsDep,
    tokenizer: TokenizerDep,
    guard: GuardDep,
    limiter: LimiterDep,
    body: Annotated[TokenizeBody, Depends(json_body(TokenizeBody))],
) -> Response:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidArgument("give either prompt or messages")
    if body.prompt is not None:
        text, special, what = body.prompt, body.add_special_tokens, "prompt"
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        turns = [m.turn() for m in body.messages or []]
        text = tokenizer.render_chat(turns, tools, template_kwargs=body.chat_template_kwargs)
        special, what = False, "conversation, rendered with the chat template,"  # (the template writes them)
    guard.fewest_tokens(text, what)
    await _check_model(body.model, caller.tenant, resolver, settings)
    admission = await limiter.admit(caller.tenant, 0)
    tokens = await guard.encode(caller.tenant, text, add_special_tokens=special)
    answer = {"count": len(tokens), "max_model_len": settings.max_model_len, "tokens": tokens}
    # (orjson: a tenant's 1M-token prompt took the stdlib encoder ~0.3-1.2 s, on the loop every tenant shares)
    return Response(orjson.dumps(answer), media_type="application/json", headers=admission.headers())


@router.post("/detokenize", response_model=Detokenized, responses=errors(404, 429))
async def detokenize(
    caller: CallerDep,
    resolver: ResolverDep,
    settings: SettingsDep,
    tokenizer: TokenizerDep,
    limiter: LimiterDep,
    body: Annotated[DetokenizeBody, Depends(json_body(DetokenizeBody))],
) -> JSONResponse:
    if len(body.tokens) > settings.max_model_len:
        raise PayloadTooLarge(
            f"tokens: {len(body.tokens)} token ids; this server detokenizes at most {settings.max_model_len} "
            "(max_model_len) at once."
        )
    if any(not 0 <= t < tokenizer.vocab_size for t in body.tokens):
        raise InvalidArgument(f"tokens: token ids must be in [0, {tokenizer.vocab_size})")
    await _check_model(body.model, caller.tenant, resolver, settings)
    admission = await limiter.admit(caller.tenant, 0)
    return JSONResponse({"prompt": tokenizer.decode(body.tokens)}, headers=admission.headers())
