"""The expand kernel: y[rows] += z·B[slot]ᵀ over a step's groups, for all of a module's slices in one launch.

It reads B where its slots keep it and adds straight into y's token rows, writing nothing else (the torch path
gathers B, materializes each slice's delta and adds it into a strided slice of y: a large share of a LoRA pass's
device time). An ``ExpandPlan`` holds a module's tables (kept in the worker's ``PlanCache``). Where the padded rank,
z's strides and B's are multiples of 8 (in the engine, always), its RANK_ALIGNED variant loads z's and B's rank
columns in 16-byte vectors, fewer and wider loads (docs/kernels.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import triton_launch
from preft.vllm_plugin.kernels.common import Args, Groups, make_args, precision, step_args, triton, z_vectors
from preft.vllm_plugin.kernels.plans import PlanCache

if triton is not None:
    import triton.language as tl

    from preft.vllm_plugin.kernels.common import _add_rows, _group_rows, _rank_aligned, _slice_entry, jit_options

if triton is not None:

    @triton.jit(**jit_options(["stride_z", "z_slice_step"], ["z_ptr", "slice_table_ptr", "tile_table_ptr"]))
    def _expand_kernel(
        y_ptr,
        z_ptr,
        stride_y,
        stride_z,
        stride_z_col,
        z_slice_step,
        ADD: tl.constexpr,
        rows_ptr,
        block_group_ptr,
        block_start_ptr,
        offs_ptr,
        slots_ptr,
        span_start,
        rank,
        USE_SPAN: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        b0_ptr,
        slice_table_ptr,
        tile_table_ptr,
        stride_b_out,
        stride_b_rank,
        ALIGNED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        RANK_ALIGNED: tl.constexpr,
        COLS_FIRST: tl.constexpr,
    ):
        """y[row(m), slice's first column + n] += z[m, s·z_slice_step :][:rank] · B_s[slot][n]: every slice at once
        (not ADD: y[...] = the product, y's rows not read).
        RANK_ALIGNED: rank, z's row stride and slice step, and each B's offset from b0, slot stride and row
        stride are multiples of 8 elements, z starts 16-byte aligned and its and B's rank columns are
        contiguous (z's and B's rows then load in 16-byte vectors, not an element at a time).

        Program (block, t): row block `block` (or a part of it), and t's entry of the tile table (slice s, its
        first column n0), BLOCK_N columns; (t, block) where COLS_FIRST (``Tiles.cols_first``). The slice table
        holds, per slice: B's offset from b0 in elements, B's slot stride, the slice's width and its first
        column in y.
        """
        m, rows, mask_m, slot = _group_rows(
            tl.program_id(1 if COLS_FIRST else 0),
            rows_ptr,
            block_group_ptr,
            block_start_ptr,
            offs_ptr,
            slots_ptr,
            span_start,
            USE_SPAN,
            SPLIT,
            BLOCK_M,
        )
        tile = tl.program_id(0 if COLS_FIRST else 1)
        s = tl.load(tile_table_ptr + 2 * tile)
        n0 = tl.multiple_of(tl.load(tile_table_ptr + 2 * tile + 1), BLOCK_N)  # (tiles start at multiples)
        entry = slice_table_ptr + 4 * s
        b_offset = tl.load(entry)
        stride_b_slot, width, y_offset = _slice_entry(entry + 1, ALIGNED)
        if RANK_ALIGNED:
            rank, stride_z, z_ptr = _rank_aligned(rank, stride_z, z_ptr)
            z_slice_step, stride_b_out = z_slice_step // 8 * 8, stride_b_out // 8 * 8
            b_offset, stride_b_slot = b_offset // 8 * 8, stride_b_slot // 8 * 8
        b_ptr = b0_ptr + b_offset
        n = n0 + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        mask_n = n < width
        mask_k = k < rank
        z = tl.load(
            z_ptr + m[:, None].to(tl.int64) * stride_z + (s * z_slice_step + k)[None, :] * stride_z_col,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + slot * stride_b_slot + n[None, :].to(tl.int64) * stride_b_out + k[:, None] * stride_b_rank,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc = tl.dot(z.to(b.dtype), b, input_precision=PRECISION)
        _add_rows(y_ptr, rows, mask_m, y_offset + n, mask_n, stride_y, acc, ADD)

    _EXPAND = triton_launch.Launcher(_expand_kernel)


@dataclass(frozen=True)
class ExpandPlan:
    """The expand kernel's tables for some output slices of one module (its weights stay where they are)."""

    b0: torch.Tensor  # the first slice's B, [slots, out, R]: the typed address the table's offsets count from
    slices: torch.Tensor  # int64 [S, 4]: B's offset from b0 (elements), B's slot stride, width, first column in y
    tiles: torch.Tensor  # int64 [T, 2]: slice, first column (in the slice); one program per row block and tile
    block_n: int  # the tiles' width: the expand's columns per program when the plan was made
    args: Args  # the expand's run of arguments that these fix (b0 to PRECISION)
    rank_aligned: bool  # B's rank columns contiguous, b0 16-byte aligned, offsets and strides multiples of 8


def expand_plan(
    b: Sequence[torch.Tensor], columns: Sequence[tuple[int, int]], *, plans: PlanCache
) -> ExpandPlan | None:
    """The tables for these slices' B ([slots, out, R] each) and (first column, width) in y, in tiles of the
    expand's current width; None when their B differ in dtype or row layout (one launch reads them all with
    b0's type and strides)."""
    first = b[0]
    size = first.element_size()
    if any(t.dtype != first.dtype or t.stride()[1:] != first.stride()[1:] for t in b):
        return None
    if any((t.data_ptr() - first.data_ptr()) % size for t in b):
        return None
    widths = [max(0, width) for _, width in columns]
    block_n = settings.current().lora_tiles["expand"].cols
    tiles = tuple(v for s, width in enumerate(widths) for n0 in range(0, width, block_n) for v in (s, n0))
    if not tiles:
        return None
    table = tuple(
        v
        for t, (offset, _), width in zip(b, columns, widths, strict=True)
        for v in ((t.data_ptr() - first.data_ptr()) // size, t.stride(0), width, offset)
    )
    aligned = all(v % 16 == 0 for v in (*widths, *(offset for offset, _ in columns)))
    slices, tile_table = plans.table(table, first.device), plans.table(tiles, first.device)
    values = (first, slices, tile_table, first.stride(1), first.stride(2), aligned, block_n, precision(first.dtype))
    key = (first.dtype, first.data_ptr() % 16, *values[3:])
    rank_aligned = (
        first.stride(2) == 1
        and first.data_ptr() % 16 == 0
        and all(v % 8 == 0 for v in (*table[::4], *table[1::4], first.stride(1)))
    )
    return ExpandPlan(
        b0=first,
        slices=slices,
        tiles=tile_table,
        block_n=block_n,
        args=make_args(values, key),
        rank_aligned=rank_aligned,
    )


def launch_expand(
    y2: torch.Tensor,
    z: torch.Tensor,
    stride_z: int,
    stride_z_col: int,
    z_slice_step: int,
    plan: ExpandPlan,
    groups: Groups,
    add: bool = True,
) -> None:
    """y2's rows (+)= the expand of z: added (add) or stored."""
    tiles = settings.current().lora_tiles["expand"]
    if plan.block_n != tiles.cols:
        raise ValueError(f"the plan's tiles are {plan.block_n} columns wide, the expand's {tiles.cols}")
    step, grid_rows = step_args(groups, tiles)
    y_ptr, stride_y, z_ptr = y2.data_ptr(), y2.stride(0), z.data_ptr()
    call = (stride_y, stride_z, stride_z_col, z_slice_step, add)
    rank_aligned = plan.rank_aligned and stride_z_col == 1 and z_vectors(z_ptr, groups.rank, stride_z, z_slice_step)
    grid = (grid_rows, plan.tiles.shape[0] // 2)
    order = (rank_aligned, tiles.cols_first)
    _EXPAND(
        grid[::-1] if tiles.cols_first else grid,
        (
            y2.dtype,
            y_ptr % 16,
            z.dtype,
            stride_y,
            stride_z_col,
            add,
            step.key,
            plan.args.key,
            tiles.warps,
            tiles.stages,
            *order,
        ),
        (y2, z, *call, *step.tensors, *plan.args.tensors, *order),
        tiles.warps,
        tiles.stages,
        (y_ptr, z_ptr, *call, *step.addresses, *plan.args.addresses, *order),
    )


def _expand(y2: torch.Tensor, z: torch.Tensor, plan: ExpandPlan, z_slice_step: int, groups: Groups) -> None:
    """y2[rows, each slice's columns] += z[:, s·z_slice_step :][:, :rank] @ B_s[slot]ᵀ: one launch."""
    launch_expand(y2, z, z.stride(0), z.stride(1), z_slice_step, plan, groups)


def expand_add(
    y2: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    y_col_offset: int,
    width: int,
    groups: Groups,
    *,
    plans: PlanCache,
) -> None:
    """y2[rows, y_col_offset : +width] += z[:, :rank] @ b[slot][:width, :rank]ᵀ per group.

    y2: [tokens, cols] (token rows); z: [n, ≥ rank] in group order; b: [slots, out, R]; any strides.
    """
    cols = settings.current().lora_tiles["expand"].cols
    key = ("expand", cols, b.data_ptr(), b.dtype, *b.stride(), y_col_offset, width)
    if key not in plans.plans:  # (a kept None: no columns to add)
        plans.plans[key] = expand_plan([b], [(y_col_offset, width)], plans=plans)
    plan = plans.plans[key]
    if plan is not None:
        _expand(y2, z, plan, 0, groups)


def slice_columns(
    sizes: Sequence[int], b: Sequence[torch.Tensor], y_cols: int, offset: int = 0
) -> list[tuple[int, int]]:
    """(first column in y, width) of each output slice, side by side from column `offset`: a slice's width is
    its size cut to its B's rows (b: per slice [..., out, R]) and to y's `y_cols` columns."""
    columns = []
    for size, bi in zip(sizes, b, strict=True):
        columns.append((offset, min(size, bi.shape[-2], y_cols - offset)))
        offset += size
    return columns
