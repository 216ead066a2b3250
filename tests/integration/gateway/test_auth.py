"""API keys: revocation and disabled tenants take effect within the key cache's TTL; bad keys are 401."""

from __future__ import annotations

import time

import openai
import pytest

from preft.api.v1 import registry_pb2 as pb

from .conftest import BASE, error_of

BODY = {"model": BASE, "prompt": "hi", "max_tokens": 1}


def _wait_for_status(http, status: int, timeout_s: float) -> float:
    """Seconds until POST /v1/completions answers `status`."""
    start = time.monotonic()
    while (answer := http.post("/v1/completions", json=BODY)).status_code != status:
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - start < timeout_s, f"still {answer.status_code} after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_revoked_key_is_refused_within_the_cache_ttl(make_gateway, registry):
    registry.tenant("acme")
    key_id, secret = registry.key("acme")
    _, other = registry.key("acme")
    gateway = make_gateway(key_cache_ttl_s=2.0)
    http = gateway.http(secret)
    assert http.post("/v1/completions", json=BODY).status_code == 200  # cached now

    registry.client.call("RevokeKey", pb.RevokeKeyRequest(id=key_id))
    waited = _wait_for_status(http, 401, timeout_s=3.0)
    assert waited <= 2.5
    error = error_of(http.post("/v1/completions", json=BODY))
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert gateway.http(other).post("/v1/completions", json=BODY).status_code == 200  # its other key still works
    with pytest.raises(openai.AuthenticationError):
        gateway.openai(secret).models.list()


def test_disabled_tenant_is_refused_and_can_come_back(make_gateway, registry):
    key = registry.tenant("acme")
    gateway = make_gateway(key_cache_ttl_s=1.0)
    http = gateway.http(key)
    assert http.post("/v1/completions", json=BODY).status_code == 200

    registry.client.call("SetTenantDisabled", pb.SetTenantDisabledRequest(id="acme", disabled=True))
    _wait_for_status(http, 403, timeout_s=2.0)
    error = error_of(http.post("/v1/completions", json=BODY))
    assert error["type"] == "invalid_request_error" and "disabled" in error["message"]
    with pytest.raises(openai.PermissionDeniedError):
        gateway.openai(key).models.list()

    registry.client.call("SetTenantDisabled", pb.SetTenantDisabledRequest(id="acme", disabled=False))
    start = time.monotonic()
    while http.post("/v1/completions", json=BODY).status_code != 200:
        assert time.monotonic() - start < 2.0
        time.sleep(0.05)


def test_expired_and_unknown_keys(make_gateway, registry):
    registry.tenant("acme")
    _, expiring = registry.key("acme", ttl_s=1)
    gateway = make_gateway(key_cache_ttl_s=30.0)  # the cached entry must not outlive the key
    http = gateway.http(expiring)
    assert http.post("/v1/completions", json=BODY).status_code == 200
    time.sleep(1.1)
    answer = http.post("/v1/completions", json=BODY)
    assert answer.status_code == 401 and "expired" in error_of(answer)["message"]

    for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Basic abc"}, {"authorization": "Bearer nope"}):
        answer = gateway.http().post("/v1/completions", json=BODY, headers=headers)
        assert answer.status_code == 401, headers
        assert error_of(answer)["code"] == "invalid_api_key"
        assert "nope" not in answer.text
