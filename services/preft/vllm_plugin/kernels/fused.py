"""The fused kernel: a whole LoRA linear, y[rows, slice i] += (scale · x·A_i[slot]ᵀ)·B_i[slot]ᵀ, in one launch.

Fewest launches: each program recomputes its rows' z. It serves where picked alone, or beside the shrink and expand
pair from ``policy.FUSED_FROM_RANK`` on (``policy.fuses``). Its plans (``LinearPlan``) are kept in the worker's
``PlanCache``. It loads z's and B's rank columns an element at a time (its RANK_ALIGNED variant was slower: each
program recomputes z, so the loads it would widen are not the ones that cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preft.vllm_plugin.kernels import triton_launch
from preft.vllm_plugin.kernels.common import Groups, aligned, block, can_shrink, group_args, precision, triton
from preft.vllm_plugin.kernels.expand import slice_columns
from preft.vllm_plugin.kernels.plans import PlanCache

if triton is not None:
    import triton.language as tl

    from preft.vllm_plugin.kernels.common import _add_rows, _group_rows, _shrink_rows, _slice_entry, jit_options

_BLOCK_N = 128  # the fused kernel: output columns per tile
_BLOCK_C = 64  # the fused kernel: input columns per iteration
_FUSED_WARPS, _FUSED_STAGES = 4, 3  # the fused kernel's launch (Triton's defaults on CUDA)


if triton is not None:

    @triton.jit(**jit_options(["cols_per_program"], ["slice_table_ptr", "tile_table_ptr"]))
    def _lora_kernel(
        x_ptr,
        y_ptr,
        slice_table_ptr,
        tile_table_ptr,
        rows_ptr,
        block_group_ptr,
        block_start_ptr,
        offs_ptr,
        slots_ptr,
        span_start,
        in_cols,
        rank,
        scale,
        cols_per_program,
        stride_x,
        stride_y,
        stride_a_slot,
        stride_a_rank,
        stride_b_out,
        stride_b_rank,
        USE_SPAN: tl.constexpr,
        ALIGNED: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """y[row(m), slice's columns] += (scale · x[row(m)] · A[slot]ᵀ) · B[slot]ᵀ: a LoRA linear in one launch.

        Program (t, block): row block `block`, and the columns [col0, col0 + cols_per_program) of one slice,
        t's entry of the tile table (slice, col0). The slice table holds, per slice: A's and B's addresses,
        B's slot stride, the slice's width and its first column in y. Each program computes its rows' z for
        its slice (the programs of one row block run side by side, so x's rows come from L2 after the first).
        """
        _, rows, mask_m, slot = _group_rows(
            tl.program_id(1),
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
        tile = tl.program_id(0)
        s = tl.load(tile_table_ptr + 2 * tile)
        col0 = tl.multiple_of(tl.load(tile_table_ptr + 2 * tile + 1), BLOCK_N)  # (ranges start at multiples)
        entry = slice_table_ptr + 5 * s
        a_ptr = tl.multiple_of(tl.load(entry).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)  # (can_fuse)
        b_ptr = tl.multiple_of(tl.load(entry + 1).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
        stride_b_slot, width, y_offset = _slice_entry(entry + 2, ALIGNED)
        k = tl.arange(0, BLOCK_R)
        mask_k = k < rank
        a_cols = a_ptr + slot * stride_a_slot + k * stride_a_rank
        z = _shrink_rows(x_ptr, a_cols, mask_k, rows, mask_m, in_cols, scale, stride_x, BLOCK_M, BLOCK_C, PRECISION)
        col_end = tl.minimum(col0 + cols_per_program, width)
        for n0 in range(col0, col_end, BLOCK_N):  # (cols_per_program is a multiple of BLOCK_N: only width masks)
            n = n0 + tl.arange(0, BLOCK_N)
            mask_n = n < width
            b = tl.load(
                b_ptr + slot * stride_b_slot + n[None, :].to(tl.int64) * stride_b_out + k[:, None] * stride_b_rank,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc = tl.dot(z, b, input_precision=PRECISION)
            _add_rows(y_ptr, rows, mask_m, y_offset + n, mask_n, stride_y, acc)

    _FUSED = triton_launch.Launcher(_lora_kernel)


def can_fuse(x2: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether the fused kernel takes these: as the shrink kernel, and every B in x's dtype with one row layout,
    16-byte aligned."""
    first = b[0]
    alike = all(t.dtype == x2.dtype and t.stride()[1:] == first.stride()[1:] for t in b)
    return alike and can_shrink(x2, a) and aligned(b)


@dataclass(frozen=True)
class LinearPlan:
    """The fused kernel's tables for one LoRA linear: per slice, and per column range of a program."""

    slices: torch.Tensor  # int64 [S, 5]: A's address, B's address, B's slot stride, width, first column in y
    tiles: torch.Tensor  # int64 [T, 2]: slice, first column (in the slice)
    cols_per_program: int
    aligned: bool  # every width and first column a multiple of 16


def column_ranges(widths: Sequence[int], in_cols: int) -> tuple[list[tuple[int, int]], int]:
    """Each program's (slice, first column) in one row block, and the columns each program covers.

    Every program computes its rows' z itself, reading x's rows again (from L2 once the row block's first
    program read them): a row block gets as many programs as keep those extra reads within twice y's own
    traffic (each y element is read and written), and at least one per slice.
    """
    tiles = [-(-w // _BLOCK_N) for w in widths]
    programs = max(sum(t > 0 for t in tiles), min(sum(tiles), 1 + 2 * sum(widths) // in_cols))
    per_program = -(-sum(tiles) // programs)
    ranges = [(s, i * per_program * _BLOCK_N) for s, n in enumerate(tiles) for i in range(-(-n // per_program))]
    return ranges, per_program * _BLOCK_N


def linear_plan(
    x2: torch.Tensor,
    y2: torch.Tensor,
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    slices: Sequence[int],
    *,
    plans: PlanCache,
) -> LinearPlan:
    key = (x2.shape[1], y2.shape[1], *slices, *(t.data_ptr() for t in (*a, *b)), *(t.stride(0) for t in b))
    plan = plans.plans.get(key)
    if plan is None:
        columns = slice_columns(slices, b, y2.shape[1])
        offsets, widths = [o for o, _ in columns], [max(0, w) for _, w in columns]
        ranges, cols = column_ranges(widths, x2.shape[1])
        table = [(ai.data_ptr(), bi.data_ptr(), bi.stride(0)) for ai, bi in zip(a, b, strict=True)]
        plan = plans.plans[key] = LinearPlan(
            slices=plans.table(
                tuple(v for t, w, o in zip(table, widths, offsets, strict=True) for v in (*t, w, o)), x2.device
            ),
            tiles=plans.table(tuple(v for r in ranges for v in r), x2.device),
            cols_per_program=cols,
            aligned=all(v % 16 == 0 for v in (*widths, *offsets)),
        )
    return plan


def lora_linear(
    y2: torch.Tensor,
    x2: torch.Tensor,
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    output_slices: Sequence[int],
    scale: float,
    groups: Groups,
    *,
    plans: PlanCache,
) -> None:
    """y2[rows, slice i] += (scale · x2[rows] @ A_i[slot]ᵀ) @ B_i[slot]ᵀ for every slice: one launch.

    y2: [tokens, out], x2: [tokens, in] (token rows); a: per slice [slots, R, in]; b: per slice [slots, out_i, R].
    """
    plan = linear_plan(x2, y2, a, b, output_slices, plans=plans)
    if plan.tiles.numel() == 0:
        return
    rank = groups.rank
    use_span, block_r, product = groups.span is not None, block(rank), precision(x2.dtype)
    shape = (x2.shape[1], x2.stride(0), y2.stride(0), a[0].stride(0), a[0].stride(1), b[0].stride(1), b[0].stride(2))
    key = (x2.dtype, x2.data_ptr() % 16, y2.dtype, y2.data_ptr() % 16, *shape, plan.aligned)
    _FUSED(
        (plan.tiles.shape[0] // 2, groups.block_group.shape[0]),
        (*key, use_span, groups.block_rows, block_r),
        (
            x2,
            y2,
            plan.slices,
            plan.tiles,
            *group_args(groups),
            shape[0],
            rank,
            float(scale),
            plan.cols_per_program,
            *shape[1:],
            use_span,
            plan.aligned,
            1,
            groups.block_rows,
            block_r,
            _BLOCK_C,
            _BLOCK_N,
            product,
        ),
        _FUSED_WARPS,
        _FUSED_STAGES,
    )
