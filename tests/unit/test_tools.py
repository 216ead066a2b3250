"""Tool calling's pieces: the plan a request's tools and tool_choice make, the constraints it sends, and the calls it
reads back from an answer, whole and streamed in arbitrary pieces."""

from __future__ import annotations

import json

import jsonschema
import pytest

from preft.common.errors import InvalidArgument
from preft.engine.contract import OutputConstraint
from preft.gateway.tools import NamedToolChoice, ToolCall, ToolPlan, ToolSpec, ToolStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    ToolSpec.model_validate({"type": "function", "function": {"name": "weather", "parameters": WEATHER}}),
    ToolSpec.model_validate({"type": "function", "function": {"name": "time"}}),
]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_the_plan_follows_tool_choice():
    assert ToolPlan.of(None, None) is None and ToolPlan.of(TOOLS, "none") is None
    assert ToolPlan.of(TOOLS, None).mode == "auto" and ToolPlan.of(TOOLS, "required").mode == "required"
    plan = ToolPlan.of(TOOLS, named("time"))
    assert plan.mode == "named" and [t.function.name for t in plan.tools] == ["time"]
    with pytest.raises(InvalidArgument, match="no tool is named 'nope'"):
        ToolPlan.of(TOOLS, named("nope"))
    with pytest.raises(InvalidArgument, match="give tools"):
        ToolPlan.of([], "required")


def test_constraints_hold_calls_to_the_tools_schemas():
    assert ToolPlan.of(TOOLS, None).constraint() is None
    assert ToolPlan.of(TOOLS, named("weather")).constraint() == OutputConstraint(json=WEATHER)
    assert ToolPlan.of(TOOLS, named("time")).constraint() == OutputConstraint(json_object=True)
    schema = ToolPlan.of(TOOLS, "required").constraint().json_schema
    jsonschema.validate(
        [{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}], schema
    )
    for bad in ([], [{"name": "weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = ToolPlan.of(TOOLS, "required", parallel=False).constraint().json_schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "time", "parameters": {}}] * 2, single)


HERMES_ANSWER = (
    'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
)
CALLS = [ToolCall("weather", '{"city": "Oslo"}'), ToolCall("time", "{}")]


def test_auto_reads_each_models_own_format():
    plan = ToolPlan.of(TOOLS, None)
    assert plan.read(HERMES_ANSWER, "hermes") == ("Let me look.", CALLS)
    llama = '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "time", "parameters": {}}'
    assert plan.read(llama, "llama3_json") == (None, CALLS)
    assert plan.read(' {"name": "time", "parameters": {}}', "llama3_json") == (None, CALLS[1:])
    assert ToolPlan.of(TOOLS, None, parallel=False).read(HERMES_ANSWER, "hermes") == ("Let me look.", CALLS[:1])
    for text, call_format in (
        ("It is sunny.", "hermes"),
        ('<tool_call>{"name": "weather", "argu', "hermes"),  # (cut short: not a call)
        ('<tool_call>{"arguments": {}}</tool_call>', "hermes"),  # (no name)
        ('The answer: {"name": "x"}', "llama3_json"),  # (a call only where the answer starts with one)
        ('{"name": "weather", "parameters": {"city": "Oslo"}', "llama3_json"),
    ):
        assert plan.read(text, call_format) == (text, []), text


def test_required_and_named_answers_are_calls():
    required = json.dumps([{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}])
    content, calls = ToolPlan.of(TOOLS, "required").read(required, "hermes")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}),
        ("time", {}),
    ]
    assert ToolPlan.of(TOOLS, "required").read('[{"name": "wea', "hermes") == ('[{"name": "wea', [])  # (cut short)
    assert ToolPlan.of(TOOLS, named("weather")).read('{"city": "Rome"}', "hermes") == (
        None,
        [ToolCall("weather", '{"city": "Rome"}')],
    )
    openai = CALLS[0].as_openai(index=1)
    assert openai["index"] == 1 and openai["id"].startswith("call_") and openai["type"] == "function"
    assert openai["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}


def _streamed(plan: ToolPlan, text: str, call_format, size: int) -> tuple[str, list, bool]:
    """The content and calls a stream of `text` in `size`-character pieces lets out."""
    stream = ToolStream(plan, call_format)
    deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])]
    last, called = stream.end()
    deltas += last
    content = "".join(d.get("content", "") for d in deltas)
    return content, [c for d in deltas for c in d.get("tool_calls", [])], called


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streams_let_content_out_as_it_comes_and_calls_at_the_end(size):
    auto = ToolPlan.of(TOOLS, None)
    content, calls, called = _streamed(auto, HERMES_ANSWER, "hermes", size)
    assert content == "Let me look.\n" and called
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "weather", '{"city": "Oslo"}'),
        (1, "time", "{}"),
    ]
    plain = "no call here, only <tool talk> and <tool_cal"
    assert _streamed(auto, plain, "hermes", size) == (plain, [], False)  # (held marker starts let out at the end)
    stream = ToolStream(auto, "hermes")
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]  # (what may start a call is held back)

    args = '{"city": "Rome"}'
    content, calls, called = _streamed(ToolPlan.of(TOOLS, named("weather")), args, "hermes", size)
    assert content == "" and called and calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "weather"
    assert "".join(c["function"]["arguments"] for c in calls) == args and all("id" not in c for c in calls[1:])

    required = json.dumps([{"name": "time", "parameters": {}}])
    content, calls, called = _streamed(ToolPlan.of(TOOLS, "required"), required, "hermes", size)
    assert content == "" and called and [c["function"]["name"] for c in calls] == ["time"]
