"""Per-tenant rate limits (Redis token buckets): requests/min and tokens/min, 429 with Retry-After, and the
refund of reserved-but-unused tokens."""

from __future__ import annotations

import time

import openai
import pytest

from .conftest import BASE, error_of


def test_requests_per_minute(gateway, registry):
    limited, other = registry.tenant("acme", rpm=3), registry.tenant("beta", rpm=3)
    http = gateway.http(limited)
    body = {"model": BASE, "prompt": "hi", "max_tokens": 1}
    answers = [http.post("/v1/completions", json=body) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]

    refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # one request refills in 60/3 = 20 s
    error = error_of(refused)
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
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
    refused = http.post("/v1/completions", json={"model": BASE, "prompt": prompt, "max_tokens": 20})
    assert refused.status_code == 429 and "tokens per minute" in error_of(refused)["message"]
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
