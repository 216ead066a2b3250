"""Publishing which adapters a replica holds: `preft:residency:<replica id>`, a Redis set of digests with a TTL.

Best effort by design: Redis being down never fails or slows a request. The key is rewritten every heartbeat (and soon
after a change) and expires `ttl_s` after the last write, so a dead replica's entry disappears on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from preft.common.settings import RedisSettings

logger = logging.getLogger(__name__)

KEY_PREFIX = "preft:residency:"


def residency_key(replica_id: str) -> str:
    return KEY_PREFIX + replica_id


def redis_client(settings: RedisSettings) -> aioredis.Redis:
    """An asyncio Redis client that fails fast when Redis is down (never hangs a replica)."""
    return aioredis.Redis.from_url(settings.url, **(settings.client_options() | {"max_connections": 8}))


class ResidencyPublisher:
    """Owns this replica's residency key: writes the set of held digests periodically and removes it on stop."""

    def __init__(
        self,
        *,
        replica_id: str,
        holdings: Callable[[], Iterable[str]],
        client: Any,
        heartbeat_s: float,
        ttl_s: float,
    ) -> None:
        self.key = residency_key(replica_id)
        self._holdings = holdings
        self._heartbeat_s, self._ttl_ms = heartbeat_s, int(ttl_s * 1000)
        self._redis = client
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="residency-publisher")

    def changed(self) -> None:
        """The holdings changed: publish now rather than at the next heartbeat."""
        self._changed.set()

    async def publish_once(self) -> bool:
        """Write the current holdings; False (logged once per outage) when Redis cannot be reached."""
        digests = sorted(set(self._holdings()))
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.key)
                if digests:
                    pipe.sadd(self.key, *digests)
                    pipe.pexpire(self.key, self._ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as e:
            if not self._failing:
                logger.warning("publishing adapter residency to Redis failed (will keep trying): %s", e)
            self._failing = True
            return False
        if self._failing:
            logger.info("publishing adapter residency to Redis works again")
        self._failing = False
        return True

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            try:
                await self.publish_once()
            except Exception:  # never let the heartbeat die
                logger.exception("publishing adapter residency failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._heartbeat_s)

    async def stop(self) -> None:
        """Stop publishing and delete the key (best effort)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(self.key)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()
