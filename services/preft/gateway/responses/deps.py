"""FastAPI dependencies of the Responses and Conversations routes: the Responses service, its stores, and request
parts (the body, a page of items, `include`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Query, Request

from preft.gateway.core.deps import json_body
from preft.gateway.responses.background import BackgroundRuns
from preft.gateway.responses.conversation_store import ConversationStore
from preft.gateway.responses.protocol import ResponsesBody, check_include
from preft.gateway.responses.service import ResponsesService
from preft.gateway.responses.store import ResponseStore


async def get_responses(request: Request) -> ResponsesService:
    return request.app.state.responses


ResponsesDep = Annotated[ResponsesService, Depends(get_responses)]


async def get_response_store(responses: ResponsesDep) -> ResponseStore:
    return responses.store


async def get_background_runs(responses: ResponsesDep) -> BackgroundRuns:
    return responses.runs


async def get_conversation_store(responses: ResponsesDep) -> ConversationStore:
    return responses.conversations


@dataclass
class ItemPaging:
    """A page of a list of items: `limit` of them after the item `after`, newest first unless order=asc."""

    after: str | None = None
    limit: Annotated[int, Query(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"


async def check_included(request: Request) -> None:
    """`include` (as `include=` or, as the `openai` client sends it, `include[]=`) of a route listing Responses items:
    checked as a response's; the items are kept whole, so there is nothing more to add."""
    check_include(request.query_params.getlist("include") + request.query_params.getlist("include[]"))


ResponseStoreDep = Annotated[ResponseStore, Depends(get_response_store)]
BackgroundRunsDep = Annotated[BackgroundRuns, Depends(get_background_runs)]
ConversationStoreDep = Annotated[ConversationStore, Depends(get_conversation_store)]
ResponsesBodyDep = Annotated[ResponsesBody, Depends(json_body(ResponsesBody))]
ItemPagingDep = Annotated[ItemPaging, Depends()]
IncludeChecked = Depends(check_included)
