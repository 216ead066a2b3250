"""What the generation services answer: a whole answer (`Answer`) or one to stream (`Streamed`). Routes make HTTP
responses of them (``routes``), a batch's line takes a whole answer as it is (``batches.lines``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from preft.common.engine_contract import Usage
from preft.gateway.core.engine_client import EngineStream
from preft.gateway.openai.generation import GenerationService, Job
from preft.gateway.openai.sse import ChunkRenderer, EventStreamResponse, stream_response


@dataclass(frozen=True)
class Answer:
    """A whole answer: its request id, its body (as the OpenAI API writes it), the tokens it used, and the tenant's
    rate-limit headers."""

    request_id: str
    body: dict[str, Any]
    usage: Usage
    headers: dict[str, str]


@dataclass(frozen=True)
class Streamed:
    """An answer to stream: the admitted job, its engine streams (one per choice, each with its first chunk in) and
    how their chunks become events; streaming them finishes the job. `done`: the stream ends with [DONE] (the
    Responses API's has none); `on_final` sees the last event (with the usage) before it goes out."""

    generation: GenerationService
    job: Job
    streams: list[EngineStream]
    render: ChunkRenderer
    include_usage: bool
    headers: dict[str, str]
    done: bool = True
    on_final: Callable[[dict[str, Any]], Awaitable[None]] | None = None

    def response(self) -> EventStreamResponse:
        """The SSE response that streams it."""
        return stream_response(
            self.generation,
            self.job,
            self.streams,
            self.render,
            include_usage=self.include_usage,
            headers=self.headers,
            done=self.done,
            on_final=self.on_final,
        )
