"""A small in-process TTL cache with a size bound (the key and resolution caches), and single-flight loading."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """Owns entries that expire `ttl_s` after they were stored (or earlier, per entry); the oldest go first when full.

    `get_or_load` shares one load between concurrent callers of the same key, so a burst of requests for an
    uncached key makes one lookup. Errors are not cached unless the loader returns them as values.
    """

    def __init__(self, ttl_s: float, max_entries: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._loading: dict[K, asyncio.Task[V]] = {}

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[key]
            return None
        return entry[1]

    def put(self, key: K, value: V, ttl_s: float | None = None) -> None:
        ttl = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        if ttl <= 0:
            return
        self._entries[key] = (self._clock() + ttl, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

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


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved even when every waiter left
