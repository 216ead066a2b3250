"""The copy of a replica's preft_* metrics into Ray's (engine.ray_metrics), with recording twins in place of Ray's
metric classes (the real ones, exported by a real Ray node: tests/integration/engine/test_serve_app.py)."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from preft.engine.ray_metrics import RayMetricsBridge


class Twin:
    """What a Ray Counter or Gauge was asked to record: (value, tags) per call."""

    made: ClassVar[list[Twin]] = []

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
        self.name, self.description, self.tag_keys = name, description, tag_keys
        self.calls: list[tuple[str, float, dict[str, str]]] = []
        Twin.made.append(self)

    def inc(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys)
        self.calls.append(("inc", value, tags))

    def set(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys)
        self.calls.append(("set", value, tags))


class CounterTwin(Twin):
    pass


class GaugeTwin(Twin):
    pass


@pytest.fixture
def registry():
    Twin.made = []
    registry = CollectorRegistry()
    requests = Counter("preft_requests_total", "requests", ["tenant", "mode"], registry=registry)
    ttft = Histogram("preft_time_to_first_token_seconds", "ttft", ["mode"], buckets=(0.1, 1.0), registry=registry)
    depth = Gauge("preft_queue_depth", "depth", ["service"], registry=registry)
    Histogram("preft_gateway_overhead_seconds", "gateway only", buckets=(0.1,), registry=registry)
    Counter("other_total", "not preft's", registry=registry).inc()
    return registry, requests, ttft, depth


def _twins() -> dict[str, Twin]:
    return {t.name: t for t in Twin.made}


def test_counters_are_copied_by_their_rise_and_gauges_by_value(registry):
    reg, requests, ttft, depth = registry
    bridge = RayMetricsBridge(registry=reg, counter_cls=CounterTwin, gauge_cls=GaugeTwin)
    requests.labels("t1", "prefill").inc(3)
    ttft.labels("prefill").observe(0.5)
    ttft.labels("prefill").observe(0.05)
    depth.labels("engine").set(4)
    assert bridge.push() == 7  # requests, 3 buckets, sum, count, the gauge
    twins = _twins()
    assert set(twins) == {
        "preft_requests_total",
        "preft_time_to_first_token_seconds_bucket",
        "preft_time_to_first_token_seconds_sum",
        "preft_time_to_first_token_seconds_count",
        "preft_queue_depth",
    }  # no _created timestamps, nothing of the gateway's or outside preft_
    assert isinstance(twins["preft_requests_total"], CounterTwin)
    assert isinstance(twins["preft_queue_depth"], GaugeTwin)
    assert twins["preft_requests_total"].calls == [("inc", 3.0, {"tenant": "t1", "mode": "prefill"})]
    assert twins["preft_requests_total"].description == "requests"
    buckets = twins["preft_time_to_first_token_seconds_bucket"]
    assert buckets.tag_keys == ("le", "mode")
    assert sorted((c[2]["le"], c[1]) for c in buckets.calls) == [("+Inf", 2.0), ("0.1", 1.0), ("1.0", 2.0)]
    assert twins["preft_time_to_first_token_seconds_sum"].calls == [("inc", pytest.approx(0.55), {"mode": "prefill"})]
    assert twins["preft_queue_depth"].calls == [("set", 4.0, {"service": "engine"})]

    assert bridge.push() == 1  # nothing rose: the gauge alone
    requests.labels("t1", "prefill").inc(2)
    requests.labels("t2", "all").inc()
    depth.labels("engine").dec()
    assert bridge.push() == 3
    assert twins["preft_requests_total"].calls[1:] == [
        ("inc", 2.0, {"tenant": "t1", "mode": "prefill"}),
        ("inc", 1.0, {"tenant": "t2", "mode": "all"}),
    ]
    assert twins["preft_queue_depth"].calls[-1] == ("set", 3.0, {"service": "engine"})
    assert len(Twin.made) == 5  # one twin per sample name, made once


def test_the_loop_copies_at_its_interval_and_once_more_on_stop(registry):
    reg, requests, _, _ = registry
    bridge = RayMetricsBridge(registry=reg, counter_cls=CounterTwin, gauge_cls=GaugeTwin)

    async def scenario() -> None:
        bridge.start(0.05)
        requests.labels("t1", "prefill").inc()
        await asyncio.sleep(0.2)
        assert _twins()["preft_requests_total"].calls == [("inc", 1.0, {"tenant": "t1", "mode": "prefill"})]
        requests.labels("t1", "prefill").inc(5)
        await bridge.stop()  # before the next tick: stop copies what is left

    asyncio.run(scenario())
    assert _twins()["preft_requests_total"].calls[-1] == ("inc", 5.0, {"tenant": "t1", "mode": "prefill"})
