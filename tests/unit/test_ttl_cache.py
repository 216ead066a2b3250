"""The gateway's TTL cache: expiry (the cache's and an entry's own, shorter one), its size bound, and one load shared
by concurrent callers of a key."""

from __future__ import annotations

import asyncio

import pytest

from preft.gateway.core.cache import TTLCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_after_the_cache_ttl_or_their_own_shorter_one():
    clock = Clock()
    cache: TTLCache[str, int] = TTLCache(10.0, 8, clock=clock)
    cache.put("a", 1)
    cache.put("b", 2, ttl_s=3.0)
    cache.put("c", 3, ttl_s=60.0)  # (never longer than the cache's own)
    cache.put("d", 4, ttl_s=0.0)  # not stored
    clock.now += 5
    assert (cache.get("a"), cache.get("b"), cache.get("c"), cache.get("d")) == (1, None, 3, None)
    clock.now += 5
    assert cache.get("a") is None and cache.get("c") is None


def test_the_least_recently_used_goes_first_when_full():
    cache: TTLCache[str, int] = TTLCache(60.0, 2, clock=Clock())
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a used: b is now the least recent
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3) and len(cache) == 2


def test_concurrent_callers_share_one_load_and_errors_are_not_cached():
    cache: TTLCache[str, int] = TTLCache(60.0, 8, clock=Clock())
    loads = 0

    async def load() -> tuple[int, float | None]:
        nonlocal loads
        loads += 1
        await asyncio.sleep(0.01)
        return 7, None

    async def failing() -> tuple[int, float | None]:
        raise RuntimeError("registry down")

    async def run() -> None:
        assert await asyncio.gather(*(cache.get_or_load("k", load) for _ in range(5))) == [7] * 5
        assert await cache.get_or_load("k", load) == 7 and loads == 1
        for _ in range(2):
            with pytest.raises(RuntimeError, match="registry down"):
                await cache.get_or_load("x", failing)
        assert cache.get("x") is None

    asyncio.run(run())
