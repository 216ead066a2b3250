"""Down's shrink with its input columns split over programs (split-K), against the engine's shrink, on the GPU.

    python3 -m loadtest.bench_shrink_splitk --models qwen05,llama8b --ranks 64,8 --out $OUT/gpu-shrink-splitk

Down's shrink reads the activation, [16,384 × intermediate], in 256 programs of 64 rows, each over all of its
input columns (4,864 on Qwen2.5-0.5B: 76 steps of 64): on the H100, 65.6 µs on Qwen at rank 64 (run 158), 2.4
TB/s, where a plain read moves ~3. Here an experimental kernel (this file only) splits each row block's input
columns over SPLIT_K programs, each adding its float32 partial z into a zeroed float32 z with atomics (the zeroing
timed with it), against the engine's shrink (``lora_kernels.plan_shrink``) and cuBLAS's dense x·A₀ᵀ for one slot
(no groups: what the shape allows). Device time a call (CUDA graph replays); z checked against the engine's.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import triton
import triton.language as tl

from loadtest.bench_lora_kernels import device_us, step
from loadtest.bench_lora_launch import per_model_main
from preft.vllm_plugin import lora_kernels

CELLS = [
    (split, cols, warps, stages) for split in (1, 2, 4, 8) for cols in (64, 128) for warps, stages in ((4, 3), (4, 4))
]
CELLS += [(split, 64, 8, 4) for split in (2, 4)]


@triton.jit
def _splitk_shrink(
    x_ptr,
    a_ptr,
    z_ptr,
    block_slot_ptr,
    stride_x,
    stride_a_slot,
    stride_z,
    in_cols,
    rank,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """z[t] (+)= x[t, part] · A[slot(block)][:, part]ᵀ over program_id(1)'s part of the input columns."""
    pid_m = tl.program_id(0)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    part = tl.cdiv(tl.cdiv(in_cols, SPLIT_K), BLOCK_C) * BLOCK_C
    start = tl.program_id(1) * part
    end = tl.minimum(start + part, in_cols)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    a_rows = a_ptr + slot * stride_a_slot + r[None, :] * in_cols
    for c0 in tl.range(start, end, BLOCK_C, num_stages=STAGES):
        c = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=(c < end)[None, :], other=0.0)
        a = tl.load(a_rows + c[:, None], mask=(c < end)[:, None] & (r < rank)[None, :], other=0.0)
        acc = tl.dot(x, a, acc)
    ptrs = z_ptr + rows[:, None] * stride_z + r[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(z_ptr.dtype.element_ty), mask=(r < rank)[None, :])
    else:
        tl.atomic_add(ptrs, acc, mask=(r < rank)[None, :], sem="relaxed")


def bench(model: str, rank: int, iters: int) -> dict:
    device = torch.device("cuda")
    modules, ys, groups = step(model, rank, 16384, 1024, 512, device)
    x, _, a, _, _ = modules[3]  # down's
    a0 = a[0]  # [slots, 1, rank, in]
    tokens, in_cols = x.shape
    row: dict = {"model": model, "rank": rank, "tokens": tokens, "in_cols": in_cols}
    with lora_kernels.using("expand", "shrink"):
        plan = lora_kernels.split_plan(ys[3], x, a, modules[3][3], modules[3][4])
        z_ref, _ = lora_kernels.plan_shrink(x, plan, 1.0, groups, tokens, by_row=True)
        z_ref = z_ref[: tokens * groups.rank].view(tokens, groups.rank).float().clone()
        row["engine_us"] = device_us(lambda: lora_kernels.plan_shrink(x, plan, 1.0, groups, tokens, by_row=True),
                                     device, iters)  # fmt: skip
    dense_a = a0[0, 0]
    row["cublas_one_slot_us"] = device_us(lambda: torch.matmul(x, dense_a.t()), device, iters)
    slots = np.asarray(groups.token_slots)
    block_slot = torch.tensor(slots[::64], device=device, dtype=torch.int64)  # (every 64-row block: one request's)
    rank_pad = groups.rank
    assert rank_pad == a0.shape[2], (rank_pad, a0.shape)
    block_r = max(16, triton.next_power_of_2(rank_pad))
    z32 = torch.zeros(tokens, rank_pad, device=device, dtype=torch.float32)
    z16 = torch.zeros(tokens, rank_pad, device=device, dtype=x.dtype)
    for split, cols, warps, stages in CELLS:
        out = z16 if split == 1 else z32

        def run(split=split, cols=cols, warps=warps, stages=stages, out=out) -> None:
            if split > 1:
                out.zero_()
            _splitk_shrink[(tokens // 64, split)](
                x, a0, out, block_slot, x.stride(0), a0.stride(0), out.stride(0), in_cols, rank_pad,
                BLOCK_M=64, BLOCK_R=block_r, BLOCK_C=cols, SPLIT_K=split, STAGES=stages, num_warps=warps,
            )  # fmt: skip

        label = f"split{split} c{cols} w{warps} s{stages}"
        cell = {"us": device_us(run, device, iters)}
        run()
        cell["max_rel_diff"] = float((out.float() - z_ref).abs().max() / z_ref.abs().max())
        row[label] = cell
        print(model, rank, label, json.dumps(cell), flush=True)
    print(model, rank, "engine", row["engine_us"], "cublas one slot", row["cublas_one_slot_us"], flush=True)
    return row


def main() -> None:
    per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
