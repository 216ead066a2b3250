"""The shrink kernel: z = scale · x·A[slot]ᵀ over a step's groups, for all of a module's slices in one launch.

It reads x at its token rows and A where its slots keep it (no gather); its programs take several slices side by
side, reading x once for them (``SHRINK_WIDTH``). Each program takes one block of rows inside one group
(``SlotGroups.block_group`` / ``block_start``, built on the host with the groups). Where the padded rank and z's
strides are multiples of 8 (in the engine, always), its RANK_ALIGNED variant stores z's rank columns in 16-byte
vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import triton_launch
from preft.vllm_plugin.kernels.common import (
    Args,
    Groups,
    block,
    can_shrink,
    make_args,
    precision,
    step_args,
    triton,
    z_vectors,
)
from preft.vllm_plugin.kernels.plans import PlanCache

if triton is not None:
    import triton.language as tl

    from preft.vllm_plugin.kernels.common import _group_rows, _rank_aligned, _shrink_rows, jit_options

__all__ = ["SHRINK_WIDTH", "can_shrink", "launch_shrink", "shrink", "shrink_args", "shrink_rows", "slices_per_program"]

# The shrink's widest z tile: a program takes as many of a module's slices (q/k/v, gate/up) side by side as
# fit, so that x's rows are read once for them (``slices_per_program``); 0: one slice a program, each re-reading x.
# 128 was the fastest width measured (``loadtest/engine/bench_lora_shrink``; docs/kernels.md): wider was no faster
SHRINK_WIDTH = 128


if triton is not None:
    # The shrink's and the expand's parameters come in three runs: what each call passes, what the step's
    # groups and the tiles fix (``common.step_args``, once per step), what the module's weights fix (kept in its plan)

    @triton.jit(**jit_options(["stride_z"], ["z_ptr"]))
    def _shrink_kernel(
        x_ptr,
        z_ptr,
        stride_x,
        stride_z,
        scale,
        Z_BY_ROW: tl.constexpr,
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
        BLOCK_R: tl.constexpr,
        a_table_ptr,
        slices,
        in_cols,
        stride_a_slot,
        stride_a_rank,
        BLOCK_C: tl.constexpr,
        PRECISION: tl.constexpr,
        RANK_ALIGNED: tl.constexpr,
        SLICES_PER_PROGRAM: tl.constexpr,
    ):
        """z[m, s·rank + r] = scale · x[row(m)] · A_s[slot][r] for the slices s of program_id(1): the
        SLICES_PER_PROGRAM from program_id(1) · SLICES_PER_PROGRAM on, side by side in one product (x's rows
        read once for them all), up to `slices` (Z_BY_ROW: z[row(m)]). RANK_ALIGNED: rank and z's row stride
        are multiples of 8 and z starts 16-byte aligned (z's rows are then stored in 16-byte vectors)."""
        m, rows, mask_m, slot = _group_rows(
            tl.program_id(0),
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
        a_type: tl.constexpr = tl.pointer_type(x_ptr.dtype.element_ty)
        if SLICES_PER_PROGRAM == 1:  # (a constexpr branch: Triton compiles only the one taken)
            s = tl.program_id(1)
            r = tl.arange(0, BLOCK_R)
            a_ptr = tl.multiple_of(tl.load(a_table_ptr + s).to(a_type), 16)  # (can_shrink)
            mask_cols = r < rank
        else:  # column j: slice s's rank row r, A_s's address gathered from the table per column
            j = tl.arange(0, SLICES_PER_PROGRAM * BLOCK_R)
            s = tl.program_id(1) * SLICES_PER_PROGRAM + j // BLOCK_R
            r = j % BLOCK_R
            a_ptr = tl.multiple_of(tl.load(a_table_ptr + s, mask=s < slices, other=0).to(a_type), 16)
            mask_cols = (r < rank) & (s < slices)
        a_cols = a_ptr + slot * stride_a_slot + r * stride_a_rank
        z = _shrink_rows(x_ptr, a_cols, mask_cols, rows, mask_m, in_cols, scale, stride_x, BLOCK_M, BLOCK_C, PRECISION)
        if RANK_ALIGNED:
            rank, stride_z, z_ptr = _rank_aligned(rank, stride_z, z_ptr)
        mask_z = r < rank  # (rank as the compiler now knows it)
        if SLICES_PER_PROGRAM > 1:
            mask_z = mask_z & (s < slices)
        z_rows = rows if Z_BY_ROW else m.to(tl.int64)  # (at its token's row: for the activation, lora_act)
        ptrs = z_ptr + z_rows[:, None] * stride_z + (s * rank + r)[None, :]
        tl.store(ptrs, z, mask=mask_m[:, None] & mask_z[None, :])

    _SHRINK = triton_launch.Launcher(_shrink_kernel)


def shrink(
    x2: torch.Tensor, a: Sequence[torch.Tensor], scale: float, groups: Groups, *, plans: PlanCache
) -> torch.Tensor:
    """[n, S·rank] in group order: scale · x2[row] @ A_s[slot][:rank]ᵀ for each slice s, side by side.

    x2: [tokens, in] (token rows); a: per slice [slots, R, in].
    """
    return _shrink(x2, a, plans.pointer_table(a), scale, groups)


def shrink_rows(z: torch.Tensor, x2: torch.Tensor, a: torch.Tensor, groups: Groups, *, plans: PlanCache) -> None:
    """z[row, :rank] = x2[row] @ A[slot][:rank]ᵀ at the groups' token rows (z: [tokens, ≥ rank]; a: [slots, R, in],
    ``can_shrink``'s), on the shrink kernel; z's other rows untouched."""
    cols = settings.current().lora_tiles["shrink"].cols
    key = ("shrink rows", cols, a.data_ptr(), a.dtype, *a.shape, *a.stride(), x2.dtype, x2.shape[1])
    if key not in plans.plans:  # (kept as expand_add's: the table holds A's address, which stays put)
        plans.plans[key] = shrink_args(x2.dtype, [a], plans.pointer_table([a]), x2.shape[1], cols)
    launch_shrink(x2, z, z.stride(0), 1.0, 1, plans.plans[key], groups, by_row=True)


def shrink_args(
    x_dtype: torch.dtype, a: Sequence[torch.Tensor], a_table: torch.Tensor, in_cols: int, cols: int
) -> Args:
    """The shrink's run of arguments that a module's A (and x's width and dtype) and the tiles' columns fix."""
    values = (a_table, len(a), in_cols, a[0].stride(0), a[0].stride(1), cols, precision(x_dtype))
    return make_args(values, (x_dtype, a_table.data_ptr() % 16, *values[1:]))


def slices_per_program(slices: int, rank: int) -> int:
    """How many of a module's slices one shrink program takes, side by side: the most, a power of two, whose
    rank tiles fit in ``SHRINK_WIDTH`` columns (at least one)."""
    per, tile = 1, block(rank)
    while per < slices and 2 * per * tile <= SHRINK_WIDTH:
        per *= 2
    return per


def launch_shrink(
    x2: torch.Tensor,
    z: torch.Tensor,
    stride_z: int,
    scale: float,
    slices: int,
    module: Args,
    groups: Groups,
    by_row: bool = False,
) -> None:
    """z = the shrink over the groups' rows, at their positions in group order (by_row: at their token rows)."""
    tiles = settings.current().lora_tiles["shrink"]
    step, grid_rows = step_args(groups, tiles)
    x_ptr, stride_x, z_ptr = x2.data_ptr(), x2.stride(0), z.data_ptr()
    call = (stride_x, stride_z, scale, by_row)
    rank_aligned = z_vectors(z_ptr, groups.rank, stride_z)
    per = slices_per_program(slices, groups.rank)
    _SHRINK(
        (grid_rows, -(-slices // per)),
        (x_ptr % 16, stride_x, by_row, step.key, module.key, tiles.warps, tiles.stages, rank_aligned, per),
        (x2, z, *call, *step.tensors, *module.tensors, rank_aligned, per),
        tiles.warps,
        tiles.stages,
        (x_ptr, z_ptr, *call, *step.addresses, *module.addresses, rank_aligned, per),
    )


def _shrink(
    x2: torch.Tensor, a: Sequence[torch.Tensor], a_table: torch.Tensor, scale: float, groups: Groups
) -> torch.Tensor:
    z = torch.empty(groups.rows.shape[0], len(a) * groups.rank, device=x2.device, dtype=x2.dtype)
    module = shrink_args(x2.dtype, a, a_table, x2.shape[1], settings.current().lora_tiles["shrink"].cols)
    launch_shrink(x2, z, z.stride(0), float(scale), len(a), module, groups)
    return z
