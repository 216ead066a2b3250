"""The gateway application: `create_app(settings)` is its table of contents, each sub-package wiring its own part.

Each sub-package's `start` builds its collaborators in the lifespan, over those of the packages below it (``core``
for all; ``openai``'s generation service for the Responses and Batch APIs); its `wire` adds its routes. What a
route needs comes through its package's typed dependencies (``core.deps``, ``openai.deps``, ...), which read the one
slot of `app.state` that the package fills here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI

from preft.gateway.batches import wiring as batches
from preft.gateway.core import wiring as core
from preft.gateway.core.engine_client import EngineClient
from preft.gateway.core.registry import AsyncRegistry
from preft.gateway.core.tokenization import PromptTokenizer
from preft.gateway.files import wiring as files
from preft.gateway.manage import wiring as manage
from preft.gateway.openai import wiring as openai
from preft.gateway.responses import wiring as responses
from preft.gateway.settings import GatewaySettings


def create_app(
    settings: GatewaySettings,
    *,
    engine_client: EngineClient | None = None,
    registry: AsyncRegistry | None = None,
    redis: aioredis.Redis | None = None,
    tokenizer: PromptTokenizer | None = None,
) -> FastAPI:
    """The gateway app; keyword arguments replace the collaborators the lifespan would build from `settings`
    (used as they are and left open: their owner closes them)."""
    collaborators = {"engine_client": engine_client, "registry": registry, "redis": redis, "tokenizer": tokenizer}
    app = FastAPI(
        title="preft-serve gateway",
        summary="OpenAI-compatible API over per-tenant adapters",
        version="0.1.0",
        lifespan=_lifespan(settings, collaborators),
    )
    core.wire(app)  # errors, request metrics, /healthz, /readyz, /healthz/deps (/metrics: its own port)
    openai.wire(app)  # /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /v1/models
    responses.wire(app)  # /v1/responses, /v1/conversations
    files.wire(app)  # /v1/files
    batches.wire(app)  # /v1/batches
    manage.wire(app)  # /v1/adapters (and their shares), /v1/organization/usage
    return app


def _lifespan(
    settings: GatewaySettings, collaborators: dict[str, Any]
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Each sub-package's collaborators, started in order (and closed in reverse: the batch runner first, its lines
    use the rest), each in its package's slot of `app.state`."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            app.state.core = base = await core.start(stack, settings, **collaborators)
            app.state.generation = generation = openai.start(settings, base)
            app.state.responses = answers = responses.start(stack, settings, base, generation)
            app.state.files = stored = files.start(
                stack, settings, base, max_batch_requests=settings.batches_max_requests
            )
            app.state.batches = batches.start(stack, settings, base, stored, generation, answers)
            yield

    return lifespan
