"""The platform benchmark's numbers come from a real Prometheus server: counters as differences over a window,
latency quantiles from histogram buckets (loadtest.platform.measure.read_window)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from loadtest.platform.measure import Series, read_window
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from preft.common.loopback import LOOPBACK, wait_until
from preft.stack import free_port
from preft.stack.servers import PrometheusServer

SCRAPE_S = 0.2


@pytest.fixture()
def exporter():
    registry = CollectorRegistry()
    metrics = {
        "generated": Counter("bench_generated_tokens_total", "", registry=registry),
        "prompt": Counter("bench_prompt_tokens_total", "", registry=registry),
        "requests": Counter("bench_requests_total", "", registry=registry),
        "errors": Counter("bench_errors_total", "", registry=registry),
        "ttft": Histogram("bench_ttft_seconds", "", buckets=(0.1, 0.2, 0.4, 0.8), registry=registry),
    }
    port = free_port()
    server, thread = start_http_server(port, addr=LOOPBACK, registry=registry)
    try:
        yield port, metrics
    finally:
        server.shutdown()
        thread.join(5)


def test_a_window_reads_what_happened_inside_it_and_nothing_before(tmp_path: Path, exporter) -> None:
    port, m = exporter
    series = Series(
        generated="bench_generated_tokens_total",
        prompt="bench_prompt_tokens_total",
        requests="bench_requests_total",
        ttft="bench_ttft_seconds_bucket",
        itl="bench_ttft_seconds_bucket",
        http_errors="bench_errors_total",
    )
    with PrometheusServer(tmp_path, free_port(), {"bench": [f"{LOOPBACK}:{port}"]}, scrape_interval_s=SCRAPE_S) as prom:
        wait_until(lambda: prom.query("up", time.time())[0]["value"][1] == "1", timeout_s=20, what="first scrape")
        m["generated"].inc(1000)  # before the window: must not count
        m["ttft"].observe(0.75)
        time.sleep(4 * SCRAPE_S)
        t0 = time.time()
        time.sleep(2 * SCRAPE_S)
        m["generated"].inc(300)
        m["prompt"].inc(2400)
        m["requests"].inc(3)
        for v in (0.15, 0.15, 0.35):
            m["ttft"].observe(v)
        time.sleep(6 * SCRAPE_S)
        t1 = time.time()
        time.sleep(3 * SCRAPE_S)
        row = read_window(prom, series, t0, t1)
    window = t1 - t0
    assert row["output_tok_s"] == pytest.approx(300 / window, rel=0.01)
    assert row["total_tok_s"] == pytest.approx(2700 / window, rel=0.01)
    assert (row["requests"], row["failed"]) == (3, 0)
    # p50 inside the (0.1, 0.2] bucket and p95 inside (0.2, 0.4]; the 0.75 before the window is left out
    assert 0.1 < row["ttft_p50_s"] <= 0.2
    assert 0.2 < row["ttft_p95_s"] <= 0.4
