"""The gateway's token meter: each answered generation's tokens, added to its tenant's UTC hour and day in Redis
(the layout of ``common.metering``), in batches.

`record` adds to counts held in memory; `run()` sends them every `interval_s` as one batch, which also adds each
tenant's tokens to its UTC month's counter (what admission checks a monthly quota against, ``limits``). A batch is
applied by one Lua script under a batch id that Redis remembers for a day, so a batch sent again (its first answer
lost to a timeout) is counted once. A batch that fails stays queued, with its id, and goes first at the next send:
while Redis is down the counts wait, up to `max_pending` (tenant, hour, model) entries in all; past that, new records
are dropped and counted (``preft_gateway_metering_dropped_total``). A clean shutdown sends what is left once more.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from preft.common import metering
from preft.common.errors import Unavailable
from preft.common.metrics import METERING_DROPPED
from preft.gateway.flushing import flush_every
from preft.gateway.redis_client import guarded

log = logging.getLogger(__name__)

BATCH_PREFIX = "preft:usage-batch:"
BATCH_MEMORY_S = 86_400  # how long Redis remembers a batch id (a batch re-sent within it is not counted again)
BATCH_ENTRIES = 1_000  # (tenant, hour, model) entries a batch holds at most: one script's work stays short

# KEYS[1] = the batch id's key, then the H hashes (days' and hours'), then the month counters; ARGV[1] = the batch
# id's TTL (s), ARGV[2] = H, ARGV[3] = the month counters' TTL; then per hash its TTL, how many (field, increment)
# pairs follow, and the pairs; then per month counter its increment. 0 when the batch was applied before.
APPLY_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[1])) then return 0 end
local hashes, a = tonumber(ARGV[2]), 4
for k = 2, hashes + 1 do
  local ttl, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]); a = a + 2
  for i = 1, n do
    redis.call('HINCRBY', KEYS[k], ARGV[a], ARGV[a + 1]); a = a + 2
  end
  redis.call('EXPIRE', KEYS[k], ttl)
end
for k = hashes + 2, #KEYS do
  redis.call('INCRBY', KEYS[k], ARGV[a]); a = a + 1
  redis.call('EXPIRE', KEYS[k], tonumber(ARGV[3]))
end
return 1
"""

Entry = tuple[str, int, str]  # tenant, the UTC hour's start (Unix s), model


@dataclass
class Batch:
    """Counts to add, per (tenant, hour, model): requests, input tokens, output tokens; sent under one id."""

    counts: dict[Entry, list[int]] = field(default_factory=dict)
    batch_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def script_args(self) -> tuple[list[str], list[str | int]]:
        """The apply script's keys and arguments."""
        hashes: dict[str, tuple[int, list[str | int]]] = {}  # key: (TTL, field and increment pairs)
        by_month: dict[str, int] = {}
        day_ttl, hour_ttl = metering.RETENTION_DAYS * metering.DAY_S, metering.HOUR_RETENTION_DAYS * metering.DAY_S
        for (tenant, hour, model), values in self.counts.items():
            day = metering.day_of(hour)
            pairs = [
                item
                for counter, value in zip(metering.COUNTERS, values, strict=True)
                if value
                for item in (metering.field(counter, model), value)
            ]
            hashes.setdefault(metering.day_key(tenant, day), (day_ttl, []))[1].extend(pairs)
            hashes.setdefault(metering.hour_key(tenant, hour), (hour_ttl, []))[1].extend(pairs)
            month = metering.month_key(tenant, day)
            by_month[month] = by_month.get(month, 0) + values[1] + values[2]
        keys = [BATCH_PREFIX + self.batch_id, *hashes, *by_month]
        args: list[str | int] = [BATCH_MEMORY_S, len(hashes), metering.MONTH_TTL_DAYS * metering.DAY_S]
        for ttl, pairs in hashes.values():
            args += [ttl, len(pairs) // 2, *pairs]
        return keys, args + list(by_month.values())


class TokenMeter:
    """Owns the counts not yet in Redis: the batch being filled and the batches that failed to send."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        interval_s: float,
        timeout_s: float,
        max_pending: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._apply = redis.register_script(APPLY_LUA)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._clock = clock
        self._filling = Batch()
        self._unsent: list[Batch] = []

    @property
    def pending(self) -> int:
        """(tenant, hour, model) entries held: the batch being filled and the unsent ones."""
        return len(self._filling.counts) + sum(len(b.counts) for b in self._unsent)

    def record(self, tenant: str, model: str, input_tokens: int, output_tokens: int) -> None:
        """One answered request of `tenant` on `model`, on this UTC hour's (and day's) counts."""
        entry = (tenant, int(self._clock()) // metering.HOUR_S * metering.HOUR_S, model)
        counts = self._filling.counts.get(entry)
        if counts is None:
            if self.pending >= self._max_pending:
                METERING_DROPPED.inc()
                return
            if len(self._filling.counts) >= BATCH_ENTRIES:
                self._unsent.append(self._filling)
                self._filling = Batch()
            counts = self._filling.counts[entry] = [0, 0, 0]
        counts[0] += 1
        counts[1] += input_tokens
        counts[2] += output_tokens

    async def flush(self) -> None:
        """Send the unsent batches, oldest first, then the one being filled; stop at the first failure (it and the
        rest stay queued)."""
        if self._filling.counts:
            self._unsent.append(self._filling)
            self._filling = Batch()
        while self._unsent:
            keys, args = self._unsent[0].script_args()
            try:
                await guarded(self._apply(keys=keys, args=args), self._timeout_s)
            except (Unavailable, RedisError) as e:
                log.warning("token usage not sent (%d batches wait for the next send): %s", len(self._unsent), e)
                return
            self._unsent.pop(0)

    async def run(self) -> None:
        """Flush every interval until cancelled, then once more (``flushing.flush_every``)."""
        await flush_every(self._interval_s, self.flush)
