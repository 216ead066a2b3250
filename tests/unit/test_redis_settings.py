"""Redis credentials in the services' settings: kept secret, required outside dev; and the ACL rules' shape."""

from __future__ import annotations

import fnmatch
from datetime import date

import pytest
from pydantic import SecretStr

from preft.common import metering
from preft.common.redis_acl import ACLS, SERVICES, acl_lines
from preft.common.settings import RedisSettings, RegistrySettings
from preft.engine.residency import residency_key
from preft.gateway.core.limits import reservations_key, reserved_key
from preft.gateway.settings import GatewaySettings


def test_credentials_in_the_url_move_to_the_secret_fields():
    s = RedisSettings(url="redis://gateway:p%40ss@redis:6379/0")
    assert s.url == "redis://redis:6379/0" and s.username == "gateway"
    assert s.password is not None and s.password.get_secret_value() == "p@ss"
    assert "p@ss" not in repr(s) and "p%40ss" not in repr(s) and "p@ss" not in str(s.model_dump())
    explicit = RedisSettings(url="redis://x:from-url@redis:6379/0", username="engine", password=SecretStr("own"))
    assert (explicit.username, explicit.password.get_secret_value()) == ("engine", "own")  # (explicit fields win)
    assert RedisSettings(url="rediss://:only-pw@redis:6380/0").client_options()["password"] == "only-pw"


def test_outside_dev_each_service_must_authenticate_to_redis(monkeypatch):
    monkeypatch.setenv("PREFT_GATEWAY__REGISTRY_TOKEN", "a-real-token")
    monkeypatch.setenv("PREFT_GATEWAY__ENGINE_TOKEN", "a-real-engine-token")
    monkeypatch.setenv("PREFT_REGISTRY__ADMIN_TOKEN", "a-real-token")
    with pytest.raises(ValueError, match="PREFT_GATEWAY__REDIS__USERNAME and PREFT_GATEWAY__REDIS__PASSWORD"):
        GatewaySettings()
    with pytest.raises(ValueError, match="PREFT_REGISTRY__REDIS__USERNAME"):
        RegistrySettings()
    monkeypatch.setenv("PREFT_REGISTRY__REDIS__URL", "redis://registry@redis:6379/0")  # a user, no password
    with pytest.raises(ValueError, match="PREFT_REGISTRY__REDIS__PASSWORD"):
        RegistrySettings()
    monkeypatch.setenv("PREFT_GATEWAY__REDIS__USERNAME", "gateway")
    monkeypatch.setenv("PREFT_GATEWAY__REDIS__PASSWORD", "s3cret-pw")
    settings = GatewaySettings()
    assert settings.redis.client_options()["username"] == "gateway" and "s3cret-pw" not in repr(settings)
    monkeypatch.setenv("PREFT_REGISTRY__ENVIRONMENT", "dev")
    monkeypatch.setenv("PREFT_REGISTRY__REDIS__URL", "redis://127.0.0.1:6379/0")
    assert RegistrySettings().redis.password is None  # (dev: an open local Redis still works)


def test_each_services_keys_fall_in_its_acl():
    """A sample of every service's key builders against its patterns (the integration tests run them for real)."""
    day = date(2026, 1, 31)
    keys = {
        "gateway": [
            reserved_key("acme", day),
            reservations_key("acme", day),
            metering.day_key("acme", day),
            metering.month_key("acme", day),
            metering.minute_key("acme", 0),
            "preft:limits:acme",
        ],
        "registry": ["preft:tenant:acme", "preft:tenant:acme:keys", "preft:adapter:acme/x:versions", "preft:hot"],
        "engine": [residency_key("replica-1")],
    }
    for service, names in keys.items():
        patterns = ACLS[service].writes
        assert all(any(fnmatch.fnmatchcase(k, p) for p in patterns) for k in names), service
    assert not any(fnmatch.fnmatchcase("preft:key:x", p) for p in ACLS["gateway"].writes)  # (read only)
    assert not any(fnmatch.fnmatchcase("preft:tenant:acme", p) for p in ACLS["gateway"].writes)


def test_acl_lines_refuse_passwords_an_acl_file_cannot_hold():
    passwords = {"default": "a", **{s: s + "-pw" for s in SERVICES}}
    assert [line.split()[1] for line in acl_lines(passwords)] == ["default", *SERVICES]
    with pytest.raises(ValueError, match="whitespace"):
        acl_lines({**passwords, "gateway": "two words"})
