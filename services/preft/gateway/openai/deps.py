"""FastAPI dependencies of the OpenAI generation routes: the generation service and the request bodies."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from preft.gateway.core.deps import json_body
from preft.gateway.openai.generation import GenerationService
from preft.gateway.openai.schemas import ChatBody, CompletionBody


async def get_generation(request: Request) -> GenerationService:
    return request.app.state.generation


GenerationDep = Annotated[GenerationService, Depends(get_generation)]
CompletionBodyDep = Annotated[CompletionBody, Depends(json_body(CompletionBody))]
ChatBodyDep = Annotated[ChatBody, Depends(json_body(ChatBody))]
