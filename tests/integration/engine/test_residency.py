"""Residency publishing against a real Redis: a TTL'd set per replica, best effort when Redis is down."""

from __future__ import annotations

import asyncio

import redis

from preft.common.settings import RedisSettings
from preft.engine.residency import ResidencyPublisher, redis_client, residency_key
from preft.stack import free_port
from tests.integration.conftest import service_redis


def test_publishes_the_held_digests_with_a_ttl_and_removes_them_on_stop(redis_url):
    held = {"a" * 64, "b" * 64}
    sync = redis.Redis.from_url(redis_url)

    async def scenario():
        pub = ResidencyPublisher(
            replica_id="replica-1",
            holdings=lambda: held,
            client=redis_client(service_redis(redis_url, "engine")),
            heartbeat_s=0.1,
            ttl_s=2.0,
        )
        pub.start()
        await asyncio.sleep(0.3)
        key = residency_key("replica-1")
        assert {m.decode() for m in sync.smembers(key)} == held
        assert 0 < sync.pttl(key) <= 2000
        held.discard("a" * 64)
        pub.changed()
        await asyncio.sleep(0.2)
        assert {m.decode() for m in sync.smembers(key)} == {"b" * 64}
        held.clear()
        pub.changed()
        await asyncio.sleep(0.2)
        assert not sync.exists(key)  # nothing held: no key
        held.add("c" * 64)
        pub.changed()
        await asyncio.sleep(0.2)
        await pub.stop()
        assert not sync.exists(key)

    asyncio.run(scenario())


def test_redis_down_never_fails(caplog):
    async def scenario():
        pub = ResidencyPublisher(
            replica_id="replica-2",
            holdings=lambda: ["a" * 64],
            client=redis_client(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)),
            heartbeat_s=0.05,
            ttl_s=1.0,
        )
        assert await pub.publish_once() is False
        pub.start()
        await asyncio.sleep(0.3)
        await pub.stop()

    asyncio.run(scenario())
    warnings = [r for r in caplog.records if "residency" in r.getMessage()]
    assert len(warnings) == 1  # logged once per outage, not per beat
