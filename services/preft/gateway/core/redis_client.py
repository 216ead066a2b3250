"""The gateway's async Redis connection: no client-side retries, and every operation under one short deadline.

A Redis outage must turn into a 503 within about a second, not hang a request or retry with backoff; the pool
reconnects by itself on the next operation once Redis is back.

Lua scripts: each store registers its own with redis-py's `register_script` (EVALSHA, loaded again when Redis lost
it), beside the key builders and the Python that reads their answers; a registry of all of them in one module would
part each script from the only code that knows its keys and replies, for no gain over redis-py's. The one script kind
redis-py lacks, a read-only one (EVALSHA_RO, which the gateway's ACL user needs on the registry's keys), is here.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from preft.common.errors import Unavailable
from preft.common.metrics import STORE_ERRORS
from preft.common.settings import RedisSettings

T = TypeVar("T")


# Redis' clock in ms, for scripts that score entries by when they lapse: `local now = clock()`.
CLOCK_LUA = """
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""


def connect(settings: RedisSettings, timeout_s: float) -> aioredis.Redis:
    """A pooled client (connections open lazily) whose socket timeouts never exceed the operation deadline.

    The pool waits for a free connection (up to the deadline) when all are busy: redis-py's default pool raises
    MaxConnectionsError at once instead, which turned a burst of a few hundred concurrent requests into 503s while
    Redis itself was idle."""
    socket_timeout_s = min(settings.socket_timeout_s, timeout_s)
    options = settings.client_options() | {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
    }
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url, timeout=timeout_s, decode_responses=True, retry=Retry(NoBackoff(), 0), **options
    )
    return aioredis.Redis.from_pool(pool)


async def guarded(operation: Awaitable[T], timeout_s: float) -> T:
    """Await a Redis operation; a connection error or a missed deadline becomes Unavailable (503), counted in
    preft_store_errors_total{store="redis"} (the alert on Redis errors reads it from the gateway as from the registry).

    A cancel that arrived during the operation is raised even where the operation returned: Python 3.11's
    `asyncio.wait_for`, which redis-py awaits, returns a reply that came with the cancel and drops the cancel, so a
    loop that awaits only Redis would run on. Only a cancel new to this await counts: a task that caught an earlier
    cancel (a shutdown path writing its last state) still gets its replies."""
    task = asyncio.current_task()
    cancels = task.cancelling() if task is not None else 0
    try:
        async with asyncio.timeout(timeout_s):
            result = await operation
    except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as e:
        STORE_ERRORS.labels("redis").inc()
        raise Unavailable("the gateway's metadata store (Redis) is unavailable; retry later") from e
    if task is not None and task.cancelling() > cancels:
        raise asyncio.CancelledError
    return result


class ReadOnlyScript:
    """A read-only Lua script, run by EVALSHA_RO (loaded by SCRIPT LOAD the first time Redis lacks it).

    EVALSHA's declared keys need write access under Redis' ACLs; EVALSHA_RO's only read access, which is all the
    gateway's Redis user has on the registry's keys (`common.redis_acl`)."""

    def __init__(self, redis: aioredis.Redis, script: str) -> None:
        self._redis, self._script = redis, script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    async def __call__(self, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> Any:
        try:
            return await self._redis.evalsha_ro(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._redis.script_load(self._script)
            return await self._redis.evalsha_ro(self.sha, len(keys), *keys, *args)
