"""Tokens per second over a sliding window, per position mode (prefill-only vs all-token throughput)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class ThroughputWindow:
    """Owns recent (time, tokens) events per key and answers tokens per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s, self._clock = window_s, clock
        self._events: dict[str, deque[tuple[float, int]]] = {}
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()  # read by the metrics exposition, possibly from another thread

    def record(self, key: str, tokens: int) -> None:
        if tokens <= 0:
            return
        with self._lock:
            now = self._clock()
            self._events.setdefault(key, deque()).append((now, tokens))
            self._totals[key] = self._totals.get(key, 0) + tokens
            self._expire(key, now)

    def rate(self, key: str) -> float:
        with self._lock:
            if key not in self._events:
                return 0.0
            self._expire(key, self._clock())
            return self._totals[key] / self.window_s

    def _expire(self, key: str, now: float) -> None:
        events, cutoff = self._events[key], now - self.window_s
        while events and events[0][0] <= cutoff:
            self._totals[key] -= events.popleft()[1]
