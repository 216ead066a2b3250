"""The chat service: a conversation, rendered with the base model's chat template, answered by the base model or an
adapter, whole (`answer_chat`) or streamed (`stream_chat`); its tool calls and thinking told apart."""

from __future__ import annotations

import time
import uuid
from typing import Any

from preft.common.engine_contract import EngineChunk, EngineResponse, Usage
from preft.common.errors import InvalidArgument
from preft.gateway.core.auth import Caller
from preft.gateway.openai.answers import Answer, Streamed
from preft.gateway.openai.generation import GenerationService, HeldMetering, Job, total_usage
from preft.gateway.openai.logprobs import chat_logprobs
from preft.gateway.openai.reasoning import Thinking, ThinkSplitter
from preft.gateway.openai.schemas import ChatBody, ServedTier
from preft.gateway.openai.sse import usage_dict
from preft.gateway.openai.tools import ToolCallFormat, ToolPlan, ToolStream

PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens whose text says whether the template opened the thinking


class ChatChunks:
    """Stream events of a chat completion: the role first, then content deltas (or, under a tool plan, what each
    choice's ToolStream lets out), then the finish reason; each names the tier it is served in."""

    def __init__(
        self,
        request_id: str,
        model: str,
        include_usage: bool,
        plan: ToolPlan | None = None,
        call_format: ToolCallFormat = "hermes",
        thinking: Thinking | None = None,
        service_tier: ServedTier = "default",
    ) -> None:
        self.head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "service_tier": service_tier,
        }
        self.include_usage = include_usage
        self.plan, self.call_format, self.thinking = plan, call_format, thinking
        self.tool_streams: dict[int, ToolStream] = {}
        self.splitters: dict[int, ThinkSplitter] = {}

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
        logprobs = None if chunk.logprobs is None else chat_logprobs(chunk.logprobs)
        text, events = chunk.text, []
        if self.thinking is not None:
            splitter = self.splitters.setdefault(index, self.thinking.splitter())
            last = chunk.finish_reason is not None
            reasoning, text = splitter.feed(text, last=last, tokens=len(chunk.token_ids))
            if reasoning or (logprobs and splitter.thinking):
                events.append(self._event(index, {"reasoning": reasoning}, None, logprobs))
                logprobs = None
        if self.plan is not None:
            return events + self._tool_piece(text, chunk.finish_reason, index, logprobs)
        if text or logprobs:
            events.append(self._event(index, {"content": text}, None, logprobs))
        if chunk.finish_reason is not None:
            events.append(self._event(index, {}, chunk.finish_reason))
        return events

    def _tool_piece(self, text: str, finish: str | None, index: int, logprobs: Any) -> list[dict[str, Any]]:
        """What the choice's ToolStream lets out of the piece: content, calls' deltas, then the finish; the
        piece's token logprobs (where asked for) go with its first event, an empty delta where it lets out
        nothing yet (every generated token's, as on plain answers)."""
        assert self.plan is not None
        stream = self.tool_streams.setdefault(index, ToolStream(self.plan, self.call_format))
        deltas = stream.feed(text)
        if finish is not None:
            last, called = stream.end()
            deltas += last
            finish = finish_reason(self.plan, finish, called)
        if self.plan.legacy:
            deltas = [as_function_call(delta) for delta in deltas]
        if logprobs and not deltas:
            deltas = [{}]
        events = [self._event(index, delta, None, logprobs if i == 0 else None) for i, delta in enumerate(deltas)]
        return events + ([self._event(index, {}, finish)] if finish is not None else [])

    def usage(self, usage: Usage) -> dict[str, Any]:
        thought = None if self.thinking is None else sum(s.tokens for s in self.splitters.values())
        return {**self.head, "choices": [], "usage": chat_usage(usage, thought)}


def chat_usage(usage: Usage, reasoning_tokens: int | None) -> dict[str, Any]:
    """A chat answer's usage; where the model thinks, with how many of its tokens were thinking."""
    if reasoning_tokens is None:
        return usage_dict(usage)
    return {**usage_dict(usage), "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def finish_reason(plan: ToolPlan, engine_finish: str, called: bool) -> str:
    """The answer's finish reason: tool_calls (function_call, for the deprecated functions) where it ended by itself
    having made calls (`auto`, `required`); a named function's answer ends with stop, as OpenAI's."""
    if called and engine_finish == "stop" and plan.mode != "named":
        return "function_call" if plan.legacy else "tool_calls"
    return engine_finish


def as_function_call(delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed delta's call as the deprecated `function_call` (the name with the call's first delta)."""
    if "tool_calls" not in delta:
        return delta
    (call,) = delta["tool_calls"]  # (one call at most: the plan is not parallel)
    function = call["function"]
    piece = {"name": function["name"], "arguments": function["arguments"]} if "id" in call else function
    return {**{k: v for k, v in delta.items() if k != "tool_calls"}, "function_call": piece}


def _message(
    out: EngineResponse, plan: ToolPlan | None, call_format: ToolCallFormat, thinking: Thinking | None
) -> tuple[dict[str, Any], str]:
    """A whole answer's message (its thinking apart, where the model thinks) and finish reason."""
    reasoning, text = (None, out.text) if thinking is None else thinking.split(out.text)
    thought = {} if thinking is None else {"reasoning": reasoning or None}
    if plan is None:
        return {"role": "assistant", "content": text, **thought}, out.finish_reason
    content, calls = plan.read(text, call_format)
    message: dict[str, Any] = {"role": "assistant", "content": content, **thought}
    if calls and plan.legacy:
        message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
    elif calls:
        message["tool_calls"] = [call.as_openai() for call in calls]
    return message, finish_reason(plan, out.finish_reason, bool(calls))


async def start_chat(
    generation: GenerationService, caller: Caller, body: ChatBody, request_id: str, *, held: HeldMetering | None = None
) -> tuple[Job, ToolPlan | None, Thinking | None]:
    """A chat request's conversation rendered with the chat template (and the tools, in auto mode), then admitted
    (its tokens to `held` where given, else to the meter); with its tool plan and, where the model thinks, how its
    answers begin."""
    body.refuse_unsupported()
    tokenizer = generation.tokenizer
    plan = body.tool_plan
    if plan is not None and plan.mode == "auto" and not tokenizer.takes_tools:
        raise InvalidArgument(
            "tools: this base model's chat template does not show tools to the model; use tool_choice "
            "required or a named function"
        )
    tools = plan.template_tools() if plan is not None else None
    if plan is not None and plan.mode == "auto":
        body.skip_special_tokens = False  # (as vLLM: a call's marker may be a special token, and must reach the reader)
    text = tokenizer.render_chat(
        body.conversation(),
        tools,
        continue_final=body.continue_final_message,
        template_kwargs=body.template_kwargs(),
    )
    fewest = [generation.guard.fewest_tokens(text, "conversation, rendered with the chat template,")]
    max_tokens, vocab_size = body.token_limit, tokenizer.vocab_size
    async with generation.precharged(caller, body, fewest, max_tokens=max_tokens, request_id=request_id) as pre:
        # (the template writes any special tokens itself)
        prompt_ids = await generation.guard.encode(caller.tenant, text, add_special_tokens=False)
        prompt_ids = body.truncated(prompt_ids, generation.settings.max_prompt_tokens)
        thinking = None
        if generation.formats.reasoning_format == "think":
            thinking = Thinking.of_prompt(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        job = await generation.admit(
            caller,
            body,
            [prompt_ids],
            max_tokens=max_tokens,
            request_id=request_id,
            vocab_size=vocab_size,
            precharge=pre,
            held=held,
        )
    return job, plan, thinking


async def stream_chat(generation: GenerationService, caller: Caller, body: ChatBody, *, started_s: float) -> Streamed:
    """A chat completion to stream (POST /v1/chat/completions with `stream`)."""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    job, plan, thinking = await start_chat(generation, caller, body, request_id)
    headers = {"x-request-id": request_id, **job.admission.headers()}
    streams = await generation.open_streams(job, started_s=started_s)
    call_format = generation.formats.tool_call_format
    render = ChatChunks(request_id, body.model, body.include_usage, plan, call_format, thinking, body.tier_used)
    return Streamed(generation, job, streams, render, body.include_usage, headers)


async def answer_chat(
    generation: GenerationService,
    caller: Caller,
    body: ChatBody,
    *,
    started_s: float,
    held: HeldMetering | None = None,
) -> Answer:
    """A whole chat completion: the answer of POST /v1/chat/completions, and of a batch's line (its tokens to `held`
    where given, else to the meter)."""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    job, plan, thinking = await start_chat(generation, caller, body, request_id, held=held)
    headers = {"x-request-id": request_id, **job.admission.headers()}
    outs = await generation.complete(job, started_s=started_s)
    call_format, decode = generation.formats.tool_call_format, generation.tokenizer.decode
    choices = []
    for i, out in enumerate(outs):
        message, finish = _message(out, plan, call_format, thinking)
        logprobs = None if out.logprobs is None else chat_logprobs(out.logprobs)
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
    usage = total_usage([out.usage for out in outs], job.samples)  # (the prompt once, every choice's tokens)
    thought = None if thinking is None else sum(thinking.tokens(o.text, o.token_ids, decode) for o in outs)
    answer = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": chat_usage(usage, thought),
        "service_tier": body.tier_used,
    }
    return Answer(request_id, answer, usage, headers)
