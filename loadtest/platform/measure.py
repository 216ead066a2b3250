"""One saturating run: Locust at a fixed concurrency for a warm-up and a measured window, then the window's numbers
read from Prometheus (PromQL over the window; Locust's own counts are kept only as a cross-check)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from preft.stack.servers import PrometheusServer

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True)
class Series:
    """Where one server kind keeps its numbers, and the label selector of one mode's requests."""

    generated: str
    prompt: str
    requests: str
    ttft: str
    itl: str
    http_errors: str  # answers of the completion route that were not 2xx, as clients saw them
    paging: bool = False  # the platform's engine: its paging counters are read too


def platform_series(method: str, mode: str) -> Series:
    """The platform: token and request counters and latency histograms of the engine replicas, by method and mode
    (the latency histograms carry the mode alone); client errors counted at the gateway."""
    selector = f'method="{method}",mode="{mode}"'
    return Series(
        generated=f"preft_generated_tokens_total{{{selector}}}",
        prompt=f"preft_prompt_tokens_total{{{selector}}}",
        requests=f'preft_requests_total{{{selector},outcome="ok"}}',
        ttft=f'preft_time_to_first_token_seconds_bucket{{mode="{mode}"}}',
        itl=f'preft_inter_token_latency_seconds_bucket{{mode="{mode}"}}',
        http_errors='preft_gateway_requests_total{route="/v1/completions",status_class=~"4xx|5xx"}',
        paging=True,
    )


VLLM_SERIES = Series(
    generated="vllm:generation_tokens_total",
    prompt="vllm:prompt_tokens_total",
    requests="vllm:request_success_total",
    ttft="vllm:time_to_first_token_seconds_bucket",
    itl="vllm:inter_token_latency_seconds_bucket",
    http_errors='http_requests_total{handler="/v1/completions",status=~"4xx|5xx"}',
)


@dataclass(frozen=True)
class Load:
    """The workload and how long it is held."""

    host: str
    targets: list[dict]
    prompt_tokens: int
    output_tokens: int
    vocab: int
    concurrency: int
    popularity: str = "uniform"
    extra: dict | None = None
    warmup_s: float = 15.0
    window_s: float = 30.0
    probes: tuple[dict, ...] = ()  # {"api_key", "model"} asked once each mid-warm-up (their answers kept, not counted)


def _delta(aggregation: str, selector: str, t0: float, t1: float) -> str:
    """PromQL for `aggregation (selector)`'s growth from t0 to t1, exactly: the `@` modifier pins both ends (no
    extrapolation, unlike increase(), which stretches each bucket by its own factor in a short window). A series
    born inside the window counts from zero."""
    at0, at1 = f"{aggregation} ({selector} @ {t0:.3f})", f"{aggregation} ({selector} @ {t1:.3f})"
    return f"({at1} - ({at0} or {at1} * 0))"


def _value(prom: PrometheusServer, promql: str, at: float) -> float:
    result = prom.query(promql, at)
    return float(result[0]["value"][1]) if result else 0.0


def _quantile(prom: PrometheusServer, buckets: str, q: float, t0: float, t1: float) -> float | None:
    result = prom.query(f"histogram_quantile({q}, {_delta('sum by (le)', buckets, t0, t1)})", t1)
    value = float(result[0]["value"][1]) if result else float("nan")
    return None if value != value else round(value, 4)  # (NaN: no observation in the window)


def read_window(prom: PrometheusServer, series: Series, t0: float, t1: float) -> dict:
    """The window's throughput, latency quantiles and errors, from the counters' and buckets' growth over it."""
    window = t1 - t0
    delta = {
        name: _value(prom, _delta("sum", getattr(series, name), t0, t1), t1)
        for name in ("generated", "prompt", "requests", "http_errors")
    }
    return {
        "output_tok_s": round(delta["generated"] / window, 1),
        "total_tok_s": round((delta["generated"] + delta["prompt"]) / window, 1),
        "ttft_p50_s": _quantile(prom, series.ttft, 0.5, t0, t1),
        "ttft_p95_s": _quantile(prom, series.ttft, 0.95, t0, t1),
        "itl_p50_s": _quantile(prom, series.itl, 0.5, t0, t1),
        "itl_p95_s": _quantile(prom, series.itl, 0.95, t0, t1),
        "requests": round(delta["requests"]),
        "failed": round(delta["http_errors"]),
        "window_s": round(window, 1),
    }


def probe(host: str, targets: tuple[dict, ...], timeout_s: float) -> list[dict]:
    """One short completion for each target, all at once: [{model, status, seconds, error}] (error: the answer's
    message, or the client's exception)."""

    def ask(target: dict) -> dict:
        body = {"model": target["model"], "prompt": "w3 w4 w5 w6", "max_tokens": 1, "temperature": 0}
        started = time.monotonic()
        try:
            resp = httpx.post(
                f"{host}/v1/completions", json=body, timeout=timeout_s,
                headers={"Authorization": f"Bearer {target['api_key']}"},
            )  # fmt: skip
            status, error = resp.status_code, "" if resp.is_success else resp.text[:200]
        except httpx.HTTPError as e:
            status, error = 0, f"{type(e).__name__}: {e}"[:200]
        return {"model": target["model"], "status": status, "seconds": round(time.monotonic() - started, 3),
                "error": error, "answered_at": time.time()}  # fmt: skip

    with ThreadPoolExecutor(max(1, len(targets))) as pool:
        return list(pool.map(ask, targets))


def read_paging(prom: PrometheusServer, t0: float, t1: float) -> dict:
    """The engine's paging over the window: adapters loaded into host memory and fetched from S3, and how long a
    load into host memory took (p50, p95: the fetch from S3 or the disk included)."""
    return {
        "host_loads": round(_value(prom, _delta("sum", 'preft_paging_misses_total{tier="host"}', t0, t1), t1)),
        "s3_fetches": round(_value(prom, _delta("sum", 'preft_paging_hits_total{tier="s3"}', t0, t1), t1)),
        "host_load_p50_s": _quantile(prom, 'preft_paging_load_seconds_bucket{tier="host"}', 0.5, t0, t1),
        "host_load_p95_s": _quantile(prom, 'preft_paging_load_seconds_bucket{tier="host"}', 0.95, t0, t1),
    }


def _probe_later(load: Load) -> list[dict]:
    """The probes, asked once the load has ramped up (a quarter of the users a second), half-way into the warm-up;
    each may take until the window ends (behind a backlog of adapters being paged in)."""
    time.sleep(load.warmup_s / 2)
    return probe(load.host, load.probes, timeout_s=load.warmup_s / 2 + load.window_s)


def run(load: Load, prom: PrometheusServer, series: Series, scrape_s: float) -> dict:
    """Hold the load for warm-up + window, read the window from Prometheus, and add Locust's totals of the whole run
    (`locust_requests`, `locust_failures`, the first failure reasons). The probes are asked once the load has
    ramped up, inside the warm-up, under the same load; their answers are not the load's."""
    with tempfile.TemporaryDirectory(prefix="preft-load-") as tmp:
        targets = Path(tmp) / "targets.json"
        targets.write_text(json.dumps(load.targets))
        env = {
            **os.environ,
            "PREFT_SAT_TARGETS": str(targets),
            "PREFT_SAT_POPULARITY": load.popularity,
            "PREFT_SAT_PROMPT_TOKENS": str(load.prompt_tokens),
            "PREFT_SAT_OUTPUT_TOKENS": str(load.output_tokens),
            "PREFT_SAT_VOCAB": str(load.vocab),
            "PREFT_SAT_EXTRA": json.dumps(load.extra or {}),
        }
        total_s = load.warmup_s + load.window_s + 2 * scrape_s
        cmd = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", load.host,
            "-u", str(load.concurrency), "-r", str(max(1, load.concurrency // 4)), "--run-time", f"{total_s:.0f}s",
            "--stop-timeout", "0", "--csv", f"{tmp}/locust", "--only-summary", "--loglevel", "WARNING",
        ]  # fmt: skip
        with open(f"{tmp}/stderr", "w") as stderr:
            locust = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        started = time.time()
        t0 = started + load.warmup_s
        t1 = t0 + load.window_s
        probing = ThreadPoolExecutor(1)
        probed = probing.submit(_probe_later, load) if load.probes else None
        try:
            locust.wait(timeout=total_s + 120)
        except subprocess.TimeoutExpired:
            locust.kill()
            raise
        time.sleep(max(0.0, t1 + 2 * scrape_s - time.time()))  # the window's last scrape has landed
        row = read_window(prom, series, t0, t1)
        if series.paging:
            row["paging"] = read_paging(prom, t0, t1)
        row.update(_locust_totals(Path(tmp)))
        if probed is not None:
            row["probes"] = probed.result()
            # a probe answered inside the window counts in the gateway's errors: not the load's
            row["failed"] -= sum(1 for p in row["probes"] if p["status"] >= 400 and t0 <= p["answered_at"] <= t1)
        probing.shutdown()
    return row


def _locust_totals(tmp: Path) -> dict:
    stats = tmp / "locust_stats.csv"
    rows = (
        [r for r in csv.DictReader(stats.read_text().splitlines()) if r["Name"] == "Aggregated"]
        if stats.exists()
        else []
    )
    failures = tmp / "locust_failures.csv"
    reasons = (
        [r["Error"][:160] for r in csv.DictReader(failures.read_text().splitlines())][:3] if failures.exists() else []
    )
    out = {
        "locust_requests": int(rows[0]["Request Count"]) if rows else 0,
        "locust_failures": int(rows[0]["Failure Count"]) if rows else 0,
    }
    if reasons:
        out["failure_reasons"] = reasons
    if not rows:
        out["locust_stderr"] = (tmp / "stderr").read_text()[-2000:]
    return out
