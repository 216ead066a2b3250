"""The LoRA kernel benchmark on CPU: every path runs, on the same step, and agree."""

from __future__ import annotations

import torch
from loadtest import bench_lora_kernels


def test_bench_times_both_paths_and_they_agree(lora_kernels_interpreted):
    row = bench_lora_kernels.bench("qwen05", 16, 128, 64, 8, torch.device("cpu"), 1)
    paths = ("expand", "expand+shrink", "fused")
    assert row["lora_torch_ms"] > 0 and all(row[f"lora_{path}_ms"] > 0 for path in paths)
    assert all(row[f"{path}_max_rel_diff"] < 1e-5 for path in paths)
