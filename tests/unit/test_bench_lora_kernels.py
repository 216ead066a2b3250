"""The LoRA kernel benchmark on CPU: both paths run, on the same step, and agree."""

from __future__ import annotations

import torch
from loadtest import bench_lora_kernels


def test_bench_times_both_paths_and_they_agree(lora_kernels_interpreted):
    row = bench_lora_kernels.bench("qwen05", 16, 128, 64, 8, torch.device("cpu"), 1)
    assert all(row[f"lora_{path}_ms"] > 0 for path in ("torch", "expand", "expand+shrink"))
    assert row["expand_max_rel_diff"] < 1e-5 and row["expand+shrink_max_rel_diff"] < 1e-5
