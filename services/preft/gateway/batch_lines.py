"""A batch's line answered as a live request to its endpoint is: the same body validation and size limit, then the
route's own function (`chat_completion`, `completion`, `respond`: model resolution with the tenant's access,
admission, the engine), for the batch's creator as an offline caller (no per-minute buckets; the line's tokens are
reserved against the monthly quota as a live request's are, and a quota without room refuses it). Its tokens are held
from the meter and metered with the part that records the line, so a line answered again after a crash counts once.
The route runs holding a slot of the fleet's cap on batch requests (``offline_slots``) per engine request the parsed
body makes: prompts × samples.

A line the endpoint refuses (its 4xx or 5xx, as OpenAI's error body) is an answer too: it goes to the error file.
Only whole answers are given: a line asking to stream (or a response in the background) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from preft.common.errors import InvalidArgument, PreftError, Unavailable
from preft.gateway.auth import Caller
from preft.gateway.background import BackgroundRuns
from preft.gateway.conversation_store import ConversationStore
from preft.gateway.deps import parsed_body
from preft.gateway.errors import PayloadTooLarge, error_body, error_code
from preft.gateway.generation import GenerationService, held_metering
from preft.gateway.metering import Metered
from preft.gateway.offline_slots import OfflineSlots
from preft.gateway.response_store import ResponseStore
from preft.gateway.responses import ResponsesBody
from preft.gateway.routes.chat import chat_completion
from preft.gateway.routes.completions import completion
from preft.gateway.routes.responses import respond
from preft.gateway.schemas import ChatBody, CompletionBody
from preft.gateway.tokenization import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineAnswer:
    """What the endpoint answered: its status, request id and body, and the tokens it used."""

    status_code: int
    request_id: str
    body: dict[str, Any]
    input_tokens: int = 0
    output_tokens: int = 0
    retryable: bool = False  # (a 5xx of an outage: trying again later may answer it)
    metered: tuple[Metered, ...] = ()  # its generations' tokens, held from the meter: they go with the line's part

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


def _usage(body: dict[str, Any]) -> tuple[int, int]:
    """(input, output) tokens of an answer: chat and completions count prompt and completion tokens, Responses
    input and output tokens."""
    usage = body.get("usage") or {}
    return (
        int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0),
        int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0),
    )


class LineAnswerer:
    """Owns how each batch endpoint answers a line: the endpoint's body and route function, and their collaborators."""

    def __init__(
        self,
        *,
        generation: GenerationService,
        tokenizer: PromptTokenizer,
        response_store: ResponseStore,
        background_runs: BackgroundRuns,
        conversation_store: ConversationStore,
        slots: OfflineSlots,
    ) -> None:
        self._generation = generation
        self._slots = slots
        self._tokenizer = tokenizer
        self._responses = response_store
        self._runs = background_runs
        self._conversations = conversation_store
        self._routes: dict[str, Callable[[Caller, str], Awaitable[Response]]] = {
            "/v1/chat/completions": self._chat,
            "/v1/completions": self._completion,
            "/v1/responses": self._response,
        }

    async def answer(self, caller: Caller, url: str, body: dict[str, Any]) -> LineAnswer:
        """The endpoint's answer to the line's body (never raises for what the endpoint refuses), with its generations'
        tokens held from the meter: they are metered with the part that records the line (``batch_store``), once."""
        with held_metering(later_s=self._generation.settings.batches_part_s) as held:
            answer = await self._answer(caller, url, body)
        return dataclasses.replace(answer, metered=tuple(held.entries))

    async def _answer(self, caller: Caller, url: str, body: dict[str, Any]) -> LineAnswer:
        try:
            data = json.dumps(body, separators=(",", ":"))
            limit = self._generation.settings.max_request_bytes
            if len(data.encode()) > limit:
                raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
            route = self._routes.get(url)
            if route is None:
                raise InvalidArgument(f"url {url!r} is not an endpoint batches run")
            response = await route(caller, data)
        except PreftError as e:
            status = e.http_status
            if status >= 500:
                log.warning("batch line answered %d %s: %s (cause: %r)", status, error_code(e), e.message, e.__cause__)
            error = error_body(status, e.message, error_code(e), getattr(e, "error_type", None))
            return LineAnswer(status, f"req_{uuid.uuid4().hex}", error, retryable=isinstance(e, Unavailable))
        except Exception:
            log.exception("batch line failed")
            error = error_body(500, "internal gateway error", "internal_error")
            return LineAnswer(500, f"req_{uuid.uuid4().hex}", error)
        answer = json.loads(bytes(response.body))
        input_tokens, output_tokens = _usage(answer)
        request_id = response.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
        return LineAnswer(response.status_code, request_id, answer, input_tokens, output_tokens)

    @staticmethod
    def _whole(stream: bool | None, background: bool | None = None) -> None:
        if stream:
            raise InvalidArgument("stream: a batch's requests are answered whole; leave stream out")
        if background:
            raise InvalidArgument("background: a batch's requests are answered in the batch; leave background out")

    async def _chat(self, caller: Caller, data: str) -> Response:
        body = parsed_body(ChatBody, data)
        self._whole(body.stream)
        async with self._slots.slots(body.samples()):
            return await chat_completion(caller, body, self._generation, self._tokenizer, started_s=time.perf_counter())

    async def _completion(self, caller: Caller, data: str) -> Response:
        body = parsed_body(CompletionBody, data)
        self._whole(body.stream)
        async with self._slots.slots(len(body.prompts()) * body.samples()):
            return await completion(caller, body, self._generation, self._tokenizer, started_s=time.perf_counter())

    async def _response(self, caller: Caller, data: str) -> Response:
        body = parsed_body(ResponsesBody, data)
        self._whole(body.stream, body.background)
        async with self._slots.slots(1):
            return await respond(
                caller,
                body,
                self._generation,
                self._tokenizer,
                self._responses,
                self._runs,
                self._conversations,
                started_s=time.perf_counter(),
            )
