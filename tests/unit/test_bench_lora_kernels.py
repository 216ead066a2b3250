"""The LoRA kernel benchmark on CPU: both paths run, on the same step, and agree."""

from __future__ import annotations

import torch
from loadtest import bench_lora_kernels


def test_bench_times_both_paths_and_they_agree(expand_kernel_interpreted):
    row = bench_lora_kernels.bench("qwen05", 16, 128, 64, 8, torch.device("cpu"), 1)
    assert row["base_matmuls_ms"] > 0 and row["lora_torch_ms"] > 0 and row["lora_kernel_ms"] > 0
    assert row["max_rel_diff"] < 1e-5
