"""`guarded`: a cancel that came with a Redis reply is raised, not dropped; an earlier, caught cancel is not; outages
are 503s, counted."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError

from preft.common.errors import Unavailable
from preft.gateway.core.redis_client import guarded


async def _reply_despite_cancel(started: asyncio.Event) -> str:
    """What Python 3.11's `wait_for` does where the reply and the cancel come together: the cancel is dropped."""
    started.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(10)
    return "reply"


def test_a_cancel_dropped_by_the_operation_is_raised():
    ran_on: list[str] = []

    async def writer(started: asyncio.Event) -> None:
        ran_on.append(await guarded(_reply_despite_cancel(started), 30))  # (a loop awaiting only Redis would run on)

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(writer(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert ran_on == []


def test_a_task_that_caught_an_earlier_cancel_still_gets_its_replies():
    async def reply() -> str:
        await asyncio.sleep(0)
        return "written"

    async def shutting_down(started: asyncio.Event) -> str:
        try:
            started.set()
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return await guarded(reply(), 5)  # (its last state, written on the way out)
        return "not cancelled"

    async def main() -> str:
        started = asyncio.Event()
        task = asyncio.create_task(shutting_down(started))
        await started.wait()
        task.cancel()
        return await task

    assert asyncio.run(main()) == "written"


def _redis_errors() -> float:
    return REGISTRY.get_sample_value("preft_store_errors_total", {"store": "redis"}) or 0.0


def test_outages_and_missed_deadlines_are_unavailable_and_counted():
    async def refused() -> None:
        raise RedisConnectionError("refused")

    async def main() -> None:
        before = _redis_errors()
        with pytest.raises(Unavailable):
            await guarded(refused(), 5)
        with pytest.raises(Unavailable):
            await guarded(asyncio.sleep(10), 0.05)
        assert _redis_errors() == before + 2  # (the alert on Redis errors reads this counter)
        assert await guarded(asyncio.sleep(0, result=7), 5) == 7
        assert _redis_errors() == before + 2

    asyncio.run(main())
