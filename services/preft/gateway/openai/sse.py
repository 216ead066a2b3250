"""Server-sent events in OpenAI's streaming format: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

A stream that fails after its first byte cannot change its status any more; it ends with one
`data: {"error": {...}}` event instead of [DONE], which OpenAI's clients raise as an APIError.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from preft.common.engine_contract import EngineChunk, Usage
from preft.common.errors import Unavailable
from preft.gateway.core.engine_client import EngineFailed, EngineStream
from preft.gateway.core.errors import sse_error
from preft.gateway.openai.generation import GenerationService, Job, total_usage

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse(event: dict[str, Any]) -> bytes:
    """One event; one with a `type` (the Responses API's) is named after it."""
    data = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return b"event: " + event["type"].encode() + b"\n" + data if "type" in event else data


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ChunkRenderer(Protocol):
    """Formats one route's stream events (completions and chat differ only here); `index`: the chunk's choice."""

    def opening(self, choices: int) -> list[dict[str, Any]]: ...

    def piece(self, chunk: EngineChunk, index: int) -> list[dict[str, Any]]: ...

    def usage(self, usage: Usage) -> dict[str, Any]: ...


async def merged(streams: list[EngineStream]) -> AsyncGenerator[tuple[int, EngineChunk], None]:
    """The streams' chunks as they arrive, each with its stream's index; the first failure of any is raised."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, EngineChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: EngineStream) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk, None))
        except Exception as e:
            await queue.put((index, None, e))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def rendered(
    generation: GenerationService,
    job: Job,
    streams: list[EngineStream],
    render: ChunkRenderer,
    *,
    include_usage: bool,
    on_final: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """The events of a job's opened engine streams (one per choice) as `render` makes them, the usage last (where
    `include_usage`; `on_final` sees it first); raises what fails; always closes the streams and finishes the job."""
    try:
        for event in render.opening(len(streams)):
            yield event
        usages: dict[int, Usage | None] = {}
        async with contextlib.aclosing(merged(streams)) as chunks:
            async for index, chunk in chunks:
                job.generated_tokens += len(chunk.token_ids)
                if chunk.finish_reason == "abort":
                    raise Unavailable("the engine aborted the generation; retry later")
                for event in render.piece(chunk, index):
                    yield event
                if chunk.finish_reason is not None:
                    usages[index] = chunk.usage
                    if len(usages) == len(streams):
                        break
        if len(usages) < len(streams):
            raise EngineFailed("the engine's stream ended without a finish reason")
        known = [usages[i] for i in range(len(streams)) if usages[i] is not None]
        if len(known) == len(streams):
            usage = total_usage(known, job.samples)  # type: ignore[arg-type]
            job.generated_tokens = usage.completion_tokens
            if include_usage:
                final = render.usage(usage)
                if on_final is not None:
                    await on_final(final)
                yield final
    finally:
        for stream in streams:
            await stream.aclose()
        generation.finish(job)


async def as_sse(body: AsyncGenerator[dict[str, Any], None], *, done: bool) -> AsyncGenerator[bytes, None]:
    """Events as SSE bytes, ending with [DONE] where `done`, or with an error event where `body` fails."""
    try:
        async with contextlib.aclosing(body) as each:
            async for event in each:
                yield sse(event)
        if done:
            yield DONE
    except Exception as e:
        yield sse_error(e)


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends, even if it never started streaming."""

    def __init__(
        self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]], headers: dict[str, str]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


def stream_response(
    generation: GenerationService,
    job: Job,
    streams: list[EngineStream],
    render: ChunkRenderer,
    *,
    include_usage: bool,
    headers: dict[str, str],
    done: bool = True,
    on_final: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> EventStreamResponse:
    """The SSE response of a job's streams, ending with [DONE] where `done` (the Responses API's stream has none);
    `on_final` sees the last event (with the usage) before it goes out."""
    events = rendered(generation, job, streams, render, include_usage=include_usage, on_final=on_final)
    body = as_sse(events, done=done)

    async def close() -> None:
        # Normally the generator has finished the job already; this covers a client gone before or mid-stream.
        with contextlib.suppress(RuntimeError):
            await body.aclose()
        for stream in streams:
            await stream.aclose()
        generation.finish(job)

    return EventStreamResponse(body, on_close=close, headers=headers)
