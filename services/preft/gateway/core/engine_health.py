"""Whether the engine is alive, told from what it answers, so a request nobody will take fails fast (503).

When its replica died, Ray Serve's proxy still accepts requests and queues them until a new replica is up (~40 s),
and it queues them the same way behind a replica that is alive but saturated. Nor does a response's first byte say
which: a replica sends a non-streaming answer's headers with its last token, a stream's with its first. So a
request without response headers after half of `engine_unresponsive_s` is kept waiting (bounded only by the read
timeout) while the engine shows life: an answer to any request (a status below 500, a streamed chunk) in that half,
or else its health check (GET /healthz, through the proxy: a replica answers it between requests, one probe at a
time for all requests) answering 200 within the rest. Otherwise it is dropped at the deadline: no replica took it.
A replica so saturated that it answers nothing, not even its health check, for a whole deadline sheds load this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

log = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"


class EngineHealth:
    """Owns when the engine last showed life, and the one health probe in flight."""

    def __init__(self, url: str, session: Callable[[], aiohttp.ClientSession]) -> None:
        self._url = url
        self._session = session
        self._seen_s = float("-inf")  # (monotonic)
        self._probe: asyncio.Task[bool] | None = None

    def seen(self) -> None:
        """The engine answered something."""
        self._seen_s = time.monotonic()

    def seen_within(self, window_s: float) -> bool:
        return time.monotonic() - self._seen_s <= window_s

    async def worth_waiting(self, answer: asyncio.Future, deadline_s: float) -> bool:
        """Whether to keep waiting for `answer` (a request's response headers) past `deadline_s` (loop time): it came,
        or the engine showed life since half the time left (else its probe answered by the deadline)."""
        loop = asyncio.get_running_loop()
        half_s = max(0.0, deadline_s - loop.time()) / 2
        await asyncio.wait({answer}, timeout=half_s)
        if answer.done() or self.seen_within(half_s):
            return True
        probe = self._probing(half_s)
        left_s = max(0.0, deadline_s - loop.time())
        await asyncio.wait({answer, probe}, timeout=left_s, return_when=asyncio.FIRST_COMPLETED)
        return answer.done() or (probe.done() and probe.result())

    def _probing(self, timeout_s: float) -> asyncio.Task[bool]:
        """The health probe in flight, started where there is none."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._check(timeout_s), name="preft-engine-probe")
        return self._probe

    async def check(self, timeout_s: float) -> bool:
        """Whether the engine answers its health check within `timeout_s` (the one probe in flight, shared)."""
        return await asyncio.shield(self._probing(timeout_s))

    async def _check(self, timeout_s: float) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._session().get(self._url, timeout=timeout) as resp:
                alive = resp.status == 200
        except Exception as e:  # (down, refusing, too slow: all mean no sign of life)
            log.debug("engine health probe failed: %r", e)
            alive = False
        if alive:
            self.seen()
        return alive

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(BaseException):
                await self._probe
