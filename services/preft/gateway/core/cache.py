"""An in-process TTL cache with a size bound (the key and resolution caches), and single-flight loading.

The entries live in cachetools' TLRUCache (a time-aware LRU: per-entry expiry, then least recently used first);
what it lacks, and this adds, is sharing one asynchronous load between concurrent callers of a key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from cachetools import TLRUCache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """Owns entries that expire `ttl_s` after they were stored (or earlier, per entry); the least recently used go
    first when full.

    `get_or_load` shares one load between concurrent callers of the same key, so a burst of requests for an
    uncached key makes one lookup. Errors are not cached unless the loader returns them as values.
    """

    def __init__(self, ttl_s: float, max_entries: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        # (values stored with their own lifetime: the cache's time-to-use reads it)
        self._entries: TLRUCache[K, tuple[float, V]] = TLRUCache(max_entries, _expiry, timer=clock)
        self._loading: dict[K, asyncio.Task[V]] = {}

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def put(self, key: K, value: V, ttl_s: float | None = None) -> None:
        ttl = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        if ttl <= 0:
            return
        self._entries[key] = (ttl, value)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    async def get_or_load(self, key: K, load: Callable[[], Awaitable[tuple[V, float | None]]]) -> V:
        """The cached value, else `load()`'s (value, ttl_s or None for the default), stored before returning.

        The load runs as its own task: a caller that gives up (client gone) does not cancel it for the others.
        """
        cached = self.get(key)
        if cached is not None:
            return cached
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(key, load))
            task.add_done_callback(_retrieve)
            self._loading[key] = task
        return await asyncio.shield(task)

    async def _load(self, key: K, load: Callable[[], Awaitable[tuple[V, float | None]]]) -> V:
        try:
            value, ttl_s = await load()
            self.put(key, value, ttl_s)
            return value
        finally:
            del self._loading[key]


def _expiry(_key: Any, entry: tuple[float, Any], now: float) -> float:
    return now + entry[0]


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved even when every waiter left
