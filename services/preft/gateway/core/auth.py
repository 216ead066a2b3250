"""API keys: `Authorization: Bearer <key>` -> sha256 -> the key's record and its tenant's state in Redis.

The gateway reads the registry's Redis layout (documented in `preft.registry.index`) with one read-only Lua
script, one round trip: its Redis user may read API keys and tenants, never write them (`common.redis_acl`).
Outcomes, refusals included, are cached in memory for `key_cache_ttl_s`, so a revoked key or a disabled tenant stops
working within that time; an expiring key's entry never outlives the key. Keys are looked up by their hash only;
neither the key nor its hash is ever logged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from preft.common.errors import PermissionDenied, PreftError
from preft.gateway.core.cache import TTLCache
from preft.gateway.core.errors import InvalidApiKey
from preft.gateway.core.redis_client import ReadOnlyScript, guarded
from preft.registry.index import key_hash
from preft.registry.lua import KEY_STATE


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant and the key id (never the secret)."""

    tenant: str
    key_id: str
    offline: bool = False  # a batch's line (sent by the batch for its creator): no per-minute buckets are taken


class KeyAuthenticator:
    """Owns API key checks and their short-lived cache."""

    def __init__(self, redis: aioredis.Redis, *, ttl_s: float, max_entries: int, redis_timeout_s: float) -> None:
        self._redis = redis
        self._script = ReadOnlyScript(redis, KEY_STATE)  # (the gateway may only read API keys)
        self._cache: TTLCache[str, Caller | PreftError] = TTLCache(ttl_s, max_entries)
        self._timeout_s = redis_timeout_s

    async def authenticate(self, authorization: str | None) -> Caller:
        """The caller behind an Authorization header; Unauthenticated (401) or PermissionDenied (403) otherwise."""
        digest = key_hash(_bearer(authorization))
        outcome = await self._cache.get_or_load(digest, lambda: self._lookup(digest))
        if isinstance(outcome, PreftError):
            raise type(outcome)(outcome.message)
        return outcome

    async def _lookup(self, digest: str) -> tuple[Caller | PreftError, float | None]:
        found = await guarded(self._script(keys=[f"preft:key:{digest}"]), self._timeout_s)
        if not found:
            return InvalidApiKey("Incorrect API key provided."), None
        key_id, tenant, revoked_ms, expires_ms, state = found
        if int(revoked_ms):
            return InvalidApiKey("Incorrect API key provided."), None
        expires_ms = int(expires_ms)
        now_ms = time.time() * 1000
        if expires_ms and expires_ms <= now_ms:
            return InvalidApiKey("The API key has expired."), None
        if state == "disabled":
            return PermissionDenied(f"tenant {tenant!r} is disabled"), None
        if state == "missing":
            return InvalidApiKey("Incorrect API key provided."), None
        ttl_s = (expires_ms - now_ms) / 1000 if expires_ms else None
        return Caller(tenant=tenant, key_id=key_id), ttl_s


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise InvalidApiKey("You didn't provide an API key. Send it as 'Authorization: Bearer <API key>'.")
    scheme, _, secret = authorization.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise InvalidApiKey("The Authorization header must be 'Bearer <API key>'.")
    return secret
