"""OpenAI's Conversations API: a tenant's stored conversations and their items (``responses.conversation_store``),
which `POST /v1/responses` continues with `conversation`.

    POST   /v1/conversations                          {"items": [...], "metadata": {...}}: a new conversation
    GET    /v1/conversations/{id}
    POST   /v1/conversations/{id}                     {"metadata": {...}}: replace its metadata
    DELETE /v1/conversations/{id}
    POST   /v1/conversations/{id}/items               {"items": [...]}: add items (up to 20 a call)
    GET    /v1/conversations/{id}/items               a page (after, limit, order: desc unless asc)
    GET    /v1/conversations/{id}/items/{item_id}
    DELETE /v1/conversations/{id}/items/{item_id}     the conversation as it then is

Items are Responses input items (messages with text, function calls and their outputs), checked as a response's
input is, each given a new id.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from preft.common.errors import InvalidArgument
from preft.gateway.core.deps import CallerDep, json_body
from preft.gateway.core.openapi import errors
from preft.gateway.core.pages import Metadata, item_list
from preft.gateway.responses.deps import ConversationStoreDep, IncludeChecked, ItemPagingDep
from preft.gateway.responses.protocol import conversation, input_items
from preft.gateway.responses.response_models import Conversation, ConversationDeleted, Item, ItemPage

router = APIRouter(tags=["conversations"])

MAX_ITEMS_A_CALL = 20


EXAMPLE_ITEM = {"type": "message", "role": "user", "content": "Hi!"}


class NewConversation(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"items": [EXAMPLE_ITEM], "metadata": {"topic": "demo"}}]}
    )

    items: list[dict[str, Any]] | None = Field(None, max_length=MAX_ITEMS_A_CALL, description="Its first items")
    metadata: Metadata | None = None


class ConversationChange(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"metadata": {"topic": "demo"}}]})

    metadata: Metadata


class NewItems(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"items": [EXAMPLE_ITEM]}]})

    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS_A_CALL)


def _checked_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as a response's input is checked (a 400 names the item), each with a new id."""
    conversation(items, field="items")
    return input_items(items, new_ids=True)


@router.post("/v1/conversations", response_model=Conversation, responses=errors(429))
async def create_conversation(
    caller: CallerDep,
    conversations: ConversationStoreDep,
    body: Annotated[NewConversation, Depends(json_body(NewConversation))],
) -> JSONResponse:
    if not conversations.enabled:
        raise InvalidArgument("this server does not store conversations")
    items = _checked_items(body.items) if body.items else []
    created = await conversations.create(caller.tenant, f"conv_{uuid.uuid4().hex}", body.metadata or {}, items)
    return JSONResponse(created.as_object())


@router.get("/v1/conversations/{conversation_id}", response_model=Conversation, responses=errors(404))
async def retrieve_conversation(
    conversation_id: str, caller: CallerDep, conversations: ConversationStoreDep
) -> JSONResponse:
    return JSONResponse((await conversations.get(caller.tenant, conversation_id)).as_object())


@router.post("/v1/conversations/{conversation_id}", response_model=Conversation, responses=errors(404))
async def update_conversation(
    conversation_id: str,
    caller: CallerDep,
    conversations: ConversationStoreDep,
    body: Annotated[ConversationChange, Depends(json_body(ConversationChange))],
) -> JSONResponse:
    return JSONResponse((await conversations.update(caller.tenant, conversation_id, body.metadata)).as_object())


@router.delete("/v1/conversations/{conversation_id}", response_model=ConversationDeleted, responses=errors(404))
async def delete_conversation(
    conversation_id: str, caller: CallerDep, conversations: ConversationStoreDep
) -> JSONResponse:
    await conversations.delete(caller.tenant, conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.post("/v1/conversations/{conversation_id}/items", response_model=ItemPage, responses=errors(404))
async def add_items(
    conversation_id: str,
    caller: CallerDep,
    conversations: ConversationStoreDep,
    body: Annotated[NewItems, Depends(json_body(NewItems))],
    _: None = IncludeChecked,
) -> JSONResponse:
    items = _checked_items(body.items)
    await conversations.add_items(caller.tenant, conversation_id, items)
    return JSONResponse(item_list(items, has_more=False))


@router.get("/v1/conversations/{conversation_id}/items", response_model=ItemPage, responses=errors(400, 404))
async def list_items(
    conversation_id: str,
    caller: CallerDep,
    conversations: ConversationStoreDep,
    paging: ItemPagingDep,
    _: None = IncludeChecked,
) -> JSONResponse:
    """A page of the conversation's items (newest first unless order=asc; `after`: an item id)."""
    await conversations.get(caller.tenant, conversation_id)  # (a 404 for a missing one, not an empty page)
    page = await conversations.page(
        caller.tenant, conversation_id, after=paging.after, limit=paging.limit, order=paging.order
    )
    return JSONResponse(item_list(page.items, has_more=page.has_more))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", response_model=Item, responses=errors(400, 404))
async def retrieve_item(
    conversation_id: str,
    item_id: str,
    caller: CallerDep,
    conversations: ConversationStoreDep,
    _: None = IncludeChecked,
) -> JSONResponse:
    return JSONResponse(await conversations.item(caller.tenant, conversation_id, item_id))


@router.delete(
    "/v1/conversations/{conversation_id}/items/{item_id}", response_model=Conversation, responses=errors(404)
)
async def delete_item(
    conversation_id: str, item_id: str, caller: CallerDep, conversations: ConversationStoreDep
) -> JSONResponse:
    return JSONResponse((await conversations.delete_item(caller.tenant, conversation_id, item_id)).as_object())
