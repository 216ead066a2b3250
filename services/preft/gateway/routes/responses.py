"""POST /v1/responses: OpenAI's Responses API, answered through the chat path (`preft.gateway.responses`); GET and
DELETE /v1/responses/{id} for stored responses (`preft.gateway.response_store`)."""

from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from preft.common.errors import InvalidArgument, Unavailable
from preft.gateway.deps import CallerDep, GenerationDep, ResponsesBodyDep, ResponseStoreDep, TokenizerDep
from preft.gateway.errors import validation_message
from preft.gateway.observability import started_s
from preft.gateway.response_store import StoredResponse
from preft.gateway.responses import (
    ResponseEvents,
    ResponseShape,
    conversation,
    in_responses_terms,
    input_items,
    output_items,
    output_turns,
)
from preft.gateway.routes.chat import start_chat
from preft.gateway.schemas import ChatBody
from preft.gateway.sse import stream_response

log = logging.getLogger(__name__)
router = APIRouter(tags=["responses"])


@router.post("/v1/responses")
async def create_response(
    request: Request,
    caller: CallerDep,
    body: ResponsesBodyDep,
    generation: GenerationDep,
    tokenizer: TokenizerDep,
    store: ResponseStoreDep,
) -> Response:
    body.refuse_unsupported()
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        if not store.enabled:
            raise InvalidArgument("previous_response_id: this server does not store responses")
        history = (await store.get(caller.tenant, body.previous_response_id)).conversation
    turns = conversation(body.input, history)  # (what a later response continues)
    try:
        chat = ChatBody.model_validate(body.chat_fields(turns))
    except ValidationError as e:
        raise InvalidArgument(in_responses_terms(validation_message(e.errors(include_input=False)))) from None
    response_id = f"resp_{uuid.uuid4().hex}"
    job, plan = await start_chat(caller, chat, generation, tokenizer, response_id)
    call_format = generation.settings.tool_call_format
    headers = {"x-request-id": response_id, **job.admission.headers()}
    keep = store.enabled and body.store is not False
    shape = ResponseShape(body, response_id, stored=keep)

    async def save(response: dict[str, Any]) -> None:
        try:
            stored = StoredResponse(response, turns + output_turns(response["output"]), input_items(body.input))
            await store.save(caller.tenant, stored)
        except Unavailable as e:
            log.warning("response %s not stored: %s", response["id"], e.message)
            response["store"] = False

    if body.stream:
        streams = await generation.open_streams(job, started_s=started_s(request))
        render = ResponseEvents(shape, plan, call_format)
        on_final = (lambda event: save(event["response"])) if keep else None
        return stream_response(
            generation, job, streams, render, include_usage=True, headers=headers, done=False, on_final=on_final
        )
    (out,) = await generation.complete(job, started_s=started_s(request))
    answer = shape.response(output_items(out, plan, call_format), out.finish_reason, out.usage)
    if keep:
        await save(answer)
    return JSONResponse(answer, headers=headers)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, caller: CallerDep, store: ResponseStoreDep) -> JSONResponse:
    return JSONResponse((await store.get(caller.tenant, response_id)).response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    caller: CallerDep,
    store: ResponseStoreDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    """A stored response's input items, a page at a time (newest first unless order=asc; `after`: an item id)."""
    items = (await store.get(caller.tenant, response_id)).input_items
    items = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidArgument(f"after: {after!r} is not an input item of this response")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(items),
        }
    )


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, caller: CallerDep, store: ResponseStoreDep) -> JSONResponse:
    await store.delete(caller.tenant, response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
