"""The monthly token quota is reserved at admission (``limits``): concurrent requests on any replica are admitted only
as far as what they may use fits, an ended request (a background run too) keeps what it used reserved for a short
hold and frees the rest, a crashed gateway's reservations lapse, the last month's requests in flight count in the new
month (where they are metered), a release that fails is logged, and tenants without a quota reserve nothing. (Batch
lines: ``test_batches``.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial

import httpx
import pytest
import redis

from preft.api.v1 import registry_pb2 as pb
from preft.common import metering
from preft.common.settings import RedisSettings
from preft.gateway.core.limits import LAPSE_BATCH, Admission, RateLimiter, Reservation, reservations_key, reserved_key
from preft.gateway.core.redis_client import connect
from preft.stack import free_port
from tests.integration.conftest import service_redis

from .conftest import BASE, error_of, redis_now_ms, until

BODY = {"model": BASE, "prompt": [5, 6, 7, 8], "max_tokens": 8}  # (4 + 8 = 12 tokens reserved, and used)
FAST = {"metering_flush_interval_s": 0.05}


@pytest.fixture
def store(redis_url) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def _set_quota(registry, tenant: str, tokens: int) -> None:
    """As `preft-admin tenant limits --tokens-per-month` does."""
    limits = pb.TenantLimits(tokens_per_month=tokens)
    registry.client.call("SetTenantLimits", pb.SetTenantLimitsRequest(id=tenant, limits=limits))


def _keys(tenant: str) -> tuple[str, str, str]:
    """This month's metered tokens, reserved tokens and reservations of the tenant."""
    day = metering.day_of(time.time())
    return metering.month_key(tenant, day), reserved_key(tenant, day), reservations_key(tenant, day)


_until = partial(until, timeout_s=10.0, poll_s=0.02)


def test_concurrent_requests_on_two_replicas_are_admitted_as_far_as_their_reservations_fit(
    make_gateway, registry, stub, store
):
    key = registry.tenant("acme")
    _set_quota(registry, "acme", 50)  # (4 requests of 12 tokens fit, a fifth would not)
    replicas = [make_gateway(**FAST), make_gateway(**FAST)]
    stub.token_delay_s = 0.1  # (0.8 s a request: all ten are in flight at once, none metered yet)

    def send(i: int) -> httpx.Response:
        return replicas[i % 2].http(key).post("/v1/completions", json=BODY)

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(send, range(10)))
    assert sorted(a.status_code for a in answers) == [200] * 4 + [429] * 6
    for refused in (a for a in answers if a.status_code == 429):
        error = error_of(refused)
        assert error["code"] == "insufficient_quota" and "requests in flight" in error["message"]
    assert len(stub.received) == 4
    month, reserved, reservations = _keys("acme")
    assert _until(lambda: int(store.get(month) or 0), lambda used: used >= 48) == 48
    # what they used stays reserved a moment more, in this month's keys, kept as the month's counter is
    held = store.zrange(reservations, 0, -1)
    assert len(held) == 4 and all(entry.endswith(":12") for entry in held) and int(store.get(reserved)) == 48
    for name in (reserved, reservations):
        assert store.ttl(name) > metering.MONTH_TTL_DAYS * metering.DAY_S - 60
    time.sleep(replicas[0].settings.redis_timeout_s + 0.5)  # (past the hold)
    assert send(0).status_code == 429  # (48 used: 12 more would pass 50)
    assert store.zcard(reservations) == 0 and store.get(reserved) is None  # (the lapsed holds went)
    assert int(store.get(month)) == 48


def test_an_ended_request_frees_what_it_did_not_use_and_holds_the_rest_briefly(make_gateway, registry, stub, store):
    key = registry.tenant("acme")
    _set_quota(registry, "acme", 100)
    gateway = make_gateway(**FAST)
    http, client = gateway.http(key), gateway.openai(key)
    month, reserved, reservations = _keys("acme")
    big = {**BODY, "max_tokens": 90}  # (4 + 90 = 94 reserved)

    # never reached the engine (no such model) or never answered (the engine failed): all of it back at once
    assert http.post("/v1/completions", json={**big, "model": "nope"}).status_code == 404
    assert _until(lambda: store.get(reserved), lambda value: value is None) is None
    stub.fail_next(503, times=2)  # (the gateway tries twice)
    assert http.post("/v1/completions", json=big).status_code == 503
    assert _until(lambda: store.get(reserved), lambda value: value is None) is None

    # a stream in flight holds all it may use; it ends having used 4 + 2
    stub.reply, stub.token_delay_s = "abcdefgh", 1.5  # (2 tokens of 4 characters, then stop; 1.5 s apart)
    stream = client.completions.create(**big, stream=True)
    next(iter(stream))
    assert int(store.get(reserved)) == 94
    refused = http.post("/v1/completions", json=BODY)
    assert refused.status_code == 429 and "hold 94 more reserved" in error_of(refused)["message"]
    list(stream)
    ((_, lapses_ms),) = _until(
        lambda: store.zrange(reservations, 0, -1, withscores=True), lambda e: len(e) == 1 and e[0][0].endswith(":6")
    )
    assert int(store.get(reserved)) == 6
    hold_ms = (2 * gateway.settings.metering_flush_interval_s + gateway.settings.redis_timeout_s) * 1000
    assert 0 < lapses_ms - redis_now_ms(store) <= hold_ms
    # once metered and past the hold, only the metered 6 count: a request needing all the other 94 fits
    assert _until(lambda: int(store.get(month) or 0), lambda used: used >= 6) == 6
    time.sleep((lapses_ms - redis_now_ms(store)) / 1000 + 0.05)
    stub.reply, stub.token_delay_s = None, 0.0
    assert http.post("/v1/completions", json=big).status_code == 200
    assert _until(lambda: int(store.get(month) or 0), lambda used: used >= 100) == 100


def test_a_crashed_gateways_reservations_lapse(make_gateway, registry, store):
    key = registry.tenant("acme")
    _set_quota(registry, "acme", 100)
    http = make_gateway(**FAST).http(key)
    month, reserved, reservations = _keys("acme")
    now_ms = redis_now_ms(store)
    # a gateway that crashed left 60 reserved, lapsed a second ago; another replica's request holds 30, in flight
    store.zadd(reservations, {"cmpl-crashed:60": now_ms - 1000, "cmpl-elsewhere:30": now_ms + 60_000})
    store.set(reserved, 90)

    assert http.post("/v1/completions", json=BODY).status_code == 200  # (30 + 12: fits once the 60 lapsed)
    entries = _until(lambda: store.zrange(reservations, 0, -1), lambda e: len(e) == 2)
    assert "cmpl-crashed:60" not in entries and "cmpl-elsewhere:30" in entries
    assert int(store.get(reserved)) == 42  # (30, and 12 of the answered request, held until metered)
    refused = http.post("/v1/completions", json={**BODY, "max_tokens": 60})  # (4 + 60 more: no room)
    assert refused.status_code == 429 and "requests in flight" in error_of(refused)["message"]

    # a backlog of lapsed entries goes a bounded batch at a time; what is left still counts (refused early, not late)
    store.delete(reserved, reservations)
    store.zadd(reservations, {f"cmpl-crashed-{i}:1": now_ms - 1000 for i in range(LAPSE_BATCH + 95)})
    store.set(reserved, LAPSE_BATCH + 95)
    assert http.post("/v1/completions", json=BODY).status_code == 429  # (95 lapsed ones left + 12 > 100 - 12)
    assert store.zcard(reservations) == 95 and int(store.get(reserved)) == 95
    assert http.post("/v1/completions", json=BODY).status_code == 200  # (the rest went: 12 + 12 fit)
    assert store.zcard(reservations) == 1 and int(store.get(month) or 0) <= 24


def test_last_months_requests_in_flight_count_against_the_new_month(make_gateway, registry, store, redis_url):
    key = registry.tenant("acme")
    _set_quota(registry, "acme", 70)
    http = make_gateway(**FAST).http(key)
    reserved = _keys("acme")[1]
    last_month = metering.day_of(time.time()).replace(day=1) - timedelta(days=1)
    last_reserved, last_reservations = reserved_key("acme", last_month), reservations_key("acme", last_month)
    now_ms = redis_now_ms(store)
    # admitted last month: a request still running holds 60 (the meter adds what it uses to this month, where it
    # ends), a crashed gateway's 40 lapsed a second ago
    store.zadd(last_reservations, {"cmpl-late:60": now_ms + 60_000, "cmpl-crashed:40": now_ms - 1000})
    store.set(last_reserved, 100)

    refused = http.post("/v1/completions", json=BODY)  # (60 + 12 > 70)
    assert refused.status_code == 429 and "hold 60 more reserved" in error_of(refused)["message"]
    assert store.zrange(last_reservations, 0, -1) == ["cmpl-late:60"] and int(store.get(last_reserved)) == 60
    assert store.get(reserved) is None  # (nothing reserved this month)

    async def release_the_late_one() -> None:  # (it used 5: held in last month's keys until metered)
        client = connect(service_redis(redis_url, "gateway"), 1.0)
        late = Reservation("cmpl-late", 60, (last_reserved, last_reservations))
        admission = Admission("acme", 60, 1, 0, 100, 0, late)
        await RateLimiter(client, redis_timeout_s=1.0).release(admission, unused=55, used=5)
        await client.aclose()

    asyncio.run(release_the_late_one())
    assert int(store.get(last_reserved)) == 5
    assert http.post("/v1/completions", json=BODY).status_code == 200  # (5 + 12 fit)
    assert int(store.get(reserved)) == 12  # (this month's, held until metered)
    assert http.post("/v1/completions", json={**BODY, "max_tokens": 50}).status_code == 429  # (5 + 12 + 54 > 70)


def test_tenants_without_a_quota_reserve_nothing(make_gateway, registry, stub, store):
    key = registry.tenant("beta")
    gateway = make_gateway(**FAST)
    http = gateway.http(key)
    assert http.post("/v1/completions", json=BODY).status_code == 200
    assert http.post("/v1/completions", json={**BODY, "model": "nope"}).status_code == 404
    stub.reply = "abcdefgh"
    assert len(list(gateway.openai(key).completions.create(**BODY, stream=True))) >= 2
    chat = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    month = _keys("beta")[0]
    assert _until(lambda: int(store.get(month) or 0), lambda used: used > 0) > 0  # (metered as ever)
    time.sleep(0.2)  # (the releases ran)
    assert list(store.scan_iter("preft:quota-*")) == []


def test_a_background_response_holds_its_reservation_while_it_runs(make_gateway, registry, stub, store):
    key = registry.tenant("acme")
    _set_quota(registry, "acme", 10_000)
    client = make_gateway(responses_store_ttl_s=60, **FAST).openai(key)
    _, reserved, reservations = _keys("acme")
    stub.reply, stub.token_delay_s = "Hello Bob.", 0.5  # (3 tokens)
    queued = client.responses.create(model=BASE, input="I am Bob.", max_output_tokens=20, background=True)
    ((entry, _),) = store.zrange(reservations, 0, -1, withscores=True)  # (reserved before it was answered queued)
    run_id, tokens = entry.rsplit(":", 1)
    assert run_id == queued.id and int(store.get(reserved)) == int(tokens) > 20  # (the prompt + 20)
    _until(lambda: client.responses.retrieve(queued.id).status, lambda status: status == "completed")
    assert _until(lambda: store.zrange(reservations, 0, -1), lambda e: e != [entry]) == [f"{run_id}:{int(tokens) - 17}"]


def test_a_release_that_fails_is_logged_and_left_to_lapse(caplog):
    async def release() -> None:
        down = connect(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"), 0.5)  # (nothing listens there)
        admission = Admission("acme", 94, 1, 0, 100, 6, Reservation("cmpl-1", 94, _keys("acme")[1:]))
        await RateLimiter(down, redis_timeout_s=0.5).release(admission, unused=88, used=6)
        await down.aclose()

    asyncio.run(release())
    assert "quota reservation cmpl-1 of tenant acme not released" in caplog.text
