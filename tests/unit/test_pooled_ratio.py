"""bench_table1's pooled ratio: a configuration's passes against every base pass of its engine and workload."""

from __future__ import annotations

from loadtest.engine.bench_table1 import pool_ratios


def _row(config, method, tokens_per_s, pairs=None, run=None, prompt_len=1):
    notes = {"pairs_tokens_per_s": pairs} if pairs else {}
    return {"config": config, "engine": "preft", "method": method, "tokens_per_s": tokens_per_s, "run": run,
            "model": "m", "prompt_len": prompt_len, "output_len": 1, "notes": notes}  # fmt: skip


def test_the_medians_of_all_passes_not_the_passes_next_to_each_other():
    rows = [
        _row("base", None, 100.0),
        _row("LoRAP", "lora", 90.0, pairs=[[200.0, 95.0], [50.0, 80.0]]),  # pairs: 0.475 and 1.6
        _row("DiReFTP", "direft", 99.0, pairs=[[104.0, 101.0]]),
        _row("base, after", None, 110.0),
        _row("LoRAP", "lora", 10.0, run="other"),  # another run's engine, whose base is not here: no reference
        _row("LoRAP", "lora", 10.0, prompt_len=2),  # another workload: likewise
    ]
    pool_ratios(rows)
    bases = sorted([100.0, 110.0, 200.0, 50.0, 104.0])  # every base pass of the engine: median 104
    assert bases[2] == 104.0
    assert [r["pooled_ratio"] for r in rows] == [
        None,
        round(90.0 / 104.0, 3),
        round(100.0 / 104.0, 3),
        None,
        None,
        None,
    ]
