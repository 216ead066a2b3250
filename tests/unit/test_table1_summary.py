"""loadtest.engine.table1_summary: issue 6's table, one row per configuration pooled over the runs that measured it."""

from __future__ import annotations

import json

import pytest
from loadtest.engine.table1_summary import BASE_MODEL, BASE_REQUESTS, _rows, main, markdown, summarize


def _row(config, engine, method, tokens_per_s, pairs=None, rank=8, mode="prefill", requests=1024):
    notes = {"pairs_tokens_per_s": pairs} if pairs else {}
    return {
        "config": config, "model": "qwen05", "engine": engine, "method": method, "rank": rank if method else None,
        "mode": mode if method else None, "requests": requests, "prompt_len": 1024, "output_len": 128,
        "tokens_per_s": tokens_per_s, "prompt_only_s": 2.0, "prompt_only_tokens_per_s": tokens_per_s * 10,
        "seconds": 1.0, "ttft_p50_s": 1.0, "ttft_p95_s": 2.0, "adapter_first_load_s": 0.01, "notes": notes,
    }  # fmt: skip


def _report(path, *rows, max_lora_rank=8, device="NVIDIA H200"):
    engines = {
        "qwen05 preft": {"kwargs": {"max_loras": 512, "max_lora_rank": max_lora_rank}, "max_num_batched_tokens": 16384}
    }
    settings = {"vllm": "0.26.0", "triton": "3.6.0", "lora_kernels": ["expand", "shrink"]}
    if device:
        settings["device"] = device
    path.write_text(json.dumps({"settings": settings, "engines": engines, "results": list(rows)}))
    return path


@pytest.fixture
def reports(tmp_path):
    run_a = _report(
        tmp_path / "run-a.json",
        _row("base (PreFT engine, before any adapter)", "preft", None, 100.0),
        _row("LoRAP r8", "preft", "lora", 80.0, pairs=[[100.0, 90.0], [100.0, 70.0]]),  # 0.8, 0.9, 0.7 of 100
        _row("LoRAP r8 [kernels: none]", "preft", "lora", 1.0),  # an A/B row: left out
    )
    run_b = _report(
        tmp_path / "run-b.json",
        _row("base (PreFT engine, before any adapter)", "preft", None, 200.0),
        _row("base (PreFT engine, after all passes)", "preft", None, 200.0),
        _row("LoRAP r8", "preft", "lora", 190.0),  # 0.95 of run b's base
        _row("DiReFTP r8", "preft", "direft", 210.0),
        max_lora_rank=64,
    )
    earlier = _report(  # made before bench_table1 recorded the device: the command's --device says it
        tmp_path / "old.json",
        _row("base", "base", None, 150.0),
        _row("stock multi-LoRA r8", "stock", "lora", 15.0),
        _row("LoRAP r8", "preft", "lora", 1.0),  # measured again by the current runs: theirs are kept
        _row("LoRA all r8", "preft", "lora", 45.0, mode="all", requests=512),
        _row("base (PreFT engine, before any adapter)", "preft", None, 150.0),
        device=None,
    )
    return [run_a, run_b], [earlier]


def test_each_configuration_pools_every_pass_over_its_own_runs_base(reports):
    current, earlier = reports
    rows = {s.config: s for s in summarize(_rows(current), _rows(earlier, "NVIDIA H200"))}
    lorap = rows["LoRAP r8"]
    assert lorap.code == "current" and lorap.runs == ["run-a", "run-b"] and lorap.passes == 4
    assert lorap.ratio_to_base == 0.85  # median of 0.7, 0.8, 0.9, 0.95: each pass over its own run's base
    assert lorap.ratio_to_base_per_run == {"run-a": 0.8, "run-b": 0.95}  # (their median would be 0.875)
    assert lorap.paired_ratio == 0.8 and lorap.pairs == 2
    assert lorap.tokens_per_s == 85.0 and lorap.ratio_to_stock == 5.667  # 85 over stock's 15 tokens/s
    assert lorap.settings["max_loras"] == 512 and lorap.settings["vllm"] == "0.26.0"
    assert rows["DiReFTP r8"].ratio_to_base == 1.05 and rows["DiReFTP r8"].ratio_to_stock is None
    base = rows[BASE_REQUESTS]  # both runs' base rows, and the base passes of run a's pairs
    assert base.code == "current" and base.passes == 5 and base.ratio_to_base == 1.0
    assert base.tokens_per_s == 100.0


def test_configurations_the_current_runs_lack_come_from_earlier_reports(reports):
    current, earlier = reports
    rows = {s.config: s for s in summarize(_rows(current), _rows(earlier, "NVIDIA H200"))}
    assert not any("[" in c for c in rows)
    assert rows[BASE_MODEL].code == "earlier" and rows[BASE_MODEL].ratio_to_base == 1.0
    stock = rows["stock multi-LoRA r8"]
    assert stock.code == "earlier" and stock.ratio_to_base == 0.1  # against its report's base model
    everything = rows["LoRA all r8"]
    assert everything.code == "earlier" and everything.requests == 512 and everything.ratio_to_stock == 3.0
    assert everything.ratio_to_base == 0.3  # against the base requests of its own (earlier) engine
    ordered = [s.config for s in summarize(_rows(current), _rows(earlier, "NVIDIA H200"))]
    assert ordered == [BASE_MODEL, "stock multi-LoRA r8", BASE_REQUESTS, "DiReFTP r8", "LoRAP r8", "LoRA all r8"]
    table = markdown(summarize(_rows(current), _rows(earlier, "NVIDIA H200")))
    assert "| LoRA all r8, 512 requests (old) | 45 | 0.300 |" in table
    assert "| qwen05 | 1024+128 | base model (vLLM without LoRA) (old) |" in table


def test_a_base_pass_no_adapter_was_compared_with_is_left_out(reports, tmp_path):
    """A run cut short after its base pass: that workload's base requests stay the earlier reports', and the
    other workload's the runs' that compared adapters with them."""
    current, earlier = reports
    lone = _row("base (PreFT engine, before any adapter)", "preft", None, 999.0)
    cut = _report(tmp_path / "run-cut.json", lone | {"prompt_len": 128, "output_len": 1024})
    old = _report(
        tmp_path / "old-128.json",
        _row("base (PreFT engine, before any adapter)", "preft", None, 50.0) | {"prompt_len": 128, "output_len": 1024},
        _row("DiReFTP r8", "preft", "direft", 55.0) | {"prompt_len": 128, "output_len": 1024},
        device=None,
    )
    rows = summarize(_rows([*current, cut]), _rows([*earlier, old], "NVIDIA H200"))
    base = {(s.prompt_len, s.output_len): s for s in rows if s.config == BASE_REQUESTS}
    assert base[(128, 1024)].code == "earlier" and base[(128, 1024)].tokens_per_s == 50.0
    assert base[(1024, 128)].runs == ["run-a", "run-b"] and base[(1024, 128)].tokens_per_s == 100.0


def test_the_command_writes_json_and_plot(reports, tmp_path, capsys, monkeypatch):
    current, earlier = reports
    out = tmp_path / "table" / "gpu-table1"
    argv = ["table1_summary", "--current", *map(str, current), "--earlier", *map(str, earlier), "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit, match=r"old\.json: on which device it ran is not recorded"):
        main()
    monkeypatch.setattr("sys.argv", [*argv, "--device", "NVIDIA H200"])
    main()
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["results"]
    assert report["settings"]["device"] == "NVIDIA H200"
    assert len(rows) == 6 and {r["code"] for r in rows} == {"current", "earlier"}
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| LoRAP r8 | 85 | 0.850 | 0.80 / 0.95 | 0.800 (2) |  | 5.67 |" in capsys.readouterr().out


def _paced(row, period, pair_periods=None):
    row["notes"]["decode_step_period_ms_median"] = period
    if pair_periods:
        row["notes"]["pairs_decode_step_period_ms"] = pair_periods
    return row


def test_paced_ratio_compares_each_pass_with_the_base_at_its_own_host_pace(tmp_path):
    # a host-paced engine: the base's tokens/s goes as period^-0.5; LoRAP runs at 0.9 of it at any pace
    base_at = {10.0: 1000.0, 20.0: 1000.0 / 2**0.5, 40.0: 500.0}
    run = _report(
        tmp_path / "paced.json",
        _paced(_row("base (PreFT engine, before any adapter)", "preft", None, base_at[10.0]), 10.0),
        _paced(_row("base (PreFT engine, after all passes)", "preft", None, base_at[20.0]), 20.0),
        _paced(
            _row("LoRAP r8", "preft", "lora", 0.9 * base_at[40.0], pairs=[[base_at[40.0], 0.9 * base_at[20.0]]]),
            40.0,
            pair_periods=[[40.0, 20.0]],
        ),
    )
    faster = _report(  # another lease's machine, twice as fast at every pace: its own intercept, the same slope
        tmp_path / "faster.json",
        _paced(_row("base (PreFT engine, before any adapter)", "preft", None, 2 * base_at[10.0]), 10.0),
        _paced(_row("base (PreFT engine, after all passes)", "preft", None, 2 * base_at[40.0]), 40.0),
        _paced(_row("LoRAP r8", "preft", "lora", 2 * 0.9 * base_at[20.0]), 20.0),
    )
    lorap = {s.config: s for s in summarize(_rows([run]), [])}["LoRAP r8"]
    assert lorap.paced_ratio == 0.9 and lorap.paced_passes == 2 and lorap.paced_fit_sd == 0.0
    assert lorap.ratio_to_base == pytest.approx(0.768, abs=1e-3)  # the same passes against the base's median
    all_mode = _paced(_row("LoRA all r8", "preft", "lora", 0.2 * base_at[40.0], mode="all"), 40.0)
    everything = _report(tmp_path / "all.json", *json.loads(run.read_text())["results"], all_mode)
    assert summarize(_rows([everything]), [])[-1].paced_ratio is None  # its decode is not the base's: no pace
    both = {s.config: s for s in summarize(_rows([run, faster]), [])}["LoRAP r8"]
    assert both.paced_ratio == 0.9 and both.paced_passes == 3 and both.paced_fit_sd == 0.0


def test_a_device_bound_engines_steady_pace_leaves_its_base_at_the_mean(tmp_path):
    run = _report(
        tmp_path / "steady.json",
        _paced(_row("base (PreFT engine, before any adapter)", "preft", None, 100.0), 30.0),
        _paced(_row("base (PreFT engine, after all passes)", "preft", None, 101.0), 30.3),
        _paced(_row("LoRAP r8", "preft", "lora", 93.0, pairs=[[99.0, 93.0]]), 29.8, pair_periods=[[29.9, 30.1]]),
    )
    lorap = {s.config: s for s in summarize(_rows([run]), [])}["LoRAP r8"]
    assert lorap.paced_ratio == pytest.approx(93.0 / 100.0, abs=2e-3) and lorap.paced_passes == 2


def test_reports_from_different_devices_are_not_pooled(reports, tmp_path, monkeypatch):
    current, _ = reports
    h100 = _report(
        tmp_path / "h100.json",
        _row("base (PreFT engine, before any adapter)", "preft", None, 90.0),
        _row("LoRAP r8", "preft", "lora", 85.0),
        device="NVIDIA H100 80GB HBM3",
    )
    out = tmp_path / "mixed"
    monkeypatch.setattr("sys.argv", ["table1_summary", "--current", *map(str, current), str(h100), "--out", str(out)])
    with pytest.raises(SystemExit, match=r"different devices \(NVIDIA H100 80GB HBM3, NVIDIA H200\)"):
        main()
    assert not out.with_suffix(".json").exists()
