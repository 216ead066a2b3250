"""POST /v1/chat/completions: a conversation, rendered with the base model's chat template, answered by the
base model or an adapter."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from preft.engine.contract import EngineChunk, Usage
from preft.gateway.deps import CallerDep, ChatBodyDep, GenerationDep, TokenizerDep
from preft.gateway.generation import total_usage
from preft.gateway.logprobs import chat_logprobs
from preft.gateway.observability import started_s
from preft.gateway.sse import stream_response, usage_dict

router = APIRouter(tags=["chat"])


class ChatChunks:
    """Stream events of a chat completion: the role first, then content deltas, then the finish reason."""

    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        self.include_usage = include_usage

    def _event(
        self, index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        event = {**self.head, "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return event

    def opening(self, choices: int) -> list[dict[str, Any]]:
        return [self._event(i, {"role": "assistant", "content": ""}, None) for i in range(choices)]

    def piece(self, chunk: EngineChunk, index: int) -> list[dict[str, Any]]:
        events = []
        if chunk.text or chunk.logprobs:
            logprobs = None if chunk.logprobs is None else chat_logprobs(chunk.logprobs)
            events.append(self._event(index, {"content": chunk.text}, None, logprobs))
        if chunk.finish_reason is not None:
            events.append(self._event(index, {}, chunk.finish_reason))
        return events

    def usage(self, usage: Usage) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage_dict(usage)}


@router.post("/v1/chat/completions")
async def create_chat_completion(
    request: Request, caller: CallerDep, body: ChatBodyDep, generation: GenerationDep, tokenizer: TokenizerDep
) -> Response:
    body.refuse_unsupported()
    prompt_ids = await tokenizer.encode_chat(body.conversation())
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    job = await generation.admit(
        caller, body, prompt_ids, max_tokens=body.token_limit, request_id=request_id, vocab_size=tokenizer.vocab_size
    )
    headers = {"x-request-id": request_id, **job.admission.headers()}
    if body.stream:
        streams = await generation.open_streams(job, started_s=started_s(request))
        render = ChatChunks(request_id, body.model, body.include_usage)
        return stream_response(generation, job, streams, render, include_usage=body.include_usage, headers=headers)
    outs = await generation.complete(job, started_s=started_s(request))
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None if out.logprobs is None else chat_logprobs(out.logprobs),
            "finish_reason": out.finish_reason,
        }
        for i, out in enumerate(outs)
    ]
    answer = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": usage_dict(total_usage([out.usage for out in outs])),
    }
    return JSONResponse(answer, headers=headers)
