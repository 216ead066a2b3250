"""Live requests beside a running batch, with and without the fleet's cap on batch requests at the engines, in one run.

    .venv/bin/python -m loadtest.bench_batch_isolation [--lines 5000] [--probes 32] [--cap 16]

Starts the local stack (`preft up`'s: Redis, S3, the registry, the real engine, vLLM on CPU behind Ray Serve, one
replica with room for `max_ongoing_requests` 64 requests; the stack's own gateway runs no batches) in a temporary
directory. Then, for each cap (none, then `--cap`), a gateway of its own whose batch runner sends up to 128 of a
batch's lines at once, twice the replica's room, so that without a cap Ray Serve's first-come-first-served queue in
front of the replica fills with batch lines:
- idle: `--probes` live chat requests (the demo LoRA adapter, streamed, `--probe-tokens` tokens), one after another;
- busy: a batch of `--lines` chat lines (`--line-tokens` tokens each) is created through that gateway; once its lines
  have filled the engine (`--settle-s` after the first line is answered), the same probes; then the batch is
  cancelled and the gateway stopped.
Each probe's time to first token and to its last token is measured from this process. The report (printed, and written
with a plot to loadtest/results/batch-isolation.{json,png}) gives each phase's p50/p95, busy ÷ idle for each cap, and
the no-cap busy p50 ÷ the capped busy p50 (how much the cap spares live traffic), and what the cap costs the batch: its
lines answered a second while the busy probes ran, capped ÷ uncapped. Everything shares this machine's two cores (the
engine, the gateways, Redis, S3 and this client): the absolute times are this machine's, the ratios are the result.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from preft.common.loopback import LOOPBACK
from preft.stack import free_port, wait_until
from preft.stack.local import DEMO_FILE, LocalStack, StackPorts
from preft.stack.process import ManagedProcess

ADAPTER = "demo-lora"
# one batch at a time, 128 of its lines at once; its counts recorded every second (the batch's pace is read off them)
RUNNER = {"BATCHES_MAX_RUNNING": "1", "BATCHES_LINE_CONCURRENCY": "128", "BATCHES_POLL_S": "0.2", "BATCHES_PART_S": "1"}


def _probe(client: openai.OpenAI, tokens: int) -> tuple[float, float] | str:
    """One live streamed chat request: (time to first token, time to its end), in seconds; or the error it got."""
    started = time.perf_counter()
    first = None
    try:
        stream = client.chat.completions.create(
            model=ADAPTER,
            messages=[{"role": "user", "content": "how are the adapters paged?"}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
    except openai.APIError as e:
        return f"{getattr(e, 'status_code', None)}: {e.message}"
    return first if first is not None else float("nan"), time.perf_counter() - started


def _probes(client: openai.OpenAI, count: int, tokens: int) -> dict[str, Any]:
    answers = [_probe(client, tokens) for _ in range(count)]
    timed = [a for a in answers if isinstance(a, tuple)]
    return {
        "ttft_s": [t for t, _ in timed],
        "latency_s": [total for _, total in timed],
        "errors": [a for a in answers if isinstance(a, str)],
    }


def _batch_input(lines: int, tokens: int) -> bytes:
    rows = []
    for i in range(lines):
        body = {
            "model": ADAPTER,
            "messages": [{"role": "user", "content": f"summarise request {i} of the batch"}],
            "max_tokens": tokens,
            "ignore_eos": True,
        }
        rows.append(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(rows) + "\n").encode()


def _answered(client: openai.OpenAI, batch_id: str) -> int:
    """Lines of the batch recorded as answered so far (its counts move a part at a time)."""
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed + counts.failed if counts else 0


def _stats(values: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}


def _phase(stack: LocalStack, key: str, cap: int, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Idle probes, then probes beside a batch, through a gateway whose batch cap is `cap` (0: none)."""
    port = free_port()
    env = {**stack.gateway_env(port), **{f"PREFT_GATEWAY__{k}": v for k, v in RUNNER.items()}}
    env["PREFT_GATEWAY__BATCHES_MAX_LINES_IN_FLIGHT"] = str(cap)
    gateway = ManagedProcess(f"gateway-cap{cap}", logs / f"gateway-cap{cap}.log")
    gateway.spawn([sys.executable, "-m", "preft.gateway"], cwd=stack.state_dir, env=env)
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, timeout_s=60, what="gateway")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
        _probes(client, 2, args.probe_tokens)  # (warm: the adapter resident, the connections open)
        idle = _probes(client, args.probes, args.probe_tokens)
        upload = client.files.create(
            file=("lines.jsonl", io.BytesIO(_batch_input(args.lines, args.line_tokens))), purpose="batch"
        )
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_until(lambda: _answered(client, batch.id) > 0, timeout_s=300, what="the batch's first answers")
        time.sleep(args.settle_s)
        answered, started = _answered(client, batch.id), time.perf_counter()
        busy = _probes(client, args.probes, args.probe_tokens)
        window_s = time.perf_counter() - started
        lines = _answered(client, batch.id) - answered
        status = client.batches.retrieve(batch.id).status
        client.batches.cancel(batch.id)
        return {
            "cap": cap,
            "idle": idle,
            "busy": busy,
            "batch_status_after": status,
            "batch_lines_per_s": lines / window_s,  # (while the busy probes ran; counts move a part, ~1 s, at a time)
        }
    finally:
        gateway.stop()


def _brief(value: Any) -> Any:
    """A phase's probes as the summary prints them: their percentiles and errors, not every time."""
    if isinstance(value, dict) and "ttft" in value:
        return {"ttft": value["ttft"], "latency": value["latency"], "errors": len(value["errors"])}
    return value


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, p50s, p95s = [], [], []
    for phase in report["phases"]:
        name = "no cap" if phase["cap"] == 0 else f"cap {phase['cap']}"
        for state in ("idle", "busy"):
            labels.append(f"{name}\n{state}")
            p50s.append(phase[state]["ttft"]["p50"])
            p95s.append(phase[state]["ttft"]["p95"])
    x = np.arange(len(labels))
    ax.bar(x - 0.2, p50s, 0.4, label="TTFT p50")
    ax.bar(x + 0.2, p95s, 0.4, label="TTFT p95")
    ax.set_xticks(x, labels)
    ax.set_ylabel("seconds")
    ax.set_title("Live requests beside a batch (vLLM on CPU, one Serve replica)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=5000, help="Lines of the batch (more than the probes outlast)")
    ap.add_argument("--line-tokens", type=int, default=32)
    ap.add_argument("--probes", type=int, default=32, help="Live requests per phase, one after another")
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--cap", type=int, default=16, help="The capped phase's batches_max_lines_in_flight")
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/batch-isolation"))
    args = ap.parse_args()

    os.environ["PREFT_GATEWAY__BATCHES_MAX_RUNNING"] = "0"  # (the stack's own gateway runs no batches)
    with tempfile.TemporaryDirectory(prefix="preft-isolation-") as tmp:
        ports = StackPorts(**{f.name: free_port() for f in fields(StackPorts)})
        stack = LocalStack(Path(tmp), ports)
        try:
            stack.start()
            key = json.loads((stack.state_dir / DEMO_FILE).read_text())["api_key"]
            phases = [_phase(stack, key, cap, args, stack.state_dir / "logs") for cap in (0, args.cap)]
        finally:
            stack.stop()

    for phase in phases:
        for state in ("idle", "busy"):
            phase[state] = {
                "ttft": _stats(phase[state]["ttft_s"]),
                "latency": _stats(phase[state]["latency_s"]),
                **phase[state],
            }
        phase["busy_over_idle_ttft_p50"] = phase["busy"]["ttft"]["p50"] / phase["idle"]["ttft"]["p50"]
    uncapped, capped = phases
    report = {
        "settings": {**vars(args), "out": str(args.out), "runner": RUNNER, "engine_max_ongoing_requests": 64},
        "phases": phases,
        "uncapped_over_capped_busy_ttft_p50": uncapped["busy"]["ttft"]["p50"] / capped["busy"]["ttft"]["p50"],
        "uncapped_over_capped_busy_latency_p50": uncapped["busy"]["latency"]["p50"] / capped["busy"]["latency"]["p50"],
        "capped_over_uncapped_batch_lines_per_s": capped["batch_lines_per_s"] / uncapped["batch_lines_per_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, args.out.with_suffix(".png"))
    summary = {k: v for k, v in report.items() if k != "phases"}
    summary["phases"] = [{k: _brief(v) for k, v in p.items()} for p in phases]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
