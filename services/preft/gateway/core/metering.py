"""The gateway's token meter: each answered generation's tokens, added to its tenant's UTC minute, hour and day in
Redis (the layout of ``common.metering``), in batches.

`record` adds to counts held in memory; `run()` sends them every `interval_s` as one batch, which also adds each
tenant's tokens to its UTC month's counter (what admission checks a monthly quota against, ``limits``). A batch is
applied by one Lua script under a batch id that Redis remembers for a day, so a batch sent again (its first answer
lost to a timeout) is counted once. A batch that fails stays queued, with its id, and goes first at the next send:
while Redis is down the counts wait, up to `max_pending` (tenant, minute, model) entries in all (each minute of the
outage adds one per tenant and model in use). Reaching it, the meter gives up the outage's minutes: the batches never
sent are folded into (tenant, hour, model) entries, which add to the hours, days and months alone, and so are the
records that follow until everything held is sent (``preft_gateway_metering_coarsened_total``), so an outage of days
keeps those counts whole; only where the hours fill `max_pending` too are new records dropped, from every count
alike (``preft_gateway_metering_dropped_total``). A clean shutdown sends what is left once more.

A batch's lines do not pass through the meter: their tokens (``Metered``) are added to the same keys by the script
that records the part holding them (``batches.store``), once per line however often it was answered.
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
from preft.common.metrics import METERING_COARSENED, METERING_DROPPED
from preft.gateway.core.flushing import flush_every
from preft.gateway.core.redis_client import guarded

log = logging.getLogger(__name__)

BATCH_PREFIX = "preft:usage-batch:"
BATCH_MEMORY_S = 86_400  # how long Redis remembers a batch id (a batch re-sent within it is not counted again)
BATCH_ENTRIES = 1_000  # (tenant, minute, model) entries a batch holds at most: one script's work stays short

# KEYS[1] = the batch id's key, then the H hashes (minutes', hours' and days'), then the month counters; ARGV[1] = the
# batch id's TTL (s), ARGV[2] = H, ARGV[3] = the month counters' TTL; then per hash its TTL, how many (field,
# increment) pairs follow, and the pairs; then per month counter its increment. 0 when the batch was applied before.
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


@dataclass(frozen=True)
class Metered:
    """An answered generation's tokens for the meter, on its model (the adapter's ref, or the served base model)."""

    model: str
    input_tokens: int
    output_tokens: int


Entry = tuple[str, int, str]  # tenant, the UTC minute's start (Unix s; an hour's in a batch of hours), model
WINDOW_TTLS_S = {  # how long each width's hashes stay after their last write
    "minute": metering.MINUTE_RETENTION_DAYS * metering.DAY_S,
    "hour": metering.HOUR_RETENTION_DAYS * metering.DAY_S,
    "day": metering.RETENTION_DAYS * metering.DAY_S,
}
MONTH_TTL_S = metering.MONTH_TTL_DAYS * metering.DAY_S


def window_keys(tenant: str, minute: int, *, minutes: bool = True) -> dict[str, str]:
    """The hashes that counts of `tenant`'s UTC minute starting at `minute` add to, by width (``WINDOW_TTLS_S``): its
    hour's and day's, and its minute's unless `minutes` is off (a batch of hours, `minute` then an hour's start)."""
    keys = {
        "hour": metering.hour_key(tenant, minute // metering.HOUR_S * metering.HOUR_S),
        "day": metering.day_key(tenant, metering.day_of(minute)),
    }
    if minutes:
        keys["minute"] = metering.minute_key(tenant, minute)
    return keys


@dataclass
class Batch:
    """Counts to add, per (tenant, minute, model): requests, input tokens, output tokens; sent under one id. A batch
    of `hours` holds (tenant, hour, model) entries, and adds to no minute."""

    counts: dict[Entry, list[int]] = field(default_factory=dict)
    batch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    hours: bool = False

    def script_args(self) -> tuple[list[str], list[str | int]]:
        """The apply script's keys and arguments: each entry's counts on its minute's, hour's and day's hashes (the
        minutes of one hour or day summed into one increment per field) and its tokens on its month's counter."""
        hashes: dict[str, tuple[int, dict[str, int]]] = {}  # key: (TTL, increment per field)
        by_month: dict[str, int] = {}
        for (tenant, minute, model), values in self.counts.items():
            for width, key in window_keys(tenant, minute, minutes=not self.hours).items():
                increments = hashes.setdefault(key, (WINDOW_TTLS_S[width], {}))[1]
                for counter, value in zip(metering.COUNTERS, values, strict=True):
                    if value:
                        name = metering.field(counter, model)
                        increments[name] = increments.get(name, 0) + value
            month = metering.month_key(tenant, metering.day_of(minute))
            by_month[month] = by_month.get(month, 0) + values[1] + values[2]
        args: list[str | int] = [BATCH_MEMORY_S, len(hashes), MONTH_TTL_S]
        for ttl, increments in hashes.values():
            args += [ttl, len(increments), *(item for pair in increments.items() for item in pair)]
        return [BATCH_PREFIX + self.batch_id, *hashes, *by_month], args + list(by_month.values())


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
        self._by_hour = False  # (the held entries reached max_pending: counted by hour until all are sent)

    @property
    def pending(self) -> int:
        """Entries held (tenant, minute or hour, model): the batch being filled and the unsent ones."""
        return len(self._filling.counts) + sum(len(b.counts) for b in self._unsent)

    def record(self, tenant: str, model: str, input_tokens: int, output_tokens: int) -> None:
        """One answered request of `tenant` on `model`, on this UTC minute's (and hour's and day's) counts."""
        width = metering.HOUR_S if self._by_hour else metering.MINUTE_S
        entry = (tenant, int(self._clock()) // width * width, model)
        counts = self._filling.counts.get(entry)
        if counts is None:
            if self.pending >= self._max_pending and not self._by_hour:
                self._to_hours()
                self.record(tenant, model, input_tokens, output_tokens)
                return
            if self.pending >= self._max_pending:
                METERING_DROPPED.inc()
                return
            if len(self._filling.counts) >= BATCH_ENTRIES:
                self._unsent.append(self._filling)
                self._filling = Batch(hours=self._by_hour)
            counts = self._filling.counts[entry] = [0, 0, 0]
        counts[0] += 1
        counts[1] += input_tokens
        counts[2] += output_tokens

    def _to_hours(self) -> None:
        """Count by hour from now on, and fold every batch never sent into batches of (tenant, hour, model) entries:
        they give up their minutes and keep their hours', days' and months' counts. (The first unsent batch stays
        whole: Redis may have applied it with its id, and a batch sent again must be the same.)"""
        kept, folded = self._unsent[:1], [*self._unsent[1:], self._filling]
        hours: dict[Entry, list[int]] = {}
        for batch in folded:
            for (tenant, start, model), values in batch.counts.items():
                total = hours.setdefault((tenant, start // metering.HOUR_S * metering.HOUR_S, model), [0, 0, 0])
                for i, value in enumerate(values):
                    total[i] += value
        entries = list(hours.items())
        self._unsent = kept + [
            Batch(dict(entries[first : first + BATCH_ENTRIES]), hours=True)
            for first in range(0, len(entries), BATCH_ENTRIES)
        ]
        self._filling = Batch(hours=True)
        self._by_hour = True
        METERING_COARSENED.inc(sum(len(b.counts) for b in folded) - len(entries))
        log.warning("token usage held while Redis is unreachable reached its limit: kept by hour, not by minute")

    async def flush(self) -> None:
        """Send the unsent batches, oldest first, then the one being filled; stop at the first failure (it and the
        rest stay queued)."""
        if self._filling.counts:
            self._unsent.append(self._filling)
            self._filling = Batch(hours=self._by_hour)
        while self._unsent:
            keys, args = self._unsent[0].script_args()
            try:
                await guarded(self._apply(keys=keys, args=args), self._timeout_s)
            except (Unavailable, RedisError) as e:
                log.warning("token usage not sent (%d batches wait for the next send): %s", len(self._unsent), e)
                return
            self._unsent.pop(0)
        if self._by_hour:  # (all sent: by minute again)
            self._by_hour = False
            if not self._filling.counts:
                self._filling = Batch()

    async def run(self) -> None:
        """Flush every interval until cancelled, then once more (``flushing.flush_every``)."""
        await flush_every(self._interval_s, self.flush)
