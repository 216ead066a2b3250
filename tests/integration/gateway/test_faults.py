"""Faults in every collaborator: Redis down (503 within a second, recovery by itself), registry down (cached
models keep working, uncached ones 503, recovery), engine 503s (one retry), engine down, a stream cut midway,
and a bug in the gateway (generic 500, logged once)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import openai
import pytest
from prometheus_client import REGISTRY

from preft.registry.server import build_server
from preft.stack import free_port
from tests.integration.conftest import acl_redis

from .conftest import BASE, error_of, start_gateway, start_registry, stop_gateway

BODY = {"model": BASE, "prompt": "hi", "max_tokens": 2}


def _retries(reason: str) -> float:
    return REGISTRY.get_sample_value("preft_gateway_engine_retries_total", {"reason": reason}) or 0.0


def test_redis_down_is_503_within_a_second_and_recovers_by_itself(tmp_path, s3_bucket, engine, tokenizer, tiny_models):
    redis = acl_redis(tmp_path / "redis", persist=True).start()
    registry = start_registry(redis.admin_url, s3_bucket, (tiny_models["model"] / "config.json").read_text())
    gateway = start_gateway(
        redis_url=redis.admin_url,
        registry_address=registry.address,
        engine_url=engine.url,
        model_dir=tiny_models["model"],
        tokenizer=tokenizer,
        key_cache_ttl_s=30.0,
        responses_store_ttl_s=60.0,
    )
    try:
        key = registry.tenant("acme")
        http = gateway.http(key)
        assert http.post("/v1/completions", json=BODY).status_code == 200  # the key is cached from here on
        conversation = http.post("/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]}).json()
        items = f"/v1/conversations/{conversation['id']}/items"

        redis.stop()
        calls = [
            (http, "POST", "/v1/completions", BODY),  # (a cached key: the limits fail)
            (gateway.http("preft_unknown_key"), "POST", "/v1/completions", BODY),  # (an uncached key: auth fails)
            (http, "GET", items, None),  # (the conversations)
            (http, "POST", items, {"items": [{"role": "user", "content": "lost?"}]}),
            (http, "GET", "/v1/organization/usage/completions?start_time=0&limit=1", None),  # (the token usage)
        ]
        for client, method, path, body in calls:
            start = time.monotonic()
            answer = client.request(method, path, json=body)
            assert time.monotonic() - start < 1.0
            assert answer.status_code == 503
            error = error_of(answer)
            assert error["type"] == "server_error" and "Redis" in error["message"]
            assert answer.headers["retry-after"] == "1"
        # the pod stays ready (a Redis blip must not take every gateway pod out at once); its dependencies' health
        # says Redis is down
        assert http.get("/readyz").status_code == 200
        deps = http.get("/healthz/deps")
        assert deps.status_code == 503 and deps.json()["checks"]["redis"].startswith("unavailable")

        redis.start()  # same port and data directory: the keys are still there
        start = time.monotonic()
        while (answer := http.post("/v1/completions", json=BODY)).status_code != 200:
            assert answer.status_code == 503 and time.monotonic() - start < 5.0
            time.sleep(0.05)
        assert http.get("/healthz/deps").status_code == 200
        kept = http.get(items).json()["data"]  # (the conversation as it was: the refused add left nothing)
        assert [i["content"][0]["text"] for i in kept] == ["hi"]
        assert http.post(items, json={"items": [{"role": "user", "content": "back"}]}).status_code == 200  # (Lua)
    finally:
        stop_gateway(gateway)
        registry.client.close()
        registry.server.stop(grace=None)
        redis.stop()


def test_registry_down_keeps_cached_models_working(make_gateway, registry, redis_url, tiny_models, stub):
    key = registry.tenant("acme")
    registry.publish("acme", "chat", tiny_models["lora"])
    registry.publish("acme", "other", tiny_models["direft"])
    gateway = make_gateway(resolve_cache_ttl_s=60.0, registry_timeout_s=0.5)
    http = gateway.http(key)
    assert http.post("/v1/completions", json={**BODY, "model": "chat"}).status_code == 200

    port = int(registry.address.rsplit(":", 1)[1])
    registry.server.stop(grace=None).wait()
    for _ in range(3):  # uses are still counted: their RecordUse calls fail quietly
        assert http.post("/v1/completions", json={**BODY, "model": "chat"}).status_code == 200
    assert http.post("/v1/completions", json=BODY).status_code == 200  # the base model needs no registry
    for path, body in [("/v1/completions", {**BODY, "model": "other"}), ("/v1/models", None)]:
        start = time.monotonic()
        answer = http.post(path, json=body) if body else http.get(path)
        assert time.monotonic() - start < 1.0
        assert answer.status_code == 503, answer.text
        assert error_of(answer)["message"] == "the adapter registry is unavailable; retry later"
    assert http.get("/readyz").status_code == 200
    assert http.get("/healthz/deps").json()["checks"]["registry"].startswith("unavailable")

    # the registry comes back on its address: the gateway reconnects by itself
    registry.server, _ = build_server(registry_settings_for(registry, redis_url, port), registry.service)
    start = time.monotonic()
    while (answer := http.post("/v1/completions", json={**BODY, "model": "other"})).status_code != 200:
        assert answer.status_code == 503 and time.monotonic() - start < 5.0
        time.sleep(0.1)
    assert http.get("/healthz/deps").status_code == 200


def registry_settings_for(registry, redis_url, port):
    return registry.settings.model_copy(update={"listen_address": f"127.0.0.1:{port}"})


def test_engine_503_is_retried_once(gateway, registry, stub, caplog):
    client = gateway.openai(registry.tenant("acme"))
    client.completions.create(model=BASE, prompt="hi", max_tokens=1)  # the gateway's first connection opened
    stub.received.clear()
    before = _retries("unavailable")
    stub.fail_next(503)
    assert client.completions.create(model=BASE, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert len(stub.received) == 2 and _retries("unavailable") == before + 1
    assert "(unavailable: 'HTTP 503'); retrying once" in caplog.text

    stub.fail_next(503)
    chunks = list(client.completions.create(model=BASE, prompt="hi", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks).count(" w") == 3
    assert len(stub.received) == 4 and _retries("unavailable") == before + 2

    stub.fail_next(503, times=2)
    with pytest.raises(openai.InternalServerError) as twice:
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}])
    assert twice.value.status_code == 503 and "engine is unavailable" in str(twice.value)

    stub.fail_next(500)
    with pytest.raises(openai.InternalServerError) as broken:
        client.completions.create(model=BASE, prompt="hi")
    assert broken.value.status_code == 500 and "engine failed" in str(broken.value)
    assert len(stub.received) == 7  # a 500 is not retried


def test_a_replica_lost_before_any_token_is_retried_once(gateway, registry, stub):
    """Ray Serve's proxy answers a bare 500 when the replica died with the request; the engine's own 500s carry
    an EngineError (above: not retried)."""
    client = gateway.openai(registry.tenant("acme"))
    before, sent = _retries("replica_lost"), len(stub.received)
    stub.fail_next(500, replica_lost=True)
    assert client.completions.create(model=BASE, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    stub.fail_next(500, replica_lost=True)
    chunks = list(client.completions.create(model=BASE, prompt="hi", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks).count(" w") == 3
    assert len(stub.received) == sent + 4 and _retries("replica_lost") == before + 2  # each sent twice

    stub.fail_next(500, times=2, replica_lost=True)
    with pytest.raises(openai.InternalServerError) as twice:
        client.completions.create(model=BASE, prompt="hi")
    assert twice.value.status_code == 500 and "engine failed" in str(twice.value)
    assert _retries("replica_lost") == before + 3


def test_engine_down_is_503(make_gateway, registry):
    gateway = make_gateway(engine_url=f"http://127.0.0.1:{free_port()}")
    http = gateway.http(registry.tenant("acme"))
    before = _retries("connect")
    for stream in (False, True):
        answer = http.post("/v1/completions", json={**BODY, "stream": stream})
        assert answer.status_code == 503
        assert "engine is unreachable" in error_of(answer)["message"]
    assert _retries("connect") == before + 2
    assert http.get("/readyz").status_code == 200  # (the pod is fine: its dependency is not)
    deps = http.get("/healthz/deps")
    assert deps.status_code == 503 and deps.json()["checks"]["engine"].startswith("unavailable")


def test_a_gateway_without_the_engine_token_is_refused_by_the_engine(make_gateway, registry, stub, caplog):
    """The stub requires the token as the engine does: the other tests' answers show the gateway sends it; with the
    wrong one every request is refused (not retried) and the gateway says why in its log, not to the client."""
    from pydantic import SecretStr

    gateway = make_gateway(engine_token=SecretStr("not-the-engine-token"))
    http = gateway.http(registry.tenant("acme"))
    for stream in (False, True):
        answer = http.post("/v1/completions", json={**BODY, "stream": stream})
        assert answer.status_code == 500 and "engine token" not in answer.text
    assert stub.received == [] and "the engine refused the gateway's token" in caplog.text


def test_stream_failing_midway_ends_with_an_error_event(gateway, registry, stub):
    client = gateway.openai(registry.tenant("acme"))
    for status, says in [(None, "stream broke off"), (503, "engine is unavailable: injected failure")]:
        stub.received.clear()
        gate = threading.Event()  # the break waits until the client holds the chunks before it
        stub.fail_next(status, after_chunks=2, gate=gate)  # the connection drops, or the engine sends an EngineError
        received = []
        with pytest.raises(openai.APIError, match=says):
            for chunk in client.completions.create(model=BASE, prompt="hi", max_tokens=6, stream=True):
                received.append(chunk.choices[0].text)
                if len(received) == 2:
                    gate.set()
        assert len(received) == 2 and len(stub.received) == 1  # tokens had reached the client: no retry

    # an error line before the first chunk is retried like a 503 status
    before = _retries("unavailable")
    stub.fail_next(503, after_chunks=0)
    chunks = list(client.completions.create(model=BASE, prompt="hi", max_tokens=3, stream=True))
    assert len([c for c in chunks if c.choices[0].text]) == 3 and _retries("unavailable") == before + 1

    # n = 2: one choice's stream breaks off; the client gets the error, and the other choice's stream is closed
    stub.received.clear()
    gate = threading.Event()
    stub.fail_next(None, after_chunks=2, gate=gate)
    per_choice: Counter[int] = Counter()
    with pytest.raises(openai.APIError, match="stream broke off"):
        for chunk in client.completions.create(model=BASE, prompt="hi", max_tokens=6, n=2, stream=True):
            per_choice[chunk.choices[0].index] += bool(chunk.choices[0].text)
            if len(per_choice) == 2 and min(per_choice.values()) >= 2:
                gate.set()
    assert len(stub.received) == 2 and min(per_choice.values()) == 2


class BrokenEngine:
    async def generate(self, req, model_id):
        raise RuntimeError("bug with a secret detail")


def test_unexpected_error_is_a_generic_500_logged_once(registry, redis_url, tokenizer, tiny_models, caplog):
    gateway = start_gateway(
        redis_url=redis_url,
        registry_address=registry.address,
        engine_url="http://127.0.0.1:1",
        model_dir=tiny_models["model"],
        tokenizer=tokenizer,
        engine_client=BrokenEngine(),
    )
    try:
        with caplog.at_level(logging.ERROR):
            answer = gateway.http(registry.tenant("acme")).post("/v1/completions", json=BODY)
        assert answer.status_code == 500
        assert error_of(answer) == {
            "message": "internal gateway error",
            "type": "server_error",
            "code": "internal_error",
            "param": None,
        }
        logged = [r for r in caplog.records if r.exc_info and "secret detail" in str(r.exc_info[1])]
        assert len(logged) == 1 and logged[0].name == "preft.gateway.core.errors"
    finally:
        stop_gateway(gateway)
