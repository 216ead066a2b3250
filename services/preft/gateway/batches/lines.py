"""A batch's line answered as a live request to its endpoint is: the same body validation and size limit, then the
endpoint's service (``openai.chat.answer_chat``, ``openai.completions.answer_completion``,
``responses.service.ResponsesService.answer``: model resolution with the tenant's access, admission, the engine),
for the batch's creator as an offline caller (no per-minute buckets; the line's tokens are reserved against the
monthly quota as a live request's are, and a quota without room refuses it). Its tokens are held from the meter
(passed to the service as `held`) and metered with the part that records the line, so a line answered again after a
crash counts once. The service runs holding a slot of the fleet's cap on batch requests (``offline_slots``) per
engine request the parsed body makes: prompts × samples.

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

from preft.common.errors import InvalidArgument, PreftError, Unavailable
from preft.gateway.batches.offline_slots import OfflineSlots
from preft.gateway.core.auth import Caller
from preft.gateway.core.deps import parsed_body
from preft.gateway.core.errors import PayloadTooLarge, error_body, error_code
from preft.gateway.core.metering import Metered
from preft.gateway.openai.answers import Answer
from preft.gateway.openai.chat import answer_chat
from preft.gateway.openai.completions import answer_completion
from preft.gateway.openai.generation import GenerationService, HeldMetering
from preft.gateway.openai.schemas import ChatBody, CompletionBody
from preft.gateway.responses.protocol import ResponsesBody
from preft.gateway.responses.service import ResponsesService

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


class LineAnswerer:
    """Owns how each batch endpoint answers a line: the endpoint's body and service, holding the fleet's slots."""

    def __init__(
        self,
        *,
        generation: GenerationService,
        responses: ResponsesService,
        slots: OfflineSlots,
        max_request_bytes: int,
        metering_later_s: float,
    ) -> None:
        self._generation = generation
        self._responses = responses
        self._slots = slots
        self._max_request_bytes = max_request_bytes
        self._metering_later_s = metering_later_s
        self._endpoints: dict[str, Callable[[Caller, str, HeldMetering], Awaitable[Answer]]] = {
            "/v1/chat/completions": self._chat,
            "/v1/completions": self._completion,
            "/v1/responses": self._response,
        }

    async def answer(self, caller: Caller, url: str, body: dict[str, Any]) -> LineAnswer:
        """The endpoint's answer to the line's body (never raises for what the endpoint refuses), with its generations'
        tokens held from the meter: they are metered with the part that records the line (``batches.store``), once."""
        held = HeldMetering(later_s=self._metering_later_s)
        answer = await self._answer(caller, url, body, held)
        return dataclasses.replace(answer, metered=tuple(held.entries))

    async def _answer(self, caller: Caller, url: str, body: dict[str, Any], held: HeldMetering) -> LineAnswer:
        try:
            data = json.dumps(body, separators=(",", ":"))
            limit = self._max_request_bytes
            if len(data.encode()) > limit:
                raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
            endpoint = self._endpoints.get(url)
            if endpoint is None:
                raise InvalidArgument(f"url {url!r} is not an endpoint batches run")
            answer = await endpoint(caller, data, held)
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
        usage = answer.usage
        return LineAnswer(200, answer.request_id, answer.body, usage.prompt_tokens, usage.completion_tokens)

    @staticmethod
    def _whole(stream: bool | None, background: bool | None = None) -> None:
        if stream:
            raise InvalidArgument("stream: a batch's requests are answered whole; leave stream out")
        if background:
            raise InvalidArgument("background: a batch's requests are answered in the batch; leave background out")

    async def _chat(self, caller: Caller, data: str, held: HeldMetering) -> Answer:
        body = parsed_body(ChatBody, data)
        self._whole(body.stream)
        async with self._slots.slots(body.samples()):
            return await answer_chat(self._generation, caller, body, started_s=time.perf_counter(), held=held)

    async def _completion(self, caller: Caller, data: str, held: HeldMetering) -> Answer:
        body = parsed_body(CompletionBody, data)
        self._whole(body.stream)
        async with self._slots.slots(len(body.prompts()) * body.samples()):
            return await answer_completion(self._generation, caller, body, started_s=time.perf_counter(), held=held)

    async def _response(self, caller: Caller, data: str, held: HeldMetering) -> Answer:
        body = parsed_body(ResponsesBody, data)
        self._whole(body.stream, body.background)
        async with self._slots.slots(1):
            return await self._responses.answer(caller, body, started_s=time.perf_counter(), held=held)
