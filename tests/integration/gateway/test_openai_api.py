"""The official `openai` client against the gateway over real HTTP: completions, chat, streaming, models."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from preft.api.v1 import registry_pb2 as pb
from preft.common.engine_contract import BASE_MODEL_ID, OutputConstraint
from preft.common.modes import PositionMode

from .conftest import BASE, error_of


def fake_text(stub, req) -> str:
    return "".join(f" w{t}" for t in stub.tokens(req))


def last_requests(stub, count: int) -> list:
    """The stub's last `count` engine requests in the order the gateway made them (they may arrive in any order)."""

    def order(req) -> int:
        tail = req.request_id.rsplit("-", 1)[-1]
        return int(tail) if len(tail) < 8 else 0  # (the first sample's id is the request's own)

    return sorted((req for _, req in stub.received[-count:]), key=order)


def test_completions_chat_and_streams_with_the_openai_client(make_gateway, registry, stub, tokenizer, tiny_models):
    key = registry.tenant("acme")
    manifest = registry.publish("acme", "chat", tiny_models["lora"], mode="all")
    gateway = make_gateway(inject_tokenizer=False)  # the app loads the tokenizer itself, as in production
    client = gateway.openai(key)

    # completion with an adapter: the prompt is tokenized by the gateway, the adapter's digest routes the request
    out = client.completions.create(model="chat", prompt="hello world", max_tokens=5, temperature=0, seed=3)
    model_id, req = stub.received[-1]
    assert model_id == manifest.digest == req.adapter.digest
    assert req.prompt_token_ids == tokenizer._tok.encode("hello world")
    assert (req.max_tokens, req.temperature, req.seed, req.mode, req.tenant) == (5, 0.0, 3, PositionMode.ALL, "acme")
    assert req.adapter.method == "lora" and req.adapter.ref == "acme/chat@v1"
    assert {f.path for f in req.adapter.files} == {"adapter_config.json", "adapter_model.safetensors"}
    assert out.object == "text_completion" and out.model == "chat" and out.id.startswith("cmpl-")
    assert out.choices[0].text == fake_text(stub, req) and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(req.prompt_token_ids), 5)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5

    # the base model by its served name: no adapter, multiplexed as "base"; default max_tokens from settings
    out = client.completions.create(model=BASE, prompt=[5, 6, 7])
    model_id, req = stub.received[-1]
    assert model_id == BASE_MODEL_ID and req.adapter is None and req.prompt_token_ids == [5, 6, 7]
    assert req.max_tokens == gateway.settings.default_max_tokens and req.temperature == 1.0

    # chat: the model's own chat template renders the conversation
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="chat", messages=messages, max_completion_tokens=4, stop=["w9"])
    _, req = stub.received[-1]
    rendered = tokenizer._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "system: be brief\nuser: hello\nassistant:"
    assert req.prompt_token_ids == tokenizer._tok.encode(rendered, add_special_tokens=False)
    assert req.max_tokens == 4 and req.stop == ["w9"]
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == fake_text(stub, req)
    assert chat.usage.completion_tokens == 4

    # streaming completion, with usage at the end
    stream = client.completions.create(
        model="chat", prompt="hello", max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    _, req = stub.received[-1]
    assert req.stream
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == fake_text(stub, req)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    # streaming chat: role first, then content deltas, then the finish reason (no usage unless asked)
    chunks = list(client.chat.completions.create(model="chat", messages=messages, max_tokens=3, stream=True))
    _, req = stub.received[-1]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == fake_text(stub, req)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    assert all(c.object == "chat.completion.chunk" and c.model == "chat" for c in chunks)

    # every use was counted towards the adapter's hotness (batched RecordUse)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        hot = registry.client.call("Hot", pb.HotRequest(limit=5)).entries
        if hot and hot[0].score > 3.5:
            break
        time.sleep(0.1)
    assert [(e.manifest.name, e.manifest.version) for e in hot] == [("chat", 1)]
    assert hot[0].score == pytest.approx(4, rel=0.01)  # four adapter requests, none for the base model


def test_logprobs_and_penalties_with_the_openai_client(gateway, registry, stub):
    """Penalties and logit biases reach the engine; its logprobs come back in each route's OpenAI shape, whole and
    streamed (the stub's token i has logprob -(i+1)/8 and its top alternatives the next ids, each 1 lower)."""
    client = gateway.openai(registry.tenant("acme"))
    out = client.completions.create(
        model=BASE,
        prompt="hello",
        max_tokens=3,
        logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-1.25,
        logit_bias={"5": 10, "17": -100},
    )
    _, req = stub.received[-1]
    assert (req.logprobs, req.presence_penalty, req.frequency_penalty) == (2, 0.5, -1.25)
    assert req.logit_bias == {5: 10.0, 17: -100.0}
    ids = stub.tokens(req)
    words = [f" w{t}" for t in ids]
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == words and logprobs.token_logprobs == [-0.125, -0.25, -0.375]
    assert logprobs.top_logprobs[1] == {words[1]: -0.25, f" w{(ids[1] + 1) % stub.vocab_size}": -1.25}
    assert logprobs.text_offset == [0, len(words[0]), len(words[0]) + len(words[1])]
    stream = list(client.completions.create(model=BASE, prompt="hello", max_tokens=3, logprobs=0, stream=True))
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == words and all(lp.top_logprobs == [{}] for lp in streamed)
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset  # (offsets run across events)
    assert client.completions.create(model=BASE, prompt="hello", max_tokens=2).choices[0].logprobs is None
    _, req = stub.received[-1]
    assert req.logprobs is None and req.presence_penalty == 0.0 and req.logit_bias == {}
    sent = lambda r: (  # noqa: E731
        r.repetition_penalty, r.top_k, r.min_p, r.min_tokens, r.stop_token_ids, r.allowed_token_ids,
        r.include_stop_str_in_output, r.bad_words, r.skip_special_tokens, r.spaces_between_special_tokens,
    )  # fmt: skip
    assert sent(req) == (1.0, 0, 0.0, 0, [], [], False, [], True, True)
    extensions = {"repetition_penalty": 1.2, "top_k": -1, "min_p": 0.05, "min_tokens": 2, "stop_token_ids": [7, 9]}
    extensions |= {"allowed_token_ids": [3, 4], "include_stop_str_in_output": True, "bad_words": ["no", "not this"]}
    extensions |= {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "guided_json": None, "not_a_field": 1}
    client.completions.create(model=BASE, prompt="hello", max_tokens=3, extra_body=extensions | defaults)
    asked = (1.2, 0, 0.05, 2, [7, 9], [3, 4], True, ["no", "not this"], False, False)
    assert sent(stub.received[-1][1]) == asked  # (top_k -1: all, sent as 0)
    # (vLLM's fields this server does not implement pass at their defaults: test_bad_input has them refused otherwise;
    # fields no one defines are ignored)

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=BASE, messages=messages, max_tokens=2, logprobs=True, top_logprobs=3)
    _, req = stub.received[-1]
    assert req.logprobs == 3
    words = [f" w{t}" for t in stub.tokens(req)]
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [(words[0], -0.125), (words[1], -0.25)]
    assert content[0].bytes == list(words[0].encode()) and len(content[0].top_logprobs) == 3
    assert [t.logprob for t in content[1].top_logprobs] == [-0.25, -1.25, -2.25]
    chunks = list(
        client.chat.completions.create(model=BASE, messages=messages, max_tokens=2, logprobs=True, stream=True)
    )
    assert stub.received[-1][1].logprobs == 0
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.top_logprobs) for t in streamed] == [(words[0], []), (words[1], [])]
    plain = client.chat.completions.create(model=BASE, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None and stub.received[-1][1].logprobs is None


def test_echo_answers_the_prompt_first_with_its_tokens_logprobs(gateway, registry, stub, tokenizer):
    """echo: the prompt's text before each choice's answer, whole and streamed (in each choice's first event); with
    logprobs, the prompt's tokens come first, the first without a logprob (null), the generated tokens' offsets
    counted from the end of the echoed text. A token-id prompt is echoed as its decoded text."""
    client = gateway.openai(registry.tenant("acme"))
    prompt = "hello world"
    plain = client.completions.create(model=BASE, prompt=prompt, max_tokens=3, echo=True)
    _, req = stub.received[-1]
    assert plain.choices[0].text == prompt + fake_text(stub, req) and req.prompt_logprobs is None
    assert plain.usage.prompt_tokens == len(req.prompt_token_ids) and plain.usage.completion_tokens == 3

    scored = client.completions.create(model=BASE, prompt=prompt, max_tokens=3, echo=True, logprobs=1)
    _, req = stub.received[-1]
    assert (req.prompt_logprobs, req.logprobs) == (1, 1)
    ids, prompt_ids = stub.tokens(req), req.prompt_token_ids
    first = tokenizer.decode(prompt_ids[:1])
    prompt_words, words = [f" w{t}" for t in prompt_ids[1:]], [f" w{t}" for t in ids]
    logprobs = scored.choices[0].logprobs
    assert logprobs.tokens == [first, *prompt_words, *words]
    fakes = [-(i + 1) / 8 for i in range(len(prompt_words))]
    assert logprobs.token_logprobs == [None, *fakes, -0.125, -0.25, -0.375]
    assert logprobs.top_logprobs[0] is None and logprobs.top_logprobs[1] == {prompt_words[0]: -0.125}
    offsets = [0, len(first)]
    for word in prompt_words[:-1]:
        offsets.append(offsets[-1] + len(word))
    assert logprobs.text_offset[: len(prompt_ids)] == offsets
    assert logprobs.text_offset[len(prompt_ids) :] == [
        len(prompt),
        len(prompt) + len(words[0]),
        len(prompt) + 2 * len(words[0]),
    ]

    stream = list(
        client.completions.create(model=BASE, prompt=prompt, max_tokens=3, echo=True, logprobs=1, n=2, stream=True)
    )
    for i in (0, 1):
        events = [c.choices[0] for c in stream if c.choices and c.choices[0].index == i]
        assert events[0].text.startswith(prompt) and not any(e.text.startswith(prompt) for e in events[1:])
        assert "".join(e.text for e in events) == scored.choices[0].text
        assert [t for e in events if e.logprobs for t in e.logprobs.tokens] == logprobs.tokens
        assert [o for e in events if e.logprobs for o in e.logprobs.text_offset] == logprobs.text_offset

    token_prompt = asyncio.run(tokenizer.encode("the cat"))
    echoed = client.completions.create(model=BASE, prompt=token_prompt, max_tokens=2, echo=True)
    assert echoed.choices[0].text == "the cat" + fake_text(stub, stub.received[-1][1])


def test_truncate_prompt_tokens_keeps_the_prompts_end_or_start(make_gateway, registry, stub, tokenizer):
    """truncate_prompt_tokens: the engine gets the prompt's last tokens (truncation_side right: its first), counted in
    usage and echoed as their text; -1 keeps as many as the server accepts, so an over-long prompt is served; chat
    truncates the rendered conversation."""
    client = make_gateway(max_prompt_tokens=8).openai(registry.tenant("acme"))
    prompt = "the cat sat on the mat and then the dog sat on the cat"
    ids = asyncio.run(tokenizer.encode(prompt))
    assert len(ids) > 8
    out = client.completions.create(
        model=BASE, prompt=prompt, max_tokens=2, echo=True, extra_body={"truncate_prompt_tokens": 3}
    )
    _, req = stub.received[-1]
    assert req.prompt_token_ids == ids[-3:] and out.usage.prompt_tokens == 3
    assert out.choices[0].text == tokenizer.decode(ids[-3:]) + fake_text(stub, req)
    right = {"truncate_prompt_tokens": 3, "truncation_side": "right"}
    client.completions.create(model=BASE, prompt=prompt, max_tokens=2, extra_body=right)
    assert stub.received[-1][1].prompt_token_ids == ids[:3]
    client.completions.create(model=BASE, prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert stub.received[-1][1].prompt_token_ids == ids[-8:]
    with pytest.raises(openai.APIStatusError) as refused:  # (without truncation: over the server's limit)
        client.completions.create(model=BASE, prompt=prompt, max_tokens=2)
    assert refused.value.status_code == 413
    client.completions.create(model=BASE, prompt=ids[:5], max_tokens=2, extra_body={"truncate_prompt_tokens": 6})
    assert stub.received[-1][1].prompt_token_ids == ids[:5]  # (shorter than the limit: whole)

    messages = [{"role": "user", "content": "hi"}]
    whole = asyncio.run(tokenizer.encode_chat(messages))
    client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=2, extra_body={"truncate_prompt_tokens": 4}
    )
    assert stub.received[-1][1].prompt_token_ids == whole[-4:]


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Today's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time"}},
]


def test_tools_with_logprobs_give_every_generated_tokens(make_gateway, registry, stub):
    """logprobs with tools (as vLLM's): one per generated token, a call's tokens too, whole and streamed alike (a
    streamed piece the tool reader holds back carries its logprobs in an empty delta)."""
    client = make_gateway(max_prompt_tokens=450).openai(registry.tenant("acme"))
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    stub.reply = 'Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    asked = {"model": BASE, "messages": messages, "max_tokens": 50, "tools": TOOLS, "logprobs": True, "top_logprobs": 2}
    out = client.chat.completions.create(**asked)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.tool_calls
    whole = out.choices[0].logprobs.content
    assert len(whole) == out.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in whole)
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]


def test_tools_auto_required_and_named_whole_and_streamed(make_gateway, registry, stub, tokenizer):
    """auto: the tools reach the model through the chat template and calls in the model's format (hermes here) come
    back as tool_calls, content before them and each call's arguments streamed as they come; required and named: the
    engine is constrained to the calls' schema and the answer is the calls; past calls and tool answers go back into
    the prompt."""
    client = make_gateway(max_prompt_tokens=450).openai(registry.tenant("acme"))  # (tools take ~270 tiny tokens)
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    stub.reply = 'Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    out = client.chat.completions.create(model=BASE, messages=messages, max_tokens=50, tools=TOOLS)
    _, req = stub.received[-1]
    assert 'tools: {"name": "weather", "description": "Today\'s weather"' in tokenizer.decode(req.prompt_token_ids)
    assert req.constraint is None and not req.skip_special_tokens  # (a call's marker may be a special token)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("weather", {"city": "Oslo"})

    chunks = list(
        client.chat.completions.create(model=BASE, messages=messages, max_tokens=50, tools=TOOLS, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me look.\n"
    streamed = [t for d in deltas for t in d.tool_calls or []]  # (the call opens, then its arguments come in pieces)
    assert len(streamed) > 2 and streamed[0].id and streamed[0].function.name == "weather"
    assert all(t.index == 0 and t.id is None and t.function.name is None for t in streamed[1:])
    assert "".join(t.function.arguments for t in streamed) == '{"city": "Oslo"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    stub.reply = "It is sunny."  # (no call: plain content)
    plain = client.chat.completions.create(model=BASE, messages=messages, max_tokens=50, tools=TOOLS)
    assert plain.choices[0].message.content == "It is sunny." and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"

    stub.reply = '{"city": "Rome"}'
    weather = {"type": "function", "function": {"name": "weather"}}
    out = client.chat.completions.create(model=BASE, messages=messages, max_tokens=50, tools=TOOLS, tool_choice=weather)
    assert (
        stub.received[-1][1].constraint == OutputConstraint(json=WEATHER) and stub.received[-1][1].skip_special_tokens
    )
    assert (
        out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls[0].function.arguments == stub.reply
    )
    chunks = list(
        client.chat.completions.create(
            model=BASE, messages=messages, max_tokens=50, tools=TOOLS, tool_choice=weather, stream=True
        )
    )
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert streamed[0].id and streamed[0].function.name == "weather" and len(streamed) > 1
    assert "".join(t.function.arguments for t in streamed) == stub.reply

    stub.reply = json.dumps([{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"city": "Oslo"}}])
    out = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=50, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    schema = stub.received[-1][1].constraint.json_schema
    assert schema["type"] == "array" and schema["maxItems"] == 1  # (the engine would give one call)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["time", "weather"]
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None

    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    stub.reply = "Sunny in Oslo."
    out = client.chat.completions.create(model=BASE, messages=history, max_tokens=50, tools=TOOLS)
    prompt = tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\ntool: sunny, 21 C' in prompt
    assert out.choices[0].message.content == "Sunny in Oslo."


def test_deprecated_functions_answer_as_function_call(make_gateway, registry, stub, tokenizer):
    """The deprecated `functions` / `function_call`: the functions go to the model as tools, its one call comes back
    as the message's `function_call` (finish_reason function_call), whole and streamed; a forced function's answer is
    constrained to its schema; past function calls and `function` results go back into the prompt as tool turns."""
    client = make_gateway(max_prompt_tokens=450).openai(registry.tenant("acme"))
    functions = [t["function"] for t in TOOLS]
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    stub.reply = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    out = client.chat.completions.create(model=BASE, messages=messages, max_tokens=50, functions=functions)
    assert 'tools: {"name": "weather"' in tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    choice = out.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert (choice.message.function_call.name, json.loads(choice.message.function_call.arguments)) == (
        "weather",
        {"city": "Oslo"},
    )
    chunks = list(
        client.chat.completions.create(model=BASE, messages=messages, max_tokens=50, functions=functions, stream=True)
    )
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert calls[0].name == "weather" and all(c.name is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == '{"city": "Oslo"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "function_call"

    stub.reply = '{"city": "Rome"}'
    forced = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=50, functions=functions, function_call={"name": "weather"}
    )
    assert stub.received[-1][1].constraint == OutputConstraint(json=WEATHER)
    assert forced.choices[0].message.function_call.arguments == stub.reply and forced.choices[0].finish_reason == "stop"
    stub.reply = "It is sunny."
    none = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=50, functions=functions, function_call="none"
    )
    assert none.choices[0].message.content == "It is sunny." and "tools:" not in tokenizer.decode(
        stub.received[-1][1].prompt_token_ids
    )

    history = [
        *messages,
        {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"role": "function", "name": "weather", "content": "sunny, 21 C"},
    ]
    client.chat.completions.create(model=BASE, messages=history, max_tokens=50, functions=functions)
    prompt = tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\ntool: sunny, 21 C' in prompt
    for bad, says in (
        ({"functions": functions, "tools": TOOLS}, "not both"),
        ({"function_call": "auto"}, "give functions"),
        ({"functions": [{"name": "no spaces"}]}, "functions.0.name"),
    ):
        with pytest.raises(openai.BadRequestError, match=says):
            client.chat.completions.create(model=BASE, messages=messages, max_tokens=5, **bad)
    nameless = [*messages, {"role": "function", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="function's name"):
        client.chat.completions.create(model=BASE, messages=nameless, max_tokens=5)


def test_n_choices_are_samples_of_their_own_whole_and_streamed(gateway, registry, stub):
    """n > 1: one engine request per choice (seeded seed, seed + 1, ...), each answered as its own choice; usage counts
    the prompt once and every choice's tokens."""
    client = gateway.openai(registry.tenant("acme"))
    out = client.completions.create(model=BASE, prompt="hello", max_tokens=4, n=3, seed=10, logprobs=1)
    reqs = [req for _, req in stub.received[-3:]]
    assert sorted(r.seed for r in reqs) == [10, 11, 12] and len({r.request_id for r in reqs}) == 3
    by_seed = {r.seed: r for r in reqs}
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [fake_text(stub, by_seed[10 + i]) for i in range(3)]
    assert all(len(c.logprobs.tokens) == 4 for c in out.choices)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(reqs[0].prompt_token_ids), 12)

    messages = [{"role": "user", "content": "hello"}]
    usage = {"include_usage": True}
    stream = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=3, n=2, seed=4, stream=True, stream_options=usage
    )
    chunks = list(stream)
    by_seed = {req.seed: req for _, req in stub.received[-2:]}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == fake_text(stub, by_seed[4 + i])
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i]
        assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    whole = client.chat.completions.create(model=BASE, messages=messages, max_tokens=3, n=2, seed=4)
    prompt_tokens = len(stub.received[-1][1].prompt_token_ids)  # (counted once, as the streamed usage counts it)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 6)
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_response_formats_and_constraints_reach_the_engine(gateway, registry, stub):
    """OpenAI's response_format (json_object; json_schema, with and without a schema) and vLLM's structured_outputs
    extension (sent through extra_body) become the engine request's constraint, on both routes and for every choice;
    text asks for none. (That the engine holds to them: tests/engine/test_async_engine.py, tests/e2e.)"""
    client = gateway.openai(registry.tenant("acme"))
    messages = [{"role": "user", "content": "hello"}]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    named = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, OutputConstraint(json_object=True)),
        ({"response_format": named}, OutputConstraint(json=schema)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
            OutputConstraint(json_object=True),
        ),
        ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, OutputConstraint(choice=["yes", "no"])),
        ({"extra_body": {"structured_outputs": {"regex": "[0-9]+"}}}, OutputConstraint(regex="[0-9]+")),
        ({"extra_body": {"structured_outputs": {"json": json.dumps(schema)}}}, OutputConstraint(json=schema)),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "a"'}}}, OutputConstraint(grammar='root ::= "a"')),
    ]
    for options, want in cases:
        client.chat.completions.create(model=BASE, messages=messages, max_tokens=2, **options)
        assert stub.received[-1][1].constraint == want, options
    completion = {"response_format": named, "n": 2}  # (completions take response_format too, as vLLM's do)
    list(client.completions.create(model=BASE, prompt="hello", max_tokens=2, stream=True, extra_body=completion))
    assert [req.constraint for _, req in stub.received[-2:]] == [OutputConstraint(json=schema)] * 2


def test_best_of_answers_the_most_likely_samples(gateway, registry, stub):
    """best_of: that many samples (seeded seed + i), the n with the highest logprob per token answered, most likely
    first (the stub's samples are less likely the higher their seed); usage counts every sample's tokens; logprobs
    only where asked."""
    client = gateway.openai(registry.tenant("acme"))
    out = client.completions.create(model=BASE, prompt="hello", max_tokens=4, n=2, best_of=3, seed=20)
    reqs = {req.seed: req for _, req in stub.received[-3:]}
    assert sorted(reqs) == [20, 21, 22] and all(r.logprobs == 0 for r in reqs.values())  # (to rank them)
    assert [c.text for c in out.choices] == [fake_text(stub, reqs[20]), fake_text(stub, reqs[21])]
    assert [c.index for c in out.choices] == [0, 1] and all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == 12
    scored = client.completions.create(model=BASE, prompt="hello", max_tokens=4, best_of=2, seed=31, logprobs=1)
    first, second = last_requests(stub, 2)
    assert (first.seed, second.seed) == (31, 32) and len(scored.choices) == 1
    assert scored.choices[0].text == fake_text(stub, first)
    assert scored.choices[0].logprobs.token_logprobs[0] == pytest.approx(-1 / 8 - 31 / 64)


def test_a_batch_of_prompts_answers_each_prompts_choices_in_turn(gateway, registry, stub, tokenizer):
    """A list of prompts: choice i × n + m is prompt i's m-th, whole and streamed, with echo and logprobs per prompt;
    usage counts each prompt once; best_of picks within each prompt's samples."""
    client = gateway.openai(registry.tenant("acme"))
    prompts = ["hello", "the cat sat"]
    out = client.completions.create(model=BASE, prompt=prompts, max_tokens=3, n=2, seed=1, echo=True, logprobs=1)
    reqs = last_requests(stub, 4)
    ids = [asyncio.run(tokenizer.encode(p)) for p in prompts]
    assert [(r.prompt_token_ids, r.seed) for r in reqs] == [(ids[0], 1), (ids[0], 2), (ids[1], 1), (ids[1], 2)]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [prompts[k // 2] + fake_text(stub, reqs[k]) for k in range(4)]
    assert [len(c.logprobs.tokens) for c in out.choices] == [len(ids[k // 2]) + 3 for k in range(4)]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids[0]) + len(ids[1]), 12)

    stream = list(
        client.completions.create(
            model=BASE,
            prompt=prompts,
            max_tokens=3,
            n=2,
            seed=1,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for choice in out.choices:
        events = [c.choices[0] for c in stream if c.choices and c.choices[0].index == choice.index]
        assert "".join(e.text for e in events) == choice.text
    assert stream[-1].usage.prompt_tokens == out.usage.prompt_tokens

    by_ids = client.completions.create(model=BASE, prompt=[[5, 6], [7, 8, 9]], max_tokens=2)
    assert [r.prompt_token_ids for r in last_requests(stub, 2)] == [[5, 6], [7, 8, 9]]
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == 5

    best = client.completions.create(model=BASE, prompt=prompts, max_tokens=2, best_of=3, seed=40)
    reqs = last_requests(stub, 6)
    assert [r.seed for r in reqs] == [40, 41, 42] * 2
    assert [c.text for c in best.choices] == [fake_text(stub, reqs[0]), fake_text(stub, reqs[3])]  # (seed 40 each)


def test_models_lists_the_tenants_adapters_and_the_base_model(gateway, registry, tiny_models):
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    registry.publish("acme", "chat", tiny_models["lora"])
    registry.publish("acme", "style", tiny_models["direft"])
    registry.publish("beta", "mine", tiny_models["lora"])
    registry.publish("beta", "shared", tiny_models["direft"])
    registry.share("beta", "shared", add=("acme",))

    listed = gateway.openai(acme).models.list()
    assert [(m.id, m.owned_by) for m in listed.data] == [
        (BASE, "preft"),
        ("chat", "acme"),
        ("style", "acme"),
        ("beta/shared", "beta"),
    ]
    assert [m.id for m in gateway.openai(beta).models.list().data] == [BASE, "mine", "shared"]
    assert gateway.openai(acme).models.retrieve("beta/shared").owned_by == "beta"
    assert gateway.openai(acme).models.retrieve(BASE).owned_by == "preft"


def test_the_base_model_is_listed_by_its_served_name_and_base_is_an_alias(gateway, registry, stub):
    """The gateway serves the base model as PREFT_GATEWAY__SERVED_MODEL_NAME (the local stack's `tiny-llama`), not as
    `base`; `base`, what it was listed as before, still names it in requests."""
    acme = registry.tenant("acme")
    client = gateway.openai(acme)
    assert BASE != "base" and [m.id for m in client.models.list().data] == [BASE]
    assert client.models.retrieve("base").id == BASE
    answer = client.completions.create(model="base", prompt="hi", max_tokens=1)
    assert stub.received[-1][0] == BASE_MODEL_ID and answer.choices[0].text  # (no adapter)
    assert gateway.http(acme).post("/tokenize", json={"model": "base", "prompt": "hi"}).status_code == 200


def test_continue_final_message_prefills_the_answer(gateway, registry, stub, tokenizer):
    """continue_final_message: the prompt ends inside the last (assistant) message, which the answer continues."""
    client = gateway.openai(registry.tenant("acme"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=2, extra_body={"continue_final_message": True}
    )
    assert tokenizer.decode(stub.received[-1][1].prompt_token_ids) == "user: hi\nassistant: The answer is"
    client.chat.completions.create(model=BASE, messages=messages, max_tokens=2)
    assert tokenizer.decode(stub.received[-1][1].prompt_token_ids).endswith("The answer is\nassistant:")


def test_tokenize_counts_what_the_generation_routes_send(gateway, registry, stub, tiny_models):
    """/tokenize gives the token ids the completions and chat routes send the engine (a conversation rendered with its
    tools), for the base model and the caller's adapters only; /detokenize turns them back into text."""
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    registry.publish("beta", "mine", tiny_models["lora"])
    http = gateway.http(acme)
    counted = http.post("/tokenize", json={"model": BASE, "prompt": "the cat sat"}).json()
    gateway.openai(acme).completions.create(model=BASE, prompt="the cat sat", max_tokens=1)
    assert counted["tokens"] == stub.received[-1][1].prompt_token_ids and counted["count"] == len(counted["tokens"])
    assert counted["max_model_len"] == gateway.settings.max_model_len
    messages = [{"role": "user", "content": "hello"}]
    chat = http.post("/tokenize", json={"model": BASE, "messages": messages, "tools": TOOLS[1:]}).json()
    gateway.openai(acme).chat.completions.create(model=BASE, messages=messages, max_tokens=1, tools=TOOLS[1:])
    assert chat["tokens"] == stub.received[-1][1].prompt_token_ids
    text = http.post("/detokenize", json={"model": BASE, "tokens": counted["tokens"]}).json()
    assert text == {"prompt": "the cat sat"}
    assert gateway.http(beta).post("/tokenize", json={"model": "mine", "prompt": "x"}).status_code == 200
    for path, body, status, says in (
        ("/tokenize", {"model": "beta/mine", "prompt": "x"}, 404, "beta/mine"),  # (not shared with acme)
        ("/tokenize", {"model": BASE}, 400, "either prompt or messages"),
        ("/tokenize", {"model": BASE, "prompt": "x", "messages": messages}, 400, "either prompt or messages"),
        ("/detokenize", {"model": BASE, "tokens": [5, 10**6]}, 400, "token ids"),
        ("/detokenize", {"model": BASE, "tokens": "abc"}, 400, "tokens"),
    ):
        answer = http.post(path, json=body)
        assert answer.status_code == status and says in error_of(answer)["message"], (path, body, answer.text)
    assert gateway.http().post("/tokenize", json={"model": BASE, "prompt": "x"}).status_code == 401


def test_metrics_and_probes(gateway, registry):
    key = registry.tenant("acme")
    http = gateway.http(key)
    assert http.post("/v1/completions", json={"model": BASE, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready"}
    deps = http.get("/healthz/deps")
    assert deps.status_code == 200 and deps.json()["checks"] == {"redis": "ok", "registry": "ok", "engine": "ok"}
    assert http.get("/metrics").status_code == 404  # (never on the API's port: an Ingress would expose it)
    metrics = httpx.get(gateway.metrics_url, timeout=10)
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'preft_gateway_requests_total{route="/v1/completions",status_class="2xx"}' in text
    assert "preft_gateway_overhead_seconds_count" in text
