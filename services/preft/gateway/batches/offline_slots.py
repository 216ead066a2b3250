"""Room kept for live traffic at the engines: a cap, over every gateway replica, on the engine requests of batch lines
in flight at once.

Batch lines are offline work. The engine schedules them behind live requests (priority 1 against 0), but only once a
request has reached vLLM: in front of it, Ray Serve's queue is first come, first served, and a replica's
`max_ongoing_requests` and vLLM's `max_num_seqs` fill with whatever arrived first. Gateways scale out (each replica
runs its own batches), so a per-replica bound does not bound the fleet; this cap does. Set it below the engines' room
(replicas × `max_ongoing_requests`), and what is left over is always live traffic's.

A line takes as many slots as the engine requests it makes (``batches.lines``: its parsed body's prompts × samples;
the cap at most, so that any line can run). A slot is an entry `<replica token>:<line>:<k>` of one sorted set in Redis
(`preft:offline-slots`), scored by when it lapses (Redis' clock, ms): one Lua script drops the lapsed entries and
takes a line's slots where the cap leaves room for all of them. A replica renews its entries every batch round
(`renew`, with the batch leases), so a crashed replica's slots lapse after one lease, as its batches do. On a
replica, one waiting line at a time asks Redis (every `poll_s`, or at once when a line of this replica gives its
slots back); the others wait behind it, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from preft.common.errors import PreftError
from preft.common.metrics import BATCH_SLOTS_HELD, BATCH_SLOTS_WAIT
from preft.gateway.core.redis_client import CLOCK_LUA, guarded

log = logging.getLogger(__name__)

SLOTS_KEY = "preft:offline-slots"

# KEYS[1] = the slots; ARGV[1] = the cap, ARGV[2] = a slot's lease (ms), ARGV[3..] = the line's entries. 1 where
# they were all taken, 0 where the cap leaves no room for them all (none taken).
_TAKE = (
    CLOCK_LUA
    + """
local now = clock()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) + #ARGV - 2 > tonumber(ARGV[1]) then return 0 end
local lapses = now + tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], lapses, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
return 1
"""
)

# KEYS[1] = the slots; ARGV[1] = a slot's lease (ms), ARGV[2..] = the entries. Renews those still held (a lapsed one
# stays lapsed: its slot may be another's now).
_RENEW = (
    CLOCK_LUA
    + """
local lapses = clock() + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', lapses, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return 0
"""
)


class OfflineSlots:
    """This replica's share of the fleet's slots for batch lines. `cap` 0: no cap (nothing asked of Redis)."""

    def __init__(self, redis: aioredis.Redis, *, cap: int, lease_s: float, poll_s: float, timeout_s: float) -> None:
        self._redis = redis
        self.cap = cap
        self._lease_ms = int(lease_s * 1000)
        self.poll_s = poll_s
        self._timeout_s = timeout_s
        self._token = uuid.uuid4().hex  # (this replica's name on the slots it holds)
        self._lines = itertools.count()
        self._held: set[str] = set()
        self._asking = asyncio.Lock()  # (one line of this replica asks Redis at a time)
        self._given_back = asyncio.Event()
        self._take = redis.register_script(_TAKE)
        self._renew = redis.register_script(_RENEW)

    @property
    def held(self) -> int:
        """Slots this replica holds now."""
        return len(self._held)

    @contextlib.asynccontextmanager
    async def slots(self, count: int) -> AsyncIterator[None]:
        """Hold `count` slots (the cap at most) for the block's time: wait for them, then give them back at the end,
        whatever ends it."""
        if self.cap <= 0:
            yield
            return
        line = f"{self._token}:{next(self._lines)}"
        entries = [f"{line}:{k}" for k in range(max(1, min(count, self.cap)))]
        started = time.monotonic()
        await self._wait(entries)
        BATCH_SLOTS_WAIT.observe(time.monotonic() - started)
        try:
            yield
        finally:
            await self._give_back(entries)

    async def renew(self) -> None:
        """Renew the slots this replica holds (Unavailable where Redis is down: they lapse after their lease)."""
        if self._held:
            await guarded(self._renew(keys=[SLOTS_KEY], args=[self._lease_ms, *self._held]), self._timeout_s)

    async def _wait(self, entries: list[str]) -> None:
        async with self._asking:
            while True:
                self._given_back.clear()
                try:
                    if await guarded(
                        self._take(keys=[SLOTS_KEY], args=[self.cap, self._lease_ms, *entries]), self._timeout_s
                    ):
                        self._held.update(entries)
                        BATCH_SLOTS_HELD.set(len(self._held))
                        return
                except asyncio.CancelledError:  # (they may have been taken as the cancel came: given back)
                    await self._give_back(entries)
                    raise
                except PreftError as e:  # (Redis down: lines wait, as every other part of the batch does)
                    log.warning("batches: no slot for a line, asked again in %.1f s: %s", self.poll_s, e.message)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_s):
                        await self._given_back.wait()

    async def _give_back(self, entries: list[str]) -> None:
        self._held.difference_update(entries)
        BATCH_SLOTS_HELD.set(len(self._held))
        self._given_back.set()
        with contextlib.suppress(PreftError):  # (Redis down: they lapse after their lease)
            await guarded(self._redis.zrem(SLOTS_KEY, *entries), self._timeout_s)
