"""The GPU platform benchmark, rehearsed at tiny scale on CPU: the same script, every part real (Redis, SeaweedFS,
the registry, a Ray Serve engine, the gateway, Prometheus, Locust, `vllm serve` peers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
WINDOW_S, CONCURRENCY = 6, 4  # (the cpu-tiny preset's concurrency)


def _bench(phase: str, out: Path, state: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "loadtest.platform", phase, "--preset", "cpu-tiny", "--out", str(out)]
    cmd += ["--state-dir", str(state), "--port-base", "0", "--window-s", str(WINDOW_S), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def test_every_mode_and_peer_is_measured_from_prometheus_with_no_failed_request(tmp_path: Path) -> None:
    out, state = tmp_path / "results" / "cpu-platform", tmp_path / "state"
    _bench("platform", out, state, "--modes", "base,lorap,direftp,lora_all", "--popularity", "zipf", "--no-sweep")
    _bench("peers", out, state, "--popularity", "zipf")
    data = json.loads(out.with_suffix(".json").read_text())
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"base", "lorap", "direftp", "lora_all", "vllm_base", "vllm_lora"}
    for mode, run in runs.items():
        assert run["failed"] == 0 and run["locust_failures"] == 0, (mode, run)
        assert run["requests"] > 0 and run["output_tok_s"] > 0, (mode, run)
        # every answer had exactly the workload's tokens, so the window's two token counts keep its proportion, but for
        # the requests cut by the window's two edges (prompt counted, answer not yet, or the reverse): at most the
        # concurrency's worth of requests at each edge
        edges = 2 * CONCURRENCY * (64 + 16) / WINDOW_S
        assert abs(run["total_tok_s"] - run["output_tok_s"] * (64 + 16) / 16) <= edges, (mode, run)
        assert run["ttft_p50_s"] is not None and run["itl_p50_s"] is not None, (mode, run)
    # adapters whose weight blob is missing or corrupt, asked for under the load: a clear 503, the load unharmed
    probes = {p["model"]: p for p in runs["lorap"]["probes"]}
    assert set(probes) == {"broken-missing", "broken-corrupt"}
    for how, p in (("missing", probes["broken-missing"]), ("corrupt", probes["broken-corrupt"])):
        assert p["status"] == 503 and how in p["error"], p
    assert [c["tier"] for c in data["cold_start"]] == ["s3", "host", "disk"]
    assert data["paging"]["preft_paging_hits_total"]["s3"] >= 4 + 48  # cold-start adapters and the fleet's first uses
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
