"""Per-tenant token metering: every answered generation (whole, streamed, Responses) is counted in Redis by UTC
minute, hour, day and model, read back through GET /v1/organization/usage/completions in day, hour or minute buckets;
failures and other tenants are not counted; the meter keeps its counts while Redis is down and sends each batch once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from preft.common import metering
from preft.gateway.core import metering as gateway_metering
from preft.gateway.core.metering import APPLY_LUA, Batch, TokenMeter
from preft.gateway.manage import token_usage
from preft.stack import RedisServer, free_port

from .conftest import BASE, error_of

ROUTE = "/v1/organization/usage/completions"
DAY_S, HOUR_S, MINUTE_S = 86_400, 3_600, 60
COUNTS = ("num_model_requests", "input_tokens", "output_tokens")


def _today_start() -> int:
    return int(time.time()) // DAY_S * DAY_S


def _hour_start() -> int:
    return int(time.time()) // HOUR_S * HOUR_S


def _minute_start() -> int:
    return int(time.time()) // MINUTE_S * MINUTE_S


def _clear_of_minute_end(margin_s: float = 5.0) -> None:
    """Sleep past the current minute's last `margin_s` seconds, so that the bucket the gateway calls current and the
    one this test computes agree for the queries that follow (a minute's end is also each hour's and day's)."""
    left = MINUTE_S - time.time() % MINUTE_S
    if left < margin_s:
        time.sleep(left + 0.05)


def _sums(buckets: list[dict[str, Any]], span_s: int = DAY_S) -> dict[tuple[int, str], list[int]]:
    """The buckets' counts summed per (start of their `span_s`, model)."""
    sums: dict[tuple[int, str], list[int]] = {}
    for bucket in buckets:
        for result in bucket["results"]:
            into = sums.setdefault((bucket["start_time"] // span_s * span_s, result["model"]), [0, 0, 0])
            for i, counter in enumerate(COUNTS):
                into[i] += result[counter]
    return sums


def _usage(http, **params: Any) -> dict[str, Any]:
    answer = http.get(ROUTE, params={"start_time": _today_start(), **params})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _wait_for(http, requests: int, **params: Any) -> list[dict[str, Any]]:
    """Today's results once they count `requests` requests (the meter sends every 0.1 s here)."""
    deadline = time.monotonic() + 5.0
    while True:
        results = _usage(http, **params)["data"][-1]["results"]
        if sum(r["num_model_requests"] for r in results) >= requests or time.monotonic() > deadline:
            return results
        time.sleep(0.05)


def test_answered_generations_are_metered_by_day_and_model(make_gateway, registry, stub, tiny_models):
    gateway = make_gateway(metering_flush_interval_s=0.1)
    _clear_of_minute_end(10.0)  # (the requests below all fall in one day)
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    registry.publish("acme", "pre", tiny_models["lora"], mode="prefill")
    client, http = gateway.openai(acme), gateway.http(acme)

    first = client.completions.create(model=BASE, prompt=[5, 6, 7, 8], max_tokens=3)
    chat = client.chat.completions.create(model="pre", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2)
    streamed = client.chat.completions.create(
        model="pre",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    stream_usage = next(chunk.usage for chunk in streamed if chunk.usage is not None)
    response = client.responses.create(model=BASE, input="how are you", max_output_tokens=2)
    stub.fail_next(503, times=2)  # (the gateway retries once: the request fails, and is not metered)
    assert http.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2}).status_code == 503
    gateway.openai(beta).completions.create(model=BASE, prompt=[9, 9], max_tokens=7)

    by_model = {r["model"]: r for r in _wait_for(http, 4, group_by="model")}
    adapter = f"acme/pre@v{registry.client.resolve('acme', 'pre').version}"  # (a model the API takes)
    assert set(by_model) == {BASE, adapter}
    base_in = first.usage.prompt_tokens + response.usage.input_tokens
    base_out = first.usage.completion_tokens + response.usage.output_tokens
    assert (by_model[BASE]["num_model_requests"], by_model[BASE]["input_tokens"]) == (2, base_in)
    assert by_model[BASE]["output_tokens"] == base_out == 3 + 2
    assert by_model[adapter]["num_model_requests"] == 2  # (n=2 is one request: its prompt once, both samples)
    assert by_model[adapter]["input_tokens"] == chat.usage.prompt_tokens + stream_usage.prompt_tokens
    assert by_model[adapter]["output_tokens"] == chat.usage.completion_tokens + stream_usage.completion_tokens == 13

    (total,) = _usage(http)["data"][-1]["results"]  # (not grouped: one result, no model)
    assert total["model"] is None and total["object"] == "organization.usage.completions.result"
    assert total["num_model_requests"] == 4
    assert total["input_tokens"] == base_in + by_model[adapter]["input_tokens"]
    assert [r["model"] for r in _usage(http, group_by="model", models=adapter)["data"][-1]["results"]] == [adapter]
    assert _usage(http, models="nothing-of-ours")["data"][-1]["results"] == []

    _clear_of_minute_end()
    hour = _hour_start()
    hours = _usage(http, bucket_width="1h", group_by="model", limit=24)["data"]  # (today's hours: they sum to the day)
    assert [b["end_time"] - b["start_time"] for b in hours] == [HOUR_S] * len(hours)
    assert hours[0]["start_time"] == _today_start() and hours[-1]["start_time"] in {hour, _hour_start()}
    daily = {(_today_start(), m): [r[c] for c in COUNTS] for m, r in by_model.items()}
    assert _sums(hours) == daily
    minute = _minute_start()  # (the gateway's current bucket is the minute it answered in: this one or the next)
    minutes = _usage(http, bucket_width="1m", group_by="model", limit=1440)["data"]  # (today's minutes: to each hour)
    assert minutes[0]["start_time"] == _today_start() and minutes[-1]["start_time"] in {minute, _minute_start()}
    assert [b["end_time"] - b["start_time"] for b in minutes] == [MINUTE_S] * len(minutes)
    assert _sums(minutes, HOUR_S) == _sums(hours, HOUR_S) and _sums(minutes) == daily

    (theirs,) = _wait_for(gateway.http(beta), 1)  # beta sees its own only
    assert (theirs["num_model_requests"], theirs["input_tokens"], theirs["output_tokens"]) == (1, 2, 7)


def test_buckets_are_utc_days_paged_by_limit(gateway, registry):
    http = gateway.http(registry.tenant("acme"))
    _clear_of_minute_end()
    start = _today_start() - 3 * DAY_S + 5  # (within a day: the bucket starts at its midnight)
    page = http.get(ROUTE, params={"start_time": start, "limit": 2}).json()
    assert page["object"] == "page" and page["has_more"] is True
    assert [b["start_time"] for b in page["data"]] == [_today_start() - 3 * DAY_S, _today_start() - 2 * DAY_S]
    assert all(b["end_time"] - b["start_time"] == DAY_S and b["results"] == [] for b in page["data"])
    rest = http.get(ROUTE, params={"start_time": start, "limit": 2, "page": page["next_page"]}).json()
    assert [b["start_time"] for b in rest["data"]] == [_today_start() - DAY_S, _today_start()]
    assert rest["has_more"] is False and rest["next_page"] is None
    ended = http.get(ROUTE, params={"start_time": start, "end_time": _today_start() - 2 * DAY_S}).json()
    assert len(ended["data"]) == 1 and ended["has_more"] is False  # (end_time is exclusive)


def test_hour_buckets_are_utc_hours_paged_by_limit(gateway, registry):
    http = gateway.http(registry.tenant("acme"))
    _clear_of_minute_end()
    start = _hour_start() - 3 * HOUR_S + 5  # (within an hour: the bucket starts at its first second)
    page = http.get(ROUTE, params={"start_time": start, "limit": 2, "bucket_width": "1h"}).json()
    assert page["has_more"] is True
    assert [b["start_time"] for b in page["data"]] == [_hour_start() - 3 * HOUR_S, _hour_start() - 2 * HOUR_S]
    assert all(b["end_time"] - b["start_time"] == HOUR_S for b in page["data"])
    params = {"start_time": start, "limit": 2, "bucket_width": "1h", "page": page["next_page"]}
    rest = http.get(ROUTE, params=params).json()
    assert [b["start_time"] for b in rest["data"]] == [_hour_start() - HOUR_S, _hour_start()]
    assert rest["has_more"] is False and rest["next_page"] is None
    assert len(http.get(ROUTE, params={"start_time": start, "bucket_width": "1h"}).json()["data"]) == 4  # (limit 24)
    day_cursor = {"start_time": start, "bucket_width": "1h", "page": metering.day_of(start).isoformat()}
    assert "cursor" in error_of(http.get(ROUTE, params=day_cursor))["message"]  # (a 1d cursor on 1h)


def test_minute_buckets_are_utc_minutes_paged_by_limit(gateway, registry):
    http = gateway.http(registry.tenant("acme"))
    minute = _minute_start()
    start, end = minute - 3 * MINUTE_S + 5, minute + MINUTE_S  # (start within a minute: its bucket starts at :00)
    params = {"start_time": start, "end_time": end, "bucket_width": "1m", "limit": 2}
    page = http.get(ROUTE, params=params).json()
    assert page["has_more"] is True
    assert [b["start_time"] for b in page["data"]] == [minute - 3 * MINUTE_S, minute - 2 * MINUTE_S]
    assert all(b["end_time"] - b["start_time"] == MINUTE_S and b["results"] == [] for b in page["data"])
    rest = http.get(ROUTE, params={**params, "page": page["next_page"]}).json()
    assert [b["start_time"] for b in rest["data"]] == [minute - MINUTE_S, minute]
    assert rest["has_more"] is False and rest["next_page"] is None

    day_ago = {"start_time": minute - DAY_S - 90 * MINUTE_S, "end_time": end, "bucket_width": "1m"}
    first = http.get(ROUTE, params=day_ago).json()  # (60 a page by default)
    assert len(first["data"]) == 60 and first["has_more"] is True
    assert first["data"][-1]["start_time"] == minute - DAY_S - 31 * MINUTE_S
    cursor = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(minute - DAY_S - 30 * MINUTE_S))
    assert first["next_page"] == cursor
    widest = http.get(ROUTE, params={**day_ago, "limit": 1440}).json()  # (the most: a day of minutes)
    assert len(widest["data"]) == 1440 and widest["has_more"] is True
    last = http.get(ROUTE, params={**day_ago, "limit": 1440, "page": widest["next_page"]}).json()
    assert [b["start_time"] for b in last["data"]] == list(range(minute - 90 * MINUTE_S, end, MINUTE_S))
    assert last["has_more"] is False


def test_the_current_bucket_is_answered_from_its_first_moment(gateway, registry, monkeypatch):
    """Without end_time the range ends now: at 0.3 s past a day's start, that day, its first hour and minute are the
    last buckets (usage of those 0.3 s may be in them)."""
    http = gateway.http(registry.tenant("acme"))
    midnight = _today_start()
    monkeypatch.setattr(token_usage, "time", SimpleNamespace(time=lambda: midnight + 0.3))
    for width, seconds in (("1d", DAY_S), ("1h", HOUR_S), ("1m", MINUTE_S)):
        buckets = _usage(http, start_time=midnight - seconds, bucket_width=width)["data"]
        assert [b["start_time"] for b in buckets] == [midnight - seconds, midnight], width
    assert _usage(http, start_time=midnight)["data"][0]["start_time"] == midnight  # (a range of 0.3 s: not a 400)


def test_the_minutes_of_an_hour_sum_to_the_hour_per_model(gateway, registry, redis_url):
    """Counts the meter wrote over the last hour's minutes (its clock set to each) read back per minute and per hour."""
    http = gateway.http(registry.tenant("acme"))
    hour = _hour_start() - HOUR_S
    records = [(0, "m1", 10, 1), (0, "m1", 5, 2), (0, "m2", 3, 3), (17, "m2", 4, 4), (59, "m1", 6, 5), (59, "m2", 1, 0)]

    async def meter_the_hour() -> None:
        client = aioredis.Redis.from_url(redis_url)
        clock = [0.0]
        meter = TokenMeter(client, interval_s=60, timeout_s=2.0, max_pending=100, clock=lambda: clock[0])
        try:
            for minute, model, input_tokens, output_tokens in records:
                clock[0] = hour + minute * MINUTE_S + 59.5  # (its last half second: still that minute)
                meter.record("acme", model, input_tokens, output_tokens)
            meter.record("beta", "m1", 1_000, 1_000)  # (another tenant's)
            assert meter.pending == 6  # (one per tenant, minute and model)
            await meter.flush()
            ttl = await client.ttl(metering.minute_key("acme", hour + 17 * MINUTE_S))
            assert metering.MINUTE_RETENTION_DAYS * DAY_S - 60 < ttl <= metering.MINUTE_RETENTION_DAYS * DAY_S
        finally:
            await client.aclose()

    asyncio.run(meter_the_hour())
    params = {"start_time": hour, "group_by": "model"}
    minutes = http.get(ROUTE, params={**params, "bucket_width": "1m"}).json()  # (60 a page: the hour)
    assert [b["start_time"] for b in minutes["data"]] == list(range(hour, hour + HOUR_S, MINUTE_S))
    used = {(b["start_time"] - hour) // MINUTE_S: b["results"] for b in minutes["data"] if b["results"]}
    assert {m: sorted((r["model"], *(r[c] for c in COUNTS)) for r in rs) for m, rs in used.items()} == {
        0: [("m1", 2, 15, 3), ("m2", 1, 3, 3)],
        17: [("m2", 1, 4, 4)],
        59: [("m1", 1, 6, 5), ("m2", 1, 1, 0)],
    }
    (hourly,) = http.get(ROUTE, params={**params, "bucket_width": "1h", "end_time": hour + HOUR_S}).json()["data"]
    expected = {(hour, "m1"): [3, 21, 8], (hour, "m2"): [3, 8, 7]}
    assert _sums(minutes["data"], HOUR_S) == _sums([hourly], HOUR_S) == expected


def test_a_start_time_before_the_minutes_kept_is_a_400_that_changes_nothing(gateway, registry, redis_url):
    http = gateway.http(registry.tenant("acme"))
    kept_s = metering.MINUTE_RETENTION_DAYS * DAY_S
    client = redis.Redis.from_url(redis_url)
    try:
        before = {key: client.type(key) for key in client.scan_iter()}
        answer = http.get(ROUTE, params={"start_time": int(time.time()) - kept_s - 2 * MINUTE_S, "bucket_width": "1m"})
        assert answer.status_code == 400
        message = error_of(answer)["message"]
        assert f"per-minute usage is kept {metering.MINUTE_RETENTION_DAYS} days" in message
        assert "bucket_width=1h" in message
        assert {key: client.type(key) for key in client.scan_iter()} == before
    finally:
        client.close()
    kept = http.get(ROUTE, params={"start_time": int(time.time()) - kept_s + 2 * MINUTE_S, "bucket_width": "1m"})
    assert kept.status_code == 200 and len(kept.json()["data"]) == 60


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "start_time"),
        ({"start_time": 0, "bucket_width": "1m"}, f"kept {metering.MINUTE_RETENTION_DAYS} days"),
        ({"start_time": 0, "bucket_width": "1h"}, f"kept {metering.HOUR_RETENTION_DAYS} days"),
        ({"start_time": 0, "bucket_width": "1w"}, "bucket_width"),
        ({"start_time": 0, "group_by": "project_id"}, "grouped by model only"),
        ({"start_time": 100, "end_time": 100}, "after start_time"),
        ({"start_time": 0, "limit": 32}, "at most 31"),
        ({"start_time": int(time.time()) - 3_600, "bucket_width": "1h", "limit": 169}, "at most 168"),
        ({"start_time": int(time.time()) - 3_600, "bucket_width": "1m", "limit": 1441}, "at most 1440"),
        ({"start_time": 0, "page": "tomorrow"}, "cursor"),
        ({"start_time": 0, "end_time": DAY_S, "page": "2001-01-01"}, "outside"),
        ({"start_time": -1}, "start_time"),
    ],
)
def test_bad_queries_are_400(gateway, registry, params, message):
    http = gateway.http(registry.tenant("acme"))
    answer = http.get(ROUTE, params=params)
    assert answer.status_code == 400
    assert message in error_of(answer)["message"]
    assert gateway.http("preft_unknown_key").get(ROUTE, params={"start_time": 0}).status_code == 401


def test_the_meter_keeps_its_counts_while_redis_is_down_and_sends_each_batch_once(tmp_path, monkeypatch):
    server = RedisServer(tmp_path / "redis", free_port(), persist=True).start()
    monkeypatch.setattr(gateway_metering, "BATCH_ENTRIES", 1)  # (each entry a batch of its own)

    async def scenario() -> None:
        redis = aioredis.Redis.from_url(server.url, decode_responses=True)
        hour = int(time.time()) // HOUR_S * HOUR_S
        clock = [hour + 5 * MINUTE_S + 1.0]  # (the meter's: minute 5 of this hour, then 6)
        meter = TokenMeter(redis, interval_s=60, timeout_s=0.5, max_pending=2, clock=lambda: clock[0])
        day = metering.day_key("acme", metering.day_of(hour))
        minute_5, minute_6 = (metering.minute_key("acme", hour + m * MINUTE_S) for m in (5, 6))

        async def rows(key: str) -> dict[str, tuple[int, int, int]]:
            parsed = metering.parse_day(metering.day_of(hour), await redis.hgetall(key))
            return {r.model: (r.requests, r.input_tokens, r.output_tokens) for r in parsed}

        try:
            meter.record("acme", "m1", 10, 3)
            meter.record("acme", "m1", 5, 1)
            server.stop()
            await meter.flush()  # (refused: kept)
            clock[0] += MINUTE_S
            meter.record("acme", "m1", 7, 2)  # (the next minute: a new entry, two held, the most)
            meter.record("acme", "m3", 1, 1)  # (minute 6 folded into its hour, then m3's hour: dropped)
            assert meter.pending == 2
            server.start()
            await meter.flush()
            assert meter.pending == 0
            assert await rows(day) == await rows(metering.hour_key("acme", hour)) == {"m1": (3, 22, 6)}
            assert (await rows(minute_5), await rows(minute_6)) == ({"m1": (2, 15, 4)}, {})  # (6: in the hour)
            assert 0 < await redis.ttl(day) <= metering.RETENTION_DAYS * DAY_S
            assert 0 < await redis.ttl(minute_5) <= metering.MINUTE_RETENTION_DAYS * DAY_S
            meter.record("acme", "m4", 4, 0)  # (all sent: by minute again)
            meter.record("acme", "m5", 5, 0)
            assert len(meter._unsent) == 1  # (m4's batch sealed at its one entry, m5's being filled)
            await meter.flush()
            assert meter.pending == 0
            sent = await rows(minute_6)
            assert (sent["m4"][1], sent["m5"][1]) == (4, 5)

            batch = Batch({("acme", hour + 6 * MINUTE_S, "m1"): [1, 100, 0]})
            keys, args = batch.script_args()
            applied = [await redis.eval(APPLY_LUA, len(keys), *keys, *args) for _ in range(2)]
            assert applied == [1, 0]  # (sent again under its id: not counted twice)
            assert (await rows(day))["m1"] == (await rows(metering.hour_key("acme", hour)))["m1"] == (4, 122, 6)
            assert (await rows(minute_6))["m1"] == (1, 100, 0)  # (the earlier 7 + 2 went to the hour alone)
            assert 0 < await redis.ttl(metering.hour_key("acme", hour)) <= metering.HOUR_RETENTION_DAYS * DAY_S
        finally:
            await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
