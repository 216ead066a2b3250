"""Sending what a gateway replica gathers in memory (adapter uses, token usage) at an interval."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


async def flush_every(interval_s: float, flush: Callable[[], Awaitable[None]]) -> None:
    """Call `flush` every interval until cancelled, then once more (for at most 2 s) so a clean shutdown loses
    nothing."""
    try:
        while True:
            await asyncio.sleep(interval_s)
            await flush()
    finally:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            async with asyncio.timeout(2.0):
                await flush()
