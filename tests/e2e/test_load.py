"""A short, bounded Locust run against the whole stack: zero failed requests required (no time assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_short_headless_load_run_has_no_failures(stack, tmp_path):
    env = {**os.environ, "PREFT_LOAD_STAGES": "8:2:2,20:4:2,25:2:2"}
    fleet = [sys.executable, "-m", "loadtest.fleet", "--state-dir", str(stack.state_dir), "--tenants", "2",
             "--adapters-per-tenant", "4"]  # fmt: skip
    subprocess.run(fleet, check=True, env=env, timeout=120)
    out = tmp_path / "load"
    run = [sys.executable, "-m", "loadtest.run_load", "--state-dir", str(stack.state_dir), "--run-time", "25s",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(run, env=env, timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["locust"]["requests"] > 0 and report["locust"]["failures"] == 0
    assert {"prefill", "all"} <= set(report["modes"])  # both kinds of adapter traffic were measured
    assert out.with_suffix(".png").is_file() and "| prefill |" in out.with_suffix(".md").read_text()
