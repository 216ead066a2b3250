"""A replica's `preft_*` metrics, copied into Ray's metrics so that a fleet's per-pod scrape sees every replica.

Every engine metric lives in the replica's prometheus_client registry (`common.metrics`, served at the replica's
`/metrics`), but behind Serve's proxy that endpoint reaches one random replica. What Prometheus can scrape per pod is
Ray's metrics agent (each Ray node's metrics port: the PodMonitor in deploy/), and it exports only `ray.util.metrics`.
So the bridge copies the registry's samples there at an interval: counter samples (a counter's `_total`, a
histogram's `_bucket`, `_sum` and `_count`) as Ray counters, by what they rose since the last copy; gauges as Ray
gauges, by value. A histogram so keeps its exact buckets and sum (a Ray histogram would keep buckets only and report
each observation's bucket midpoint as its sum). Ray's counters take only rises, so a sample still at 0 (an empty
low bucket) appears in Ray's export once it first rises.

Ray exports each as `ray_<name>`, with `_total` appended to a counter whose name lacks it, and labels of its own
(`WorkerId`, `NodeAddress`, ...); the PodMonitor's relabelings (`deploy/base/monitoring/servicemonitor.yaml`, the
chart's `monitoring.yaml`) give the samples back their own names, so alerts and dashboards read `preft_*` alike from
the gateway's scrape and the engine's.

vLLM's own engine metrics (`vllm:*`, its PrometheusStatLogger, which AsyncLLM registers in the same process registry
when `EngineOptions.log_stats` is on) ride the same copy, those of `VLLM_METRICS` only: vLLM's
`vllm:lora_requests_info` labels a sample with adapter names (unbounded), and the rest are detail the dashboards and
alerts do not read. Ray takes no `:` in a name, so `vllm:x` goes as `vllm_x` (exported `ray_vllm_x`), and the
PodMonitor names it `vllm:x` again. (vLLM's RayPrometheusStatLogger, which Ray Serve LLM passes as a stat logger,
would record them in Ray directly, but all of them, adapter names included, and a histogram's sum from bucket
midpoints; this copy touches no vLLM internal: the names are vLLM's documented Prometheus metrics.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "preft_"
GATEWAY_PREFIX = "preft_gateway_"  # (declared beside the engine's, recorded only by the gateway)
COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# vLLM's metric families copied (prometheus_client family names, a counter's without `_total`) and their types;
# the same names in vLLM 0.26 and 0.28 but TPOT's (0.28: request_time_per_output_token_seconds; the older
# time_per_output_token_seconds is copied where a release still has it).
VLLM_METRICS = {
    "vllm:kv_cache_usage_perc": "gauge",  # (a fraction, 0-1, despite its name)
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def copied(family_name: str) -> bool:
    """Whether the bridge copies this family: preft's engine metrics and the chosen vLLM ones."""
    if family_name.startswith(PREFIX):
        return not family_name.startswith(GATEWAY_PREFIX)
    return family_name in VLLM_METRICS


def ray_name(sample_name: str) -> str:
    """The name a sample goes to Ray under (Ray takes [a-zA-Z0-9_] only: vLLM's `vllm:` becomes `vllm_`)."""
    return sample_name.replace(":", "_")


class RayMetricsBridge:
    """Owns the Ray twins of the registry's engine samples and the last value copied of each counter sample.

    `counter_cls` and `gauge_cls` make a metric from (name, description, tag_keys): Ray's by default.
    """

    def __init__(
        self,
        *,
        registry: Collector = REGISTRY,
        counter_cls: Callable[..., Any] | None = None,
        gauge_cls: Callable[..., Any] | None = None,
    ) -> None:
        if counter_cls is None or gauge_cls is None:
            from ray.util import metrics as ray_metrics

            counter_cls, gauge_cls = counter_cls or ray_metrics.Counter, gauge_cls or ray_metrics.Gauge
        self._registry = registry
        self._counter_cls, self._gauge_cls = counter_cls, gauge_cls
        self._twins: dict[str, Any] = {}
        self._copied: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._task: asyncio.Task[None] | None = None

    def push(self) -> int:
        """Copy every engine sample (and the chosen vLLM ones) once; returns how many were recorded (a counter that
        did not rise is not)."""
        recorded = 0
        for family in self._registry.collect():
            if not copied(family.name):
                continue
            for sample in family.samples:
                if family.type == "gauge":
                    self._twin(sample.name, family.documentation, sample.labels, self._gauge_cls).set(
                        sample.value, tags=sample.labels
                    )
                    recorded += 1
                elif sample.name.endswith(COUNTER_SUFFIXES):  # (not `_created`: a timestamp, not a count)
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    rise = sample.value - self._copied.get(key, 0.0)
                    if rise < 0:  # (a registry cleared in between: start again from its value)
                        rise = sample.value
                    self._copied[key] = sample.value
                    if rise > 0:
                        self._twin(sample.name, family.documentation, sample.labels, self._counter_cls).inc(
                            rise, tags=sample.labels
                        )
                        recorded += 1
        return recorded

    def _twin(self, name: str, documentation: str, labels: dict[str, str], cls: Callable[..., Any]) -> Any:
        twin = self._twins.get(name)
        if twin is None:
            twin = self._twins[name] = cls(ray_name(name), description=documentation, tag_keys=tuple(sorted(labels)))
        return twin

    def start(self, interval_s: float) -> None:
        """Copy every `interval_s` seconds until `stop` (a failed copy is logged and the next one tried)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(interval_s), name="ray-metrics-bridge")

    async def _run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.push()
            except Exception:  # never let the copy loop die
                logger.exception("copying the replica's metrics into Ray's failed")

    async def stop(self) -> None:
        """Stop the loop and copy once more (what the replica counted since the last copy)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            self.push()
        except Exception as e:  # (the replica is stopping: its last counts are lost, nothing else)
            logger.warning("the last copy of the replica's metrics into Ray's failed: %s", e)
