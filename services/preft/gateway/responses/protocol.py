"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: the request becomes a chat request (`input` and
`instructions` the conversation, `text.format` the response format, flat function tools the chat's), and the chat
answer becomes the response's output items (a message with its `output_text`, then any function calls), whole or as
the Responses stream's events.

Responses are stored where the operator turned that on (`preft.gateway.responses.store`: then `store`, true unless
the request says false, keeps the response for `GET /v1/responses/{id}` and `previous_response_id`); otherwise a
conversation goes in `input` whole, with its past function calls and their outputs as items. There too,
`conversation` continues a stored conversation (``conversation_store``) and adds the response's input and output to
it, and `background` runs a response on the gateway (``background``).
"""

from __future__ import annotations

import copy
import re
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from preft.common.engine_contract import MAX_COUNT, EngineChunk, EngineResponse, JsonSchema, Usage
from preft.common.errors import InvalidArgument
from preft.gateway.core.pages import Metadata
from preft.gateway.openai.logprobs import chat_logprobs
from preft.gateway.openai.reasoning import Thinking
from preft.gateway.openai.schemas import (
    EXAMPLE_MODEL,
    VLLM_FIELDS_NOT_SUPPORTED,
    GenerationBody,
    ReasoningEffort,
    ServiceTier,
    tier_served,
)
from preft.gateway.openai.tools import MAX_TOOLS, ToolCall, ToolCallFormat, ToolPlan, ToolStream

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values that ask for items this server never produces (reasoning, built-in tools, images): nothing to add
INCLUDE_NOT_PRODUCED = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
# Fields of a Responses request that OpenAI defines and this server does not do: refused when asked for (not null)
NOT_SUPPORTED = ("prompt",)
# The generation fields a Responses request gives in its own way (or not at all: `n`)
CHAT_ONLY = frozenset(
    {"model", "max_tokens", "stream", "stream_options", "n", "response_format", "user", "service_tier"}
)
# The vLLM and PreFT extensions a Responses request may carry, as on chat (sampling options, `preft_mode`, ...)
EXTENSIONS = (frozenset(GenerationBody.model_fields) - CHAT_ONLY) | {"chat_template_kwargs", *VLLM_FIELDS_NOT_SUPPORTED}


class ConversationRef(BaseModel):
    """`conversation: {"id": ...}` (or the id alone)."""

    model_config = ConfigDict(extra="ignore")

    id: str


class ReasoningConfig(BaseModel):
    """`reasoning`: a thinking model's effort, given to its chat template as chat's reasoning_effort is (no summary
    is made: `summary` is accepted and left out)."""

    model_config = ConfigDict(extra="ignore")

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionTool(BaseModel):
    """A Responses `tools` entry: a function, flat (`{"type": "function", "name", "parameters", ...}`)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        if self.type != "function":
            raise InvalidArgument(f"tools: only function tools are supported, not {self.type!r}")
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class FunctionChoice(BaseModel):
    """`tool_choice: {"type": "function", "name": ...}`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON satisfying a named schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.name is None:
            raise InvalidArgument("text.format: a json_schema format needs a name")
        schema = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesBody(BaseModel):
    """POST /v1/responses (text in and out, function tools; extensions as on chat, through `extra_body`)."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={"examples": [{"model": EXAMPLE_MODEL, "input": "Hi!", "max_output_tokens": 16}]},
    )

    model: str = Field(min_length=1, max_length=256, description="Base model name or adapter reference")
    input: str | list[dict[str, Any]] = Field(description="A user message, or a list of messages and call items")
    instructions: str | None = Field(None, description="A system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="Most tokens to generate")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs included: the most likely tokens")
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: the input's last tokens, as many as the server accepts (disabled: refused if longer)"
    )
    metadata: Metadata | None = None
    user: str | None = None
    store: bool | None = Field(None, description="Keep the response (where the server stores responses); default true")
    previous_response_id: str | None = Field(None, description="A stored response this one continues")
    conversation: str | ConversationRef | None = Field(
        None, description="A conversation this one continues; its input and output are added to it"
    )
    background: bool | None = Field(None, description="Answer at once (queued) and run it; poll GET /v1/responses/{id}")
    reasoning: ReasoningConfig | None = None
    service_tier: ServiceTier = None

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in NOT_SUPPORTED:
            if extra.get(name) not in (None, False):
                raise InvalidArgument(f"{name} is not supported by this server")
        check_include(self.include)
        if self.tools and self.logprobs:  # (an output_text's logprobs would have to leave out the calls' tokens)
            raise InvalidArgument("logprobs (include, top_logprobs): not available with tools")
        if self.conversation is not None and self.previous_response_id is not None:
            raise InvalidArgument("conversation and previous_response_id cannot both be given")

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def logprobs(self) -> bool:
        """Logprobs asked for: by `include`, or by asking for the most likely tokens."""
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def chat_fields(self, turns: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request this one asks for (ChatBody's fields): `instructions` as a system message, then the
        conversation's `turns` (`conversation`: the history it continues and its input)."""
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}  # type: ignore[assignment]
        response_format = self.text.format.as_response_format() if self.text and self.text.format else None
        extensions = {k: v for k, v in (self.model_extra or {}).items() if k in EXTENSIONS}
        if self.truncation == "auto":
            extensions["truncate_prompt_tokens"] = -1
        fields = {
            "model": self.model,
            "messages": ([{"role": "system", "content": self.instructions}] if self.instructions else []) + turns,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "tools": [t.as_chat() for t in self.tools] if self.tools else None,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": response_format,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs if self.logprobs else None,
            "user": self.user,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "service_tier": self.service_tier,
        }
        return extensions | {k: v for k, v in fields.items() if v is not None}


def check_include(include: list[str] | None) -> None:
    """`include`'s values: logprobs, or items this server never produces (nothing to add); others are a 400."""
    for item in include or []:
        if item != LOGPROBS_INCLUDE and item not in INCLUDE_NOT_PRODUCED:
            raise InvalidArgument(f"include: unknown value {item!r}")


# chat field paths in validation messages → the Responses request's own
_CHAT_PATHS = (
    (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"\bresponse_format\.json_schema\."), "text.format."),
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bmessages\b"), "input"),
)


def in_responses_terms(message: str) -> str:
    """A chat validation message with the fields named as the Responses request names them."""
    for pattern, name in _CHAT_PATHS:
        message = pattern.sub(name, message)
    return message


def _text(content: Any, where: str) -> str:
    """A message's or output's content as text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}: content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidArgument(f"{where}: only text content parts are supported, not {kind!r}")
        if not isinstance(part.get("text"), str):
            raise InvalidArgument(f"{where}: a text part needs its text")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{where}: {key} must be a non-empty string")
    return value


def conversation(
    input: str | list[dict[str, Any]],
    history: list[dict[str, Any]] = (),  # type: ignore[assignment]
    *,
    field: str = "input",
) -> list[dict[str, Any]]:
    """The chat turns of a Responses input after the `history` it continues: each item (messages; function calls,
    consecutive ones as one assistant turn; their outputs as tool turns). No instructions: a later response that
    continues these turns does not carry them. `field` names the items in a refusal's message."""
    messages = [dict(turn) for turn in history]
    if isinstance(input, str):
        if not input:
            raise InvalidArgument(f"{field}: the input is empty")
        return [*messages, {"role": "user", "content": input}]
    if not input:
        raise InvalidArgument(f"{field}: the input is empty")
    for i, item in enumerate(input):
        where, kind = f"{field}.{i}", item.get("type", "message")
        if not isinstance(item.get("id", ""), str | None):  # (items are listed by their ids: strings, as ours)
            raise InvalidArgument(f"{where}: id must be a string")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidArgument(f"{where}: role must be user, assistant, system or developer, not {role!r}")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":  # (an earlier answer's thinking: chat templates leave it out of later turns)
            continue
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise InvalidArgument(f"{where}: input items of type {kind!r} are not supported")
    return messages


def input_items(input: str | list[dict[str, Any]], *, new_ids: bool = False) -> list[dict[str, Any]]:
    """A (checked) Responses input as its items, each with an id (`GET /v1/responses/{id}/input_items`): its own,
    or a new one (always, where `new_ids`: items added to a conversation)."""
    items = []
    for item in [{"role": "user", "content": input}] if isinstance(input, str) else input:
        kind = item.get("type", "message")
        given = None if new_ids else item.get("id")
        if kind == "message":
            content = item["content"]
            if isinstance(content, str):
                content = [{"type": "output_text" if item["role"] == "assistant" else "input_text", "text": content}]
            message = {"type": "message", "role": item["role"], "content": content, "status": "completed"}
            items.append({"id": given or _id("msg"), **message})
        else:
            prefix = {"function_call": "fc", "reasoning": "rs"}.get(kind, "fco")
            items.append({**item, "id": given or _id(prefix)})
    return items


ANSWERED = ("completed", "incomplete")  # a response's statuses once its answer is whole (cut short or not)


def output_turns(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat turn that continues its conversation: its text and its calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    return [
        {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}
    ]


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage_of(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseShape:
    """The response object around the output: what the request asked, echoed as OpenAI does."""

    def __init__(self, body: ResponsesBody, response_id: str, *, stored: bool) -> None:
        tools = [{"type": "function", **t.model_dump(exclude_none=True, exclude={"type"})} for t in body.tools or []]
        choice: Any = body.tool_choice or "auto"
        self.head = {
            "id": response_id,
            "object": "response",
            "background": body.background is True,
            "created_at": int(time.time()),
            "model": body.model,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": None if body.reasoning is None else {"effort": body.reasoning.effort, "summary": None},
            "conversation": None if body.conversation_id is None else {"id": body.conversation_id},
            "store": stored,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": {"type": "text"}}
            if body.text is None
            else body.text.model_dump(exclude_none=True, by_alias=True),
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice,
            "tools": tools,
            "top_logprobs": body.top_logprobs,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled",
            "user": body.user,
            "service_tier": tier_served(body.service_tier),
        }

    def response(
        self,
        output: list[dict[str, Any]],
        finish_reason: str | None,
        usage: Usage | None,
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        """The response: in progress (no finish reason yet), completed, or incomplete (cut at max_output_tokens);
        `reasoning_tokens`: how many of its output tokens were thinking."""
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            **self.head,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "output": output,
            "usage": None if usage is None else usage_of(usage, reasoning_tokens),
        }


def message_item(text: str, logprobs: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant", "content": [part]}


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": content, "status": status}


def call_item(call: ToolCall, call_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call_id or _id("call"),
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def output_items(
    out: EngineResponse, plan: ToolPlan | None, call_format: ToolCallFormat, thinking: Thinking | None
) -> list[dict[str, Any]]:
    """A whole answer's output: its thinking (where the model thinks and it did), its text as a message (where it
    has any), then its calls."""
    reasoning, text = ("", out.text) if thinking is None else thinking.split(out.text)
    content, calls = (text, []) if plan is None else plan.read(text, call_format)
    logprobs = chat_logprobs(out.logprobs)["content"] if out.logprobs is not None else []
    items = ([reasoning_item(reasoning)] if reasoning else []) + ([message_item(content, logprobs)] if content else [])
    return items + [call_item(call) for call in calls]


class ResponseEvents:
    """The Responses stream's events for one answer (a `ChunkRenderer`): the response created and in progress, each
    output item added (a thinking model's reasoning first), its text, thinking or arguments in deltas and done, then
    the response completed (or incomplete)."""

    def __init__(
        self, shape: ResponseShape, plan: ToolPlan | None, call_format: ToolCallFormat, thinking: Thinking | None
    ) -> None:
        self.shape = shape
        self.tools = None if plan is None else ToolStream(plan, call_format)
        self.splitter = None if thinking is None else thinking.splitter()
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items so far (the last one may be open)
        self.open: int | None = None  # the index of the item being written
        self.calls: dict[int, int] = {}  # a chat call index → its item's index
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": f"response.{kind}", "sequence_number": self.sequence - 1, **fields}

    def opening(self, choices: int) -> list[dict[str, Any]]:
        response = self.shape.response([], None, None)
        return [self._event("created", response=response), self._event("in_progress", response=response)]

    def piece(self, chunk: EngineChunk, index: int) -> list[dict[str, Any]]:
        text, events = chunk.text, []
        if self.splitter is not None:
            last = chunk.finish_reason is not None
            reasoning, text = self.splitter.feed(text, last=last, tokens=len(chunk.token_ids))
            if reasoning:
                events += self._reasoning(reasoning)
        if self.tools is None:
            deltas = [{"content": text}] if text or (chunk.logprobs and not self._thinking) else []
        else:
            deltas = self.tools.feed(text)
            if chunk.finish_reason is not None:
                deltas += self.tools.end()[0]
        logprobs = chat_logprobs(chunk.logprobs)["content"] if chunk.logprobs else []
        for delta in deltas:
            if delta.get("content") or ("content" in delta and logprobs):
                events += self._text(delta["content"], logprobs)
                logprobs = []
            for call in delta.get("tool_calls", []):
                events += self._call(call)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            events += self._close()
        return events

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.output[self.open]["type"] != "message":
            events += self._close()
            item = message_item("", [], status="in_progress")
            events += self._add(item)
            part = item["content"][0]
            events.append(self._event("content_part.added", **self._at(), content_index=0, part=copy.deepcopy(part)))
        part = self.output[self.open]["content"][0]  # type: ignore[index]
        part["text"] += text
        part["logprobs"] += logprobs
        return [*events, self._event("output_text.delta", **self._at(), content_index=0, delta=text, logprobs=logprobs)]

    @property
    def _thinking(self) -> bool:
        return self.splitter is not None and self.splitter.thinking

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.output[self.open]["type"] != "reasoning":
            events += self._close()
            events += self._add(reasoning_item("", status="in_progress"))
        self.output[self.open]["content"][0]["text"] += text  # type: ignore[index]
        return [*events, self._event("reasoning_text.delta", **self._at(), content_index=0, delta=text)]

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if delta["index"] not in self.calls:
            events += self._close()
            function = delta["function"]
            item = call_item(ToolCall(function["name"], ""), delta["id"], status="in_progress")
            events += self._add(item)
            self.calls[delta["index"]] = self.open  # type: ignore[assignment]
        arguments = delta["function"].get("arguments", "")
        if arguments:
            self.output[self.calls[delta["index"]]]["arguments"] += arguments
            events.append(self._event("function_call_arguments.delta", **self._at(), delta=arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = len(self.output) - 1
        return [self._event("output_item.added", output_index=self.open, item=copy.deepcopy(item))]

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.output[self.open]["id"], "output_index": self.open}

    def _close(self) -> list[dict[str, Any]]:
        """The open item's done events."""
        if self.open is None:
            return []
        item, events = self.output[self.open], []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._event(
                    "output_text.done", **self._at(), content_index=0, text=part["text"], logprobs=part["logprobs"]
                )
            )
            events.append(self._event("content_part.done", **self._at(), content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._event("reasoning_text.done", **self._at(), content_index=0, text=text))
        else:
            done = {"name": item["name"], "arguments": item["arguments"]}
            events.append(self._event("function_call_arguments.done", **self._at(), **done))
        item["status"] = "completed"
        events.append(self._event("output_item.done", output_index=self.open, item=item))
        self.open = None
        return events

    def usage(self, usage: Usage) -> dict[str, Any]:
        thought = 0 if self.splitter is None else self.splitter.tokens
        response = self.shape.response(self.output, self.finish_reason, usage, thought)
        return self._event("incomplete" if response["status"] == "incomplete" else "completed", response=response)
