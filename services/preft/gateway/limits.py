"""Per-tenant rate limits: a requests/min and a tokens/min token bucket per tenant, in Redis, checked atomically.

Both buckets hold one minute's worth (the tenant's `requests_per_min` / `tokens_per_min`, read from its
`preft:tenant:<t>` hash at every check, so limit changes apply at once) and refill continuously. One Lua script
checks and takes from both, with Redis' clock, so any number of gateway replicas share the buckets exactly.

A tenant whose hash sets `tokens_per_month` (the registry's limit; absent or 0: no quota) is refused with 429
`insufficient_quota` once its metered tokens this UTC month (``metering``'s month counter) reach it, until the month
ends or the quota is raised. The counter follows the meter, a second or so behind, and a request admitted below the
quota is answered whole: a tenant may go over by what its last requests use.

Offline work (a batch's lines, ``batches``) takes from neither bucket: a batch is not interactive traffic. Only the
monthly quota, and the tenant's existence and state, apply to it (`admit_offline`).

Token charging: a request reserves `prompt_tokens + max_tokens` when it is admitted (as OpenAI counts
max_tokens against TPM), and the unused part (max_tokens - generated tokens, or everything when the request
never reached the engine) is given back after it finishes. So concurrent long generations cannot overdraw the
budget, and short answers cost only what they used. A request that needs more tokens than the tenant's whole
per-minute budget can never be admitted: 429 without Retry-After.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from preft.common import metering
from preft.common.errors import PermissionDenied, PreftError, Unavailable
from preft.gateway.errors import InvalidApiKey, QuotaExceeded, RateLimited
from preft.gateway.redis_client import guarded

log = logging.getLogger(__name__)

# KEYS[1] = preft:tenant:<t> (limits), KEYS[2] = preft:limits:<t> (bucket levels), KEYS[3] = the tenant's tokens this
# UTC month (common.metering.month_key); ARGV[1] = tokens to take.
TAKE_LUA = """
local lim = redis.call('HMGET', KEYS[1], 'requests_per_min', 'tokens_per_min', 'tokens_per_month')
local rpm, tpm, quota = tonumber(lim[1]), tonumber(lim[2]), tonumber(lim[3]) or 0
if not rpm or not tpm then return {'no_tenant'} end
if quota > 0 and (tonumber(redis.call('GET', KEYS[3])) or 0) >= quota then return {'quota', tostring(quota)} end
local cost = tonumber(ARGV[1])
if cost > tpm then return {'too_large', tostring(tpm)} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local s = redis.call('HMGET', KEYS[2], 'req', 'tok', 'ts')
local req, tok = rpm, tpm
if s[3] then
  local dt = math.max(0, now - tonumber(s[3]))
  req = math.min(rpm, tonumber(s[1]) + dt * rpm / 60000)
  tok = math.min(tpm, tonumber(s[2]) + dt * tpm / 60000)
end
if req < 1 or tok < cost then
  local wait_req, wait_tok = 0, 0
  if req < 1 then wait_req = (1 - req) * 60000 / rpm end
  if tok < cost then wait_tok = (cost - tok) * 60000 / tpm end
  local which = 'requests'
  if wait_tok > wait_req then which = 'tokens' end
  return {'limited', tostring(math.max(wait_req, wait_tok)), which}
end
req, tok = req - 1, tok - cost
redis.call('HSET', KEYS[2], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now))
-- an untouched bucket is full again after a minute: the key may go, and a missing key reads as full
redis.call('PEXPIRE', KEYS[2], 60000)
return {'ok', tostring(math.floor(req)), tostring(math.floor(tok)), tostring(rpm), tostring(tpm)}
"""

# KEYS as TAKE_LUA's: admission of offline work (a batch's line), which takes from no bucket; only a tenant that is
# gone or disabled, or whose monthly quota is used, is refused.
OFFLINE_LUA = """
local lim = redis.call('HMGET', KEYS[1], 'requests_per_min', 'tokens_per_month', 'disabled')
if not lim[1] then return {'no_tenant'} end
if lim[3] == '1' then return {'disabled'} end
local quota = tonumber(lim[2]) or 0
if quota > 0 and (tonumber(redis.call('GET', KEYS[3])) or 0) >= quota then return {'quota', tostring(quota)} end
return {'ok'}
"""

# KEYS as above; ARGV[1] = tokens to give back (never above the bucket's size).
REFUND_LUA = """
local tpm = tonumber(redis.call('HGET', KEYS[1], 'tokens_per_min'))
local tok = redis.call('HGET', KEYS[2], 'tok')
if not tpm or not tok then return 0 end
redis.call('HSET', KEYS[2], 'tok', tostring(math.min(tpm, tonumber(tok) + tonumber(ARGV[1]))))
return 1
"""


@dataclass(frozen=True)
class Admission:
    """A request let through: what it reserved, and the buckets' state for the x-ratelimit-* headers."""

    tenant: str
    tokens_reserved: int
    requests_limit: int
    requests_remaining: int
    tokens_limit: int
    tokens_remaining: int

    def headers(self) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": str(self.requests_limit),
            "x-ratelimit-remaining-requests": str(self.requests_remaining),
            "x-ratelimit-limit-tokens": str(self.tokens_limit),
            "x-ratelimit-remaining-tokens": str(self.tokens_remaining),
        }


class RateLimiter:
    """Owns the per-tenant buckets: admit (take a request and reserve tokens) and refund (give unused tokens back)."""

    def __init__(self, redis: aioredis.Redis, *, redis_timeout_s: float) -> None:
        self._take = redis.register_script(TAKE_LUA)
        self._offline = redis.register_script(OFFLINE_LUA)
        self._refund = redis.register_script(REFUND_LUA)
        self._timeout_s = redis_timeout_s

    async def admit(self, tenant: str, tokens: int) -> Admission:
        """Take one request and `tokens` tokens from the tenant's buckets, or raise RateLimited (429)."""
        res = await guarded(self._take(keys=_keys(tenant), args=[tokens]), self._timeout_s)
        if res[0] == "ok":
            return Admission(tenant, tokens, int(res[3]), int(res[1]), int(res[4]), int(res[2]))
        raise self._refusal(tenant, tokens, res)

    async def admit_offline(self, tenant: str) -> Admission:
        """Admit offline work (a batch's line): it reserves nothing and takes from no bucket, but is refused as any
        request once the tenant's monthly quota is used (QuotaExceeded), or where the tenant is gone or disabled."""
        res = await guarded(self._offline(keys=_keys(tenant)), self._timeout_s)
        if res[0] == "ok":
            return Admission(tenant, 0, 0, 0, 0, 0)
        if res[0] == "disabled":
            raise PermissionDenied(f"tenant {tenant!r} is disabled")
        raise self._refusal(tenant, 0, res)

    def _refusal(self, tenant: str, tokens: int, res: list[str]) -> PreftError:
        """Why the admission script refused."""
        if res[0] == "limited":
            wait_s = float(res[1]) / 1000
            return RateLimited(
                f"Rate limit reached for {res[2]} per minute (tenant {tenant!r}); retry in {wait_s:.1f} s.",
                retry_after_s=wait_s,
            )
        if res[0] == "quota":
            month = metering.day_of(time.time())
            return QuotaExceeded(
                f"Tenant {tenant!r} has used its {int(res[1]):,} tokens for {month:%Y-%m} (UTC); the quota renews at "
                "the start of next month, or when it is raised."
            )
        if res[0] == "too_large":
            return RateLimited(
                f"This request needs {tokens} tokens (prompt + max_tokens), more than the tenant's limit of "
                f"{res[1]} tokens per minute; lower max_tokens or shorten the prompt.",
                retry_after_s=None,
            )
        return InvalidApiKey(f"tenant {tenant!r} no longer exists")

    async def refund(self, tenant: str, tokens: int) -> None:
        """Give back reserved tokens that were not used; best effort (a failure only makes the bucket stricter)."""
        if tokens <= 0:
            return
        try:
            await guarded(self._refund(keys=_keys(tenant), args=[tokens]), self._timeout_s)
        except Unavailable:
            log.debug("token refund for tenant %s dropped: Redis unavailable", tenant)


def _keys(tenant: str) -> list[str]:
    month = metering.month_key(tenant, metering.day_of(time.time()))
    return [f"preft:tenant:{tenant}", f"preft:limits:{tenant}", month]
