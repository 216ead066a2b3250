"""POST /v1/responses with the official `openai` client (real gateway, Redis and registry; the stub engine): the
request reaches the engine as the chat route sends it, the answer comes back as output items, whole and streamed
(the client's own stream accumulator rebuilds the same response)."""

from __future__ import annotations

import json
import time
from functools import partial

import httpx
import openai
import pytest
import redis

from preft.common.engine_contract import OutputConstraint

from .conftest import BASE, error_of, until

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "name": "weather", "description": "Today's weather", "parameters": WEATHER},
    {"type": "function", "name": "time"},
]


def _shape(response) -> list[tuple]:
    """A response's output as (type, text or name, arguments), ids left out."""
    return [
        (item.type, item.content[0].text) if item.type == "message" else (item.type, item.name, item.arguments)
        for item in response.output
    ]


def test_text_in_and_out_whole_and_streamed(gateway, registry, stub, tokenizer):
    """instructions and input become the chat template's conversation; the answer is one message with its text;
    streamed, the client's accumulator rebuilds the same response from the events (in order, numbered)."""
    client = gateway.openai(registry.tenant("acme"))
    stub.reply = "It is sunny in Oslo."
    out = client.responses.create(
        model=BASE, instructions="Be brief.", input="weather?", max_output_tokens=40, metadata={"job": "7"}
    )
    _, req = stub.received[-1]
    assert tokenizer.decode(req.prompt_token_ids).startswith("system: Be brief.\nuser: weather?")
    assert req.max_tokens == 40 and req.temperature == 1.0
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    assert out.output_text == "It is sunny in Oslo." and _shape(out) == [("message", "It is sunny in Oslo.")]
    assert out.output[0].role == "assistant" and out.output[0].id.startswith("msg_")
    assert out.usage.input_tokens == len(req.prompt_token_ids) and out.usage.output_tokens == len(stub.tokens(req))
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.store is False and out.instructions == "Be brief." and out.max_output_tokens == 40
    assert out.metadata == {"job": "7"}

    with client.responses.stream(model=BASE, instructions="Be brief.", input="weather?", max_output_tokens=40) as s:
        events = list(s)
        final = s.get_final_response()
    assert _shape(final) == _shape(out) and final.usage.output_tokens == out.usage.output_tokens
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == out.output_text


def test_cut_short_answers_are_incomplete(gateway, registry, stub):
    client = gateway.openai(registry.tenant("acme"))
    stub.reply = "a long answer that will not fit"
    out = client.responses.create(model=BASE, input="hi", max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=BASE, input="hi", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].content[0].text


def test_function_calls_and_their_outputs(make_gateway, registry, stub, tokenizer):
    """Flat function tools reach the chat template; calls in the model's format come back as function_call items
    (after the text before them), their arguments streamed; required and named choices hold the engine to the
    tools' schema; past calls and their outputs in `input` go back into the prompt."""
    client = make_gateway(max_prompt_tokens=450).openai(registry.tenant("acme"))
    stub.reply = 'Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    out = client.responses.create(model=BASE, input="weather in Oslo?", tools=TOOLS, max_output_tokens=60)
    _, req = stub.received[-1]
    assert 'tools: {"name": "weather", "description": "Today\'s weather"' in tokenizer.decode(req.prompt_token_ids)
    assert _shape(out) == [("message", "Let me look."), ("function_call", "weather", '{"city": "Oslo"}')]
    call = out.output[1]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert out.tools[0].name == "weather" and out.tool_choice == "auto"

    with client.responses.stream(model=BASE, input="weather in Oslo?", tools=TOOLS, max_output_tokens=60) as s:
        events = list(s)
        final = s.get_final_response()
    # (streamed, the text before a call goes out as it comes, its last newline included; whole, it is trimmed)
    assert _shape(final) == [("message", "Let me look.\n"), ("function_call", "weather", '{"city": "Oslo"}')]
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(arguments) > 1 and "".join(arguments) == '{"city": "Oslo"}'

    stub.reply = '{"city": "Rome"}'
    named = client.responses.create(
        model=BASE,
        input="weather?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=60,
    )
    assert stub.received[-1][1].constraint == OutputConstraint(json=WEATHER)
    assert _shape(named) == [("function_call", "weather", '{"city": "Rome"}')]
    named_asked = {"tools": TOOLS, "tool_choice": {"type": "function", "name": "weather"}, "max_output_tokens": 60}
    with client.responses.stream(model=BASE, input="weather?", **named_asked) as s:
        assert _shape(s.get_final_response()) == _shape(named)
    stub.reply = json.dumps([{"name": "time", "parameters": {}}])
    required = client.responses.create(
        model=BASE, input="time?", tools=TOOLS, tool_choice="required", max_output_tokens=60
    )
    assert stub.received[-1][1].constraint.json_schema["type"] == "array"
    assert _shape(required) == [("function_call", "time", "{}")]
    with client.responses.stream(
        model=BASE, input="time?", tools=TOOLS, tool_choice="required", max_output_tokens=60
    ) as s:
        assert _shape(s.get_final_response()) == _shape(required)

    history = [
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    stub.reply = "Sunny in Oslo."
    answer = client.responses.create(model=BASE, input=history, tools=TOOLS, max_output_tokens=60)
    prompt = tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\ntool: sunny, 21 C' in prompt
    assert answer.output_text == "Sunny in Oslo."


def test_formats_logprobs_and_extensions_reach_the_engine(gateway, make_gateway, registry, stub):
    """text.format is the response format; logprobs come with `include`; vLLM's and PreFT's extensions pass as on
    chat (chat's own fields do not); truncation auto keeps the input's last tokens."""
    key = registry.tenant("acme")
    client = gateway.openai(key)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    stub.reply = '{"a": 1}'
    out = client.responses.create(model=BASE, input="a?", text=text)
    assert stub.received[-1][1].constraint == OutputConstraint(json=schema)
    assert out.output_text == '{"a": 1}' and out.text.format.type == "json_schema"
    assert out.text.format.schema_ == schema and out.text.format.name == "answer"
    client.responses.create(model=BASE, input="a?", text={"format": {"type": "json_object"}})
    assert stub.received[-1][1].constraint == OutputConstraint(json_object=True)

    stub.reply = None  # (the stub's own tokens: token i's logprob is -(i+1)/8)
    out = client.responses.create(
        model=BASE, input="hi", max_output_tokens=3, include=["message.output_text.logprobs"], top_logprobs=2
    )
    _, req = stub.received[-1]
    assert req.logprobs == 2
    logprobs = out.output[0].content[0].logprobs
    assert [lp.logprob for lp in logprobs] == [-0.125, -0.25, -0.375] and len(logprobs[0].top_logprobs) == 2
    streamed = list(
        client.responses.create(
            model=BASE, input="hi", max_output_tokens=3, include=["message.output_text.logprobs"], stream=True
        )
    )
    done = next(e for e in streamed if e.type == "response.output_text.done")
    assert [lp.logprob for lp in done.logprobs] == [-0.125, -0.25, -0.375]
    client.responses.create(
        model=BASE, input="hi", max_output_tokens=3, top_logprobs=1
    )  # (top_logprobs alone asks too)
    assert stub.received[-1][1].logprobs == 1
    client.responses.create(model=BASE, input="hi", max_output_tokens=3)
    assert stub.received[-1][1].logprobs is None

    extensions = {"seed": 7, "top_k": 5, "stop": ["."], "repetition_penalty": 1.1}
    client.responses.create(model=BASE, input="hi", temperature=0.5, top_p=0.9, extra_body=extensions)
    _, req = stub.received[-1]
    assert (req.seed, req.top_k, req.stop, req.repetition_penalty) == (7, 5, ["."], 1.1)
    assert (req.temperature, req.top_p) == (0.5, 0.9)
    sent = len(stub.received)
    client.responses.create(model=BASE, input="hi", extra_body={"n": 3, "max_tokens": 1})
    assert len(stub.received) == sent + 1 and stub.received[-1][1].max_tokens != 1

    small = make_gateway(max_prompt_tokens=8).openai(key)
    long_input = "the cat sat on the mat and then the dog sat on the cat"
    with pytest.raises(openai.APIStatusError) as refused:
        small.responses.create(model=BASE, input=long_input, max_output_tokens=2)
    assert refused.value.status_code == 413
    out = small.responses.create(model=BASE, input=long_input, max_output_tokens=2, truncation="auto")
    assert len(stub.received[-1][1].prompt_token_ids) == 8 == out.usage.input_tokens


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": []}, "input is empty"),
        ({"input": ""}, "input is empty"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0: role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "type 'web_search_call' are not supported"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
        ({"input": [{"role": "user", "content": "x", "id": 7}]}, "input.0: id must be a string"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "does not store responses"),
        ({"input": "hi", "background": True}, "background: needs a stored response"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": "hi", "prompt": {"id": "pmpt_1", "version": "2"}}, "prompt is not supported"),
        ({"input": "hi", "include": ["everything"]}, "include: unknown value"),
        ({"input": "hi", "tools": TOOLS, "include": ["message.output_text.logprobs"]}, "not available with tools"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "needs a name"),
        ({"input": "hi", "tool_choice": "required"}, "give tools"),
        ({"input": "hi", "tools": [{"type": "function", "name": "no spaces"}]}, "tools.0.name: String should match"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a b"}}}, "text.format.name"),
        ({"input": "hi", "extra_body": {"top_k": -2}}, "top_k"),
        ({"input": "hi", "extra_body": {"use_beam_search": True}}, "use_beam_search is not supported"),
    ],
)
def test_bad_requests_are_400_before_the_engine(gateway, registry, stub, body, says):
    client = gateway.openai(registry.tenant("acme"))
    sent = len(stub.received)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=BASE, **body)
    assert says in error_of(refused.value.response)["message"] and len(stub.received) == sent


def test_stored_responses_continue_conversations(make_gateway, registry, stub, tokenizer):
    """Where the server stores responses: previous_response_id continues the conversation (its input and output, not
    its instructions), whole and streamed; GET finds a stored response, DELETE removes it; store false keeps nothing;
    another tenant's response is a 404. Without storing, previous_response_id is a 400."""
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    gateway = make_gateway(responses_store_ttl_s=60)
    client = gateway.openai(acme)
    stub.reply = "Hello Bob."
    first = client.responses.create(model=BASE, instructions="Be kind.", input="I am Bob.", max_output_tokens=20)
    assert first.store is True and client.responses.retrieve(first.id).output_text == "Hello Bob."
    stub.reply = "You are Bob."
    second = client.responses.create(model=BASE, previous_response_id=first.id, input="Who am I?", max_output_tokens=20)
    prompt = tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert prompt.startswith("user: I am Bob.\nassistant: Hello Bob.\nuser: Who am I?") and "Be kind" not in prompt
    assert second.previous_response_id == first.id
    with client.responses.stream(
        model=BASE, previous_response_id=second.id, input="Again?", max_output_tokens=20
    ) as events:
        third = events.get_final_response()
    assert "assistant: You are Bob.\nuser: Again?" in tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert client.responses.retrieve(third.id).output_text == "You are Bob."
    history = [
        {"role": "user", "content": "one"},
        {"type": "function_call", "call_id": "call_1", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
    ]
    items = client.responses.create(model=BASE, input=history, max_output_tokens=5).id
    listed = list(client.responses.input_items.list(items, limit=2))  # (the client pages through `after`)
    assert [i.type for i in listed] == ["function_call_output", "function_call", "message"]  # (newest first)
    assert listed[2].content[0].type == "input_text" and listed[2].content[0].text == "one"
    assert listed[0].output == "noon" and listed[1].call_id == "call_1" and all(i.id for i in listed)
    oldest = client.responses.input_items.list(items, order="asc", limit=1)
    assert [i.type for i in oldest.data] == ["message"] and oldest.has_more
    with pytest.raises(openai.BadRequestError, match="after"):
        client.responses.input_items.list(items, after="msg_nope")
    assert gateway.http(acme).get(f"/v1/responses/{items}/input_items?limit=0").status_code == 400
    assert gateway.http(acme).get(f"/v1/responses/{items}/input_items?include[]=x").status_code == 400
    assert len(client.responses.input_items.list(items, include=["message.output_text.logprobs"]).data) == 3

    with pytest.raises(openai.NotFoundError):
        gateway.openai(beta).responses.retrieve(first.id)
    client.responses.delete(first.id)
    for gone in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=BASE, previous_response_id=first.id, input="hi")
    unkept = client.responses.create(model=BASE, input="hi", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)

    with pytest.raises(openai.BadRequestError, match="does not store responses"):
        make_gateway().openai(acme).responses.create(model=BASE, previous_response_id=second.id, input="hi")


_until = partial(until, timeout_s=15.0)


def test_background_responses_run_and_are_polled(make_gateway, registry, stub, tokenizer, redis_url):
    """background: answered at once (queued), run by the gateway, read by polling GET; it continues as any stored
    response; a background response needs storing (and only one created streaming streams again); a replica full
    of runs answers 503 and reserves nothing; one left in progress by a replica that stopped (its lease gone) reads
    as failed."""
    key = registry.tenant("acme")
    gateway = make_gateway(responses_store_ttl_s=60)
    client = gateway.openai(key)
    stub.reply = "Hello Bob."
    queued = client.responses.create(model=BASE, input="I am Bob.", max_output_tokens=20, background=True)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _until(lambda: client.responses.retrieve(queued.id), lambda r: r.status == "completed")
    assert done.output_text == "Hello Bob." and done.usage.output_tokens == 3 and done.background
    stub.reply = "You are Bob."
    sent = len(stub.received)
    later = client.responses.create(model=BASE, previous_response_id=done.id, input="Who?", background=True)
    _until(lambda: len(stub.received), lambda n: n > sent)
    assert "assistant: Hello Bob.\nuser: Who?" in tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert stub.received[-1][1].stream  # (a background run streams from the engine)
    assert _until(lambda: client.responses.retrieve(later.id), lambda r: r.status == "completed").output_text

    stub.fail_next(503, after_chunks=2)  # (the engine fails midway: the run fails with what it wrote)
    broken = client.responses.create(model=BASE, input="go", background=True)
    failed = _until(lambda: client.responses.retrieve(broken.id), lambda r: r.status not in ("queued", "in_progress"))
    assert failed.status == "failed" and "injected failure" in failed.error.message and failed.output
    with pytest.raises(openai.BadRequestError, match="only a background response created with stream"):
        client.responses.retrieve(done.id, stream=True)
    with pytest.raises(openai.BadRequestError, match="needs a stored response"):
        client.responses.create(model=BASE, input="hi", background=True, store=False)
    full = make_gateway(responses_store_ttl_s=60, responses_background_max=0).openai(key)
    sent = len(stub.received)
    with pytest.raises(openai.InternalServerError, match="background responses"):
        full.responses.create(model=BASE, input="hi", background=True)
    assert len(stub.received) == sent

    stopped = json.loads(redis.Redis.from_url(redis_url).get(f"preft:response:acme:{done.id}"))
    stopped["response"] = {**stopped["response"], "status": "in_progress", "id": "resp_" + "0" * 32}
    redis.Redis.from_url(redis_url).set(f"preft:response:acme:resp_{'0' * 32}", json.dumps(stopped))
    left = client.responses.retrieve("resp_" + "0" * 32)  # (no replica holds its lease)
    assert left.status == "failed" and "stopped" in left.error.message


def test_background_responses_cancel_on_any_replica(make_gateway, registry, stub):
    """cancel stops a background run (on its own replica, or through the lease from another one) and answers it
    cancelled with its output so far; deleting one in progress stops it too; a finished one is answered as it is,
    and only background responses can be cancelled."""
    key = registry.tenant("acme")
    one, other = make_gateway(responses_store_ttl_s=60), make_gateway(responses_store_ttl_s=60)
    client = one.openai(key)
    stub.token_delay_s = 0.05  # (200 tokens: 10 s unless stopped)
    for canceller in (client, other.openai(key)):
        run = client.responses.create(model=BASE, input="go", max_output_tokens=200, background=True)
        _until(lambda run=run: client.responses.retrieve(run.id), lambda r: r.status == "in_progress")
        time.sleep(0.3)
        started = time.monotonic()
        cancelled = canceller.responses.cancel(run.id)
        assert cancelled.status == "cancelled" and time.monotonic() - started < 5, cancelled
        (cut,) = cancelled.output  # (what it wrote so far)
        assert cut.status == "incomplete" and cut.content[0].text.startswith(" w")
        assert client.responses.retrieve(run.id).status == "cancelled"
    tokens = len(stub.received)
    deleted = client.responses.create(model=BASE, input="go", max_output_tokens=200, background=True)
    _until(lambda: client.responses.retrieve(deleted.id), lambda r: r.status == "in_progress")
    client.responses.delete(deleted.id)
    time.sleep(1.5)
    with pytest.raises(openai.NotFoundError):  # (the run's end does not bring it back)
        client.responses.retrieve(deleted.id)
    assert len(stub.received) == tokens + 1

    stub.token_delay_s, stub.reply = 0.0, "Done."
    finished = client.responses.create(model=BASE, input="go", background=True)
    _until(lambda: client.responses.retrieve(finished.id), lambda r: r.status == "completed")
    assert client.responses.cancel(finished.id).status == "completed"
    plain = client.responses.create(model=BASE, input="go")
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(plain.id)
    metrics = httpx.get(one.metrics_url, timeout=10).text  # (how runs ended, and none left running)
    assert 'preft_gateway_background_responses_ended_total{status="cancelled"}' in metrics
    assert 'preft_gateway_background_responses_ended_total{status="completed"}' in metrics
    assert "\npreft_gateway_background_responses 0.0" in metrics


def test_background_streams_are_kept_and_streamed_again(make_gateway, registry, stub):
    """background with stream: the events of a streamed response, kept as the run makes them; a client gone midway
    leaves the run going; GET with stream streams them again from any event and follows a run still going."""
    client = make_gateway(responses_store_ttl_s=60).openai(registry.tenant("acme"))
    stub.reply = "Hello there, Bob."
    events = list(client.responses.create(model=BASE, input="hi", background=True, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == "Hello there, Bob." and final.background
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == client.responses.retrieve(final.id).output_text
    again = list(client.responses.retrieve(final.id, stream=True, starting_after=3))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[4:]]

    stub.reply, stub.token_delay_s = None, 0.05  # (40 tokens: 2 s)
    stream = client.responses.create(model=BASE, input="go", max_output_tokens=40, background=True, stream=True)
    first = [next(stream) for _ in range(4)]
    stream.close()  # (its client gone: the run goes on)
    response_id = first[0].response.id
    followed = list(client.responses.retrieve(response_id, stream=True, starting_after=1))  # (while it runs)
    assert [e.sequence_number for e in followed][:2] == [2, 3] and followed[-1].type == "response.incomplete"
    whole = followed[-1].response
    assert "".join(e.delta for e in followed if e.type == "response.output_text.delta") == whole.output_text
    assert whole.usage.output_tokens == 40 and client.responses.retrieve(response_id).status == "incomplete"

    stub.token_delay_s = 0.0
    stub.fail_next(503, after_chunks=2)  # (a run failing midway ends its stream with response.failed)
    failed = list(client.responses.create(model=BASE, input="go", max_output_tokens=8, background=True, stream=True))
    assert failed[-1].type == "response.failed" and "injected failure" in failed[-1].response.error.message
    assert failed[-1].response.status == "failed" and failed[-1].sequence_number == failed[-2].sequence_number + 1
