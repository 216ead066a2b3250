"""The registry's metadata in Redis: tenants, API keys, base models, adapter versions, aliases, sharing, hotness.

Layout (all keys start with `preft:`):
- `tenants` set; `tenant:<t>` hash (limits, usage, disabled); `tenant:<t>:adapters`, `:keys`, `:shared_in` (`t/n`
  it accepted), `:offers_in` (`t/n` offered to it, pending; may exist for a name no tenant has yet) sets;
  the limits are LIMIT_FIELDS and `tokens_per_month` (0 or absent = no monthly quota; the gateway reads it)
- `keys` set of key ids; `keyid:<id>` hash (tenant, hash, label, times); `key:<sha256(secret)>` -> key id
- `bases` set; `base:<id>` hash (config, architecture digest)
- `adapters` set of `t/n`; `adapter:<t>/<n>` hash (exists while the adapter has versions); `:versions` hash
  (version -> manifest JSON); `:aliases` hash (alias -> version); `:shared`, `:offered` sets (recipients who
  accepted, recipients offered); `:seq` (last version number, kept after deletion so numbers are never reused)
- `blobrefs` hash (sha256 -> versions referencing it); `blobtouch` zset (sha256 -> last use, ms); `gc:deleting`
- `hot` zset (`t/n@v` -> log2 of the decayed use sum, see lua.RECORD_USE)
- read only: `usage:<t>:<YYYY-MM-DD>` hashes, the gateway's token metering (layout in common.metering)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import date
from typing import Any, TypeVar

import redis

from preft.common import metering
from preft.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from preft.common.metrics import STORE_ERRORS
from preft.common.refs import AdapterRef
from preft.common.settings import RedisSettings
from preft.registry import lua
from preft.registry.model import (
    AdapterSummary,
    ApiKeyRecord,
    BaseModelRecord,
    Manifest,
    TenantLimits,
    TenantRecord,
)

F = TypeVar("F", bound=Callable[..., Any])
# Limits every tenant hash holds (0 in a request = default/keep); `tokens_per_month` may be absent (= no quota).
LIMIT_FIELDS = ("requests_per_min", "tokens_per_min", "max_adapters", "max_bytes")


def now_ms() -> int:
    return int(time.time() * 1000)


def key_hash(secret: str) -> str:
    """What is stored for an API key: its sha256 (the key is 256 random bits, so no slow hash is needed)."""
    return hashlib.sha256(secret.encode()).hexdigest()


@contextlib.contextmanager
def redis_errors() -> Iterator[None]:
    """Turn a Redis outage into Unavailable (fast: the client has short socket timeouts), counted in
    preft_store_errors_total."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        STORE_ERRORS.labels("redis").inc()
        raise Unavailable(f"metadata store (Redis) unavailable: {e}") from e


def _guarded(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with redis_errors():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class RedisIndex:
    """Owns every registry key in Redis; each change that touches several keys is one Lua script (atomic)."""

    def __init__(self, settings: RedisSettings, *, client: redis.Redis | None = None) -> None:
        self.redis = client or redis.Redis.from_url(settings.url, decode_responses=True, **settings.client_options())
        self._scripts = {
            name: self.redis.register_script(getattr(lua, name))
            for name in (
                "CREATE_TENANT",
                "UPDATE_TENANT",
                "ISSUE_KEY",
                "REVOKE_KEY",
                "PUBLISH",
                "RESOLVE",
                "SET_ALIAS",
                "SHARE",
                "ANSWER_OFFER",
                "DELETE",
                "RECORD_USE",
                "GC_CLAIM",
                "GC_RELEASE",
                "KEY_STATE",
            )
        }

    def _run(self, script: str, *args: Any) -> list[str]:
        return self._scripts[script](args=[str(a) for a in args])

    @_guarded
    def ping(self) -> bool:
        return bool(self.redis.ping())

    @_guarded
    def entry_counts(self) -> dict[str, int]:
        """How many tenants, adapters, base models and referenced blobs the index holds (one round trip, O(1))."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.scard("preft:tenants")
        pipe.scard("preft:adapters")
        pipe.scard("preft:bases")
        pipe.hlen("preft:blobrefs")
        return dict(zip(("tenants", "adapters", "base_models", "blobs"), map(int, pipe.execute()), strict=True))

    # -- tenants -------------------------------------------------------------------------------------------------

    @_guarded
    def create_tenant(self, tenant: str, limits: TenantLimits) -> TenantRecord:
        res = self._run(
            "CREATE_TENANT",
            tenant,
            now_ms(),
            limits.requests_per_min,
            limits.tokens_per_min,
            limits.max_adapters,
            limits.max_bytes,
            limits.tokens_per_month or 0,
        )
        if res[0] == "exists":
            raise AlreadyExists(f"tenant {tenant!r} already exists")
        return self.get_tenant(tenant)

    @_guarded
    def get_tenant(self, tenant: str) -> TenantRecord:
        data = self.redis.hgetall(f"preft:tenant:{tenant}")
        if not data:
            raise NotFound(f"tenant {tenant!r} does not exist")
        return _tenant(tenant, data)

    @_guarded
    def list_tenants(self) -> list[TenantRecord]:
        ids = sorted(self.redis.smembers("preft:tenants"))
        pipe = self.redis.pipeline(transaction=False)
        for t in ids:
            pipe.hgetall(f"preft:tenant:{t}")
        return [_tenant(t, d) for t, d in zip(ids, pipe.execute(), strict=True) if d]

    @_guarded
    def update_tenant(self, tenant: str, **fields: int | str) -> TenantRecord:
        flat = [x for kv in fields.items() for x in kv]
        if self._run("UPDATE_TENANT", tenant, *flat)[0] == "no_tenant":
            raise NotFound(f"tenant {tenant!r} does not exist")
        return self.get_tenant(tenant)

    # -- API keys ------------------------------------------------------------------------------------------------

    @_guarded
    def add_key(self, record: ApiKeyRecord, secret: str) -> None:
        res = self._run(
            "ISSUE_KEY",
            record.tenant,
            record.id,
            key_hash(secret),
            record.label,
            record.created_unix_ms,
            record.expires_unix_ms,
        )
        if res[0] == "no_tenant":
            raise NotFound(f"tenant {record.tenant!r} does not exist")
        if res[0] == "disabled":
            raise FailedPrecondition(f"tenant {record.tenant!r} is disabled")

    @_guarded
    def revoke_key(self, key_id: str) -> ApiKeyRecord:
        if self._run("REVOKE_KEY", key_id, now_ms())[0] == "no_key":
            raise NotFound(f"API key {key_id!r} does not exist")
        return self._key(key_id)

    @_guarded
    def list_keys(self, tenant: str | None) -> list[ApiKeyRecord]:
        if tenant:
            self.get_tenant(tenant)
            ids = self.redis.smembers(f"preft:tenant:{tenant}:keys")
        else:
            ids = self.redis.smembers("preft:keys")
        records = [self._key(i) for i in ids]
        return sorted(records, key=lambda k: (k.tenant, k.created_unix_ms, k.id))

    @_guarded
    def authenticate(self, secret: str) -> TenantRecord:
        """The tenant a key belongs to; Unauthenticated for unknown, revoked or expired keys."""
        found = self._scripts["KEY_STATE"](keys=[f"preft:key:{key_hash(secret)}"])
        if not found:
            raise Unauthenticated("unknown or revoked API key")
        _key_id, tenant, revoked_ms, expires_ms, state = found
        if int(revoked_ms):
            raise Unauthenticated("unknown or revoked API key")
        if int(expires_ms) and int(expires_ms) <= now_ms():
            raise Unauthenticated("API key expired")
        if state == "missing":
            raise NotFound(f"tenant {tenant!r} does not exist")
        if state == "disabled":
            raise PermissionDenied(f"tenant {tenant!r} is disabled")
        return self.get_tenant(tenant)

    def _key(self, key_id: str) -> ApiKeyRecord:
        d = self.redis.hgetall(f"preft:keyid:{key_id}")
        if not d:
            raise NotFound(f"API key {key_id!r} does not exist")
        return ApiKeyRecord(
            id=key_id,
            tenant=d["tenant"],
            label=d.get("label", ""),
            created_unix_ms=int(d["created_unix_ms"]),
            expires_unix_ms=int(d.get("expires_unix_ms", 0)),
            revoked_unix_ms=int(d.get("revoked_unix_ms", 0)),
        )

    # -- base models ---------------------------------------------------------------------------------------------

    @_guarded
    def put_base_model(self, record: BaseModelRecord) -> BaseModelRecord:
        key = f"preft:base:{record.id}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, "architecture_digest", record.architecture_digest)
        pipe.hsetnx(key, "config_json", record.config_json)
        pipe.hsetnx(key, "created_unix_ms", record.created_unix_ms)
        pipe.sadd("preft:bases", record.id)
        pipe.execute()
        stored = self.get_base_model(record.id)
        if stored.architecture_digest != record.architecture_digest:
            raise FailedPrecondition(
                f"base model {record.id!r} is registered with another architecture "
                f"({stored.architecture_digest[:12]}); adapters were validated against it: use a new id"
            )
        return stored

    @_guarded
    def get_base_model(self, model_id: str) -> BaseModelRecord:
        d = self.redis.hgetall(f"preft:base:{model_id}")
        if not d:
            raise NotFound(f"base model {model_id!r} is not registered")
        return BaseModelRecord(model_id, d["architecture_digest"], d["config_json"], int(d["created_unix_ms"]))

    @_guarded
    def list_base_models(self) -> list[BaseModelRecord]:
        return [self.get_base_model(m) for m in sorted(self.redis.smembers("preft:bases"))]

    # -- adapters ------------------------------------------------------------------------------------------------

    @_guarded
    def commit_version(self, manifest: Manifest, alias: str) -> int:
        """Store a new version (number assigned here) and move `latest` and `alias`, all in one step."""
        res = self._run(
            "PUBLISH",
            manifest.tenant,
            manifest.name,
            manifest.to_json(),
            manifest.size_bytes,
            alias,
            now_ms(),
            *(f.sha256 for f in manifest.files),
        )
        if res[0] == "ok":
            return int(res[1])
        code, detail = res[0], res[1:]
        if code == "no_tenant":
            raise NotFound(f"tenant {manifest.tenant!r} does not exist")
        if code == "disabled":
            raise FailedPrecondition(f"tenant {manifest.tenant!r} is disabled")
        if code == "blob_gone":
            raise FailedPrecondition(f"blob {detail[0][:12]} is being garbage-collected: upload it again")
        if code == "max_adapters":
            raise ResourceExhausted(f"tenant {manifest.tenant!r} already owns {detail[0]} adapters, its limit")
        raise ResourceExhausted(
            f"tenant {manifest.tenant!r} would exceed its storage limit of {detail[1]} bytes "
            f"({detail[0]} used, this version {manifest.size_bytes})"
        )

    @_guarded
    def resolve(self, caller: str, ref: AdapterRef) -> Manifest:
        """The manifest `ref` names for `caller` ("" = operator); NotFound also hides adapters not shared."""
        assert ref.owner is not None
        res = self._run("RESOLVE", caller, ref.owner, ref.name, ref.version or "", ref.alias or "")
        if res[0] == "ok":
            return Manifest.from_json(ref.owner, ref.name, int(res[1]), res[2])
        if res[0] == "no_alias":
            raise NotFound(f"adapter {ref.owner}/{ref.name} has no alias {ref.alias!r}")
        if res[0] == "no_version":
            raise NotFound(f"adapter {ref.owner}/{ref.name} has no version {ref.version}")
        if res[0] == "disabled" and not caller:
            raise FailedPrecondition(f"tenant {ref.owner!r} is disabled")
        raise NotFound(f"adapter {ref} not found")

    @_guarded
    def versions(self, tenant: str, name: str) -> list[Manifest]:
        raw = self.redis.hgetall(f"preft:adapter:{tenant}/{name}:versions")
        if not raw:
            raise NotFound(f"adapter {tenant}/{name} not found")
        return [Manifest.from_json(tenant, name, int(v), m) for v, m in sorted(raw.items(), key=lambda kv: int(kv[0]))]

    @_guarded
    def adapter(self, tenant: str, name: str) -> AdapterSummary:
        found = self.adapters([(tenant, name)])
        if not found:
            raise NotFound(f"adapter {tenant}/{name} not found")
        return found[0]

    @_guarded
    def adapters(self, names: Sequence[tuple[str, str]]) -> list[AdapterSummary]:
        """Summaries of these adapters (missing ones skipped), in two pipelined round trips."""
        pipe = self.redis.pipeline(transaction=False)
        for t, n in names:
            ak = f"preft:adapter:{t}/{n}"
            pipe.hgetall(f"{ak}:aliases")
            pipe.smembers(f"{ak}:shared")
            pipe.hlen(f"{ak}:versions")
            pipe.smembers(f"{ak}:offered")
        meta = pipe.execute()
        for (t, n), i in zip(names, range(0, len(meta), 4), strict=True):
            pipe.hget(f"preft:adapter:{t}/{n}:versions", meta[i].get("latest", "0"))
        latest = pipe.execute()
        out = []
        for (t, n), i, m in zip(names, range(0, len(meta), 4), latest, strict=True):
            if m is None:
                continue
            aliases = {a: int(v) for a, v in meta[i].items()}
            out.append(
                AdapterSummary(
                    tenant=t,
                    name=n,
                    aliases=aliases,
                    shared_with=tuple(sorted(meta[i + 1])),
                    version_count=meta[i + 2],
                    latest=Manifest.from_json(t, n, aliases["latest"], m),
                    offered_to=tuple(sorted(meta[i + 3])),
                )
            )
        return out

    @_guarded
    def visible_adapters(self, tenant: str | None) -> list[tuple[str, str]]:
        """(owner, name) of adapters `tenant` owns or may use, or of every adapter for None."""
        if tenant is None:
            members = self.redis.smembers("preft:adapters")
        else:
            self.get_tenant(tenant)
            owned = {f"{tenant}/{n}" for n in self.redis.smembers(f"preft:tenant:{tenant}:adapters")}
            members = owned | self.redis.smembers(f"preft:tenant:{tenant}:shared_in")
        return sorted(tuple(m.split("/", 1)) for m in members)  # type: ignore[misc]

    @_guarded
    def set_alias(self, tenant: str, name: str, alias: str, version: int) -> None:
        res = self._run("SET_ALIAS", tenant, name, alias, version)
        if res[0] == "not_found":
            raise NotFound(f"adapter {tenant}/{name} not found")
        if res[0] == "no_version":
            raise NotFound(f"adapter {tenant}/{name} has no version {version}")
        if res[0] == "no_alias":
            raise NotFound(f"adapter {tenant}/{name} has no alias {alias!r}")

    @_guarded
    def share(
        self, tenant: str, name: str, add: Sequence[str], remove: Sequence[str], *, offer: bool, max_offers: int
    ) -> None:
        """Share directly (`offer` False: with existing tenants) or offer (any names, see lua.SHARE); remove both."""
        mode = "offer" if offer else "direct"
        res = self._run("SHARE", tenant, name, mode, max_offers, len(add), *add, *remove)
        if res[0] == "not_found":
            raise NotFound(f"adapter {tenant}/{name} not found")
        if res[0] == "no_tenant":
            raise NotFound(f"tenant {res[1]!r} does not exist")
        if res[0] == "too_many_offers":
            raise FailedPrecondition(
                f"adapter {tenant}/{name} would have more than {max_offers} pending offers: withdraw some first"
            )

    @_guarded
    def offers(self, tenant: str) -> list[tuple[str, str, bool]]:
        """(owner, name, accepted) of the adapters offered to `tenant` or shared with it, sorted."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(f"preft:tenant:{tenant}:offers_in")
        pipe.smembers(f"preft:tenant:{tenant}:shared_in")
        pending, accepted = pipe.execute()
        found = [(*m.split("/", 1), False) for m in pending] + [(*m.split("/", 1), True) for m in accepted]
        return sorted(found)  # type: ignore[arg-type]

    @_guarded
    def answer_offer(self, tenant: str, owner: str, name: str, accept: bool) -> None:
        if self._run("ANSWER_OFFER", tenant, owner, name, "1" if accept else "0")[0] == "no_offer":
            # one answer whether the owner, the adapter or the offer is missing
            raise NotFound(f"no share offer of {owner}/{name} to {tenant!r}")

    @_guarded
    def delete(self, tenant: str, name: str, version: int | None) -> list[int]:
        res = self._run("DELETE", tenant, name, version or "", now_ms())
        if res[0] == "ok":
            return sorted(int(v) for v in res[1:])
        if res[0] == "no_version":
            raise NotFound(f"adapter {tenant}/{name} has no version {version}")
        if res[0] == "alias":
            raise FailedPrecondition(
                f"alias(es) {res[1]} of {tenant}/{name} point at v{version}: move or remove them first"
            )
        raise NotFound(f"adapter {tenant}/{name} not found")

    # -- hotness -------------------------------------------------------------------------------------------------

    @_guarded
    def record_use(self, tenant: str, name: str, version: int, weight: float, half_life_s: float) -> float:
        x = time.time() / half_life_s + math.log2(weight)
        res = self._run("RECORD_USE", tenant, name, version, repr(x))
        if res[0] != "ok":
            raise NotFound(f"adapter {tenant}/{name}@v{version} not found")
        return _decayed(float(res[1]), half_life_s)

    @_guarded
    def hottest(self, limit: int, half_life_s: float) -> list[tuple[str, str, int, float]]:
        """(tenant, name, version, decayed score) of the hottest versions, hottest first."""
        out = []
        for member, score in self.redis.zrevrange("preft:hot", 0, limit - 1, withscores=True):
            owner_name, version = member.rsplit("@", 1)
            tenant, name = owner_name.split("/", 1)
            out.append((tenant, name, int(version), _decayed(score, half_life_s)))
        return out

    # -- token metering (written by the gateway) ----------------------------------------------------------------

    @_guarded
    def usage_hashes(self, tenant: str, days: Sequence[date]) -> list[dict[str, str]]:
        """Each day's metering hash of a tenant (empty where nothing was used), in one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for day in days:
            pipe.hgetall(metering.day_key(tenant, day))
        return pipe.execute()

    # -- blobs ---------------------------------------------------------------------------------------------------

    @_guarded
    def touch_blobs(self, digests: Sequence[str]) -> None:
        """Mark blobs as about to be referenced, so gc leaves them alone for its grace period."""
        if digests:
            self.redis.zadd("preft:blobtouch", dict.fromkeys(digests, now_ms()))

    @_guarded
    def referenced_blobs(self) -> set[str]:
        return set(self.redis.hkeys("preft:blobrefs"))

    @_guarded
    def claim_for_deletion(self, digest: str, cutoff_unix_ms: int) -> bool:
        return self._run("GC_CLAIM", digest, cutoff_unix_ms)[0] == "ok"

    @_guarded
    def release_deleted(self, digest: str) -> None:
        self._run("GC_RELEASE", digest)


def _decayed(log2_sum: float, half_life_s: float) -> float:
    return 2.0 ** (log2_sum - time.time() / half_life_s)


def _tenant(tenant: str, d: dict[str, str]) -> TenantRecord:
    return TenantRecord(
        id=tenant,
        disabled=d.get("disabled") == "1",
        limits=TenantLimits(
            **{f: int(d[f]) for f in LIMIT_FIELDS},
            tokens_per_month=int(d.get("tokens_per_month", 0)),  # absent in tenants created before the quota
        ),
        adapter_count=int(d.get("adapter_count", 0)),
        bytes_used=int(d.get("bytes_used", 0)),
        created_unix_ms=int(d["created_unix_ms"]),
    )
