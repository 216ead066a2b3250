"""POST /v1/completions: a text (or token-id) prompt, continued by the base model or an adapter."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from preft.common.errors import InvalidArgument
from preft.engine.contract import EngineChunk, EngineResponse, Usage
from preft.gateway.deps import CallerDep, CompletionBodyDep, GenerationDep, TokenizerDep
from preft.gateway.generation import total_usage
from preft.gateway.logprobs import Echo, completion_logprobs
from preft.gateway.observability import started_s
from preft.gateway.sse import stream_response, usage_dict

router = APIRouter(tags=["completions"])


class CompletionChunks:
    """Stream events of a text completion; with `echo`, each choice's first event starts with the prompt."""

    def __init__(self, request_id: str, model: str, include_usage: bool, echo: Echo | None) -> None:
        self.head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        self.include_usage = include_usage
        self.echo = echo
        self.text_offsets: dict[int, int] = {}  # per choice: the logprobs' offsets run over its whole text

    def opening(self, choices: int) -> list[dict[str, Any]]:
        return []

    def piece(self, chunk: EngineChunk, index: int) -> list[dict[str, Any]]:
        first = index not in self.text_offsets
        echo = self.echo if first else None
        text = chunk.text if echo is None else echo.text + chunk.text
        offset = self.text_offsets.get(index, 0 if echo is None else len(echo.text))
        self.text_offsets[index] = offset + sum(len(lp.token) for lp in chunk.logprobs or [])
        if not text and not chunk.logprobs and chunk.finish_reason is None:
            return []
        logprobs = None
        if chunk.logprobs is not None:
            if echo is not None:
                logprobs = echo.logprobs(chunk.prompt_logprobs or [], chunk.logprobs)
            else:
                logprobs = completion_logprobs(chunk.logprobs, offset)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": chunk.finish_reason}
        event = {**self.head, "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return [event]

    def usage(self, usage: Usage) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage_dict(usage)}


def most_likely(samples: list[EngineResponse], n: int, *, keep_logprobs: bool) -> list[EngineResponse]:
    """best_of: the n samples with the highest log probability per token, most likely first (the samples asked for
    logprobs to be ranked; kept only where the client asked for them). n of n: all, in order."""
    if len(samples) == n:
        return samples

    def per_token(out: EngineResponse) -> float:
        logprobs = out.logprobs or []
        return sum(lp.logprob for lp in logprobs) / len(logprobs) if logprobs else float("-inf")

    best = sorted(samples, key=per_token, reverse=True)[:n]
    return best if keep_logprobs else [out.model_copy(update={"logprobs": None}) for out in best]


def _logprobs(out: EngineResponse, echo: Echo | None) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    if echo is None:
        return completion_logprobs(out.logprobs)
    return echo.logprobs(out.prompt_logprobs or [], out.logprobs)


@router.post("/v1/completions")
async def create_completion(
    request: Request, caller: CallerDep, body: CompletionBodyDep, generation: GenerationDep, tokenizer: TokenizerDep
) -> Response:
    body.refuse_unsupported()
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        prompt_ids = await tokenizer.encode(prompt)
    else:
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise InvalidArgument(f"prompt: token ids must be in [0, {tokenizer.vocab_size})")
        prompt_ids = list(prompt)
    echo = None
    if body.echo:
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        echo = Echo(text=text, first_token=tokenizer.decode(prompt_ids[:1]))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    job = await generation.admit(
        caller, body, prompt_ids, max_tokens=body.max_tokens, request_id=request_id, vocab_size=tokenizer.vocab_size
    )
    headers = {"x-request-id": request_id, **job.admission.headers()}
    if body.stream:
        streams = await generation.open_streams(job, started_s=started_s(request))
        render = CompletionChunks(request_id, body.model, body.include_usage, echo)
        return stream_response(generation, job, streams, render, include_usage=body.include_usage, headers=headers)
    samples = await generation.complete(job, started_s=started_s(request))
    outs = most_likely(samples, body.n or 1, keep_logprobs=body.logprobs is not None)
    choices = [
        {
            "index": i,
            "text": out.text if echo is None else echo.text + out.text,
            "logprobs": _logprobs(out, echo),
            "finish_reason": out.finish_reason,
        }
        for i, out in enumerate(outs)
    ]
    answer = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": usage_dict(total_usage([out.usage for out in samples])),  # (every sample's tokens)
    }
    return JSONResponse(answer, headers=headers)
