"""The completions service: a text (or token-id) prompt, continued by the base model or an adapter, whole
(`answer_completion`) or streamed (`stream_completion`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from preft.common.engine_contract import EngineChunk, EngineResponse, Usage
from preft.common.errors import InvalidArgument
from preft.gateway.core.auth import Caller
from preft.gateway.core.prompt_guard import PromptGuard
from preft.gateway.core.tokenization import PromptTokenizer
from preft.gateway.openai.answers import Answer, Streamed
from preft.gateway.openai.generation import GenerationService, HeldMetering, Job, total_usage
from preft.gateway.openai.logprobs import Echo, completion_logprobs
from preft.gateway.openai.schemas import CompletionBody
from preft.gateway.openai.sse import usage_dict


class CompletionChunks:
    """Stream events of a text completion (choice `index` answers prompt index // n); with `echo`, each choice's first
    event starts with its prompt."""

    def __init__(self, request_id: str, model: str, include_usage: bool, echoes: list[Echo | None], n: int = 1) -> None:
        self.head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        self.include_usage = include_usage
        self.echoes, self.n = echoes, n
        self.text_offsets: dict[int, int] = {}  # per choice: the logprobs' offsets run over its whole text

    def opening(self, choices: int) -> list[dict[str, Any]]:
        return []

    def piece(self, chunk: EngineChunk, index: int) -> list[dict[str, Any]]:
        first = index not in self.text_offsets
        echo = self.echoes[index // self.n] if first else None
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


def _fewest_tokens(prompt: str | list[int], guard: PromptGuard) -> int:
    """The fewest tokens the prompt can have (413 for a text too long to tokenize)."""
    return guard.fewest_tokens(prompt) if isinstance(prompt, str) else len(prompt)


async def _token_ids(prompt: str | list[int], guard: PromptGuard, tenant: str) -> list[int]:
    if isinstance(prompt, str):
        return await guard.encode(tenant, prompt)
    vocab_size = guard.tokenizer.vocab_size
    if any(not 0 <= t < vocab_size for t in prompt):
        raise InvalidArgument(f"prompt: token ids must be in [0, {vocab_size})")
    return list(prompt)


def _echo(prompt: str | list[int], ids: list[int], tokenizer: PromptTokenizer, *, truncated: bool) -> Echo:
    """A prompt as echoed: its text (a token-id prompt's decoded, or a truncated one's: `ids` are what the engine got),
    and its first token's text."""
    text = prompt if isinstance(prompt, str) and not truncated else tokenizer.decode(ids)
    return Echo(text=text, first_token=tokenizer.decode(ids[:1]))


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


@dataclass(frozen=True)
class _Admitted:
    """A completion request admitted: its job and its prompts' echoes (where asked for)."""

    request_id: str
    job: Job
    echoes: list[Echo | None]

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.request_id, **self.job.admission.headers()}


async def _admit(
    generation: GenerationService, caller: Caller, body: CompletionBody, held: HeldMetering | None
) -> _Admitted:
    """The prompts tokenized (a text's) or checked (token ids), truncated where asked, then admitted."""
    body.refuse_unsupported()
    prompts = body.prompts()
    fewest = [_fewest_tokens(prompt, generation.guard) for prompt in prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    tokenizer = generation.tokenizer
    async with generation.precharged(caller, body, fewest, max_tokens=body.max_tokens, request_id=request_id) as pre:
        whole = [await _token_ids(prompt, generation.guard, caller.tenant) for prompt in prompts]
        prompt_ids = [body.truncated(ids, generation.settings.max_prompt_tokens) for ids in whole]
        echoes = [
            _echo(prompt, ids, tokenizer, truncated=len(ids) < len(all_ids)) if body.echo else None
            for prompt, ids, all_ids in zip(prompts, prompt_ids, whole, strict=True)
        ]
        job = await generation.admit(
            caller,
            body,
            prompt_ids,
            max_tokens=body.max_tokens,
            request_id=request_id,
            vocab_size=tokenizer.vocab_size,
            precharge=pre,
            held=held,
        )
    return _Admitted(request_id, job, echoes)


async def stream_completion(
    generation: GenerationService, caller: Caller, body: CompletionBody, *, started_s: float
) -> Streamed:
    """A text completion to stream (POST /v1/completions with `stream`)."""
    admitted = await _admit(generation, caller, body, None)
    streams = await generation.open_streams(admitted.job, started_s=started_s)
    render = CompletionChunks(admitted.request_id, body.model, body.include_usage, admitted.echoes, body.n or 1)
    return Streamed(generation, admitted.job, streams, render, body.include_usage, admitted.headers)


async def answer_completion(
    generation: GenerationService,
    caller: Caller,
    body: CompletionBody,
    *,
    started_s: float,
    held: HeldMetering | None = None,
) -> Answer:
    """A whole text completion: the answer of POST /v1/completions, and of a batch's line (its tokens to `held`
    where given, else to the meter)."""
    admitted = await _admit(generation, caller, body, held)
    job, n = admitted.job, body.n or 1
    samples = await generation.complete(job, started_s=started_s)
    choices = []
    for i, echo in enumerate(admitted.echoes):  # each prompt's n choices in turn
        prompt_samples = samples[i * job.samples : (i + 1) * job.samples]
        for m, out in enumerate(most_likely(prompt_samples, n, keep_logprobs=body.logprobs is not None)):
            text = out.text if echo is None else echo.text + out.text
            logprobs = _logprobs(out, echo)
            choices.append({"index": i * n + m, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason})
    usage = total_usage([out.usage for out in samples], job.samples)  # (every sample's tokens)
    answer = {
        "id": admitted.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": usage_dict(usage),
    }
    return Answer(admitted.request_id, answer, usage, admitted.headers)
