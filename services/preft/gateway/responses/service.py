"""The Responses service: a response answered through the chat service (``openai.chat``), whole, streamed or in the
background (``background``), continuing a stored response or a conversation (``conversation_store``), and stored
where kept (``store``). Routes (``routes.responses``) and a batch's lines (``batches.lines``) call it alike."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from preft.common.errors import InvalidArgument, NotFound, Unavailable
from preft.gateway.core.auth import Caller
from preft.gateway.core.errors import validation_message
from preft.gateway.openai.answers import Answer, Streamed
from preft.gateway.openai.chat import start_chat
from preft.gateway.openai.generation import GenerationService, HeldMetering, Job
from preft.gateway.openai.reasoning import Thinking
from preft.gateway.openai.schemas import ChatBody
from preft.gateway.openai.sse import rendered
from preft.gateway.openai.tools import ToolPlan
from preft.gateway.responses.background import IN_PROGRESS, BackgroundRuns, Run, current
from preft.gateway.responses.conversation_store import Conversation, ConversationStore, item_json
from preft.gateway.responses.protocol import (
    ANSWERED,
    ResponseEvents,
    ResponsesBody,
    ResponseShape,
    conversation,
    in_responses_terms,
    input_items,
    output_items,
)
from preft.gateway.responses.store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Queued:
    """A background response as queued: its body, its request headers, and whether its events are kept (created
    streaming: they stream now, and again on GET)."""

    response_id: str
    response: dict[str, Any]
    headers: dict[str, str]
    events: bool


@dataclass
class _Admitted:
    """A response admitted: its chat job, its shape and events, and where its end goes (the store, a
    conversation)."""

    caller: Caller
    response_id: str
    job: Job
    plan: ToolPlan | None
    thinking: Thinking | None
    shape: ResponseShape
    render: ResponseEvents
    keep: bool
    turns: list[dict[str, Any]]
    items: list[dict[str, Any]]
    extend: Callable[[dict[str, Any]], Awaitable[None]] | None

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.response_id, **self.job.admission.headers()}


@dataclass(frozen=True)
class ResponsesService:
    """The Responses API over the chat service: stored responses, conversations, background runs."""

    generation: GenerationService
    store: ResponseStore
    runs: BackgroundRuns
    conversations: ConversationStore

    async def answer(
        self, caller: Caller, body: ResponsesBody, *, started_s: float, held: HeldMetering | None = None
    ) -> Answer:
        """A whole response: the answer of POST /v1/responses, and of a batch's line (its tokens to `held` where
        given, else to the meter); stored where kept."""
        admitted = await self._admit(caller, body, held)
        (out,) = await self.generation.complete(admitted.job, started_s=started_s)
        thinking, decode = admitted.thinking, self.generation.tokenizer.decode
        thought = 0 if thinking is None else thinking.tokens(out.text, out.token_ids, decode)
        output = output_items(out, admitted.plan, self.generation.formats.tool_call_format, thinking)
        answer = admitted.shape.response(output, out.finish_reason, out.usage, thought)
        await self._ended(admitted, answer)
        return Answer(admitted.response_id, answer, out.usage, admitted.headers)

    async def stream(self, caller: Caller, body: ResponsesBody, *, started_s: float) -> Streamed:
        """A response to stream (the Responses events, no [DONE]); stored where kept once its last event is out."""
        admitted = await self._admit(caller, body, None)
        streams = await self.generation.open_streams(admitted.job, started_s=started_s)

        async def on_final(event: dict[str, Any]) -> None:
            await self._ended(admitted, event["response"])

        return Streamed(
            self.generation,
            admitted.job,
            streams,
            admitted.render,
            include_usage=True,
            headers=admitted.headers,
            done=False,
            on_final=on_final,
        )

    async def start_background(self, caller: Caller, body: ResponsesBody, *, started_s: float) -> Queued:
        """A response run in the background (streaming from the engine); as queued."""
        admitted = await self._admit(caller, body, None)
        generation, job, render = self.generation, admitted.job, admitted.render

        async def answer() -> AsyncIterator[dict[str, Any]]:
            streams = await generation.open_streams(job, started_s=started_s)
            return rendered(generation, job, streams, render, include_usage=True)

        queued = {**admitted.shape.response([], None, None), "status": "queued"}
        stored = StoredResponse(queued, admitted.turns, admitted.items, events=bool(body.stream))
        run = Run(caller.tenant, stored, answer, lambda: render.output, lambda: generation.finish(job), admitted.extend)
        try:
            await self.runs.start(run)
        except BaseException:
            generation.finish(job)
            raise
        return Queued(admitted.response_id, queued, admitted.headers, events=bool(body.stream))

    async def _admit(self, caller: Caller, body: ResponsesBody, held: HeldMetering | None) -> _Admitted:
        """The request as a chat request (its history: a stored response's, or a conversation's), admitted."""
        body.refuse_unsupported()
        keep = self.store.enabled and body.store is not False
        if body.background and not keep:
            raise InvalidArgument("background: needs a stored response (store true, on a server that stores responses)")
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = await self._previous(caller.tenant, body.previous_response_id)
        held_conversation: Conversation | None = None  # (the conversation it continues, where it continues one)
        if body.conversation_id is not None:
            held_conversation, held_items = await _held_items(self.conversations, caller.tenant, body.conversation_id)
            history = conversation(held_items, field="conversation") if held_items else []
        turns = conversation(body.input, history)  # (what a later response continues)
        items = input_items(body.input, new_ids=held_conversation is not None)
        extend = None
        if held_conversation is not None:
            extend = _extender(self.conversations, caller.tenant, held_conversation, len(held_items), items)
        try:
            chat = ChatBody.model_validate(body.chat_fields(turns))
        except ValidationError as e:
            raise InvalidArgument(in_responses_terms(validation_message(e.errors(include_input=False)))) from None
        chat.stream = chat.stream or bool(body.background)  # (a background run streams from the engine)
        response_id = f"resp_{uuid.uuid4().hex}"
        job, plan, thinking = await start_chat(self.generation, caller, chat, response_id, held=held)
        shape = ResponseShape(body, response_id, stored=keep)
        render = ResponseEvents(shape, plan, self.generation.formats.tool_call_format, thinking)
        return _Admitted(caller, response_id, job, plan, thinking, shape, render, keep, turns, items, extend)

    async def _previous(self, tenant: str, response_id: str) -> list[dict[str, Any]]:
        """The conversation a stored response continues with."""
        if not self.store.enabled:
            raise InvalidArgument("previous_response_id: this server does not store responses")
        previous = await current(self.store, tenant, response_id)
        if previous.response["status"] in IN_PROGRESS:
            raise InvalidArgument("previous_response_id: that response is still in progress")
        return previous.conversation

    async def _ended(self, admitted: _Admitted, response: dict[str, Any]) -> None:
        """The answered response stored (where kept) and added to its conversation (where it continues one)."""
        if admitted.keep:
            stored = StoredResponse(response, admitted.turns, admitted.items).at(response)
            try:
                await self.store.save(admitted.caller.tenant, stored)
            except Unavailable as e:
                log.warning("response %s not stored: %s", response["id"], e.message)
                response["store"] = False
        if admitted.extend is not None:
            await admitted.extend(response)


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
