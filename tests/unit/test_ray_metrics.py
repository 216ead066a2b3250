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


def test_chosen_vllm_metrics_are_copied_under_rays_names_and_the_rest_are_not():
    """vLLM's engine metrics (kv cache, queue, tokens, latency histograms) ride the bridge as `vllm_*` (Ray takes
    no `:`); vllm:lora_requests_info, whose labels carry adapter names, and families not chosen stay behind."""
    Twin.made = []
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=reg)
    prompt = Counter("vllm:prompt_tokens", "prompt", labels, registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=(0.1,), registry=reg)
    lora = Gauge("vllm:lora_requests_info", "adapters", ["running_lora_adapters"], registry=reg)
    Counter("vllm:corrupted_requests", "not chosen", labels, registry=reg).labels("m", "0").inc()
    kv.labels("m", "0").set(0.25)
    prompt.labels("m", "0").inc(7)
    ttft.labels("m", "0").observe(0.05)
    lora.labels("tenant-a/secret-adapter").set(1)
    RayMetricsBridge(registry=reg, counter_cls=CounterTwin, gauge_cls=GaugeTwin).push()
    twins = _twins()
    assert set(twins) == {
        "vllm_kv_cache_usage_perc",
        "vllm_prompt_tokens_total",
        "vllm_time_to_first_token_seconds_bucket",
        "vllm_time_to_first_token_seconds_sum",
        "vllm_time_to_first_token_seconds_count",
    }
    assert twins["vllm_kv_cache_usage_perc"].calls == [("set", 0.25, {"model_name": "m", "engine": "0"})]
    assert twins["vllm_prompt_tokens_total"].calls == [("inc", 7.0, {"model_name": "m", "engine": "0"})]
