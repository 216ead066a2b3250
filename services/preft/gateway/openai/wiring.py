"""The OpenAI generation routes' wiring: the generation service over the core (`start`), and the routes (`wire`)."""

from __future__ import annotations

from fastapi import FastAPI

from preft.gateway.core.collaborators import Core
from preft.gateway.openai.generation import GenerationService
from preft.gateway.openai.routes import chat, completions, models, tokenize
from preft.gateway.openai.settings import OpenAISettings


def wire(app: FastAPI) -> None:
    """POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models."""
    for module in (completions, chat, tokenize, models):
        app.include_router(module.router)


def start(settings: OpenAISettings, core: Core) -> GenerationService:
    """The generation service: the order of checks around the engine call, on the core's collaborators."""
    return GenerationService(
        core.settings,
        formats=settings,
        guard=core.guard,
        limiter=core.limiter,
        resolver=core.resolver,
        engine=core.engine,
        meter=core.meter,
    )
