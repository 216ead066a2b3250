"""Tool calling's pieces: the plan a request's tools and tool_choice make, the constraints it sends, and the calls it
reads back from an answer, whole and streamed in arbitrary pieces."""

from __future__ import annotations

import json

import jsonschema
import pytest

from preft.common.engine_contract import OutputConstraint
from preft.common.errors import InvalidArgument
from preft.gateway.openai.tools import NamedToolChoice, ToolCall, ToolPlan, ToolSpec, ToolStream

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
        ('<tool_call>{"name": 1}</tool_call>', "hermes"),  # (a name that is not a string)
        ("[TOOL_CALLS]", "mistral"),
        ("[TOOL_CALLS]weather", "mistral"),  # (no [ARGS])
        ("[1, 2] are numbers", "pythonic"),
        ("[weather(city)]", "pythonic"),  # (a positional argument)
        ("[weather(city=now())]", "pythonic"),  # (not a literal)
        ("Calls look like [weather(city='Oslo')]", "pythonic"),  # (a call only where the answer starts with one)
    ):
        assert plan.read(text, call_format) == (text, []), text


MISTRAL_ANSWERS = (
    'Let me look.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]',
    'Let me look.[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]time[ARGS]{}',
)
PYTHONIC_ANSWERS = (
    "[weather(city='Oslo'), time()]",
    '<|python_start|>[weather(city="Oslo"), time()]<|python_end|>',
)


def test_mistral_and_pythonic_formats():
    """Mistral's two ways (a JSON array after [TOOL_CALLS]; `name[ARGS]{...}` per call) and the pythonic list of
    calls (Llama 3.2, Llama 4) read to the same calls whole and streamed; Python literals become JSON."""
    plan = ToolPlan.of(TOOLS, None)
    for text in MISTRAL_ANSWERS:
        assert plan.read(text, "mistral") == ("Let me look.", CALLS), text
    for text in PYTHONIC_ANSWERS:
        assert plan.read(text, "pythonic") == (None, CALLS), text
    literals = "[weather(city=\"O'slo, (x)]\", days=[1, 2.5], hot=True, note=None, more={'a': (1, 2)})]"
    arguments = {"city": "O'slo, (x)]", "days": [1, 2.5], "hot": True, "note": None, "more": {"a": [1, 2]}}
    ((call,),) = [plan.read(literals, "pythonic")[1]]
    assert call.name == "weather" and json.loads(call.arguments) == arguments
    for size in (1, 3, 7, 1000):
        for text, call_format in [
            *((t, "mistral") for t in MISTRAL_ANSWERS),
            *((t, "pythonic") for t in PYTHONIC_ANSWERS),
        ]:
            content, deltas, called = _streamed(plan, text, call_format, size)
            assert called and content == ("Let me look." if call_format == "mistral" else ""), (text, size)
            assert _merged(deltas) == [(0, "weather", '{"city": "Oslo"}'), (1, "time", "{}")], (text, size)
    stream = ToolStream(plan, "mistral")
    assert stream.feed("Hi [TOOL_") == [{"content": "Hi "}]  # (what may start a call is held back)
    opening = stream.feed('CALLS]weather[ARGS]{"ci')  # (v11's arguments are the body's end: their brace goes out)
    assert [d["tool_calls"][0]["function"] for d in opening] == [
        {"name": "weather", "arguments": ""},
        {"arguments": '{"ci'},
    ]
    assert stream.feed('ty": "Oslo"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}]


def test_whole_answers_are_read_as_they_stream():
    """Whole and streamed answers agree (the whole one is read by a stream): a malformed body among calls is left out,
    wherever it stands; a call cut short (max_tokens) keeps the arguments it got; with parallel_tool_calls false,
    the first well-formed call; whole, arguments are re-serialized."""
    plan, one = ToolPlan.of(TOOLS, None), ToolPlan.of(TOOLS, None, parallel=False)
    good, bad = '<tool_call>{"name": "time", "arguments": {}}</tool_call>', '<tool_call>{"name": 1}</tool_call>'
    weather = '<tool_call>{"name": "weather", "arguments": {"city":"Oslo"}}</tool_call>'
    cases = [
        (plan, "hermes", f"Hi {bad}{good}", ("Hi", [CALLS[1]])),
        (plan, "hermes", f"{good}\n{bad}", (None, [CALLS[1]])),
        (one, "hermes", f"{bad}{weather}{good}", (None, [CALLS[0]])),
        (
            plan,
            "hermes",
            '<tool_call>{"name": "weather", "arguments": {"city": "Os',
            (None, [ToolCall("weather", '{"city": "Os')]),
        ),
        (plan, "hermes", '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}', (None, [CALLS[0]])),
        (plan, "llama3_json", '{"name": "weather", "parameters": {"city": "Oslo"}', (None, [CALLS[0]])),
        (plan, "llama3_json", '{"name": "time", "parameters": {}}; oops', (None, [CALLS[1]])),
        (plan, "mistral", '[TOOL_CALLS]weather[ARGS]{"city": "Os', (None, [ToolCall("weather", '{"city": "Os')])),
        (plan, "mistral", "[TOOL_CALLS]time[ARGS]{}[TOOL_CALLS]nope", (None, [CALLS[1]])),
        (plan, "pythonic", "[time(), weather(city='Os", (None, [CALLS[1]])),  # (a pythonic call goes out whole)
    ]
    for tools, call_format, text, read in cases:
        assert tools.read(text, call_format) == read, text
        for size in (1, 3, 7, 1000):
            _, deltas, called = _streamed(tools, text, call_format, size)
            streamed = [ToolCall(name, _json_or_text(args)) for _, name, args in _merged(deltas)]
            assert called and streamed == [ToolCall(c.name, _json_or_text(c.arguments)) for c in read[1]], (text, size)


def _json_or_text(arguments: str) -> str:
    """Arguments as whole answers give them: re-serialized where they are JSON."""
    try:
        return json.dumps(json.loads(arguments))
    except ValueError:
        return arguments


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
    """The content and the tool-call deltas a stream of `text` in `size`-character pieces lets out."""
    stream = ToolStream(plan, call_format)
    deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])]
    last, called = stream.end()
    deltas += last
    content = "".join(d.get("content", "") for d in deltas)
    return content, [c for d in deltas for c in d.get("tool_calls", [])], called


def _merged(deltas: list[dict]) -> list[tuple[int, str, str]]:
    """The calls tool-call deltas add up to, as a client joins them: each index's first delta opens it (id, type,
    name), the later ones add to its arguments."""
    calls: dict[int, tuple[str, str]] = {}
    for d in deltas:
        if d["index"] in calls:
            assert "id" not in d and "name" not in d["function"], d
            name, args = calls[d["index"]]
            calls[d["index"]] = (name, args + d["function"]["arguments"])
        else:
            assert d["id"].startswith("call_") and d["type"] == "function", d
            calls[d["index"]] = (d["function"]["name"], d["function"]["arguments"])
    return [(i, *calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streams_let_content_and_calls_out_as_they_come(size):
    auto = ToolPlan.of(TOOLS, None)
    content, calls, called = _streamed(auto, HERMES_ANSWER, "hermes", size)
    assert content == "Let me look.\n" and called
    assert _merged(calls) == [(0, "weather", '{"city": "Oslo"}'), (1, "time", "{}")]
    plain = "no call here, only <tool talk> and <tool_cal"
    assert _streamed(auto, plain, "hermes", size) == (plain, [], False)  # (held marker starts let out at the end)
    stream = ToolStream(auto, "hermes")
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]  # (what may start a call is held back)

    llama = '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "time", "parameters": {}}'
    assert _merged(_streamed(auto, llama, "llama3_json", size)[1]) == _merged(calls)
    nested = '<tool_call>\n{"name": "weather", "arguments": {"city": {"name": "Oslo"}} }\n</tool_call>'
    assert _merged(_streamed(auto, nested, "hermes", size)[1]) == [(0, "weather", '{"city": {"name": "Oslo"}}')]
    for unusual in (
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "weather"}</tool_call>',  # (arguments first: whole)
        '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',  # (as a string)
    ):
        assert _merged(_streamed(auto, unusual, "hermes", size)[1]) == [(0, "weather", '{"city": "Oslo"}')], unusual
    one = ToolPlan.of(TOOLS, None, parallel=False)
    assert _merged(_streamed(one, HERMES_ANSWER, "hermes", size)[1]) == [(0, "weather", '{"city": "Oslo"}')]
    bad_first = '<tool_call>{"name": 1}</tool_call><tool_call>{"name": "time", "arguments": {}}</tool_call>'
    assert _merged(_streamed(auto, bad_first, "hermes", size)[1]) == [(0, "time", "{}")]  # (indexes count calls)

    args = '{"city": "Rome"}'
    content, calls, called = _streamed(ToolPlan.of(TOOLS, named("weather")), args, "hermes", size)
    assert content == "" and called and _merged(calls) == [(0, "weather", args)]

    required = json.dumps([{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}])
    content, calls, called = _streamed(ToolPlan.of(TOOLS, "required"), required, "hermes", size)
    assert content == "" and called and _merged(calls) == [(0, "weather", '{"city": "Oslo"}'), (1, "time", "{}")]


def test_a_call_goes_out_once_its_name_has_and_its_arguments_as_they_come():
    """Streamed, a call opens as soon as its name is written, its arguments follow as written, short of what may be
    the call's own closing brace or end marker; a call cut short (max_tokens) stays one, as far as it got."""
    stream = ToolStream(ToolPlan.of(TOOLS, None), "hermes")
    assert stream.feed('Hi<tool_call>{"name": "weath') == [{"content": "Hi"}]
    opening, first = stream.feed('er", "arguments": {"ci')
    assert opening["tool_calls"][0]["function"] == {"name": "weather", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    held = stream.feed('ty": "Oslo"}')  # (a brace that may close the call is held back)
    assert held == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"'}}]}]
    let_out = stream.feed(" }</tool")  # (the next one is: the first closed the arguments)
    assert let_out == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert stream.feed("_call>") == []
    assert stream.end() == ([], True)

    cut = ToolStream(ToolPlan.of(TOOLS, None), "hermes")
    deltas = cut.feed('<tool_call>{"name": "weather", "arguments": {"city": "Os')
    last, called = cut.end()
    assert called and _merged([c for d in deltas + last for c in d["tool_calls"]]) == [(0, "weather", '{"city": "Os')]
