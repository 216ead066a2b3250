"""Redis' ACL users (`common.redis_acl`) on a real server: each service reaches only its own keys and commands, and
nobody without a password reaches anything. The services working under their users is what every other integration
test checks (the session's Redis has these users, and each service connects as its own)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import redis

from preft.common.errors import PreftError
from preft.gateway.core.auth import KeyAuthenticator
from preft.gateway.core.redis_client import connect
from preft.stack import RedisServer
from tests.integration.conftest import service_redis

SECRET = "sk-forged-by-an-attacker"


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=2.0)


def _forge_key(r: redis.Redis, tenant: str) -> None:
    """The two writes of the issue's attack: an API key (whose secret the attacker chose) for another tenant."""
    r.set(f"preft:key:{hashlib.sha256(SECRET.encode()).hexdigest()}", "forged")
    r.hset("preft:keyid:forged", mapping={"tenant": tenant, "revoked_unix_ms": "0", "expires_unix_ms": "0"})


def _authenticate(redis_url: str) -> str:
    """The tenant the gateway's authenticator (as the gateway's user) finds behind SECRET; raises where none."""

    async def go() -> str:
        r = connect(service_redis(redis_url, "gateway"), 2.0)
        try:
            auth = KeyAuthenticator(r, ttl_s=0.001, max_entries=10, redis_timeout_s=2.0)
            return (await auth.authenticate(f"Bearer {SECRET}")).tenant
        finally:
            await r.aclose()

    return asyncio.run(go())


@pytest.fixture
def victim(redis_url: str) -> str:
    """A tenant as the registry creates it (with the admin's rights: this is the setup, not the attack)."""
    _client(redis_url).hset("preft:tenant:victim", mapping={"disabled": "0", "requests_per_min": "10"})
    return "victim"


def test_a_connection_without_credentials_is_refused(redis_server: RedisServer, redis_url: str):
    with pytest.raises(redis.AuthenticationError):
        _client(redis_server.url).get("preft:tenant:victim")
    with pytest.raises(redis.AuthenticationError):
        _client(redis_server.url.replace("//", "//gateway:wrong-password@")).ping()


def test_a_forged_api_key_works_for_an_admin_only(redis_server: RedisServer, redis_url: str, victim: str):
    with pytest.raises(redis.AuthenticationError):
        _forge_key(_client(redis_server.url), victim)
    for service in ("gateway", "engine"):  # (the registry writes keys: issuing them is its job)
        with pytest.raises(redis.exceptions.NoPermissionError):
            _forge_key(_client(redis_server.url_for(service)), victim)
    with pytest.raises(PreftError, match="Incorrect API key"):
        _authenticate(redis_url)
    _forge_key(_client(redis_url), victim)  # what the attack did before ACLs, when anyone could write
    assert _authenticate(redis_url) == victim


def test_the_gateway_reads_the_registrys_keys_and_writes_only_its_own(redis_server: RedisServer, victim: str):
    gateway = _client(redis_server.url_for("gateway"))
    assert gateway.hget("preft:tenant:victim", "disabled") == "0"  # (admission and auth read tenants)
    for write in (
        lambda: gateway.hset("preft:tenant:victim", "disabled", "0"),  # no re-enabling a disabled tenant
        lambda: gateway.hset("preft:tenant:victim", "requests_per_min", "1000000"),  # nor raising its limits
        lambda: gateway.delete("preft:key:0"),
        lambda: gateway.sadd("preft:adapters", "victim/x"),
        lambda: gateway.sadd("preft:residency:r1", "d"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    assert gateway.hset("preft:limits:victim", "tok", "1") == 1
    assert gateway.incrby("preft:usage-month:victim:2026-01", 5) == 5


def test_the_engine_reaches_residency_and_hot_specs_only(redis_server: RedisServer, redis_url: str, victim: str):
    _client(redis_url).set("preft:key:abc", "k1")
    engine = _client(redis_server.url_for("engine"))
    for read in (
        lambda: engine.get("preft:key:abc"),  # tenants' API keys
        lambda: engine.hgetall("preft:keyid:k1"),
        lambda: engine.hgetall("preft:tenant:victim"),
        lambda: engine.hgetall("preft:usage:victim:2026-01-01"),
        lambda: engine.set("preft:hot:specs", "[]"),  # (read only)
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            read()
    assert engine.sadd("preft:residency:r1", "d1") == 1
    assert engine.get("preft:hot:specs") is None


def test_the_registry_does_not_reach_the_gateways_keys(redis_server: RedisServer, redis_url: str):
    registry = _client(redis_server.url_for("registry"))
    for command in (
        lambda: registry.hset("preft:limits:victim", "tok", "1000000"),  # refilling a tenant's bucket
        lambda: registry.hset("preft:usage:victim:2026-01-01", "requests|m", "0"),  # (it reads usage only)
        lambda: registry.get("preft:file:victim:f1"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    assert registry.hgetall("preft:usage:victim:2026-01-01") == {}


@pytest.mark.parametrize("service", ["gateway", "registry", "engine"])
def test_no_service_runs_server_wide_commands(redis_server: RedisServer, redis_url: str, service: str):
    _client(redis_url).set("preft:key:abc", "k1")
    r = _client(redis_server.url_for(service))
    for command in ("FLUSHALL", "FLUSHDB", "KEYS *", "SCAN 0", "RANDOMKEY", "CONFIG GET *", "ACL LIST", "SHUTDOWN"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.execute_command(*command.split())
    assert r.ping()
    assert _client(redis_url).get("preft:key:abc") == "k1"
