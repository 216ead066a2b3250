"""A layer's base GEMMs and LoRA with the LoRA's delta first: is the expand's read and write of y worth saving?

    python3 -m loadtest.bench_lora_addmm --out $OUT/gpu-lora-addmm   # on the GPU machine

On Qwen's prefill steps the expand is most of the LoRA's device time: it reads and writes y after the base
GEMM wrote it. Delta first, the expand stores the LoRA's product into y (no read: ``split_linear(add=False)``)
and the base GEMM adds itself on top (``y.addmm_(x, Wᵀ)``: cuBLAS reads y in its epilogue, beta = 1). Times,
on a full prefill step of each model (16,384 tokens in groups of 1,024, 512 slots, rank 8, every token
adapted), a decoder layer's four linears: the base GEMMs alone, the engine's order (GEMM, then shrink and
expand adding into y), and delta first. In the engine a step's rows without an adapter would also need y's
zeros before the addmm; here every row has one.
"""

from __future__ import annotations

import torch

from loadtest.bench_lora_kernels import _timed, step
from loadtest.bench_lora_launch import per_model_main
from preft.vllm_plugin import lora_kernels


def bench(model: str, rank: int, iters: int, tokens: int = 16384, device: str = "cuda") -> dict:
    """The three orders' ms per layer (`tokens`, `device`: a smaller run, e.g. under Triton's interpreter)."""
    device = torch.device(device)
    modules, ys, groups = step(model, rank, tokens, min(1024, tokens), 512, device)
    plans = [lora_kernels.split_plan(y, x, a, b, s) for (x, _, a, b, s), y in zip(modules, ys, strict=True)]

    def base() -> None:
        for (x, w, *_), y in zip(modules, ys, strict=True):
            torch.matmul(x, w.t(), out=y)

    def gemm_then_lora() -> None:
        for (x, w, *_), y, plan in zip(modules, ys, plans, strict=True):
            torch.matmul(x, w.t(), out=y)
            lora_kernels.split_linear(y, x, plan, 1.0, groups)

    def delta_first() -> None:
        for (x, w, *_), y, plan in zip(modules, ys, plans, strict=True):
            lora_kernels.split_linear(y, x, plan, 1.0, groups, add=False)
            y.addmm_(x, w.t())

    row: dict = {"model": model, "rank": rank, "tokens": tokens}
    results = {}
    for name, fn in (("base", base), ("gemm_then_lora", gemm_then_lora), ("delta_first", delta_first)):
        row[f"{name}_ms"] = _timed(fn, device, iters)[0] * 1e3
        fn()
        results[name] = [y.float() for y in ys]
    row["lora_ms"] = row["gemm_then_lora_ms"] - row["base_ms"]
    row["lora_delta_first_ms"] = row["delta_first_ms"] - row["base_ms"]
    row["delta_first_speedup"] = row["gemm_then_lora_ms"] / row["delta_first_ms"]
    row["delta_first_max_rel_diff"] = max(
        float((d - t).abs().max() / t.abs().max())
        for d, t in zip(results["delta_first"], results["gemm_then_lora"], strict=True)
    )
    return row


def main() -> None:
    with lora_kernels.using("expand", "shrink"):
        per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
