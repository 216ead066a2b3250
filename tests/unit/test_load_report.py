"""The load report's arithmetic: counter deltas and histogram quantiles per mode."""

from __future__ import annotations

import pytest
from loadtest.report import Samples, summarize
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


def _exposition(ttft_values: dict[str, list[float]], requests: dict[tuple[str, str], int]) -> str:
    reg = CollectorRegistry()
    ttft = Histogram("preft_time_to_first_token_seconds", "t", ["mode"], buckets=(0.1, 0.2, 0.4, 0.8), registry=reg)
    reqs = Counter("preft_requests_total", "r", ["tenant", "method", "mode", "outcome"], registry=reg)
    gen = Counter("preft_generated_tokens_total", "g", ["tenant", "method", "mode"], registry=reg)
    for mode, values in ttft_values.items():
        for v in values:
            ttft.labels(mode).observe(v)
    for (mode, outcome), n in requests.items():
        reqs.labels("t", "lora", mode, outcome).inc(n)
        gen.labels("t", "lora", mode).inc(10 * n)
    return generate_latest(reg).decode()


def test_deltas_and_quantiles_per_mode():
    before = Samples.parse([_exposition({"prefill": [0.05] * 10}, {("prefill", "ok"): 10})])
    after_text = _exposition(
        {"prefill": [0.05] * 10 + [0.15] * 50 + [0.3] * 50, "all": [0.7] * 4},
        {("prefill", "ok"): 110, ("all", "ok"): 3, ("all", "error"): 1},
    )
    delta = Samples.parse([after_text]).minus(before)
    summary = summarize(delta, duration_s=10.0)
    assert summary["prefill"]["requests"] == 100 and summary["prefill"]["error_rate"] == 0
    assert summary["prefill"]["generated_tokens_per_s"] == pytest.approx(100.0)
    # 100 new observations: 50 in (0.1, 0.2], 50 in (0.2, 0.4]: the median sits at the 0.2 boundary
    assert summary["prefill"]["ttft_p50_s"] == pytest.approx(0.2)
    assert summary["prefill"]["ttft_p90_s"] == pytest.approx(0.2 + 0.2 * 0.8)
    assert summary["all"]["error_rate"] == pytest.approx(0.25)
    assert summary["all"]["ttft_p50_s"] == pytest.approx(0.4 + 0.4 * 0.5)
    assert "base" not in summary  # no traffic, no row
