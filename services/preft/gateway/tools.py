"""Tool (function) calling on chat: the request's tools and `tool_choice`, what reaches the model, and the calls read
back from its answer.

- `auto` (the default with tools): the tools go into the chat template, in the model's own tool format, and the
  answer is read with the base model's tool-call format (`GatewaySettings.tool_call_format`): `hermes`
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5's) or `llama3_json` (an answer that is
  `{"name": ..., "parameters": {...}}`, several joined by `;`, Llama 3.1's). An answer that holds no well-formed
  call is plain content.
- `required`: the answer is constrained to a JSON array of calls of the given tools (each `{"name", "parameters"}`,
  the parameters following the tool's schema), as vLLM does.
- a named function: the answer is constrained to that function's parameters schema, and is its arguments.
- `none` (or no tools): plain chat; the tools are not shown to the model.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from preft.common.errors import InvalidArgument
from preft.engine.contract import JsonSchema, OutputConstraint

MAX_TOOLS = 128
ToolCallFormat = Literal["hermes", "llama3_json"]


class FunctionSpec(BaseModel):
    """A function the model may call."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JsonSchema | None = Field(None, description="JSON Schema of its arguments (None: no arguments)")
    strict: bool | None = Field(None, description="Accepted; `required` and named choices always hold to the schema")


class ToolSpec(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCall:
    """A call read from the answer: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}
        return call if index is None else {"index": index, **call}


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class HermesFormat:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after optional content."""

    marker = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def start(self, text: str, since: int = 0) -> int | None:
        """Where the first call starts, looked for from `since` (None: no call)."""
        at = text.find(self.marker, since)
        return None if at < 0 else at

    def held(self, text: str) -> int:
        """How many characters at the end of `text` may be the start of a call (not to be streamed as content yet)."""
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if text.endswith(self.marker[:k]):
                return k
        return 0

    def calls(self, text: str) -> list[ToolCall] | None:
        calls = []
        for body in self._call.findall(text):
            try:
                call = json.loads(body)
                calls.append(ToolCall(call["name"], _arguments(call.get("arguments", {}))))
            except (ValueError, KeyError, TypeError):
                return None
        return calls or None


class Llama3JsonFormat:
    """An answer that is `{"name": ..., "parameters": {...}}` (after an optional <|python_tag|>), several joined by
    `;`."""

    tag = "<|python_tag|>"

    def start(self, text: str, since: int = 0) -> int | None:
        """Where the call starts: only at the answer's beginning (None: no call)."""
        stripped = text.lstrip()
        if stripped.startswith("{") or stripped.startswith(self.tag):
            return len(text) - len(stripped)
        return None

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if self.tag.startswith(stripped) else 0

    def calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix(self.tag)
        decoder, at, calls = json.JSONDecoder(), 0, []
        while at < len(text):
            try:
                call, at = decoder.raw_decode(text, at)
                calls.append(ToolCall(call["name"], _arguments(call.get("parameters", call.get("arguments", {})))))
            except (ValueError, KeyError, TypeError):
                return None
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
        return calls or None


FORMATS = {"hermes": HermesFormat(), "llama3_json": Llama3JsonFormat()}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: `auto`, `required` or `named` (one function); `parallel`: more than one
    call allowed."""

    mode: Literal["auto", "required", "named"]
    tools: list[ToolSpec]
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool = True) -> ToolPlan | None:
        """The plan (None: plain chat); 400 for a choice that names no given tool or asks for tools without any."""
        if choice == "none":
            return None
        if not tools:
            if choice is not None:
                raise InvalidArgument("tool_choice: give tools to choose from")
            return None
        if isinstance(choice, NamedToolChoice):
            named = [t for t in tools if t.function.name == choice.function.name]
            if not named:
                raise InvalidArgument(f"tool_choice: no tool is named {choice.function.name!r}")
            return cls("named", named, parallel=False)
        return cls(choice or "auto", tools, parallel)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> OutputConstraint | None:
        """What the answer must match: a named function's parameters, or (`required`) a JSON array of calls."""
        if self.mode == "named":
            parameters = self.tools[0].function.parameters
            return OutputConstraint(json=parameters) if parameters else OutputConstraint(json_object=True)
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.function.name},
                        "parameters": t.function.parameters or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                }
                for t in self.tools
            ]
            items = {"anyOf": calls} if len(calls) > 1 else calls[0]
            array = {"type": "array", "minItems": 1, "items": items, **({} if self.parallel else {"maxItems": 1})}
            return OutputConstraint(json=array)
        return None

    def read(self, text: str, call_format: ToolCallFormat) -> tuple[str | None, list[ToolCall]]:
        """The answer's content (None where it is all calls) and its calls; no calls where none is well formed."""
        if self.mode == "named":
            return None, [ToolCall(self.tools[0].function.name, text)]
        if self.mode == "required":
            try:
                calls = [ToolCall(c["name"], _arguments(c["parameters"])) for c in json.loads(text)]
            except (ValueError, KeyError, TypeError):
                return text, []
            return None, calls
        fmt = FORMATS[call_format]
        at = fmt.start(text)
        calls = None if at is None else fmt.calls(text[at:])
        if not calls:
            return text, []
        return text[:at].strip() or None, calls if self.parallel else calls[:1]


class ToolStream:
    """One choice's answer, streamed under a plan as chat deltas: `auto` streams content until a call may start and
    holds the rest, a named function streams its arguments as they come, `required` holds all; the held text is
    read at the end (calls, or content where no call is well formed)."""

    def __init__(self, plan: ToolPlan, call_format: ToolCallFormat) -> None:
        self.plan, self.call_format, self.format = plan, call_format, FORMATS[call_format]
        self.text, self.sent = "", 0  # the answer so far; how much of it went out
        self.holding = plan.mode == "required"

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas to send for the next piece of the answer."""
        self.text += piece
        if self.plan.mode == "named":
            if not piece:
                return []
            first, self.sent = self.sent == 0, len(self.text)
            call = ToolCall(self.plan.tools[0].function.name, piece).as_openai(0)
            return [{"tool_calls": [call if first else {"index": 0, "function": {"arguments": piece}}]}]
        if self.holding:
            return []
        at = self.format.start(self.text, self.sent)  # (no call starts in what went out: held() kept it back)
        if at is not None:
            self.holding = True
        end = at if at is not None else len(self.text) - self.format.held(self.text)
        return self._content(end)

    def end(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas once the answer is complete, and whether it made calls."""
        if self.plan.mode == "named":
            return [], True
        _, calls = self.plan.read(self.text[self.sent :], self.call_format)
        if calls:
            return [{"tool_calls": [call.as_openai(i) for i, call in enumerate(calls)]}], True
        return self._content(len(self.text)), False

    def _content(self, end: int) -> list[dict[str, Any]]:
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return [{"content": piece}] if piece else []
