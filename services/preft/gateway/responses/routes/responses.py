"""POST /v1/responses: the Responses service's answer (``responses.service``), whole, streamed or in the
background; GET and DELETE /v1/responses/{id} for stored responses (``responses.store``), POST
/v1/responses/{id}/cancel for background ones, GET /v1/responses/{id}/input_items."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from preft.common.errors import InvalidArgument
from preft.gateway.core.deps import CallerDep
from preft.gateway.core.observability import started_s
from preft.gateway.core.openapi import GENERATION_ERRORS, errors, event_stream
from preft.gateway.core.pages import item_list
from preft.gateway.openai.sse import EventStreamResponse, as_sse
from preft.gateway.responses.background import IN_PROGRESS, BackgroundRuns, current, replay
from preft.gateway.responses.deps import (
    BackgroundRunsDep,
    IncludeChecked,
    ItemPagingDep,
    ResponsesBodyDep,
    ResponsesDep,
    ResponseStoreDep,
)
from preft.gateway.responses.response_models import ItemPage, ResponseDeleted, ResponseObject
from preft.gateway.responses.store import ResponseStore, StoredResponse

router = APIRouter(tags=["responses"])


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={
        **event_stream("the Responses events, response.created to response.completed"),
        **errors(*GENERATION_ERRORS),
    },
)
async def create_response(
    request: Request, caller: CallerDep, body: ResponsesBodyDep, responses: ResponsesDep
) -> Response:
    if body.background:
        queued = await responses.start_background(caller, body, started_s=started_s(request))
        if queued.events:  # (the run's kept events: the run goes on if this stream's client goes)
            return _events(replay(responses.store, caller.tenant, queued.response_id, -1), queued.headers)
        return JSONResponse(queued.response, headers=queued.headers)
    if body.stream:
        return (await responses.stream(caller, body, started_s=started_s(request))).response()
    answer = await responses.answer(caller, body, started_s=started_s(request))
    return JSONResponse(answer.body, headers=answer.headers)


@router.get(
    "/v1/responses/{response_id}",
    response_model=ResponseObject,
    responses={**event_stream("a background response's events again, from starting_after on"), **errors(400, 404)},
)
async def retrieve_response(
    response_id: str,
    caller: CallerDep,
    store: ResponseStoreDep,
    stream: bool = False,
    starting_after: Annotated[int, Query(ge=-1)] = -1,
) -> Response:
    """A stored response; with stream, a background one created streaming is streamed again from the event after
    `starting_after`, and on as its run goes."""
    stored = await current(store, caller.tenant, response_id)
    if not stream:
        return JSONResponse(stored.response)
    if not stored.events:
        raise InvalidArgument("stream: only a background response created with stream true can be streamed again")
    return _events(replay(store, caller.tenant, response_id, starting_after), {"x-request-id": response_id})


def _events(events: AsyncGenerator[dict[str, Any], None], headers: dict[str, str]) -> EventStreamResponse:
    async def nothing_to_close() -> None:
        return None

    return EventStreamResponse(as_sse(events, done=False), on_close=nothing_to_close, headers=headers)


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=errors(400, 404))
async def cancel_response(
    response_id: str, caller: CallerDep, store: ResponseStoreDep, runs: BackgroundRunsDep
) -> JSONResponse:
    """Stop a background response in progress (on whichever replica runs it); the response as it then stands."""
    stored = await current(store, caller.tenant, response_id)
    if not stored.response.get("background"):
        raise InvalidArgument("only a background response can be cancelled")
    if stored.response["status"] in IN_PROGRESS:
        await runs.cancel(caller.tenant, response_id)
        stored = await _ended(store, runs, caller.tenant, response_id)
    return JSONResponse(stored.response)


async def _ended(store: ResponseStore, runs: BackgroundRuns, tenant: str, response_id: str) -> StoredResponse:
    """The response once its run stored its end (its replica stops it within its lease poll), or as it stands."""
    deadline = time.monotonic() + 3 * runs.poll_s + 2.0
    while True:
        stored = await current(store, tenant, response_id)
        if stored.response["status"] not in IN_PROGRESS or time.monotonic() > deadline:
            return stored
        await asyncio.sleep(0.05)


@router.get("/v1/responses/{response_id}/input_items", response_model=ItemPage, responses=errors(400, 404))
async def list_input_items(
    response_id: str,
    caller: CallerDep,
    store: ResponseStoreDep,
    paging: ItemPagingDep,
    _: None = IncludeChecked,
) -> JSONResponse:
    """A stored response's input items, a page at a time (newest first unless order=asc; `after`: an item id)."""
    items = (await store.get(caller.tenant, response_id)).input_items
    items = items if paging.order == "asc" else items[::-1]
    start = 0
    if paging.after is not None:
        ids = [item["id"] for item in items]
        if paging.after not in ids:
            raise InvalidArgument(f"after: {paging.after!r} is not an input item of this response")
        start = ids.index(paging.after) + 1
    end = start + paging.limit
    return JSONResponse(item_list(items[start:end], has_more=end < len(items)))


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=errors(404))
async def delete_response(
    response_id: str, caller: CallerDep, store: ResponseStoreDep, runs: BackgroundRunsDep
) -> JSONResponse:
    await store.delete(caller.tenant, response_id)
    await runs.cancel(caller.tenant, response_id)  # (a background one in progress stops too)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
