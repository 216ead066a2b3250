"""The fold (``lora_act``'s activation with gate/up's LoRA folded in) written in Gluon, for Hopper's wgmma.

Triton's fold (``lora_act._silu_mul_lora_kernel``) runs its products on wgmma, whose accumulator's layout is not the
one gate and up load in: each program takes gate and up through shared memory into it and the output back out,
beside staging z's and B's chunks there, and each program (64 rows × 64 columns) reads its rows' z again from L2.
Here the kernel picks every layout itself (Gluon: ``triton.experimental.gluon``):

- The products run on wgmma with z in registers (each warp its own 16 rows) and Bᵀ's tile staged in shared memory.
- The accumulator [rows, columns] is what gate and up load into and h stores from: the tile's columns are taken in
  an order (B's rows permuted alike) that puts each thread's columns of a row in runs of 8 in memory, so those
  accesses are 16-byte vectors in the accumulator's own layout (a reshape and a permute of it, which move no data,
  then each thread's registers reordered). Neither gate, up nor h passes through shared memory.
- z's rank columns are permuted (B's alike, as staged) so that each thread's share of a row is one run.
- A program covers BLOCK_N columns in tiles of 64, its rows' z read from L1 after the first tile.

What it computes is the Triton kernel's: out[t, n] = silu(gate + Δg) · (up + Δu), Δ summed in float32 over the
block's slots, gate + Δ rounded once to gate_up's dtype; its outputs are as close to the LoRA added in float32 as
the Triton kernel's (the same largest difference in every cell of runs 181–183, within two units of the last place
of them in tests/unit/test_lora_fold_gluon.py). On the H200 (run 183: a step of 16,384 tokens, device time a call)
against the Triton fold: Qwen2.5-0.5B 224 against 253 µs at rank 64, 159 against 193 at rank 8; Llama-3.1-8B 636
against 728 and 459 against 545 (loadtest/RUNS.md "Runs 178–187"). Steps without LoRA tokens keep the Triton
kernel's plain variant.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (Triton 3.6's name; 3.9's)
except ImportError:  # no Triton, or one without Gluon
    gluon = None


if gluon is not None:
    TILE_N = gl.constexpr(64)  # the columns of one product's tile

    @gluon.constexpr_function
    def _vector_order(layout):
        """The layout with its registers reordered so that those along the last dimension come first, in
        order: each thread's run of adjacent elements then sits in adjacent registers, and loads in vectors.
        (Converting to it from the layout renames registers only.)"""
        last = len(layout.shape) - 1
        along = sorted((b for b in layout.reg_bases if b[last]), key=lambda b: b[last])
        rest = [b for b in layout.reg_bases if not b[last]]
        return gl.DistributedLinearLayout(
            along + rest, layout.lane_bases, layout.warp_bases, layout.block_bases, layout.shape
        )

    @gluon.jit
    def _rank_in_memory_order(a, ROWS: gl.constexpr, BLOCK_K: gl.constexpr):
        """[rows, rank columns in mma's order] with its rank columns in memory order (no data moves): a thread's
        rank columns of a row in wgmma's operand layout, k = 16·kt + 8·hk + 2·q + p, are the run
        q·BLOCK_K/4 + 4·kt + 2·hk + p."""
        return a.reshape([ROWS, BLOCK_K // 16, 2, 4, 2]).permute([0, 3, 1, 2, 4]).reshape([ROWS, BLOCK_K])

    @gluon.jit
    def _rank_in_mma_order(a, ROWS: gl.constexpr, BLOCK_K: gl.constexpr):
        """``_rank_in_memory_order``'s inverse: z's and B's tiles loaded in memory order, as the products take them."""
        return a.reshape([ROWS, 4, BLOCK_K // 16, 2, 2]).permute([0, 2, 3, 1, 4]).reshape([ROWS, BLOCK_K])

    @gluon.jit
    def _tile_in_memory_order(acc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """wgmma's accumulator [rows, columns in mma's order] in memory order (no data moves): its column
        n = 8j + 2q + p, j = 4a + b, is the tile's column 32a + 8q + 2b + p (the inverse: the same)."""
        return acc.reshape([BLOCK_M, BLOCK_N // 32, 4, 4, 2]).permute([0, 1, 3, 2, 4]).reshape([BLOCK_M, BLOCK_N])

    @gluon.jit
    def _column_of(n):
        """The tile's column in memory of wgmma's column n (as ``_tile_in_memory_order`` places it)."""
        return (n // 32) * 32 + ((n // 2) % 4) * 8 + ((n // 8) % 4) * 2 + n % 2

    @gluon.jit
    def _operand_z(z_rows, slot_rows, k0, rank, A_OP: gl.constexpr, Z_MEM: gl.constexpr, Z_VEC: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """z's chunk [the rows, BLOCK_K rank columns from k0, in mma's order] in wgmma's register operand layout,
        the rows outside slot_rows zero."""
        k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, Z_VEC))
        z = gl.load(z_rows[:, None] + k[None, :], mask=slot_rows[:, None] & (k < rank)[None, :], other=0.0)
        z = _rank_in_mma_order(gl.convert_layout(z, Z_MEM), BLOCK_M, BLOCK_K)
        return gl.convert_layout(z, A_OP, assert_trivial=True)

    @gluon.jit
    def _stage_b(smem, b_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, B_LOAD: gl.constexpr,
                 BLOCK_K: gl.constexpr):  # fmt: skip
        """The slot's Bᵀ chunk [the tile's columns and rank columns, each in mma's order] into smem."""
        cols = n0 + _column_of(gl.arange(0, TILE_N, layout=gl.SliceLayout(1, B_LOAD)))
        k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, B_LOAD))
        ptrs = b_ptr + slot.to(gl.int64) * stride_b_slot + cols.to(gl.int64)[:, None] * stride_b_out + k[None, :]
        b = gl.load(ptrs, mask=(cols < inter)[:, None] & (k < rank)[None, :], other=0.0)
        smem.store(_rank_in_mma_order(b, TILE_N, BLOCK_K))

    @gluon.jit
    def _add_slot(dg, du, slot, z_rows, slot_t, bg_ptr, bu_ptr, bg_smem, bu_smem, n0, inter, rank, stride_b_slot,
                  stride_b_out, A_OP: gl.constexpr, Z_MEM: gl.constexpr, Z_VEC: gl.constexpr, B_LOAD: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """(Δg, Δu) + the products of one slot's rows, gate's and up's in one loop over the rank chunks."""
        slot_rows = slot_t == slot
        for k0 in range(0, rank, BLOCK_K):
            z_gate = _operand_z(z_rows, slot_rows, k0, rank, A_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_K)
            z_up = _operand_z(z_rows + rank, slot_rows, k0, rank, A_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_K)
            _barrier()  # (every warpgroup's products of the last chunk have read smem before it is written again)
            _stage_b(bg_smem, bg_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, B_LOAD, BLOCK_K)
            _stage_b(bu_smem, bu_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, B_LOAD, BLOCK_K)
            fence_async_shared()
            _barrier()
            dg = warpgroup_mma(z_gate, bg_smem.permute([1, 0]), dg)
            du = warpgroup_mma(z_up, bu_smem.permute([1, 0]), du)
        return dg, du

    @gluon.jit(
        do_not_specialize=["n_rows", "n_tokens", "n_blocks", "rank", "stride_z"],
        do_not_specialize_on_alignment=["z_ptr", "token_slot_ptr", "block_offs_ptr", "block_slots_ptr"],
    )
    def fold_kernel(
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
        BLOCK_K: gl.constexpr,
        bg_ptr,
        bu_ptr,
        stride_b_slot,
        stride_b_out,
        inter,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
    ):
        """out[t, n] = silu(gu[t, n] + Δg) · (gu[t, inter + n] + Δu), Δ = z[t] · B[slot(t)][n] where t has a slot,
        as ``lora_act._silu_mul_lora_kernel`` (its arguments, less what is fixed here). Program (columns, rows):
        BLOCK_M rows (16 a warp, the step's tables' row blocks) by BLOCK_N columns in tiles of TILE_N. BLOCK_K: the
        padded rank's tile (16, 32 or 64), one product a slot. The caller's guarantees: rank, z's row stride and
        B's strides multiples of 8, z and B 16-byte aligned, B's rank columns contiguous."""
        WG: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                     instr_shape=[16, TILE_N, 16])  # fmt: skip
        A_OP: gl.constexpr = gl.DotOperandLayout(0, WG, 2)
        # the accumulator's and z's layouts in memory order (what a reshape and a permute of a zero tensor in
        # mma's layout infer), then in vector order; B loads in 16-byte vectors of a row
        TILE: gl.constexpr = _vector_order(
            _tile_in_memory_order(gl.full([BLOCK_M, TILE_N], 0, gl.float32, WG), BLOCK_M, TILE_N).type.layout
        )
        Z_MEM: gl.constexpr = _rank_in_memory_order(
            gl.full([BLOCK_M, BLOCK_K], 0, gl.bfloat16, A_OP), BLOCK_M, BLOCK_K
        ).type.layout
        Z_VEC: gl.constexpr = _vector_order(Z_MEM)
        B_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [gl.num_warps(), 1],
                                                [1, 0])  # fmt: skip
        B_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, BLOCK_K], bg_ptr.dtype.element_ty)

        pid_m = gl.program_id(1)
        first_col = gl.program_id(0) * BLOCK_N
        t = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TILE))
        t64 = t.to(gl.int64)
        block = gl.minimum(pid_m, n_blocks)  # (the table has one more entry: rows past its blocks have none)
        first = gl.load(block_offs_ptr + block)
        last = gl.load(block_offs_ptr + block + 1)
        # the block's first slot and the rows' slots, asked for before gate and up (as the Triton kernel's)
        slot = gl.load(block_slots_ptr + first, mask=first < last, other=-2)
        t_z = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, Z_VEC))
        slot_t = gl.load(token_slot_ptr + t_z, mask=t_z < n_tokens, other=-1)
        # (16-byte vectors of z and B: their addresses, strides and the rank, as the compiler then knows them)
        z_ptr = gl.multiple_of((z_ptr.to(gl.int64) // 16 * 16).to(z_ptr.dtype), 16)
        rank, stride_z = rank // 8 * 8, stride_z // 8 * 8
        stride_b_out, stride_b_slot = stride_b_out // 8 * 8, stride_b_slot // 8 * 8
        z_rows = z_ptr + t_z.to(gl.int64) * stride_z
        bg_smem = gl.allocate_shared_memory(bg_ptr.dtype.element_ty, [TILE_N, BLOCK_K], B_SMEM)
        bu_smem = gl.allocate_shared_memory(bu_ptr.dtype.element_ty, [TILE_N, BLOCK_K], B_SMEM)
        row_ptrs = gu_ptr + t64[:, None] * stride_gu
        rows_in = (t < n_rows)[:, None]
        for n0 in range(first_col, first_col + BLOCK_N, TILE_N):
            n = n0 + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, TILE))
            mask = rows_in & (n < inter)[None, :]
            gate = gl.load(row_ptrs + n[None, :], mask=mask, other=0.0)
            up = gl.load(row_ptrs + (inter + n)[None, :], mask=mask, other=0.0)
            if last > first:
                dg = gl.zeros([BLOCK_M, TILE_N], gl.float32, WG)
                du = gl.zeros([BLOCK_M, TILE_N], gl.float32, WG)
                dg, du = _add_slot(
                    dg, du, slot, z_rows, slot_t, bg_ptr, bu_ptr, bg_smem, bu_smem, n0, inter, rank, stride_b_slot,
                    stride_b_out, A_OP, Z_MEM, Z_VEC, B_LOAD, BLOCK_M, BLOCK_K,
                )  # fmt: skip
                for e in range(first + 1, last):  # (the block's other slots: one request's rows end, another's begin)
                    dg, du = _add_slot(
                        dg, du, gl.load(block_slots_ptr + e), z_rows, slot_t, bg_ptr, bu_ptr, bg_smem, bu_smem, n0,
                        inter, rank, stride_b_slot, stride_b_out, A_OP, Z_MEM, Z_VEC, B_LOAD, BLOCK_M, BLOCK_K,
                    )  # fmt: skip
                dg = gl.convert_layout(_tile_in_memory_order(dg, BLOCK_M, TILE_N), TILE)
                du = gl.convert_layout(_tile_in_memory_order(du, BLOCK_M, TILE_N), TILE)
                gate = (gate.to(gl.float32) + dg).to(gate.dtype)  # (y's rounding)
                up = (up.to(gl.float32) + du).to(up.dtype)
            g32 = gate.to(gl.float32)
            h = g32 / (1.0 + gl.exp(-g32)) * up.to(gl.float32)
            gl.store(out_ptr + t64[:, None] * stride_out + n[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)
