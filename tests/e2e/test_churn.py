"""Churn with a token-exact check, shortened (the full run: `python -m loadtest.churn --requests 2000`, its results in
loadtest/results/churn.json): adapters uploaded, republished, re-aliased, deleted and recreated through the gateway
while 4 clients ask for them (pinned versions, aliases, latest, the base model, both modes, shared prompt prefixes),
on an engine with 2 GPU slots, 4 adapters in host memory and a small disk tier. Every answer must be the HF + peft
reference's tokens of a version that may have served it (vLLM #47724: an in-flight request served with another
adapter after a runtime add_lora; #30931: prefix-cache blocks shared by two adapters of one name)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 300


def test_every_answer_under_churn_is_its_versions_reference(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    cmd = [sys.executable, "-m", "loadtest.churn", "--requests", str(REQUESTS), "--out", str(out)]
    cmd += ["--state-dir", str(tmp_path / "state")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["mismatches"] == 0, json.dumps(r["mismatch_details"], indent=1)
    assert r["text_mismatches"] == 0, r["text_mismatch_details"]  # (the text: the tokens' text, specials left out)
    assert done.returncode == 0, done.stderr[-6000:]
    assert r["requests"] == REQUESTS and r["checked"] >= 0.9 * REQUESTS, r["errors_by_status"]
    # every kind of request was checked, in both modes, and the churn did each of its operations
    assert {"checked_base", "checked_pinned", "checked_alias", "checked_latest"} <= set(r["by_kind"]), r["by_kind"]
    assert set(r["requests_by_mode"]) == {"prefill", "all"}
    assert {"publish", "alias", "delete_version", "delete_adapter"} <= set(r["churn_ops"]), r["churn_ops"]
    assert not r["churn_op_errors"], r["churn_op_errors"]
    # the tiers turned over and the prefix cache was hit
    metrics = r["engine_metrics_delta"]
    assert metrics["preft_paging_evictions{tier=host}"] > 0 and metrics["preft_paging_evictions{tier=disk}"] > 0
    assert metrics["vllm:prefix_cache_hits"] > 0, metrics
