"""The Responses API's wiring: its stores and background runs over the generation service (`start`), and its
routes (`wire`)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from preft.gateway.core.collaborators import Core
from preft.gateway.openai.generation import GenerationService
from preft.gateway.responses.background import BackgroundRuns
from preft.gateway.responses.conversation_store import ConversationLimits, ConversationStore
from preft.gateway.responses.routes import conversations, responses
from preft.gateway.responses.service import ResponsesService
from preft.gateway.responses.settings import ResponsesSettings
from preft.gateway.responses.store import ResponseStore


def wire(app: FastAPI) -> None:
    """/v1/responses and /v1/conversations."""
    for module in (responses, conversations):
        app.include_router(module.router)


def start(
    stack: contextlib.AsyncExitStack, settings: ResponsesSettings, core: Core, generation: GenerationService
) -> ResponsesService:
    """The Responses service: stored responses and conversations in the core's Redis, background runs stopped with
    the lifespan."""
    timeout_s = core.settings.redis_timeout_s
    store = ResponseStore(core.redis, ttl_s=settings.responses_store_ttl_s, timeout_s=timeout_s)
    conversation_store = ConversationStore(
        core.redis,
        ttl_s=settings.responses_store_ttl_s,
        timeout_s=timeout_s,
        limits=ConversationLimits(
            items=settings.conversations_max_items,
            bytes=settings.conversations_max_bytes,
            per_tenant=settings.conversations_max_per_tenant,
        ),
    )
    runs = BackgroundRuns(store, max_runs=settings.responses_background_max)
    stack.push_async_callback(runs.close)
    return ResponsesService(generation, store, runs, conversation_store)
