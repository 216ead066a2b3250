"""The meter's batch (pure logic): each (tenant, minute, model) entry on its minute's, hour's and day's hashes, the
minutes of one hour or day summed into one increment per field, each hash with its width's TTL; and a meter that
holds its most entries folding minutes into hours."""

from __future__ import annotations

from datetime import UTC, datetime

import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from preft.common import metering
from preft.gateway.core import metering as gateway_metering
from preft.gateway.core.metering import BATCH_PREFIX, Batch, TokenMeter

HOUR = int(datetime(2026, 3, 31, 23, tzinfo=UTC).timestamp())  # (the last hour of a month)


def _decoded(batch: Batch) -> tuple[dict[str, tuple[int, dict[str, int]]], dict[str, int]]:
    """The script's arguments read back: per hash its TTL and increments, per month counter its increment."""
    keys, args = batch.script_args()
    assert keys[0] == BATCH_PREFIX + batch.batch_id
    n_hashes, at, hashes = int(args[1]), 3, {}
    for key in keys[1 : n_hashes + 1]:
        ttl, pairs = int(args[at]), int(args[at + 1])
        fields = args[at + 2 : at + 2 + 2 * pairs]
        hashes[key] = (ttl, {str(f): int(v) for f, v in zip(fields[::2], fields[1::2], strict=True)})
        at += 2 + 2 * pairs
    months = dict(zip(keys[n_hashes + 1 :], (int(v) for v in args[at:]), strict=True))
    return hashes, months


def test_entries_go_to_their_minute_hour_and_day_with_each_widths_ttl():
    batch = Batch(
        {
            ("acme", HOUR, "m1"): [2, 10, 3],
            ("acme", HOUR + 59 * 60, "m1"): [1, 5, 0],  # (output 0: no field written)
            ("acme", HOUR + 59 * 60, "m2"): [1, 7, 1],
            ("beta", HOUR, "m1"): [1, 1, 1],
        }
    )
    hashes, months = _decoded(batch)
    day = metering.day_key("acme", metering.day_of(HOUR))
    minute_0, minute_59 = metering.minute_key("acme", HOUR), metering.minute_key("acme", HOUR + 59 * 60)
    assert minute_59 == "preft:usage-minute:acme:2026-03-31T23:59"
    days = {"m": metering.MINUTE_RETENTION_DAYS, "h": metering.HOUR_RETENTION_DAYS, "d": metering.RETENTION_DAYS}
    ttl = {width: metering.DAY_S * n for width, n in days.items()}
    m1 = {metering.field(c, "m1"): v for c, v in zip(metering.COUNTERS, (3, 15, 3), strict=True)}
    m2 = {metering.field(c, "m2"): v for c, v in zip(metering.COUNTERS, (1, 7, 1), strict=True)}
    assert hashes[minute_0] == (ttl["m"], dict(zip(m1, (2, 10, 3), strict=True)))
    assert hashes[minute_59] == (ttl["m"], {"requests|m1": 1, "input_tokens|m1": 5, **m2})
    assert hashes[metering.hour_key("acme", HOUR)] == (ttl["h"], {**m1, **m2})  # (one increment per field)
    assert hashes[day] == (ttl["d"], {**m1, **m2})
    assert len(hashes) == 7  # (acme's two minutes, its hour and day; beta's minute, hour and day)
    assert months == {"preft:usage-month:acme:2026-03": 26, "preft:usage-month:beta:2026-03": 2}


def test_a_full_meter_keeps_hours_days_and_months_whole_and_gives_up_minutes(monkeypatch):
    monkeypatch.setattr(gateway_metering, "BATCH_ENTRIES", 2)
    clock = [HOUR + 0.5]
    unreachable = aioredis.Redis.from_url("redis://127.0.0.1:1")  # (recording never reaches Redis)
    meter = TokenMeter(unreachable, interval_s=60, timeout_s=1.0, max_pending=4, clock=lambda: clock[0])
    coarsened, dropped = (
        REGISTRY.get_sample_value(f"preft_gateway_metering_{name}_total") or 0.0 for name in ("coarsened", "dropped")
    )
    for minute in range(4):  # (four minutes of m1: a sealed batch of two, two being filled; the most held)
        clock[0] = HOUR + minute * 60 + 0.5
        meter.record("acme", "m1", 10, 1)
    sealed = dict(meter._unsent[0].counts)
    meter.record("acme", "m2", 7, 0)  # (a new entry past the most: minutes given up, then counted by hour)
    meter.record("acme", "m2", 7, 0)
    assert REGISTRY.get_sample_value("preft_gateway_metering_coarsened_total") == coarsened + 1  # (two into one)
    first, hours = meter._unsent
    assert first.counts == sealed and not first.hours  # (the first unsent batch may be in Redis: kept whole)
    assert hours.hours and hours.counts == {("acme", HOUR, "m1"): [2, 20, 2]}
    assert meter._filling.hours and meter._filling.counts == {("acme", HOUR, "m2"): [2, 14, 0]}
    hashes, months = _decoded(hours)
    assert set(hashes) == {metering.hour_key("acme", HOUR), metering.day_key("acme", metering.day_of(HOUR))}
    assert months == {"preft:usage-month:acme:2026-03": 22}
    meter.record("beta", "m1", 1, 1)  # (the hours fill max_pending too: dropped)
    assert meter.pending == 4 and REGISTRY.get_sample_value("preft_gateway_metering_dropped_total") == dropped + 1
