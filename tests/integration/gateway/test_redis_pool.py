"""The gateway's Redis pool under more concurrent operations than it has connections: they wait for one (within the
operation's deadline) instead of failing, as redis-py's default pool does (a burst of a few hundred requests turned
into 503s while Redis itself was idle)."""

from __future__ import annotations

import asyncio

from preft.gateway.core.redis_client import connect, guarded
from tests.integration.conftest import service_redis


def test_more_concurrent_operations_than_connections_all_succeed(redis_url):
    settings = service_redis(redis_url, "gateway", max_connections=2)

    async def scenario() -> list[bool]:
        client = connect(settings, timeout_s=2.0)
        try:
            return await asyncio.gather(*(guarded(client.ping(), 2.0) for _ in range(64)))
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [True] * 64
