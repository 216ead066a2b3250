"""A batch's lines reach the engine with the offline priority and live requests with the live one, so an engine
with vLLM's priority scheduling admits queued live requests before queued batch work (tests/engine checks that
side on real vLLM)."""

from __future__ import annotations

from preft.common.engine_contract import LIVE_PRIORITY, OFFLINE_PRIORITY

from .conftest import BASE
from .test_batches import CHAT, COMPLETIONS, _batches, _chat, _ended, _request, _start


def test_batch_lines_reach_the_engine_offline_and_live_requests_live(make_gateway, registry, stub, s3_bucket):
    gateway = make_gateway(**_batches(s3_bucket))
    key = registry.tenant("acme")
    client, http = gateway.openai(key), gateway.http(key)
    chat = [_request("one", CHAT, _chat("hello", max_tokens=2)), _request("two", CHAT, _chat("hi", max_tokens=2, n=2))]
    prompts = {"model": BASE, "prompt": ["a", "b"], "max_tokens": 1}
    batches = [_start(client, CHAT, chat), _start(client, COMPLETIONS, [_request("prompts", COMPLETIONS, prompts)])]
    assert [_ended(client, b.id).status for b in batches] == ["completed", "completed"]
    offline = [req for _, req in stub.received]
    assert len(offline) == 5  # one, two's two samples, the two prompts
    assert {req.priority for req in offline} == {OFFLINE_PRIORITY}

    assert http.post(CHAT, json=_chat("hello", max_tokens=2, n=2)).status_code == 200
    assert http.post(COMPLETIONS, json=prompts).status_code == 200
    with http.stream("POST", CHAT, json=_chat("hello", max_tokens=2, stream=True)) as streamed:
        assert streamed.status_code == 200
        streamed.read()
    live = [req for _, req in stub.received[len(offline) :]]
    assert len(live) == 5
    assert {req.priority for req in live} == {LIVE_PRIORITY}
