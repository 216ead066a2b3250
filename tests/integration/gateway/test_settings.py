"""Gateway settings: environment variables, the placeholder-secret guard, and a served OpenAPI schema."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from preft.common.settings import DEV_ENGINE_TOKEN, DEV_TOKEN
from preft.gateway.settings import GatewaySettings


def test_settings_from_environment_and_the_placeholder_guard(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFT_GATEWAY__REDIS__URL", "redis://10.0.0.5:6379/2")
    monkeypatch.setenv("PREFT_GATEWAY__REDIS__USERNAME", "gateway")  # (outside dev, Redis needs the ACL user)
    monkeypatch.setenv("PREFT_GATEWAY__REDIS__PASSWORD", "a-real-redis-password")
    monkeypatch.setenv("PREFT_GATEWAY__REGISTRY_TOKEN", "a-real-token")
    monkeypatch.setenv("PREFT_GATEWAY__ENGINE_TOKEN", "a-real-engine-token")
    monkeypatch.setenv("PREFT_GATEWAY__MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("PREFT_GATEWAY__ALLOW_MODE_OVERRIDE", "true")
    s = GatewaySettings()
    assert s.redis.url == "redis://10.0.0.5:6379/2" and s.registry_token.get_secret_value() == "a-real-token"
    assert s.tokenizer_path == tmp_path and s.allow_mode_override and s.environment == "prod"
    assert "a-real-token" not in repr(s) and "a-real-engine-token" not in repr(s)
    assert s.engine_token.get_secret_value() == "a-real-engine-token"

    monkeypatch.delenv("PREFT_GATEWAY__ENGINE_TOKEN")
    with pytest.raises(ValidationError, match="set PREFT_GATEWAY__ENGINE_TOKEN: the placeholder"):
        GatewaySettings()
    assert GatewaySettings(environment="dev").engine_token.get_secret_value() == DEV_ENGINE_TOKEN

    monkeypatch.delenv("PREFT_GATEWAY__REGISTRY_TOKEN")
    with pytest.raises(ValidationError, match="placeholder token is only allowed in dev"):
        GatewaySettings()
    assert GatewaySettings(environment="dev").registry_token.get_secret_value() == DEV_TOKEN
    with pytest.raises(ValidationError, match="max_prompt_tokens must be below max_model_len"):
        GatewaySettings(environment="dev", max_model_len=100, max_prompt_tokens=100)


def test_the_file_sweep_period(monkeypatch):
    assert GatewaySettings(environment="dev").files_sweep_period_s == 60.0
    monkeypatch.setenv("PREFT_GATEWAY__FILES_SWEEP_PERIOD_S", "2.5")
    assert GatewaySettings(environment="dev").files_sweep_period_s == 2.5
    for period_s in (0, -1, 3601):
        with pytest.raises(ValidationError, match="files_sweep_period_s"):
            GatewaySettings(environment="dev", files_sweep_period_s=period_s)


def test_openapi_schema_lists_the_routes(gateway):
    paths = gateway.http().get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/readyz"} <= set(paths)
    assert "/metrics" not in paths


def test_openapi_declares_the_bearer_scheme_on_every_authenticated_operation(gateway):
    schema = gateway.http().get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["TenantApiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key, sent as `Authorization: Bearer <key>`",
    }
    secured = {
        (path, method): op.get("security") for path, ops in schema["paths"].items() for method, op in ops.items()
    }
    probes = {"/healthz", "/readyz", "/healthz/deps"}
    assert all(security is None for (path, _), security in secured.items() if path in probes)
    others = {key: security for key, security in secured.items() if key[0] not in probes}
    assert len(others) > 30 and all(security == [{"TenantApiKey": []}] for security in others.values())
