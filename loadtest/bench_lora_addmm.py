"""A layer's base GEMMs and LoRA in three orders: which would pay in the engine?

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

from loadtest.bench_lora_kernels import _timed, max_rel_diff, step
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

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def side_shrink() -> None:
        main = torch.cuda.current_stream(device)
        for (x, w, *_), y, plan in zip(modules, ys, plans, strict=True):
            side.wait_stream(main)  # x is written, and the last layer's expand has read the side's z
            with torch.cuda.stream(side):
                z, stride_z = lora_kernels.plan_shrink(x, plan, 1.0, groups, groups.rows.shape[0])
            torch.matmul(x, w.t(), out=y)
            main.wait_stream(side)
            lora_kernels.plan_expand(y, z, stride_z, plan, groups)

    orders = [("base", base), ("gemm_then_lora", gemm_then_lora), ("delta_first", delta_first)]
    if side is not None:
        orders.append(("side_shrink", side_shrink))
    row: dict = {"model": model, "rank": rank, "tokens": tokens}
    results = {}
    for name, fn in orders:
        row[f"{name}_ms"] = _timed(fn, device, iters)[0] * 1e3
        fn()
        results[name] = [y.to(torch.float32, copy=True) for y in ys]
    row["lora_ms"] = row["gemm_then_lora_ms"] - row["base_ms"]
    for name, _ in orders[2:]:
        row[f"lora_{name}_ms"] = row[f"{name}_ms"] - row["base_ms"]
        row[f"{name}_speedup"] = row["gemm_then_lora_ms"] / row[f"{name}_ms"]
        row[f"{name}_max_rel_diff"] = max_rel_diff(results[name], results["gemm_then_lora"])
    return row


def main() -> None:
    with lora_kernels.using("expand", "shrink"):
        per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
