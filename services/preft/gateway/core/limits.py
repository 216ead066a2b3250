"""Per-tenant rate limits and the monthly token quota, in Redis, checked atomically: a requests/min and a tokens/min
token bucket per tenant, and each request's tokens reserved against its tenant's quota for the month.

Both buckets hold one minute's worth (the tenant's `requests_per_min` / `tokens_per_min`, read from its
`preft:tenant:<t>` hash at every check, so limit changes apply at once) and refill continuously. One Lua script
checks and takes from both, with Redis' clock, so any number of gateway replicas share the buckets exactly.

Token charging: a request reserves `prompt_tokens + max_tokens` (per choice) when it is admitted (as OpenAI counts
max_tokens against TPM), and the unused part (max_tokens - generated tokens, or everything when the request
never reached the engine) is given back after it finishes. So concurrent long generations cannot overdraw the
budget, and short answers cost only what they used. A request that needs more tokens than the tenant's whole
per-minute budget can never be admitted: 429 without Retry-After.

Charged before tokenizing: a generation's request and an estimate of its tokens (the fewest its prompt's bytes can
be, ``prompt_guard``, plus max_tokens per sample) are taken before its prompt is tokenized, so an empty bucket refuses
without the tokenizer's work; `settle` then corrects the tokens to the real count in one script call (the difference
taken, or given back). Refused there, the estimate is given back, and the request stays counted: it cost a
tokenization.

Monthly quota: where the tenant's hash sets `tokens_per_month` (absent or 0: no quota), the same script also
reserves the request's cost (the bucket's estimate) against the UTC month, refusing with 429 `insufficient_quota`
where the month's metered tokens (``metering``'s month counter, a second or so behind the answers) plus the
reservations of the tenant's requests in flight plus this cost pass the quota. Concurrent requests cannot go over
it: each one admitted has room for all it may use. The reservations of a month, shared by all replicas:
`preft:quota-reserved:<t>:<YYYY-MM>` (their tokens, a counter) and `preft:quota-reservations:<t>:<YYYY-MM>` (an entry
`<request id>:<tokens>` each, scored by when it lapses, in Redis' ms). An entry lapses `reservation_lapse_s` after
its admission (longer than any request runs), so the reservations of a gateway that crashed go by themselves: the
next admission that sees an entry lapsed takes it off the counter (`LAPSE_BATCH` at most per call: a larger backlog
still counts until later admissions take it off, refusing early, not late).

When a request ends (answered, failed, client gone, cancelled), its entry shrinks to the tokens the meter will add to
the month (prompt + generated where it was answered, else none) and is held `hold_s` (a few meter flush intervals
and a Redis deadline; a batch line's `batches_part_s` more: its tokens are metered with its part) before it lapses.
Dropped at once, it would leave a gap, between the request's end and the meter's next flush, where its tokens count
nowhere and concurrent requests could go over the quota. Held, they count twice for a moment (held and metered), so a
tenant near its quota may be refused slightly early, never late: unless the meter's counts reach Redis later than the
hold (Redis unreachable for the meter, or S3 for a batch's part), or a request runs longer than
`reservation_lapse_s` (its entry lapsed: the release finds nothing to change). The release rides on the bucket
refund's script call; one that fails (Redis down) is logged, and the entry lapses. Reservations belong to the month
they were made in: its keys expire `common.metering.MONTH_TTL_DAYS` after their last write, as its counter does. A
request admitted before a month's end and answered after it is metered in the new month: so an admission counts the
previous month's reservations too (and lapses its entries as its own month's), its requests still in flight and
its ended ones' holds; those that ended before the month did are metered in the old month, and count in the new one
for their hold only (refused early, not late). A tenant without a quota has no reservation work: the same one script
call to admit and to refund.

Offline work (a batch's lines, ``batches``) takes from neither bucket: a batch is not interactive traffic. Only the
monthly quota (reserved as for any request), and the tenant's existence and state, apply to it (`admit_offline`).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass
from datetime import date, timedelta

import redis.asyncio as aioredis

from preft.common import metering
from preft.common.errors import PermissionDenied, PreftError, Unavailable
from preft.gateway.core.errors import InvalidApiKey, QuotaExceeded, RateLimited
from preft.gateway.core.redis_client import CLOCK_LUA, guarded

log = logging.getLogger(__name__)

LAPSE_BATCH = 100  # lapsed reservations one admission takes off at most (the script's work stays bounded)
HOLD_FLUSHES = 2  # meter flush intervals (plus one Redis deadline) an ended request's used tokens stay reserved
LIMITS_PREFIX = "preft:limits:"  # the tenant's buckets: LIMITS_PREFIX + tenant
KEYS_TTL_S = metering.MONTH_TTL_DAYS * metering.DAY_S  # a month's reservation keys, after their last write

# Shared by the admission and release scripts: Redis' clock (ms), the tenant's record (its limits), and taking `tokens`
# off a month's reserved counter as entries leave its reservations (the counter goes with the last one). KEYS[1] is
# always preft:limits:<t>; the tenant's record, the registry's, is named from it rather than passed in KEYS: EVALSHA's
# keys need write access, and the gateway's Redis user may only read the registry's keys (common.redis_acl).
RESERVED_LUA = (
    CLOCK_LUA
    + """
local function tenant_key() return 'preft:tenant:' .. string.sub(KEYS[1], LIMITS_PREFIX_LEN + 1) end
local function take_off(counter, entries, tokens)
  if redis.call('ZCARD', entries) == 0 then
    redis.call('DEL', counter)
  elseif tokens ~= 0 then
    redis.call('DECRBY', counter, tokens)
  end
end
""".replace("LIMITS_PREFIX_LEN", str(len(LIMITS_PREFIX)))
)

# Shared by both admission scripts; KEYS[2] = the tenant's tokens this UTC month (common.metering.month_key),
# KEYS[3] / KEYS[4] = that month's reserved tokens / reservations (`reserved_key`, `reservations_key`), KEYS[5] /
# KEYS[6] = the previous month's; ARGV[2] = the reservation's id, ARGV[3] = how long until it lapses (ms), ARGV[4] =
# the keys' TTL (s).
QUOTA_LUA = (
    RESERVED_LUA
    + """
local function lapse(counter, entries, now)
  local gone = redis.call('ZRANGEBYSCORE', entries, '-inf', now, 'LIMIT', 0, LAPSE_BATCH)
  if #gone == 0 then return end
  local tokens = 0
  for i = 1, #gone do tokens = tokens + (tonumber(string.match(gone[i], ':(%d+)$')) or 0) end
  redis.call('ZREM', entries, unpack(gone))
  take_off(counter, entries, tokens)
end
-- a refusal where the month's metered tokens and the reserved ones (this month's and the last's: requests admitted
-- then are metered now) leave no room for `cost` (nor for anything, at 0)
local function over_quota(quota, cost, now)
  lapse(KEYS[3], KEYS[4], now)
  lapse(KEYS[5], KEYS[6], now)
  local used = tonumber(redis.call('GET', KEYS[2])) or 0
  local held = (tonumber(redis.call('GET', KEYS[3])) or 0) + (tonumber(redis.call('GET', KEYS[5])) or 0)
  if used + held + math.max(cost, 1) > quota then
    return {'quota', tostring(quota), tostring(used), tostring(held)}
  end
  return nil
end
local function reserve(cost, now)
  redis.call('INCRBY', KEYS[3], cost)
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[2] .. ':' .. cost)
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[4]))
  redis.call('EXPIRE', KEYS[4], tonumber(ARGV[4]))
end
-- the buckets' levels now (KEYS[1]), refilled since their last change; a missing key reads as full
local function levels(rpm, tpm, now)
  local s = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts')
  if not s[3] then return rpm, tpm end
  local dt = math.max(0, now - tonumber(s[3]))
  return math.min(rpm, tonumber(s[1]) + dt * rpm / 60000), math.min(tpm, tonumber(s[2]) + dt * tpm / 60000)
end
local function store(req, tok, now)
  redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now))
  -- an untouched bucket is full again after a minute: the key may go, and a missing key reads as full
  redis.call('PEXPIRE', KEYS[1], 60000)
end
""".replace("LAPSE_BATCH", str(LAPSE_BATCH))
)

# KEYS[1] = preft:limits:<t> (bucket levels; the tenant's limits: `tenant_key()`), KEYS[2..6] as QUOTA_LUA's;
# ARGV[1] = tokens to take (and to reserve, where the tenant has a quota), ARGV[2..4] as QUOTA_LUA's.
TAKE_LUA = (
    QUOTA_LUA
    + """
local lim = redis.call('HMGET', tenant_key(), 'requests_per_min', 'tokens_per_min', 'tokens_per_month')
local rpm, tpm, quota = tonumber(lim[1]), tonumber(lim[2]), tonumber(lim[3]) or 0
if not rpm or not tpm then return {'no_tenant'} end
local cost = tonumber(ARGV[1])
local now = clock()
if quota > 0 then
  local refused = over_quota(quota, cost, now)
  if refused then return refused end
end
if cost > tpm then return {'too_large', tostring(tpm)} end
local req, tok = levels(rpm, tpm, now)
if req < 1 or tok < cost then
  local wait_req, wait_tok = 0, 0
  if req < 1 then wait_req = (1 - req) * 60000 / rpm end
  if tok < cost then wait_tok = (cost - tok) * 60000 / tpm end
  local which = 'requests'
  if wait_tok > wait_req then which = 'tokens' end
  return {'limited', tostring(math.max(wait_req, wait_tok)), which}
end
req, tok = req - 1, tok - cost
store(req, tok, now)
local reserved = '0'
if quota > 0 and cost > 0 then reserve(cost, now); reserved = '1' end
return {'ok', tostring(math.floor(req)), tostring(math.floor(tok)), tostring(rpm), tostring(tpm), reserved}
"""
)

# KEYS[1..6] as TAKE_LUA's, KEYS[7] / KEYS[8] = the reserved tokens / reservations holding the settled admission's
# entry (unused where it has none); ARGV[1..4] as TAKE_LUA's (ARGV[1]: the tokens the request takes in all), ARGV[5] =
# the tokens the admission took, ARGV[6] = '1' where it holds a reservation. Settling an admission made on an estimate:
# the difference is taken from the token bucket (or given back), no request more, and the reservation becomes one of
# the new tokens; a refusal changes nothing (the admission stands).
SETTLE_LUA = (
    QUOTA_LUA
    + """
local lim = redis.call('HMGET', tenant_key(), 'requests_per_min', 'tokens_per_min', 'tokens_per_month')
local rpm, tpm, quota = tonumber(lim[1]), tonumber(lim[2]), tonumber(lim[3]) or 0
if not rpm or not tpm then return {'no_tenant'} end
local cost, took, held = tonumber(ARGV[1]), tonumber(ARGV[5]), ARGV[6] == '1'
local more = cost - took
local now = clock()
if quota > 0 then
  -- (its reservation already counts among the held tokens)
  local unreserved = cost
  if held then unreserved = more end
  if unreserved > 0 then
    local refused = over_quota(quota, unreserved, now)
    if refused then return refused end
  end
end
if cost > tpm then return {'too_large', tostring(tpm)} end
local req, tok = levels(rpm, tpm, now)
if more > 0 and tok < more then
  return {'limited', tostring((more - tok) * 60000 / tpm), 'tokens'}
end
tok = math.min(tpm, tok - more)
store(req, tok, now)
if held and redis.call('ZREM', KEYS[8], ARGV[2] .. ':' .. took) == 1 then take_off(KEYS[7], KEYS[8], took) end
local reserved = '0'
if quota > 0 and cost > 0 then reserve(cost, now); reserved = '1' end
return {'ok', tostring(math.floor(req)), tostring(math.floor(tok)), tostring(rpm), tostring(tpm), reserved}
"""
)

# KEYS and ARGV as TAKE_LUA's: admission of offline work (a batch's line), which takes from no bucket; only a tenant
# that is gone or disabled, or whose monthly quota has no room for the line, is refused.
OFFLINE_LUA = (
    QUOTA_LUA
    + """
local lim = redis.call('HMGET', tenant_key(), 'requests_per_min', 'tokens_per_month', 'disabled')
if not lim[1] then return {'no_tenant'} end
if lim[3] == '1' then return {'disabled'} end
local quota, cost = tonumber(lim[2]) or 0, tonumber(ARGV[1])
if quota <= 0 then return {'ok', '0'} end
local now = clock()
local refused = over_quota(quota, cost, now)
if refused then return refused end
if cost <= 0 then return {'ok', '0'} end
reserve(cost, now)
return {'ok', '1'}
"""
)

# KEYS[1] as TAKE_LUA's, then (where the request holds a reservation) KEYS[2], KEYS[3] = its month's reserved
# tokens and reservations; ARGV[1] = tokens to give back to the bucket (never above its size; 0: none), ARGV[2] = the
# reservation's id, ARGV[3] = its tokens, ARGV[4] = the tokens its request used (held until they are metered),
# ARGV[5] = the hold (ms), ARGV[6] = the keys' TTL (s). A reservation already lapsed is left alone.
REFUND_LUA = (
    RESERVED_LUA
    + """
local give = tonumber(ARGV[1])
if give > 0 then
  local tpm = tonumber(redis.call('HGET', tenant_key(), 'tokens_per_min'))
  local tok = redis.call('HGET', KEYS[1], 'tok')
  if tpm and tok then redis.call('HSET', KEYS[1], 'tok', tostring(math.min(tpm, tonumber(tok) + give))) end
end
if #KEYS < 3 then return 1 end
local cost, used = tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('ZREM', KEYS[3], ARGV[2] .. ':' .. cost) == 0 then return 0 end
if used > 0 then
  redis.call('ZADD', KEYS[3], clock() + tonumber(ARGV[5]), ARGV[2] .. ':' .. used)
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[6]))
end
take_off(KEYS[2], KEYS[3], cost - used)
return 1
"""
)


def reserved_key(tenant: str, day: date) -> str:
    """The counter of the tokens the tenant's requests hold reserved against its quota for the UTC month of `day`."""
    return f"preft:quota-reserved:{tenant}:{day:%Y-%m}"


def reservations_key(tenant: str, day: date) -> str:
    """The sorted set of the tenant's reservations (`<id>:<tokens>`, scored by their lapse in Unix ms) for the UTC
    month of `day`."""
    return f"preft:quota-reservations:{tenant}:{day:%Y-%m}"


@dataclass(frozen=True)
class Reservation:
    """Tokens one request holds against its tenant's monthly quota: its entry's id and tokens, and its month's keys
    (`reserved_key`, `reservations_key`)."""

    entry_id: str
    tokens: int
    keys: tuple[str, str]


@dataclass(frozen=True)
class Admission:
    """A request let through: what it reserved (from the bucket; against the monthly quota, where the tenant has
    one), and the buckets' state for the x-ratelimit-* headers."""

    tenant: str
    tokens_reserved: int
    requests_limit: int
    requests_remaining: int
    tokens_limit: int
    tokens_remaining: int
    reservation: Reservation | None = None

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers: each bucket's size per minute, what is left in it after this request, and
        how long until it is full again (it refills continuously, limit/60 per second)."""
        return {
            "x-ratelimit-limit-requests": str(self.requests_limit),
            "x-ratelimit-remaining-requests": str(self.requests_remaining),
            "x-ratelimit-reset-requests": reset_duration(self.requests_limit, self.requests_remaining),
            "x-ratelimit-limit-tokens": str(self.tokens_limit),
            "x-ratelimit-remaining-tokens": str(self.tokens_remaining),
            "x-ratelimit-reset-tokens": reset_duration(self.tokens_limit, self.tokens_remaining),
        }


def reset_duration(per_min: int, remaining: int) -> str:
    """How long a bucket of `per_min` with `remaining` left takes to refill, as OpenAI writes it (`20ms`, `1.5s`,
    `6m0s`)."""
    ms = math.ceil(max(per_min - remaining, 0) * 60_000 / per_min) if per_min > 0 else 0
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


class RateLimiter:
    """Owns the per-tenant buckets and monthly quota reservations: admit (take a request, reserve tokens) and release
    (give unused tokens back, hold the used ones until metered)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        redis_timeout_s: float,
        reservation_lapse_s: float = 3600.0,
        meter_interval_s: float = 1.0,
    ) -> None:
        self._take = redis.register_script(TAKE_LUA)
        self._settle = redis.register_script(SETTLE_LUA)
        self._offline = redis.register_script(OFFLINE_LUA)
        self._refund = redis.register_script(REFUND_LUA)
        self._timeout_s = redis_timeout_s
        self._lapse_ms = int(reservation_lapse_s * 1000)
        # an ended request's record waits one flush interval at most, and its flush one Redis deadline; one more
        # interval of margin
        self.hold_s = HOLD_FLUSHES * meter_interval_s + redis_timeout_s

    async def admit(self, tenant: str, tokens: int, *, request_id: str = "") -> Admission:
        """Take one request and `tokens` tokens from the tenant's buckets, and reserve them against its monthly quota
        (where it has one), or raise RateLimited / QuotaExceeded (429)."""
        entry_id = request_id or uuid.uuid4().hex
        keys = _keys(tenant)
        res = await guarded(self._take(keys=keys, args=self._args(tokens, entry_id)), self._timeout_s)
        if res[0] == "ok":
            reservation = Reservation(entry_id, tokens, (keys[2], keys[3])) if res[5] == "1" else None
            return Admission(tenant, tokens, int(res[3]), int(res[1]), int(res[4]), int(res[2]), reservation)
        raise self._refusal(tenant, tokens, res)

    async def settle(self, admission: Admission, tokens: int, *, request_id: str) -> Admission:
        """The admission of a request charged an estimate before its prompt was tokenized, corrected to `tokens`: the
        difference taken from the token bucket (or given back) and its quota reservation made one of `tokens`, or
        RateLimited / QuotaExceeded (429) where the difference does not fit; then `admission` still stands (the
        caller releases it)."""
        keys = _keys(admission.tenant)
        held = admission.reservation
        entry_id = held.entry_id if held is not None else request_id or uuid.uuid4().hex
        args = [*self._args(tokens, entry_id), admission.tokens_reserved, "1" if held is not None else "0"]
        script = self._settle(keys=[*keys, *(held.keys if held is not None else keys[2:4])], args=args)
        res = await guarded(script, self._timeout_s)
        if res[0] == "ok":
            reservation = Reservation(entry_id, tokens, (keys[2], keys[3])) if res[5] == "1" else None
            return Admission(admission.tenant, tokens, int(res[3]), int(res[1]), int(res[4]), int(res[2]), reservation)
        raise self._refusal(admission.tenant, tokens, res)

    async def admit_offline(self, tenant: str, tokens: int = 0, *, request_id: str = "") -> Admission:
        """Admit offline work (a batch's line): it takes from no bucket, but reserves `tokens` against the tenant's
        monthly quota as any request (QuotaExceeded where they do not fit), and is refused where the tenant is gone
        or disabled."""
        entry_id = request_id or uuid.uuid4().hex
        keys = _keys(tenant)
        res = await guarded(self._offline(keys=keys, args=self._args(tokens, entry_id)), self._timeout_s)
        if res[0] == "ok":
            reservation = Reservation(entry_id, tokens, (keys[2], keys[3])) if res[1] == "1" else None
            return Admission(tenant, 0, 0, 0, 0, 0, reservation)
        if res[0] == "disabled":
            raise PermissionDenied(f"tenant {tenant!r} is disabled")
        raise self._refusal(tenant, tokens, res)

    def _args(self, tokens: int, entry_id: str) -> list[str | int]:
        return [tokens, entry_id, self._lapse_ms, KEYS_TTL_S]

    def _refusal(self, tenant: str, tokens: int, res: list[str]) -> PreftError:
        """Why the admission script refused."""
        if res[0] == "limited":
            wait_s = float(res[1]) / 1000
            return RateLimited(
                f"Rate limit reached for {res[2]} per minute (tenant {tenant!r}); retry in {wait_s:.1f} s.",
                retry_after_s=wait_s,
                bucket="tokens" if res[2] == "tokens" else "requests",
            )
        if res[0] == "quota":
            return _quota_refusal(tenant, tokens, int(res[1]), int(res[2]), int(res[3]))
        if res[0] == "too_large":
            return RateLimited(
                f"This request needs {tokens} tokens (prompt + max_tokens), more than the tenant's limit of "
                f"{res[1]} tokens per minute; lower max_tokens or shorten the prompt.",
                retry_after_s=None,
                bucket="tokens",
            )
        return InvalidApiKey(f"tenant {tenant!r} no longer exists")

    async def release(self, admission: Admission, *, unused: int, used: int, later_s: float = 0.0) -> None:
        """Give `unused` tokens back to the bucket, and shrink the request's quota reservation (if any) to the `used`
        tokens the meter will add, held `hold_s` (and `later_s` more, where they reach the meter that much later: a
        batch line's, with its part); best effort (a failure only makes the limits stricter for a while: the bucket
        refills, the reservation lapses)."""
        unused = max(unused, 0)
        reservation = admission.reservation
        if reservation is None:
            if not unused:
                return
            keys, args = _keys(admission.tenant)[:1], [unused]
        else:
            keys = [*_keys(admission.tenant)[:1], *reservation.keys]
            hold_ms = int((self.hold_s + later_s) * 1000)
            args = [unused, reservation.entry_id, reservation.tokens, max(used, 0), hold_ms, KEYS_TTL_S]
        try:
            await guarded(self._refund(keys=keys, args=args), self._timeout_s)
        except Unavailable:
            if reservation is None:
                log.debug("token refund for tenant %s dropped: Redis unavailable", admission.tenant)
            else:
                log.warning(
                    "quota reservation %s of tenant %s not released (Redis unavailable): it lapses by itself",
                    reservation.entry_id,
                    admission.tenant,
                )


def _quota_refusal(tenant: str, tokens: int, quota: int, used: int, held: int) -> QuotaExceeded:
    """The 429 of a tenant whose month has no room for the request, counting its requests in flight."""
    month = metering.day_of(time.time())
    renews = "the quota renews at the start of next month, or when it is raised."
    if used >= quota:
        return QuotaExceeded(f"Tenant {tenant!r} has used its {quota:,} tokens for {month:%Y-%m} (UTC); {renews}")
    return QuotaExceeded(
        f"Tenant {tenant!r} has used {used:,} of its {quota:,} tokens for {month:%Y-%m} (UTC), and its requests in "
        f"flight hold {held:,} more reserved (what they may still use); this request may use {tokens:,} (prompt + "
        f"max_tokens), more than is left. Lower max_tokens, wait for the requests in flight to end, or wait: {renews}"
    )


def _keys(tenant: str) -> list[str]:
    """The admission scripts' keys (TAKE_LUA's) for the tenant, now."""
    day = metering.day_of(time.time())
    last_month = day.replace(day=1) - timedelta(days=1)
    return [
        LIMITS_PREFIX + tenant,
        metering.month_key(tenant, day),
        reserved_key(tenant, day),
        reservations_key(tenant, day),
        reserved_key(tenant, last_month),
        reservations_key(tenant, last_month),
    ]
