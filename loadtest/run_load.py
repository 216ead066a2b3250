"""One bounded, headless load run against a running stack, then the per-mode report.

    .venv/bin/python -m loadtest.run_load --run-time 60s --out loadtest/results/local-load

Scrapes the stack's Prometheus endpoints, runs Locust headless (loopback only, stages from PREFT_LOAD_STAGES or
the locustfile's table, capped by --run-time), scrapes again, and writes OUT.md / OUT.png / OUT.json. Exits
non-zero when any request failed or none succeeded (Locust's own exit code, plus a check of its totals), so CI can
run it briefly; it asserts no absolute times.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from loadtest.report import Samples, scrape, summarize, write
from preft.stack.local import StackInfo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", type=Path, default=Path(".preft/stack"))
    ap.add_argument("--run-time", default="60s", help="Hard cap on the Locust run (e.g. 60s, 5m)")
    ap.add_argument("--metrics-url", action="append", default=None, help="Prometheus endpoint (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/local-load"))
    ap.add_argument("--title", default="local stack (tiny model, CPU)")
    args = ap.parse_args()
    info = StackInfo.read(args.state_dir)
    if info is None:
        raise SystemExit(f"no running stack in {args.state_dir} (start it with `preft up`)")
    metrics_urls = args.metrics_url or info.metrics_urls
    fleet = args.state_dir / "fleet.json"
    if not fleet.is_file():
        raise SystemExit(f"{fleet} is missing: create it with `python -m loadtest.fleet`")

    csv_prefix = args.out.parent / f"{args.out.name}-locust"
    csv_prefix.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "locust", "-f", str(Path(__file__).with_name("locustfile.py")), "--headless",
        "--host", info.gateway_url, "--run-time", args.run_time, "--csv", str(csv_prefix), "--only-summary",
        "--stop-timeout", "30",
    ]  # fmt: skip
    env = {**os.environ, "PREFT_LOAD_FLEET": str(fleet)}
    before = Samples.parse(scrape(metrics_urls))
    started = time.monotonic()
    code = subprocess.run(cmd, env=env, check=False).returncode
    duration_s = time.monotonic() - started
    time.sleep(1.0)  # let the last requests' metrics land
    delta = Samples.parse(scrape(metrics_urls)).minus(before)

    totals = _locust_totals(Path(f"{csv_prefix}_stats.csv"))
    summary = summarize(delta, duration_s)
    meta = {
        "title": args.title,
        "command": shlex.join(["python", "-m", "loadtest.run_load", *sys.argv[1:]]),
        "duration_s": duration_s,
        "locust": f"{totals['requests']} requests, {totals['failures']} failures",
    }
    write(summary, meta, args.out)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "locust": totals, "modes": summary}, indent=2))
    print(args.out.with_suffix(".md").read_text())
    if code != 0 or totals["failures"] or not totals["requests"]:
        raise SystemExit(code or 1)


def _locust_totals(path: Path) -> dict[str, int]:
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    return (
        {"requests": int(rows[0]["Request Count"]), "failures": int(rows[0]["Failure Count"])}
        if rows
        else {
            "requests": 0,
            "failures": 0,
        }
    )


if __name__ == "__main__":
    main()
