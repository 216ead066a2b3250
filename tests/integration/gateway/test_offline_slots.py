"""The fleet's cap on batch requests at the engines at once (``offline_slots``), over real Redis: two replicas' batches
together stay under it (live requests do not count), a line takes a slot per engine request it makes, a crashed
replica's slots lapse while a live one's are renewed, and a Redis outage makes lines wait, not fail."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import REGISTRY

from preft.common.engine_contract import LIVE_PRIORITY, OFFLINE_PRIORITY
from preft.common.settings import RedisSettings
from preft.gateway.batches.offline_slots import SLOTS_KEY, OfflineSlots
from preft.gateway.core.redis_client import connect
from preft.stack import free_port
from tests.integration.conftest import service_redis

from .conftest import BASE
from .test_batches import CHAT, COMPLETIONS, _batches, _chat, _ended, _request, _start


def test_batch_lines_of_all_replicas_stay_under_the_fleets_cap(make_gateway, registry, stub, s3_bucket):
    settings = _batches(s3_bucket, batches_max_lines_in_flight=3, batches_line_concurrency=4)
    replicas = [make_gateway(**settings), make_gateway(**settings)]
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    stub.token_delay_s = 0.05  # (0.2 s a line)
    waits = REGISTRY.get_sample_value("preft_gateway_batch_slots_wait_seconds_count") or 0
    body = {"model": BASE, "prompt": [5, 6], "max_tokens": 4}
    lines = [_request(f"l{i}", COMPLETIONS, body) for i in range(8)]
    pair = [_request("pair", COMPLETIONS, {**body, "prompt": [[5, 6], [7, 8]]})]  # (two engine requests, one line)
    batches = [(acme, _start(replicas[0].openai(acme), COMPLETIONS, lines + pair))]
    pairs = [_request(f"c{i}", CHAT, _chat("hi", max_tokens=4, n=2)) for i in range(4)]  # (two samples a line)
    batches.append((beta, _start(replicas[1].openai(beta), CHAT, pairs)))
    live = replicas[0].http(acme)
    deadline = time.monotonic() + 60
    while stub.in_flight[OFFLINE_PRIORITY] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for _ in range(4):  # (live requests go past the cap, and do not take from it)
        assert live.post(CHAT, json=_chat("hi", max_tokens=8)).status_code == 200
    for tenant, batch in batches:
        assert _ended(replicas[0].openai(tenant), batch.id).status == "completed"
    assert stub.most_in_flight[OFFLINE_PRIORITY] == 3  # (8 would be in flight without the cap)
    assert stub.most_in_flight[LIVE_PRIORITY] == 1
    assert sum(req.priority == OFFLINE_PRIORITY for _, req in stub.received) == 18
    assert REGISTRY.get_sample_value("preft_gateway_batch_slots_wait_seconds_count") == waits + 13  # (one a line)
    assert REGISTRY.get_sample_value("preft_gateway_batch_slots_held") == 0


@asynccontextmanager
async def _slots(redis_url: str, **overrides: Any) -> AsyncIterator[Callable[..., OfflineSlots]]:
    """A factory of replicas' slots over one client (`cap` 2, a 0.5 s lease, polled every 0.05 s by default)."""
    client = connect(service_redis(redis_url, "gateway"), 2.0)
    settings = {"cap": 2, "lease_s": 0.5, "poll_s": 0.05, "timeout_s": 2.0, **overrides}
    try:
        yield lambda **kw: OfflineSlots(client, **{**settings, **kw})
    finally:
        await client.aclose()


async def _waited_s(take: Awaitable[Any]) -> float:
    started = time.monotonic()
    await take
    return time.monotonic() - started


def test_a_crashed_replicas_slots_lapse_and_a_live_replicas_are_renewed(redis_url):
    async def main() -> tuple[float, float]:
        async with _slots(redis_url) as replica:
            crashed, running, waiting = replica(), replica(), replica()
            left = crashed.slots(2)  # (kept: a generator let go of would give them back)
            await left.__aenter__()  # (never given back, never renewed: as a crash leaves them)

            async def one_slot() -> None:
                async with waiting.slots(1):
                    pass

            lapsed_after = await _waited_s(one_slot())
            async with running.slots(5):  # (the cap at most: 2)
                assert running.held == 2
                late = asyncio.create_task(one_slot())
                for _ in range(10):  # (1 s: two leases, renewed)
                    await running.renew()
                    await asyncio.sleep(0.1)
                assert not late.done()
            return lapsed_after, await _waited_s(late)

    lapsed_after, after_release = asyncio.run(main())
    assert 0.3 < lapsed_after < 3.0
    assert after_release < 0.5  # (given back at once: not a lease later)


def test_a_line_waits_for_all_its_slots_and_takes_none_meanwhile(redis_url):
    async def main() -> list[str]:
        order: list[str] = []
        async with _slots(redis_url, cap=3, lease_s=10.0) as replica:
            first, second = replica(), replica()

            async def line(slots: OfflineSlots, name: str, count: int, hold_s: float) -> None:
                async with slots.slots(count):
                    order.append(f"{name} in")
                    await asyncio.sleep(hold_s)
                order.append(f"{name} out")

            one = asyncio.create_task(line(first, "one", 2, 0.3))
            await asyncio.sleep(0.05)
            three = asyncio.create_task(line(second, "three", 3, 0))  # (needs all 3: waits for one)
            await asyncio.sleep(0.1)
            assert second.held == 0
            await asyncio.gather(one, three)
        return order

    assert asyncio.run(main()) == ["one in", "one out", "three in", "three out"]


def test_without_redis_lines_wait_and_say_so(caplog):
    async def main() -> None:
        down = connect(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"), 0.2)  # (nothing listens there)
        slots = OfflineSlots(down, cap=2, lease_s=1.0, poll_s=0.05, timeout_s=0.2)
        waiting = asyncio.create_task(_waited_s(slots.slots(1).__aenter__()))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        waiting.cancel()
        await down.aclose()

    asyncio.run(main())
    assert "no slot for a line, asked again" in caplog.text


def test_no_cap_asks_nothing_of_redis():
    async def main() -> None:
        down = connect(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"), 0.2)
        async with OfflineSlots(down, cap=0, lease_s=1.0, poll_s=0.05, timeout_s=0.2).slots(5):
            pass
        await down.aclose()

    asyncio.run(main())


def test_slots_given_back_leave_nothing_in_redis(redis_url):
    async def main() -> int:
        async with _slots(redis_url) as replica:
            slots = replica()
            async with slots.slots(2):
                pass
        client = connect(service_redis(redis_url, "gateway"), 2.0)
        try:
            return await client.exists(SLOTS_KEY)
        finally:
            await client.aclose()

    assert asyncio.run(main()) == 0
