"""Tool (function) calling on chat: the request's tools and `tool_choice`, what reaches the model, and the calls read
back from its answer.

- `auto` (the default with tools): the tools go into the chat template, in the model's own tool format, and the
  answer is read with the base model's tool-call format (`GatewaySettings.tool_call_format`): `hermes`
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5's), `llama3_json` (an answer that is
  `{"name": ..., "parameters": {...}}`, several joined by `;`, Llama 3.1's), `mistral` (`[TOOL_CALLS]` and a JSON
  array, or `name[ARGS]{...}` per call) or `pythonic` (`[name(key=literal, ...), ...]`, Llama 3.2's and 4's; each
  call goes out whole). An answer that holds no well-formed call is plain content; a malformed call among
  well-formed ones is left out, and a call cut short keeps the arguments it got, whole and streamed alike (a whole
  answer is read as it streams). Streamed, a call goes out as soon as its name has, then its arguments as the model
  writes them (the text it wrote, as vLLM's parsers stream it; whole, the arguments are re-serialized).
- `required`: the answer is constrained to a JSON array of calls of the given tools (each `{"name", "parameters"}`,
  the parameters following the tool's schema), as vLLM does.
- a named function: the answer is constrained to that function's parameters schema, and is its arguments.
- `none` (or no tools): plain chat; the tools are not shown to the model.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from preft.common.engine_contract import JsonSchema, OutputConstraint
from preft.common.errors import InvalidArgument

MAX_TOOLS = 128
ToolCallFormat = Literal["hermes", "llama3_json", "mistral", "pythonic"]


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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _canonical(arguments: str) -> str:
    """Arguments text re-serialized where it is JSON (as it is otherwise: a call cut short)."""
    try:
        return _arguments(json.loads(arguments))
    except ValueError:
        return arguments


# A call's opening as the JSON formats write it, up to where its arguments' value starts.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class CallHead:
    """A call's opening as streamed: its name, where its arguments start in its body, and whether the body wraps
    them (its last brace is the call's own, not the arguments')."""

    name: str
    args_at: int
    wrapped: bool = True


def _call(body: str) -> ToolCall | None:
    """The call a complete body (`{"name": ..., "arguments"|"parameters": ...}`) holds; None where it is not one."""
    try:
        call = json.loads(body)
        name, arguments = call["name"], call.get("parameters", call.get("arguments", {}))
    except (ValueError, KeyError, TypeError):
        return None
    return ToolCall(name, _arguments(arguments)) if isinstance(name, str) else None


class CallFormat:
    """How a model writes tool calls: where they start in its answer, where each call's body lies, and the call a
    body holds. Calls whose body is a JSON object (`{"name": ..., "arguments"|"parameters": ...}`) by default."""

    def start(self, text: str, since: int = 0) -> int | None:
        """Where the first call starts, looked for from `since` (None: no call)."""
        raise NotImplementedError

    def held(self, text: str) -> int:
        """How many characters at the end of `text` may be the start of a call (not to be streamed as content yet)."""
        raise NotImplementedError

    def bodies(self, text: str) -> list[tuple[int, int | None]]:
        """Where each call's body lies in `text` (from a call's start): its start and end, None while it is open."""
        raise NotImplementedError

    def open_tail(self, body: str) -> int:
        """How many characters at the end of an open body may be its end's marker."""
        return 0

    def head(self, body: str) -> CallHead | None:
        """The body's opening once its name and its arguments' first character are written (None: not yet, or a
        body that is not written name first: it goes out whole at its end)."""
        match = _CALL_HEAD.match(body)
        return CallHead(match.group(1), match.end()) if match is not None and len(body) > match.end() else None

    def call(self, body: str) -> ToolCall | None:
        """The call a complete body holds; None where it is not one."""
        return _call(body)


class MarkedCalls(CallFormat):
    """Calls that start at a marker, after optional content."""

    marker = ""

    def start(self, text: str, since: int = 0) -> int | None:
        at = text.find(self.marker, since)
        return None if at < 0 else at

    def held(self, text: str) -> int:
        return _held_suffix(text, self.marker)


class LeadingCalls(CallFormat):
    """Calls that are the whole answer: it starts with `opener` (or the model's `tag` before it)."""

    tag, opener = "", ""

    def start(self, text: str, since: int = 0) -> int | None:
        """Where the call starts: only at the answer's beginning (None: no call)."""
        stripped = text.lstrip()
        if stripped.startswith(self.opener) or stripped.startswith(self.tag):
            return len(text) - len(stripped)
        return None

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if self.tag.startswith(stripped) else 0

    def after_tag(self, text: str) -> int:
        """Where the calls begin: past the leading spaces and the tag."""
        at = len(text) - len(text.lstrip())
        return len(text) - len(text[at + len(self.tag) :].lstrip()) if text.startswith(self.tag, at) else at


def _without_close(args: str) -> str:
    """A call's arguments text less what may be the call's own closing brace (and the spaces around it)."""
    args = args.rstrip()
    return args[:-1].rstrip() if args.endswith("}") else args


def _json_values(text: str, at: int, separators: str, stop: str = "") -> list[tuple[int, int | None]]:
    """Where each JSON value of a sequence lies in `text` from `at` (values apart by `separators`, up to `stop`): its
    start and end, None for the last while it is not yet a whole value (or never becomes one)."""
    decoder, spans = json.JSONDecoder(), []
    while True:
        while at < len(text) and text[at] in separators:
            at += 1
        if at == len(text) or text[at] == stop:
            return spans
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return [*spans, (at, None)]
        spans.append((at, end))
        at = end


def _json_items(text: str, at: int) -> list[tuple[int, int | None]]:
    """Where each item of the JSON array at `at` lies (after spaces; a bare sequence of values where no `[` opens)."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return _json_values(text, at + 1 if text.startswith("[", at) else at, " \t\r\n,", stop="]")


def _held_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesFormat(MarkedCalls):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after optional content."""

    marker, close = "<tool_call>", "</tool_call>"

    def bodies(self, text: str) -> list[tuple[int, int | None]]:
        spans, at = [], text.find(self.marker)
        while at >= 0:
            begin = at + len(self.marker)
            end = text.find(self.close, begin)
            spans.append((begin, None if end < 0 else end))
            at = -1 if end < 0 else text.find(self.marker, end + len(self.close))
        return spans

    def open_tail(self, body: str) -> int:
        return _held_suffix(body, self.close)


class Llama3JsonFormat(LeadingCalls):
    """An answer that is `{"name": ..., "parameters": {...}}` (after an optional <|python_tag|>), several joined by
    `;`."""

    tag, opener = "<|python_tag|>", "{"

    def bodies(self, text: str) -> list[tuple[int, int | None]]:
        return _json_values(text, self.after_tag(text), " \t\r\n;")


class RequiredFormat(Llama3JsonFormat):
    """`required`'s answer: a JSON array of `{"name": ..., "parameters": {...}}` (the engine is held to it)."""

    def bodies(self, text: str) -> list[tuple[int, int | None]]:
        return _json_items(text, 0)

    def calls(self, text: str) -> list[ToolCall] | None:
        """A whole answer's calls; None unless every one is well formed (the engine was held to the array)."""
        spans = self.bodies(text.rstrip())
        calls = [_call(text[begin:end]) if end is not None else None for begin, end in spans]
        return None if not calls or None in calls else calls  # type: ignore[return-value]


# Mistral's newer tokenizers (v11 on) write `name[ARGS]{...}` after each [TOOL_CALLS]; the older a JSON array.
_ARGS_HEAD = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\[ARGS\]\s*")


class MistralFormat(MarkedCalls):
    """`[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (Mistral's v3 tokenizer), or
    `[TOOL_CALLS]name[ARGS]{...}` once per call (v11 on), after optional content."""

    marker = "[TOOL_CALLS]"

    def bodies(self, text: str) -> list[tuple[int, int | None]]:
        """Each call's body: an object of the array after a marker, or `name[ARGS]` and the arguments' value."""
        spans: list[tuple[int, int | None]] = []
        at = text.find(self.marker)
        while at >= 0:
            at += len(self.marker)
            rest = text[at:].lstrip()
            if rest.startswith("[") or rest.startswith("{"):
                values = _json_items(text, at)
            else:
                head = _ARGS_HEAD.match(text, at)
                if head is None:  # (its name still coming, or no call: read as one at the end)
                    return [*spans, (at, None)] if rest else spans
                values = [(at, end) for _, end in _json_values(text, head.end(), "")[:1]] or [(at, None)]
            spans += values
            if not values or values[-1][1] is None:
                return spans
            at = text.find(self.marker, values[-1][1])
        return spans

    def head(self, body: str) -> CallHead | None:
        named = _ARGS_HEAD.match(body)
        if named is None:
            return super().head(body)
        return CallHead(named.group(1), named.end(), wrapped=False) if len(body) > named.end() else None

    def call(self, body: str) -> ToolCall | None:
        named = _ARGS_HEAD.match(body)
        if named is None:
            return _call(body)
        try:
            return ToolCall(named.group(1), _arguments(json.loads(body[named.end() :])))
        except ValueError:
            return None


class PythonicFormat(LeadingCalls):
    """An answer that is a Python list of calls with keyword arguments, `[weather(city="Oslo"), time()]` (Llama
    3.2's and 4's pythonic format; Llama 4 wraps it in <|python_start|> ... <|python_end|>). Each call goes out
    whole once written: its arguments are Python literals, not JSON text to stream."""

    tag, opener = "<|python_start|>", "["

    def bodies(self, text: str) -> list[tuple[int, int | None]]:
        """Each call's text in the list: up to its closing parenthesis (strings and brackets inside skipped)."""
        at = self.after_tag(text)
        if not text.startswith("[", at):
            return []
        spans: list[tuple[int, int | None]] = []
        at += 1
        while True:
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            if at == len(text) or text[at] == "]":
                return spans
            end = _python_call_end(text, at)
            spans.append((at, end))
            if end is None:
                return spans
            at = end

    def head(self, body: str) -> CallHead | None:
        return None

    def call(self, body: str) -> ToolCall | None:
        """`name(key=literal, ...)` as a call with JSON arguments; None for anything else."""
        try:
            node = ast.parse(body.strip(), mode="eval").body
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            if len(arguments) != len(node.keywords):
                return None
            return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return None


def _python_call_end(text: str, at: int) -> int | None:
    """Where the Python call starting at `at` ends (after its closing parenthesis); None while it is not closed."""
    depth, quote, i = 0, "", at
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif c in "'\"":
            quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else c
            i += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth <= 0:
                return i + 1 if c == ")" and depth == 0 else None
        i += 1
    return None


FORMATS = {
    "hermes": HermesFormat(),
    "llama3_json": Llama3JsonFormat(),
    "mistral": MistralFormat(),
    "pythonic": PythonicFormat(),
}
REQUIRED = RequiredFormat()


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: `auto`, `required` or `named` (one function); `parallel`: more than one
    call allowed; `legacy`: the deprecated `functions`, whose one call is answered as `function_call`."""

    mode: Literal["auto", "required", "named"]
    tools: list[ToolSpec]
    parallel: bool = True
    legacy: bool = False

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
        """The answer's content (None where it is all calls) and its calls; no calls where none is well formed.

        `auto`'s answer is read as it streams (a `ToolStream` fed the whole text), so that the whole and the streamed
        answer agree: its calls are the ones that open (a name, then arguments) or are whole, in order; a malformed
        body among them is left out; a call cut short keeps what it got. Arguments that are JSON are re-serialized."""
        if self.mode == "named":
            return None, [ToolCall(self.tools[0].function.name, text)]
        if self.mode == "required":
            calls = REQUIRED.calls(text)
            return (None, calls) if calls else (text, [])
        stream = ToolStream(self, call_format)
        deltas = stream.feed(text)
        last, called = stream.end()
        if not called:
            return text, []
        deltas += last
        content = "".join(d.get("content", "") for d in deltas).strip() or None
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        for call in (c for d in deltas for c in d.get("tool_calls", [])):
            i, function = call["index"], call["function"]
            names.setdefault(i, function.get("name", ""))
            arguments[i] = arguments.get(i, "") + function["arguments"]
        return content, [ToolCall(names[i], _canonical(arguments[i])) for i in names]


@dataclass
class _StreamedCall:
    """A call of an answer as it streams: where its arguments start in its body, how much of them went out, whether
    they go out only at its end (`whole`: their value is a string, not JSON text) and whether all did."""

    index: int
    args_at: int
    sent: int = 0
    whole: bool = False
    done: bool = False
    wrapped: bool = True


class ToolStream:
    """One choice's answer, streamed under a plan as chat deltas. `auto` streams content until a call may start, then
    each call once its name is out, with its arguments as they come (a call whose opening is not the usual
    name-then-arguments goes out whole at its end); where no call turns out well formed the held text is content at
    the end. `required`'s calls stream the same way out of their JSON array; a named function's answer is its
    arguments, streamed as they come."""

    def __init__(self, plan: ToolPlan, call_format: ToolCallFormat) -> None:
        required = plan.mode == "required"
        self.plan, self.format = plan, REQUIRED if required else FORMATS[call_format]
        self.text, self.sent = "", 0  # the answer so far; how much of it went out as content
        self.calls_at: int | None = 0 if required else None  # where the first call starts
        self.calls: list[_StreamedCall | None] = []  # per call body: None where it was no call

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas to send for the next piece of the answer."""
        self.text += piece
        if self.plan.mode == "named":
            if not piece:
                return []
            first, self.sent = self.sent == 0, len(self.text)
            call = ToolCall(self.plan.tools[0].function.name, piece).as_openai(0)
            return [{"tool_calls": [call if first else {"index": 0, "function": {"arguments": piece}}]}]
        if self.calls_at is not None:
            return self._calls(ended=False)
        at = self.format.start(self.text, self.sent)  # (no call starts in what went out: held() kept it back)
        if at is None:
            return self._content(len(self.text) - self.format.held(self.text))
        deltas = self._content(at)
        self.calls_at = at
        return deltas + self._calls(ended=False)

    def end(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas once the answer is complete, and whether it made calls."""
        if self.plan.mode == "named":
            return [], True
        if self.calls_at is not None:
            deltas = self._calls(ended=True)
            if any(self.calls):
                return deltas, True
        return self._content(len(self.text)), False  # (no call well formed: what was held is content)

    def _calls(self, ended: bool) -> list[dict[str, Any]]:
        """What the calls written since the last piece let out: a call's opening once its name is complete, then its
        arguments up to what may be its closing brace (all of them once its body ends)."""
        assert self.calls_at is not None
        region, deltas = self.text[self.calls_at :], []
        for n, (begin, end) in enumerate(self.format.bodies(region)):
            closed = end is not None or ended
            body = region[begin:end]
            body = body[: len(body) - self.format.open_tail(body)] if end is None else body
            taken_up = n < len(self.calls)
            if not taken_up and ((not self.plan.parallel and any(self.calls)) or not self._open(body, closed, deltas)):
                break
            call = self.calls[n]
            if call is None or call.done:
                continue
            args = body[call.args_at :]
            if call.whole:
                if not closed:
                    break
                parsed = self.format.call(body)
                out = parsed.arguments if parsed is not None else _without_close(args)
            elif end is None and ended and _is_json(args):
                out = args.rstrip()  # (cut short right after its arguments: the last brace was theirs)
            else:
                out = _without_close(args) if call.wrapped else args.rstrip()
            if len(out) > call.sent:
                deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": out[call.sent :]}}]})
                call.sent = len(out)
            call.done = closed
            if not closed:
                break
        return deltas

    def _open(self, body: str, closed: bool, deltas: list[dict[str, Any]]) -> bool:
        """Take up the next call's body: its opening goes out once its name and its arguments' first character are
        written; a body that never opens so goes out whole at its end, or is no call. False: wait for more."""
        index = sum(c is not None for c in self.calls)
        head = self.format.head(body)
        if head is not None:
            self.calls.append(_StreamedCall(index, head.args_at, whole=body[head.args_at] == '"', wrapped=head.wrapped))
            deltas.append({"tool_calls": [ToolCall(head.name, "").as_openai(index)]})
            return True
        if not closed:
            return False
        whole = self.format.call(body)
        self.calls.append(None if whole is None else _StreamedCall(index, len(body), done=True))
        if whole is not None:
            deltas.append({"tool_calls": [whole.as_openai(index)]})
        return True

    def _content(self, end: int) -> list[dict[str, Any]]:
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return [{"content": piece}] if piece else []
