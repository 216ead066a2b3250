"""OpenAI's `service_tier` with the official `openai` client: flex requests reach the engine with the offline priority
(behind live requests), every other tier with the live one; the answers name the tier served (flex, else default) on
chat completions and their chunks and on responses (whole, streamed, background and stored); a batch's lines stay
offline whatever tier they ask; an unknown tier is a 400 that sends nothing; flex still takes from the rate limits."""

from __future__ import annotations

import openai
import pytest

from preft.common.engine_contract import LIVE_PRIORITY, OFFLINE_PRIORITY

from .conftest import BASE, error_of
from .test_batches import CHAT, _batches, _chat, _ended, _request, _start
from .test_responses import _until

MESSAGES = [{"role": "user", "content": "hello"}]


def _priorities(stub, sent: int) -> set[int]:
    """The priorities of the engine requests received since `sent` of them."""
    return {req.priority for _, req in stub.received[sent:]}


@pytest.mark.parametrize(
    ("asked", "priority", "served"),
    [
        ("flex", OFFLINE_PRIORITY, "flex"),
        ("default", LIVE_PRIORITY, "default"),
        ("auto", LIVE_PRIORITY, "default"),
        ("priority", LIVE_PRIORITY, "default"),
        ("scale", LIVE_PRIORITY, "default"),
        ("fast", LIVE_PRIORITY, "default"),
        (None, LIVE_PRIORITY, "default"),
    ],
)
def test_chat_tiers_set_the_engine_priority_and_are_answered(gateway, registry, stub, asked, priority, served):
    """Each of a chat request's engine requests (n of them) has the tier's priority; the completion and every chunk
    of a stream (the usage chunk too) name the tier served."""
    client = gateway.openai(registry.tenant("acme"))
    tier = {} if asked is None else {"service_tier": asked}
    out = client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2, n=2, **tier)
    assert out.service_tier == served
    assert len(stub.received) == 2 and _priorities(stub, 0) == {priority}

    usage = {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model=BASE, messages=MESSAGES, max_tokens=3, stream=True, stream_options=usage, **tier
        )
    )
    assert len(chunks) > 3 and chunks[-1].usage is not None
    assert {chunk.service_tier for chunk in chunks} == {served}
    assert _priorities(stub, 2) == {priority}


def test_completions_take_the_tier_as_an_extension(gateway, registry, stub):
    """Completions: flex puts every prompt's samples behind live requests; the legacy object names no tier."""
    http = gateway.http(registry.tenant("acme"))
    flex = http.post("/v1/completions", json={"model": BASE, "prompt": ["a", "b"], "n": 2, "service_tier": "flex"})
    assert flex.status_code == 200 and "service_tier" not in flex.json()
    assert len(stub.received) == 4 and _priorities(stub, 0) == {OFFLINE_PRIORITY}
    assert (
        http.post("/v1/completions", json={"model": BASE, "prompt": "a", "service_tier": "default"}).status_code == 200
    )
    assert _priorities(stub, 4) == {LIVE_PRIORITY}


def test_responses_carry_the_tier_whole_streamed_and_stored(make_gateway, registry, stub):
    """Responses: the tier reaches the engine as chat's does, and the response object names it whole, in the stream's
    events that carry it, queued and run in the background, and read back stored."""
    client = make_gateway(responses_store_ttl_s=60).openai(registry.tenant("acme"))
    whole = client.responses.create(model=BASE, input="hi", max_output_tokens=2, service_tier="flex")
    assert whole.service_tier == "flex" and _priorities(stub, 0) == {OFFLINE_PRIORITY}
    assert client.responses.retrieve(whole.id).service_tier == "flex"
    plain = client.responses.create(model=BASE, input="hi", max_output_tokens=2, service_tier="priority")
    assert plain.service_tier == "default" and _priorities(stub, 1) == {LIVE_PRIORITY}

    stub.reply = "Hello."  # (ends by itself: the stream ends in response.completed)
    with client.responses.stream(model=BASE, input="hi", max_output_tokens=20, service_tier="flex") as stream:
        carried = [e.response.service_tier for e in stream if hasattr(e, "response")]
        final = stream.get_final_response()
    assert carried == ["flex"] * 3  # (created, in_progress, completed)
    assert final.service_tier == "flex" and _priorities(stub, 2) == {OFFLINE_PRIORITY}

    sent = len(stub.received)
    queued = client.responses.create(model=BASE, input="hi", max_output_tokens=2, background=True, service_tier="flex")
    assert queued.status == "queued" and queued.service_tier == "flex"
    done = _until(lambda: client.responses.retrieve(queued.id), lambda r: r.status == "completed")
    assert done.service_tier == "flex" and _priorities(stub, sent) == {OFFLINE_PRIORITY}
    default = client.responses.create(model=BASE, input="hi", max_output_tokens=2, background=True)
    assert _until(lambda: client.responses.retrieve(default.id), lambda r: r.status == "completed").service_tier == (
        "default"
    )


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_an_unknown_tier_is_refused_naming_the_field(gateway, registry, stub, route):
    body = {"model": BASE, "messages": MESSAGES, "prompt": "a", "input": "hi", "service_tier": "turbo"}
    refused = gateway.http(registry.tenant("acme")).post(route, json=body)
    assert refused.status_code == 400
    error = error_of(refused)
    assert error["type"] == "invalid_request_error" and "service_tier" in error["message"]
    assert "flex" in error["message"] and stub.received == []


def test_flex_takes_from_the_rate_limits(gateway, registry, stub):
    """Flex is not offline work: it takes from the per-minute buckets as any live request does."""
    client = gateway.openai(registry.tenant("acme", rpm=1))
    client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1, service_tier="flex")
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1, service_tier="flex")
    assert len(stub.received) == 1


def test_batch_lines_stay_offline_whatever_tier_they_ask(make_gateway, registry, stub, s3_bucket):
    client = make_gateway(**_batches(s3_bucket)).openai(registry.tenant("acme"))
    lines = [_request(tier, CHAT, _chat("hi", max_tokens=2, service_tier=tier)) for tier in ("priority", "default")]
    assert _ended(client, _start(client, CHAT, lines).id).status == "completed"
    assert len(stub.received) == 2 and _priorities(stub, 0) == {OFFLINE_PRIORITY}
