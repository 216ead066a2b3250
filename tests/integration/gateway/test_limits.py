"""Per-tenant rate limits (Redis token buckets): requests/min and tokens/min, 429 with Retry-After, and the
refund of reserved-but-unused tokens; and the monthly token quota (429 insufficient_quota)."""

from __future__ import annotations

import time
from datetime import date

import openai
import pytest
import redis

from preft.api.v1 import registry_pb2 as pb
from preft.common import metering
from preft.gateway.core.limits import reset_duration

from .conftest import BASE, error_of


def test_requests_per_minute(gateway, registry):
    limited, other = registry.tenant("acme", rpm=3), registry.tenant("beta", rpm=3)
    http = gateway.http(limited)
    body = {"model": BASE, "prompt": "hi", "max_tokens": 1}
    answers = [http.post("/v1/completions", json=body) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"3"}
    # until the bucket is full again: one request refills in 20 s (OpenAI's duration format)
    assert [a.headers["x-ratelimit-reset-requests"] for a in answers] == ["20s", "40s", "1m0s"]

    refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # one request refills in 60/3 = 20 s
    error = error_of(refused)
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "requests per minute" in error["message"]
    # other tenants have their own buckets
    assert gateway.http(other).post("/v1/completions", json=body).status_code == 200
    # and the official client raises RateLimitError
    with pytest.raises(openai.RateLimitError):
        gateway.openai(limited).completions.create(model=BASE, prompt="hi", max_tokens=1)


def test_tokens_per_minute_count_prompt_and_max_tokens(gateway, registry, stub):
    key = registry.tenant("acme", tpm=60)
    http = gateway.http(key)
    prompt = [5, 6, 7, 8]  # 4 tokens

    # 4 + 50 reserved; the stub generates all 50: 6 left
    ok = http.post("/v1/completions", json={"model": BASE, "prompt": prompt, "max_tokens": 50})
    assert ok.status_code == 200 and int(ok.headers["x-ratelimit-remaining-tokens"]) <= 6
    assert ok.headers["x-ratelimit-limit-tokens"] == "60"
    left = int(ok.headers["x-ratelimit-remaining-tokens"])
    assert ok.headers["x-ratelimit-reset-tokens"] == f"{60 - left}s"  # (one token a second)
    refused = http.post("/v1/completions", json={"model": BASE, "prompt": prompt, "max_tokens": 20})
    assert refused.status_code == 429 and "tokens per minute" in error_of(refused)["message"]
    assert error_of(refused)["type"] == "tokens"  # (OpenAI's type names the bucket that ran out)
    assert 17 <= int(refused.headers["retry-after"]) <= 18  # 4 + 20 needed, 6 left: 18 missing at 1 token/s

    # a request needing more than the whole budget can never pass: 429 without Retry-After
    huge = http.post("/v1/completions", json={"model": BASE, "prompt": prompt, "max_tokens": 100})
    assert huge.status_code == 429 and "retry-after" not in huge.headers
    assert "more than the tenant's limit of 60 tokens per minute" in error_of(huge)["message"]


def test_unused_tokens_are_given_back(gateway, registry, stub):
    key = registry.tenant("acme", tpm=100)
    http = gateway.http(key)
    # a missing model reserves 4 + 90 tokens, then gives them all back (it never reached the engine)
    missing = http.post("/v1/completions", json={"model": "nope", "prompt": [5, 6, 7, 8], "max_tokens": 90})
    assert missing.status_code == 404
    time.sleep(0.2)  # the refund runs after the answer
    ok_body = {"model": BASE, "prompt": [5, 6, 7, 8], "max_tokens": 90}
    ok = http.post("/v1/completions", json=ok_body)
    assert ok.status_code == 200
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) <= 6  # 94 taken again: the refund had happened

    # a stream the client leaves early is charged only for what was generated before it left
    key = registry.tenant("beta", tpm=100)
    stub.token_delay_s = 0.05
    client = gateway.openai(key)
    stream = client.completions.create(model=BASE, prompt=[5, 6, 7, 8], max_tokens=90, stream=True)
    for _, _chunk in zip(range(2), stream, strict=False):
        pass
    stream.close()
    stub.token_delay_s = 0
    deadline = time.monotonic() + 5
    while (answer := gateway.http(key).post("/v1/completions", json=ok_body)).status_code == 429:
        assert time.monotonic() < deadline, "the unused tokens of the abandoned stream were not given back"
        time.sleep(0.1)
    assert answer.status_code == 200


def test_a_monthly_token_quota_refuses_once_the_month_has_used_it(make_gateway, registry, redis_url):
    gateway = make_gateway(metering_flush_interval_s=0.1)

    def set_quota(tenant: str, tokens: int) -> None:  # (as `preft-admin tenant limits --tokens-per-month` does)
        limits = pb.TenantLimits(tokens_per_month=tokens)
        registry.client.call("SetTenantLimits", pb.SetTenantLimitsRequest(id=tenant, limits=limits))

    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    month = metering.month_key("acme", metering.day_of(time.time()))
    store.set(metering.month_key("acme", date(2000, 1, 1)), 10**9)  # (another month's tokens: not this month's)
    set_quota("acme", 30)
    http, body = gateway.http(acme), {"model": BASE, "prompt": [5, 6, 7, 8], "max_tokens": 8}  # 12 tokens a request

    def used(at_least: int) -> int:
        deadline = time.monotonic() + 5
        while int(store.get(month) or 0) < at_least:
            assert time.monotonic() < deadline, "the meter did not add the tokens"
            time.sleep(0.05)
        return int(store.get(month))

    def admitted(body: dict) -> None:  # (an ended request's tokens stay reserved a moment after they are metered)
        deadline = time.monotonic() + 10
        while (answer := http.post("/v1/completions", json=body)).status_code == 429:
            assert time.monotonic() < deadline, error_of(answer)
            time.sleep(0.1)
        assert answer.status_code == 200

    for expected in (12, 24):  # (admitted while all they may use fits: a third would go over)
        admitted(body)
        assert used(expected) == expected
    refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 429 and "retry-after" not in refused.headers
    error = error_of(refused)
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert "has used 24 of its 30 tokens" in error["message"] and "requests in flight" in error["message"]
    admitted({**body, "max_tokens": 2})  # (4 + 2: fits)
    assert used(30) == 30
    refused = http.post("/v1/completions", json={**body, "max_tokens": 1})
    assert refused.status_code == 429 and "has used its 30 tokens" in error_of(refused)["message"]
    with pytest.raises(openai.RateLimitError):
        gateway.openai(acme).chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}])
    assert gateway.http(beta).post("/v1/completions", json=body).status_code == 200  # (no quota of its own)
    assert int(store.get(month)) == 30  # (refusals use nothing)

    set_quota("acme", 100)  # raised: admitted again
    assert http.post("/v1/completions", json=body).status_code == 200
    set_quota("acme", 0)  # 0: no quota
    store.set(month, 10**9)
    assert http.post("/v1/completions", json=body).status_code == 200
    store.close()


def test_reset_durations_are_written_as_openai_writes_them():
    assert [reset_duration(60, left) for left in (60, 59, 30, 0)] == ["0ms", "1s", "30s", "1m0s"]
    assert reset_duration(600, 599) == "100ms" and reset_duration(7, 0) == "1m0s" and reset_duration(40, 39) == "1.5s"
    assert reset_duration(0, 0) == "0ms"  # (offline work takes from no bucket)
