"""POST /v1/responses: OpenAI's Responses API, answered through the chat path (`preft.gateway.responses`), at once or
in the background (`preft.gateway.background`), continuing a stored response or a conversation
(`preft.gateway.conversation_store`); GET and DELETE /v1/responses/{id} for stored responses
(`preft.gateway.response_store`), POST /v1/responses/{id}/cancel for background ones."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from preft.common.errors import InvalidArgument, NotFound, Unavailable
from preft.gateway.auth import Caller
from preft.gateway.background import IN_PROGRESS, BackgroundRuns, Run, current, replay
from preft.gateway.conversation_store import Conversation, ConversationStore, item_json
from preft.gateway.deps import (
    BackgroundRunsDep,
    CallerDep,
    ConversationStoreDep,
    GenerationDep,
    IncludeChecked,
    ItemPagingDep,
    ResponsesBodyDep,
    ResponseStoreDep,
    TokenizerDep,
)
from preft.gateway.errors import validation_message
from preft.gateway.generation import GenerationService
from preft.gateway.observability import started_s
from preft.gateway.response_store import ResponseStore, StoredResponse
from preft.gateway.responses import (
    ANSWERED,
    ResponseEvents,
    ResponsesBody,
    ResponseShape,
    conversation,
    in_responses_terms,
    input_items,
    item_list,
    output_items,
)
from preft.gateway.routes.chat import start_chat
from preft.gateway.schemas import ChatBody
from preft.gateway.sse import EventStreamResponse, as_sse, rendered, stream_response
from preft.gateway.tokenization import PromptTokenizer

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
    runs: BackgroundRunsDep,
    conversations: ConversationStoreDep,
) -> Response:
    return await respond(caller, body, generation, tokenizer, store, runs, conversations, started_s=started_s(request))


async def respond(
    caller: Caller,
    body: ResponsesBody,
    generation: GenerationService,
    tokenizer: PromptTokenizer,
    store: ResponseStore,
    runs: BackgroundRuns,
    conversations: ConversationStore,
    *,
    started_s: float,
) -> Response:
    """A response, whole, streamed or in the background: the answer of POST /v1/responses (and of a batch's
    line)."""
    body.refuse_unsupported()
    keep = store.enabled and body.store is not False
    if body.background and not keep:
        raise InvalidArgument("background: needs a stored response (store true, on a server that stores responses)")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        if not store.enabled:
            raise InvalidArgument("previous_response_id: this server does not store responses")
        previous = await current(store, caller.tenant, body.previous_response_id)
        if previous.response["status"] in IN_PROGRESS:
            raise InvalidArgument("previous_response_id: that response is still in progress")
        history = previous.conversation
    held: Conversation | None = None  # (the conversation it continues, where it continues one)
    if body.conversation_id is not None:
        held, held_items = await _held_items(conversations, caller.tenant, body.conversation_id)
        history = conversation(held_items, field="conversation") if held_items else []
    turns = conversation(body.input, history)  # (what a later response continues)
    items = input_items(body.input, new_ids=held is not None)
    extend = None if held is None else _extender(conversations, caller.tenant, held, len(held_items), items)
    try:
        chat = ChatBody.model_validate(body.chat_fields(turns))
    except ValidationError as e:
        raise InvalidArgument(in_responses_terms(validation_message(e.errors(include_input=False)))) from None
    chat.stream = chat.stream or bool(body.background)  # (a background run streams from the engine)
    response_id = f"resp_{uuid.uuid4().hex}"
    job, plan, thinking = await start_chat(caller, chat, generation, tokenizer, response_id)
    call_format = generation.settings.tool_call_format
    headers = {"x-request-id": response_id, **job.admission.headers()}
    shape = ResponseShape(body, response_id, stored=keep)
    render = ResponseEvents(shape, plan, call_format, thinking)  # (the events of a streamed or background answer)
    if body.background:

        async def answer() -> AsyncIterator[dict[str, Any]]:
            streams = await generation.open_streams(job, started_s=started_s)
            return rendered(generation, job, streams, render, include_usage=True)

        queued = {**shape.response([], None, None), "status": "queued"}
        stored = StoredResponse(queued, turns, items, events=bool(body.stream))
        run = Run(caller.tenant, stored, answer, lambda: render.output, lambda: generation.finish(job), extend)
        try:
            await runs.start(run)
        except BaseException:
            generation.finish(job)
            raise
        if body.stream:  # (the run's kept events: the run goes on if this stream's client goes)
            return _events(replay(store, caller.tenant, response_id, -1), headers)
        return JSONResponse(queued, headers=headers)

    async def ended(response: dict[str, Any]) -> None:
        """The answered response stored (where kept) and added to its conversation (where it continues one)."""
        if keep:
            try:
                await store.save(caller.tenant, StoredResponse(response, turns, items).at(response))
            except Unavailable as e:
                log.warning("response %s not stored: %s", response["id"], e.message)
                response["store"] = False
        if extend is not None:
            await extend(response)

    if body.stream:
        streams = await generation.open_streams(job, started_s=started_s)
        return stream_response(
            generation,
            job,
            streams,
            render,
            include_usage=True,
            headers=headers,
            done=False,
            on_final=lambda event: ended(event["response"]),
        )
    (out,) = await generation.complete(job, started_s=started_s)
    thought = 0 if thinking is None else thinking.tokens(out.text, out.token_ids, tokenizer.decode)
    answer = shape.response(output_items(out, plan, call_format, thinking), out.finish_reason, out.usage, thought)
    await ended(answer)
    return JSONResponse(answer, headers=headers)


async def _held_items(
    conversations: ConversationStore, tenant: str, conversation_id: str
) -> tuple[Conversation, list[dict[str, Any]]]:
    """The conversation a response continues, and its items."""
    if not conversations.enabled:
        raise InvalidArgument("conversation: this server does not store conversations")
    return await conversations.items(tenant, conversation_id)


def _extender(
    conversations: ConversationStore,
    tenant: str,
    held: Conversation,
    held_count: int,
    items: list[dict[str, Any]],
) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """What adds a finished response's input `items` and output to its conversation `held` (of `held_count` items;
    a 400 now where it has no room for them and a message)."""
    conversation_id = held.id
    size = held.size + sum(len(item_json(item).encode()) for item in items)
    conversations.check_room(held_count + len(items) + 1, size)

    async def extend(response: dict[str, Any]) -> None:
        if response["status"] not in ANSWERED:
            return
        try:  # (the output may hold a message and calls: let it pass the limit by those)
            await conversations.add_items(tenant, conversation_id, items + response["output"], limited=False)
        except (Unavailable, NotFound) as e:
            log.warning("response %s not added to %s: %s", response["id"], conversation_id, e.message)

    return extend


@router.get("/v1/responses/{response_id}")
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


@router.post("/v1/responses/{response_id}/cancel")
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


@router.get("/v1/responses/{response_id}/input_items")
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


@router.delete("/v1/responses/{response_id}")
async def delete_response(
    response_id: str, caller: CallerDep, store: ResponseStoreDep, runs: BackgroundRunsDep
) -> JSONResponse:
    await store.delete(caller.tenant, response_id)
    await runs.cancel(caller.tenant, response_id)  # (a background one in progress stops too)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
