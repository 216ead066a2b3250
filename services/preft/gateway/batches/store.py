"""Batches (OpenAI's Batch API) as Redis holds them: their state, their answered lines, and who runs them.

Keys, per batch: `preft:batch:<tenant>:<id>` (a hash: `spec`, the JSON of what was asked; `status` and its
timestamps; the request counts and tokens; the output and error file ids; a failed batch's `errors`),
`preft:batch-done:<tenant>:<id>` (a bitmap: bit i set once request i's answer is recorded),
`preft:batch-parts:<tenant>:<id>` (a list: the names of the recorded parts, in the order they were recorded; the
answers themselves are in S3, ``batches.parts``) and `preft:batch-lease:<tenant>:<id>` (the runner's lease: its
replica's token, expiring unless renewed). Per tenant, `preft:batches:<tenant>` (its batches by creation, for
listing) and `preft:batches-open:<tenant>` (its batches not ended yet: what its limits count); for all,
`preft:batches-open` (`<tenant>:<id>` of each batch not ended yet, oldest first: what replicas look for work in)
and `preft:batches-started` (each tenant's last batch taken by a runner: whose turn it is).

Every write a runner makes checks its lease in the same script (a fence): a replica that lost its lease (stopped
for longer than it, say) writes nothing more. A part is recorded in one script: each of its lines sets its bit and,
where the bit was not set, adds to the counts and its generations' tokens to the tenant's usage (the meter's keys), so
a line answered twice counts once and is metered once. A compaction swaps a run of
recorded parts for their merge (in their place in the list; the same lines) in one script, only where the list still
holds that run there. A batch that ends forgets its bitmap, parts and lease, leaves the open set, and is kept
`keep_s` more.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.client import NEVER_DECODE

from preft.common import metering
from preft.common.errors import InvalidArgument, NotFound, ResourceExhausted
from preft.gateway.core.metering import MONTH_TTL_S, WINDOW_TTLS_S, Metered, window_keys
from preft.gateway.core.redis_client import guarded

BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
OPEN_KEY = "preft:batches-open"
STARTED_KEY = "preft:batches-started"
STATUSES_OPEN = ("validating", "in_progress", "finalizing", "cancelling")
Claim = Literal["taken", "held", "tenant_busy"]  # (tenant_busy: as many of its batches run as may)
TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

# KEYS[1] = the batch; ARGV[1] = now (s). The status it then has (cancelling where it was asked in time), or nil.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  return 'cancelling'
end
return status
"""
# KEYS[1] = the batch, KEYS[2] = the tenant's index, KEYS[3] = the open set, KEYS[4] = the tenant's open set;
# ARGV[1] = its spec (JSON), ARGV[2] = created (ms), ARGV[3] = its id, ARGV[4] = its member in the open set,
# ARGV[5] = the most batches the tenant may have open. -1 when stored, else the batches it has open.
_CREATE = """
local open = redis.call('ZCARD', KEYS[4])
if open >= tonumber(ARGV[5]) then return open end
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'status', 'validating')
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[3])
return -1
"""
# KEYS[1] = the batch's lease, KEYS[2] = when each tenant's batch last started, then the leases of the tenant's
# other open batches; ARGV[1] = the runner's token, ARGV[2] = the lease (ms), ARGV[3] = the most batches of the
# tenant that may run at once (0: no limit), ARGV[4] = the tenant, ARGV[5] = now (ms). 1: taken; 0: another runner
# holds it; -1: the tenant has as many running as it may.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local most = tonumber(ARGV[3])
if most > 0 then
  local running = 0
  for i = 3, #KEYS do running = running + redis.call('EXISTS', KEYS[i]) end
  if running >= most then return -1 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
return 1
"""
# KEYS[1] = the lease, KEYS[2] = the batch; ARGV[1] = the runner's token, ARGV[2] = the lease (ms). The batch's
# status, or nil where the lease is not this runner's.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('HGET', KEYS[2], 'status') or 'gone'
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""
# KEYS[1] = the lease, KEYS[2] = the batch, KEYS[3] = its done lines (bitmap), KEYS[4] = its parts (list), KEYS[5..7]
# = the tenant's usage hashes of this minute, hour and day, KEYS[8] = its month's token counter; ARGV[1] = the
# runner's token, ARGV[2] = the part's name, ARGV[3..6] = the TTLs (s) of KEYS[5..8], ARGV[7] = how many models the
# lines were metered on, then per model its three usage fields (requests, input and output tokens); then per line its
# request index, the count it adds to (completed or failed), its input and output tokens, how many generations it
# metered, and per generation its model's number (from 1), input and output tokens. A line not recorded before adds
# to the batch's counts and its generations to the usage (the meter's layout, ``metering.APPLY_LUA``). The lines
# newly recorded; -1: the lease is not the runner's.
_RECORD_PART = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local names = {'completed', 'failed', 'input_tokens', 'output_tokens'}
local added = {completed = 0, failed = 0, input_tokens = 0, output_tokens = 0}
local fields, metered = {}, {}
local a = 8
for m = 1, tonumber(ARGV[7]) do
  fields[m] = {ARGV[a], ARGV[a + 1], ARGV[a + 2]}; a = a + 3
end
local new = 0
while a <= #ARGV do
  local generations = tonumber(ARGV[a + 4])
  if redis.call('SETBIT', KEYS[3], ARGV[a], 1) == 0 then
    new = new + 1
    added[ARGV[a + 1]] = added[ARGV[a + 1]] + 1
    added.input_tokens = added.input_tokens + tonumber(ARGV[a + 2])
    added.output_tokens = added.output_tokens + tonumber(ARGV[a + 3])
    for g = a + 5, a + 2 + 3 * generations, 3 do
      local m = tonumber(ARGV[g])
      local counts = metered[m] or {0, 0, 0}
      counts[1] = counts[1] + 1
      counts[2] = counts[2] + tonumber(ARGV[g + 1])
      counts[3] = counts[3] + tonumber(ARGV[g + 2])
      metered[m] = counts
    end
  end
  a = a + 5 + 3 * generations
end
for _, name in ipairs(names) do
  if added[name] > 0 then redis.call('HINCRBY', KEYS[2], name, added[name]) end
end
local tokens = 0
for m, counts in pairs(metered) do
  for k = 5, 7 do
    for c = 1, 3 do
      if counts[c] > 0 then redis.call('HINCRBY', KEYS[k], fields[m][c], counts[c]) end
    end
  end
  tokens = tokens + counts[2] + counts[3]
end
if next(metered) then
  for k = 5, 7 do redis.call('EXPIRE', KEYS[k], tonumber(ARGV[k - 2])) end
  redis.call('INCRBY', KEYS[8], tokens)
  redis.call('EXPIRE', KEYS[8], tonumber(ARGV[6]))
end
redis.call('RPUSH', KEYS[4], ARGV[2])
return new
"""
# KEYS[1] = the lease, KEYS[2] = its parts (list); ARGV[1] = the runner's token, ARGV[2] = the merged part's name,
# ARGV[3] = where the parts merged are in the list (from 0), then their names in order. 1: the merged part is in their
# place; 0: the list no longer holds them there (nothing changed); -1: the lease is not the runner's.
_SWAP_PARTS = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local start = tonumber(ARGV[3])
local count = #ARGV - 3
local found = redis.call('LRANGE', KEYS[2], start, start + count - 1)
if count < 1 or #found ~= count then return 0 end
for i = 1, count do
  if found[i] ~= ARGV[i + 3] then return 0 end
end
redis.call('LSET', KEYS[2], start, ARGV[2])
if count > 1 then
  for i = start + 1, start + count - 1 do redis.call('LSET', KEYS[2], i, '') end
  redis.call('LREM', KEYS[2], count - 1, '')
end
return 1
"""
# KEYS[1] = the lease, KEYS[2] = the batch, KEYS[3] = its done lines, KEYS[4] = the open set, KEYS[5] = the
# tenant's open set, KEYS[6] = its parts; ARGV[1] = the runner's token, ARGV[2] = the statuses it may move from
# (space-separated), ARGV[3] = the new status, ARGV[4] = "1" where the batch ends with it, ARGV[5] = how long an
# ended batch is kept (ms), ARGV[6] = its member in the open set, ARGV[7] = its id, then field and value pairs to
# set. {1}: moved; {0, status}: its status was another; {-1}: the lease is not the runner's.
_MOVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {-1} end
local status = redis.call('HGET', KEYS[2], 'status')
local allowed = false
for s in string.gmatch(ARGV[2], '%S+') do
  if s == status then allowed = true end
end
if not allowed then return {0, status or 'gone'} end
redis.call('HSET', KEYS[2], 'status', ARGV[3])
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
if ARGV[4] == '1' then
  redis.call('DEL', KEYS[1], KEYS[3], KEYS[6])
  redis.call('ZREM', KEYS[4], ARGV[6])
  redis.call('ZREM', KEYS[5], ARGV[7])
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end
return {1}
"""


class LeaseLost(Exception):
    """This runner's lease on a batch is gone (another replica may run it now): it must write nothing more."""


@dataclass(frozen=True)
class BatchRecord:
    """A batch as stored: what was asked (`spec`) and how it stands (the hash's other fields)."""

    tenant: str
    spec: dict[str, Any]
    fields: dict[str, str]

    @property
    def id(self) -> str:
        return self.spec["id"]

    @property
    def status(self) -> str:
        return self.fields["status"]

    @property
    def endpoint(self) -> str:
        return self.spec["endpoint"]

    @property
    def expires_at(self) -> int:
        return self.spec["expires_at"]

    def count(self, name: str) -> int:
        return int(self.fields.get(name) or 0)

    def as_object(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        f, spec = self.fields, self.spec
        input_tokens, output_tokens = self.count("input_tokens"), self.count("output_tokens")
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": json.loads(f["errors"])} if f.get("errors") else None,
            "input_file_id": spec["input_file_id"],
            "completion_window": spec["completion_window"],
            "status": self.status,
            "output_file_id": f.get("output_file_id") or None,
            "error_file_id": f.get("error_file_id") or None,
            "created_at": spec["created_at"],
            "expires_at": spec["expires_at"],
            **{name: int(f[name]) if f.get(name) else None for name in TIMESTAMPS},
            "request_counts": {
                "total": self.count("total"),
                "completed": self.count("completed"),
                "failed": self.count("failed"),
            },
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            },
            "metadata": spec.get("metadata") or None,
            "model": None,
        }


@dataclass(frozen=True)
class BatchPage:
    batches: list[BatchRecord]
    has_more: bool


def member(tenant: str, batch_id: str) -> str:
    """A batch's entry in the open set."""
    return f"{tenant}:{batch_id}"


def split_member(entry: str) -> tuple[str, str]:
    tenant, _, batch_id = entry.rpartition(":")
    return tenant, batch_id


class BatchStore:
    """Owns the batches' Redis keys; reading or cancelling another tenant's batch is a NotFound."""

    def __init__(self, redis: aioredis.Redis, *, timeout_s: float, keep_s: float, max_open_per_tenant: int) -> None:
        self._redis = redis
        self._timeout_s = timeout_s
        self.keep_s = keep_s
        self.max_open_per_tenant = max_open_per_tenant
        self._create = redis.register_script(_CREATE)
        self._claim = redis.register_script(_CLAIM)
        self._cancel = redis.register_script(_CANCEL)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._record_part = redis.register_script(_RECORD_PART)
        self._swap_parts = redis.register_script(_SWAP_PARTS)
        self._move = redis.register_script(_MOVE)

    @staticmethod
    def _key(tenant: str, batch_id: str) -> str:
        return f"preft:batch:{tenant}:{batch_id}"

    @staticmethod
    def _done_key(tenant: str, batch_id: str) -> str:
        return f"preft:batch-done:{tenant}:{batch_id}"

    @staticmethod
    def _parts_key(tenant: str, batch_id: str) -> str:
        return f"preft:batch-parts:{tenant}:{batch_id}"

    @staticmethod
    def _lease_key(tenant: str, batch_id: str) -> str:
        return f"preft:batch-lease:{tenant}:{batch_id}"

    @staticmethod
    def _index(tenant: str) -> str:
        return f"preft:batches:{tenant}"

    @staticmethod
    def _open_index(tenant: str) -> str:
        return f"preft:batches-open:{tenant}"

    @staticmethod
    def _missing(batch_id: str) -> NotFound:
        return NotFound(f"No such Batch object: {batch_id}")

    async def _guarded(self, operation: Any) -> Any:
        return await guarded(operation, self._timeout_s)

    # -- what the routes do ---------------------------------------------------------------------------------------

    async def create(self, tenant: str, spec: dict[str, Any]) -> BatchRecord:
        """Store a new batch, validating, and make it open (for a runner to take); ResourceExhausted (nothing
        stored) where the tenant has as many batches open as it may."""
        fields = {"spec": json.dumps(spec, separators=(",", ":")), "status": "validating"}
        batch_id = spec["id"]
        keys = [self._key(tenant, batch_id), self._index(tenant), OPEN_KEY, self._open_index(tenant)]
        args = [fields["spec"], int(time.time() * 1000), batch_id, member(tenant, batch_id), self.max_open_per_tenant]
        open_now = await self._guarded(self._create(keys=keys, args=args))
        if open_now != -1:
            raise ResourceExhausted(
                f"this tenant has {open_now} batches not ended yet, as many as it may; wait for one to end, or "
                "cancel one"
            )
        return BatchRecord(tenant, spec, fields)

    async def get(self, tenant: str, batch_id: str) -> BatchRecord:
        if not BATCH_ID.match(batch_id):
            raise self._missing(batch_id)
        fields = await self._guarded(self._redis.hgetall(self._key(tenant, batch_id)))
        if not fields:
            raise self._missing(batch_id)
        return BatchRecord(tenant, json.loads(fields["spec"]), fields)

    async def find(self, tenant: str, batch_id: str) -> BatchRecord | None:
        try:
            return await self.get(tenant, batch_id)
        except NotFound:
            return None

    async def cancel(self, tenant: str, batch_id: str) -> None:
        """Ask for the batch to be cancelled (where it still runs); NotFound where there is no such batch."""
        if not BATCH_ID.match(batch_id):
            raise self._missing(batch_id)
        status = await self._guarded(self._cancel(keys=[self._key(tenant, batch_id)], args=[int(time.time())]))
        if status is None:
            raise self._missing(batch_id)

    async def page(self, tenant: str, *, after: str | None, limit: int) -> BatchPage:
        """Up to `limit` of the tenant's batches, newest first, after the batch `after`."""
        index = self._index(tenant)
        start = 0
        if after is not None:
            at = await self._guarded(self._redis.zrevrank(index, after))
            if at is None:
                raise InvalidArgument(f"after: {after!r} is not one of your batches")
            start = at + 1
        ids = await self._guarded(self._redis.zrange(index, start, start + limit, desc=True))
        pipe = self._redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(self._key(tenant, batch_id))
        found, stale = [], []
        for batch_id, fields in zip(ids, await self._guarded(pipe.execute()) if ids else [], strict=True):
            if fields:
                found.append(BatchRecord(tenant, json.loads(fields["spec"]), fields))
            else:  # (an ended batch kept its time and went; its index entry goes now)
                stale.append(batch_id)
        if stale:
            await self._guarded(self._redis.zrem(index, *stale))
        return BatchPage(found[:limit], len(ids) > limit)

    # -- what runners do ------------------------------------------------------------------------------------------

    async def open_batches(self, count: int, *, start: int = 0) -> list[tuple[str, str]]:
        """(tenant, batch id) of up to `count` batches not ended yet, oldest first, from the `start`-th."""
        entries = await self._guarded(self._redis.zrange(OPEN_KEY, start, start + count - 1))
        return [split_member(e) for e in entries]

    async def forget_open(self, tenant: str, batch_id: str) -> None:
        """Take a batch whose record is gone out of the open sets."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.zrem(OPEN_KEY, member(tenant, batch_id))
        pipe.zrem(self._open_index(tenant), batch_id)
        await self._guarded(pipe.execute())

    async def held(self, batches: list[tuple[str, str]]) -> list[bool]:
        """Whether some runner holds each batch's lease."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant, batch_id in batches:
            pipe.exists(self._lease_key(tenant, batch_id))
        return [bool(n) for n in await self._guarded(pipe.execute())] if batches else []

    async def claim(self, tenant: str, batch_id: str, token: str, lease_s: float, *, max_running: int) -> Claim:
        """Take the batch's lease where no runner holds it and fewer than `max_running` of the tenant's batches run
        (0: no limit)."""
        others = [] if max_running <= 0 else await self._guarded(self._redis.zrange(self._open_index(tenant), 0, -1))
        keys = [self._lease_key(tenant, batch_id), STARTED_KEY]
        keys += [self._lease_key(tenant, i) for i in others if i != batch_id]
        args = [token, int(lease_s * 1000), max_running, tenant, int(time.time() * 1000)]
        return {1: "taken", 0: "held"}.get(await self._guarded(self._claim(keys=keys, args=args)), "tenant_busy")

    async def last_started(self, tenants: Iterable[str]) -> dict[str, int]:
        """When a batch of each tenant was last taken by a runner (ms; 0 for never)."""
        names = sorted(set(tenants))
        started = await self._guarded(self._redis.hmget(STARTED_KEY, names)) if names else []
        return {tenant: int(ms or 0) for tenant, ms in zip(names, started, strict=True)}

    async def renew(self, batches: list[tuple[str, str]], token: str, lease_s: float) -> list[str | None]:
        """Renew this runner's leases; each batch's status (`gone` where its record went), or None where the lease
        is not this runner's any more."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant, batch_id in batches:
            keys = [self._lease_key(tenant, batch_id), self._key(tenant, batch_id)]
            await self._renew(keys=keys, args=[token, int(lease_s * 1000)], client=pipe)  # (queued)
        return await self._guarded(pipe.execute())

    async def release(self, tenant: str, batch_id: str, token: str) -> None:
        """Let go of the lease (where it is this runner's): another replica may take the batch at once."""
        await self._guarded(self._release(keys=[self._lease_key(tenant, batch_id)], args=[token]))

    async def done_lines(self, tenant: str, batch_id: str) -> DoneLines:
        """The request indexes whose answer is recorded."""
        bits = await self._guarded(
            self._redis.execute_command("GET", self._done_key(tenant, batch_id), **{NEVER_DECODE: []})
        )
        return DoneLines(bits or b"")

    async def record_part(self, batch: BatchRecord, token: str, name: str, lines: Sequence[LineRecord]) -> int:
        """Record a part written to S3 and its lines: each line's counts once, and its generations' tokens on the
        tenant's usage once (this minute's, as the meter counts), however often the line was answered; the lines newly
        recorded. LeaseLost where the lease is no longer this runner's."""
        now = int(time.time())
        windows = window_keys(batch.tenant, now // metering.MINUTE_S * metering.MINUTE_S)
        widths = ("minute", "hour", "day")  # (KEYS[5..7], and their TTLs ARGV[3..5])
        keys = [
            self._lease_key(batch.tenant, batch.id),
            self._key(batch.tenant, batch.id),
            self._done_key(batch.tenant, batch.id),
            self._parts_key(batch.tenant, batch.id),
            *(windows[width] for width in widths),
            metering.month_key(batch.tenant, metering.day_of(now)),
        ]
        models = list(dict.fromkeys(m.model for r in lines for m in r.metered))
        number = {model: n for n, model in enumerate(models, 1)}
        args: list[str | int] = [token, name, *(WINDOW_TTLS_S[width] for width in widths), MONTH_TTL_S]
        args += [len(models), *(metering.field(c, model) for model in models for c in metering.COUNTERS)]
        for r in lines:
            args += [r.index, r.counts_as, r.input_tokens, r.output_tokens, len(r.metered)]
            for m in r.metered:
                args += [number[m.model], m.input_tokens, m.output_tokens]
        new = await self._guarded(self._record_part(keys=keys, args=args))
        if new == -1:
            raise LeaseLost(batch.id)
        return new

    async def swap_parts(self, batch: BatchRecord, token: str, start: int, names: Sequence[str], merged: str) -> bool:
        """Put the part `merged` in place of the recorded parts `names` (at `start` in the list, in order); False,
        changing nothing, where the list no longer holds them there. LeaseLost where the lease is no longer this
        runner's. Counts and done lines stay: the merged part holds the same lines."""
        keys = [self._lease_key(batch.tenant, batch.id), self._parts_key(batch.tenant, batch.id)]
        swapped = await self._guarded(self._swap_parts(keys=keys, args=[token, merged, start, *names]))
        if swapped == -1:
            raise LeaseLost(batch.id)
        return swapped == 1

    async def parts(self, tenant: str, batch_id: str) -> list[str]:
        """The names of the batch's recorded parts, in the order they were recorded."""
        return await self._guarded(self._redis.lrange(self._parts_key(tenant, batch_id), 0, -1))

    async def move(
        self,
        batch: BatchRecord,
        token: str,
        *,
        from_statuses: tuple[str, ...],
        to: str,
        ends: bool = False,
        **fields: str | int,
    ) -> str | None:
        """Move the batch to status `to` (from one of `from_statuses`), setting `fields`; None where moved, else the
        status it had instead. LeaseLost where the lease is no longer this runner's."""
        keys = [
            self._lease_key(batch.tenant, batch.id),
            self._key(batch.tenant, batch.id),
            self._done_key(batch.tenant, batch.id),
            OPEN_KEY,
            self._open_index(batch.tenant),
            self._parts_key(batch.tenant, batch.id),
        ]
        args: list[str | int] = [token, " ".join(from_statuses), to, "1" if ends else "0", int(self.keep_s * 1000)]
        args += [member(batch.tenant, batch.id), batch.id]
        for name, value in fields.items():
            args += [name, value]
        reply = await self._guarded(self._move(keys=keys, args=args))
        if reply[0] == -1:
            raise LeaseLost(batch.id)
        return None if reply[0] == 1 else reply[1]


@dataclass(frozen=True)
class DoneLines:
    """The request indexes whose answer is recorded, as Redis's bitmap holds them (index 0: the first byte's
    highest bit)."""

    bits: bytes

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int) or index < 0 or index >> 3 >= len(self.bits):
            return False
        return bool(self.bits[index >> 3] & (0x80 >> (index & 7)))

    def __len__(self) -> int:
        return sum(byte.bit_count() for byte in self.bits)


@dataclass(frozen=True)
class LineRecord:
    """One line's result as recorded: the output or error file's line, and what it adds to the counts."""

    index: int
    file: str  # "output" or "error"
    line: dict[str, Any]
    input_tokens: int = 0
    output_tokens: int = 0
    metered: tuple[Metered, ...] = ()  # its generations' tokens, for the tenant's usage (``openai.generation``)

    @property
    def counts_as(self) -> str:
        return "completed" if self.file == "output" else "failed"
