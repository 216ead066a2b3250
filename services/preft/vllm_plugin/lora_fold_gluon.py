"""The fold (``lora_act``'s activation with gate/up's LoRA folded in) written in Gluon, with no shared memory.

Triton's fold runs its products on wgmma, whose accumulator's layout is not the one gate and up load in: each
program takes gate and up through shared memory into it and the output back out, beside staging z's and B's chunks
there, and that traffic is what the fold costs at rank 64 (run 135). Here the kernel picks every layout itself:

- The products are computed transposed, Δᵀ = Bᵀ·zᵀ (output columns × rows), on ``mma_v2`` (mma.sync) with the
  warps along the rows, so that each thread's accumulator holds, for each of its rows, eight output columns. The
  tile's columns are taken in an order (a permutation of B's rows) that puts those eight side by side in memory:
  gate and up load, and h stores, in 16-byte vectors straight in the accumulator's layout (a reshape and a permute
  of it, which move no data), four rows of 128 bytes a warp's access.
- The operands load from global memory straight into mma's operand layouts, their rank columns permuted alike, so
  that each thread's share of a row of B or z is contiguous (16 bytes at 32-wide rank chunks).

What it computes is the Triton kernel's: out[t, n] = silu(gate + Δg) · (up + Δu), Δ summed in float32 over the
block's slots, gate + Δ rounded once to gate_up's dtype. Its arguments are the Triton kernel's
(``lora_act._silu_mul_lora_kernel``); PRECISION is not read (16-bit weights only).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (Triton 3.6's name; 3.9's)
except ImportError:  # no Triton, or one without Gluon
    gluon = None


if gluon is not None:

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
    def _tile_in_memory_order(delta, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """Δᵀ [columns in mma's order, rows] as [rows, columns in memory order] (no data moves): mma's column
        n = 16i + 8h + g is the tile's column g·BLOCK_N/8 + 2i + h."""
        return delta.reshape([BLOCK_N // 16, 2, 8, BLOCK_M]).permute([3, 2, 0, 1]).reshape([BLOCK_M, BLOCK_N])

    @gluon.jit
    def _column_of(n, BLOCK_N: gl.constexpr):
        """The tile's column in memory of mma's column n (as ``_tile_in_memory_order`` places it)."""
        return (n % 8) * (BLOCK_N // 8) + (n // 16) * 2 + (n // 8) % 2

    @gluon.jit
    def _a_in_memory_order(a, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """Bᵀ's chunk [columns, rank columns in mma's order] with its rank columns in memory order: each thread's
        rank columns of a row, k = 16·kt + 8·hk + 2·q + p, are its own run, q·BLOCK_K/4 + 4·kt + 2·hk + p."""
        return a.reshape([BLOCK_N, BLOCK_K // 16, 2, 4, 2]).permute([0, 3, 1, 2, 4]).reshape([BLOCK_N, BLOCK_K])

    @gluon.jit
    def _a_in_mma_order(a, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """``_a_in_memory_order``'s inverse."""
        return a.reshape([BLOCK_N, 4, BLOCK_K // 16, 2, 2]).permute([0, 2, 3, 1, 4]).reshape([BLOCK_N, BLOCK_K])

    @gluon.jit
    def _z_in_memory_order(z, BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr):
        """zᵀ's chunk [rank columns in mma's order, rows] as [rows, rank columns in memory order] (as B's)."""
        return z.reshape([BLOCK_K // 16, 2, 4, 2, BLOCK_M]).permute([4, 2, 0, 1, 3]).reshape([BLOCK_M, BLOCK_K])

    @gluon.jit
    def _z_in_mma_order(z, BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr):
        """``_z_in_memory_order``'s inverse."""
        return z.reshape([BLOCK_M, 4, BLOCK_K // 16, 2, 2]).permute([2, 3, 1, 4, 0]).reshape([BLOCK_K, BLOCK_M])

    @gluon.jit
    def _operand_a(b_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, A_OP: gl.constexpr,
                   A_MEM: gl.constexpr, A_VEC: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """The slot's Bᵀ chunk [the tile's columns in mma's order, BLOCK_K rank columns from k0], in mma's left
        operand layout (A_MEM: that layout in memory order, A_VEC: A_MEM in vector order)."""
        cols = n0 + _column_of(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_VEC)), BLOCK_N)
        k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A_VEC))
        ptrs = b_ptr + slot.to(gl.int64) * stride_b_slot + cols.to(gl.int64)[:, None] * stride_b_out + k[None, :]
        b = gl.load(ptrs, mask=(cols < inter)[:, None] & (k < rank)[None, :], other=0.0)
        b = _a_in_mma_order(gl.convert_layout(b, A_MEM), BLOCK_N, BLOCK_K)
        return gl.convert_layout(b, A_OP, assert_trivial=True)

    @gluon.jit
    def _operand_b(z_rows, slot_rows, k0, rank, B_OP: gl.constexpr, Z_MEM: gl.constexpr, Z_VEC: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """zᵀ's chunk [BLOCK_K rank columns from k0, the rows], in mma's right operand layout, the rows outside
        slot_rows zero (z_rows: each row's z; Z_MEM, Z_VEC as A_MEM, A_VEC)."""
        k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, Z_VEC))
        z = gl.load(z_rows[:, None] + k[None, :], mask=slot_rows[:, None] & (k < rank)[None, :], other=0.0)
        z = _z_in_mma_order(gl.convert_layout(z, Z_MEM), BLOCK_K, BLOCK_M)
        return gl.convert_layout(z, B_OP, assert_trivial=True)

    @gluon.jit
    def _add_slot(dg, du, slot, z_rows, slot_t, bg_ptr, bu_ptr, n0, inter, rank, stride_b_slot, stride_b_out,
                  A_OP: gl.constexpr, A_MEM: gl.constexpr, A_VEC: gl.constexpr, B_OP: gl.constexpr,
                  Z_MEM: gl.constexpr, Z_VEC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr):  # fmt: skip
        """(Δgᵀ, Δuᵀ) + the products of one slot's rows, gate's and up's in one loop over the rank chunks."""
        slot_rows = slot_t == slot
        for k0 in range(0, rank, BLOCK_K):
            z_gate = _operand_b(z_rows, slot_rows, k0, rank, B_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_K)
            z_up = _operand_b(z_rows + rank, slot_rows, k0, rank, B_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_K)
            b_gate = _operand_a(
                bg_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, A_OP, A_MEM, A_VEC, BLOCK_N, BLOCK_K
            )
            b_up = _operand_a(
                bu_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, A_OP, A_MEM, A_VEC, BLOCK_N, BLOCK_K
            )
            dg = mma_v2(b_gate, z_gate, dg)
            du = mma_v2(b_up, z_up, du)
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
        stride_b_rank,
        inter,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        PRECISION: gl.constexpr,
        RANK_ALIGNED: gl.constexpr,
        COLS_FIRST: gl.constexpr,
        LORA: gl.constexpr,
    ):
        """out[t, n] = silu(gu[t, n] + Δg) · (gu[t, inter + n] + Δu), as ``lora_act._silu_mul_lora_kernel``
        (its arguments; B's rank columns contiguous, stride_b_rank 1). BLOCK_M: a multiple of 8 × the warps;
        BLOCK_N: 64 or a multiple; BLOCK_K: the rank chunk, 16 at least."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, gl.num_warps()],
                                                      instr_shape=[16, 8])  # fmt: skip
        A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        # each operand's and the tile's layout in memory order (what a reshape and a permute of a zero tensor in
        # mma's layout infer), then in vector order
        TILE_MEM: gl.constexpr = _tile_in_memory_order(
            gl.full([BLOCK_N, BLOCK_M], 0, gl.float32, MMA), BLOCK_N, BLOCK_M
        ).type.layout
        A_MEM: gl.constexpr = _a_in_memory_order(
            gl.full([BLOCK_N, BLOCK_K], 0, gl.bfloat16, A_OP), BLOCK_N, BLOCK_K
        ).type.layout
        Z_MEM: gl.constexpr = _z_in_memory_order(
            gl.full([BLOCK_K, BLOCK_M], 0, gl.bfloat16, B_OP), BLOCK_K, BLOCK_M
        ).type.layout
        TILE: gl.constexpr = _vector_order(TILE_MEM)
        A_VEC: gl.constexpr = _vector_order(A_MEM)
        Z_VEC: gl.constexpr = _vector_order(Z_MEM)

        pid_m = gl.program_id(1 if COLS_FIRST else 0)
        n0 = gl.program_id(0 if COLS_FIRST else 1) * BLOCK_N
        t = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TILE))
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, TILE))
        t64 = t.to(gl.int64)
        mask = (t < n_rows)[:, None] & (n < inter)[None, :]
        if LORA:
            block = gl.minimum(pid_m, n_blocks)  # (the table has one more entry: rows past its blocks have none)
            first = gl.load(block_offs_ptr + block)
            last = gl.load(block_offs_ptr + block + 1)
            # the block's first slot and the rows' slots, asked for before gate and up (as the Triton kernel's)
            slot = gl.load(block_slots_ptr + first, mask=first < last, other=-2)
            t_z = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, Z_VEC))
            slot_t = gl.load(token_slot_ptr + t_z, mask=t_z < n_tokens, other=-1)
        ptrs = gu_ptr + t64[:, None] * stride_gu + n[None, :]
        gate = gl.load(ptrs, mask=mask, other=0.0)
        up = gl.load(ptrs + inter, mask=mask, other=0.0)
        if LORA:  # noqa: SIM102 (LORA is a constexpr: False compiles no table read)
            if last > first:
                if RANK_ALIGNED:  # (16-byte vectors of z: its address, row stride and the rank, as known)
                    z_ptr = gl.multiple_of((z_ptr.to(gl.int64) // 16 * 16).to(z_ptr.dtype), 16)
                    rank, stride_z = rank // 8 * 8, stride_z // 8 * 8
                    stride_b_out, stride_b_slot = stride_b_out // 8 * 8, stride_b_slot // 8 * 8
                z_rows = z_ptr + t_z.to(gl.int64) * stride_z
                dg = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
                du = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
                dg, du = _add_slot(
                    dg, du, slot, z_rows, slot_t, bg_ptr, bu_ptr, n0, inter, rank, stride_b_slot, stride_b_out,
                    A_OP, A_MEM, A_VEC, B_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                for e in range(first + 1, last):  # (the block's other slots: one request's rows end, another's begin)
                    dg, du = _add_slot(
                        dg, du, gl.load(block_slots_ptr + e), z_rows, slot_t, bg_ptr, bu_ptr, n0, inter, rank,
                        stride_b_slot, stride_b_out, A_OP, A_MEM, A_VEC, B_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_N,
                        BLOCK_K,
                    )  # fmt: skip
                dg = gl.convert_layout(_tile_in_memory_order(dg, BLOCK_N, BLOCK_M), TILE)
                du = gl.convert_layout(_tile_in_memory_order(du, BLOCK_N, BLOCK_M), TILE)
                gate = (gate.to(gl.float32) + dg).to(gate.dtype)  # (y's rounding)
                up = (up.to(gl.float32) + du).to(up.dtype)
        g32 = gate.to(gl.float32)
        h = g32 / (1.0 + gl.exp(-g32)) * up.to(gl.float32)
        gl.store(out_ptr + t64[:, None] * stride_out + n[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _wg_tile_in_memory_order(acc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """wgmma's accumulator [rows, columns in mma's order] in memory order (no data moves): its column
        n = 8j + 2q + p, j = 4a + b, is the tile's column 32a + 8q + 2b + p (the inverse: the same)."""
        return acc.reshape([BLOCK_M, BLOCK_N // 32, 4, 4, 2]).permute([0, 1, 3, 2, 4]).reshape([BLOCK_M, BLOCK_N])

    @gluon.jit
    def _wg_column_of(n):
        """The tile's column in memory of wgmma's column n (as ``_wg_tile_in_memory_order`` places it)."""
        return (n // 32) * 32 + ((n // 2) % 4) * 8 + ((n // 8) % 4) * 2 + n % 2

    @gluon.jit
    def _wg_operand_z(z_rows, slot_rows, k0, rank, A_OP: gl.constexpr, Z_MEM: gl.constexpr, Z_VEC: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """z's chunk [the rows, BLOCK_K rank columns from k0] in wgmma's register operand layout, the rows
        outside slot_rows zero."""
        k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, Z_VEC))
        z = gl.load(z_rows[:, None] + k[None, :], mask=slot_rows[:, None] & (k < rank)[None, :], other=0.0)
        z = _a_in_mma_order(gl.convert_layout(z, Z_MEM), BLOCK_M, BLOCK_K)
        return gl.convert_layout(z, A_OP, assert_trivial=True)

    @gluon.jit
    def _wg_stage_b(smem, b_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, B_LOAD: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """The slot's Bᵀ chunk [the tile's columns in wgmma's order, BLOCK_K rank columns from k0] into smem."""
        cols = n0 + _wg_column_of(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, B_LOAD)))
        k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, B_LOAD))
        ptrs = b_ptr + slot.to(gl.int64) * stride_b_slot + cols.to(gl.int64)[:, None] * stride_b_out + k[None, :]
        smem.store(gl.load(ptrs, mask=(cols < inter)[:, None] & (k < rank)[None, :], other=0.0))

    @gluon.jit
    def _wg_add_slot(dg, du, slot, z_rows, slot_t, bg_ptr, bu_ptr, bg_smem, bu_smem, n0, inter, rank,
                     stride_b_slot, stride_b_out, A_OP: gl.constexpr, Z_MEM: gl.constexpr, Z_VEC: gl.constexpr,
                     B_LOAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr):  # fmt: skip
        """(Δg, Δu) + the products of one slot's rows, gate's and up's in one loop over the rank chunks."""
        slot_rows = slot_t == slot
        for k0 in range(0, rank, BLOCK_K):
            z_gate = _wg_operand_z(z_rows, slot_rows, k0, rank, A_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_K)
            z_up = _wg_operand_z(z_rows + rank, slot_rows, k0, rank, A_OP, Z_MEM, Z_VEC, BLOCK_M, BLOCK_K)
            _barrier()  # (every warpgroup's products of the last chunk read smem before it is written again)
            _wg_stage_b(bg_smem, bg_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, B_LOAD, BLOCK_N,
                        BLOCK_K)  # fmt: skip
            _wg_stage_b(bu_smem, bu_ptr, slot, n0, inter, k0, rank, stride_b_slot, stride_b_out, B_LOAD, BLOCK_N,
                        BLOCK_K)  # fmt: skip
            fence_async_shared()
            _barrier()
            dg = warpgroup_mma(z_gate, bg_smem.permute([1, 0]), dg)
            du = warpgroup_mma(z_up, bu_smem.permute([1, 0]), du)
        return dg, du

    @gluon.jit(
        do_not_specialize=["n_rows", "n_tokens", "n_blocks", "rank", "stride_z"],
        do_not_specialize_on_alignment=["z_ptr", "token_slot_ptr", "block_offs_ptr", "block_slots_ptr"],
    )
    def fold_kernel_wgmma(
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
        stride_b_rank,
        inter,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        PRECISION: gl.constexpr,
        RANK_ALIGNED: gl.constexpr,
        COLS_FIRST: gl.constexpr,
        LORA: gl.constexpr,
    ):
        """As ``fold_kernel``, the products on wgmma: z from registers, B staged in shared memory, the
        accumulator [rows, columns] loaded into and stored from in its own layout. BLOCK_M: 16 × the warps."""
        WG: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                     instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        A_OP: gl.constexpr = gl.DotOperandLayout(0, WG, 2)
        TILE_MEM: gl.constexpr = _wg_tile_in_memory_order(
            gl.full([BLOCK_M, BLOCK_N], 0, gl.float32, WG), BLOCK_M, BLOCK_N
        ).type.layout
        Z_MEM: gl.constexpr = _a_in_memory_order(
            gl.full([BLOCK_M, BLOCK_K], 0, gl.bfloat16, A_OP), BLOCK_M, BLOCK_K
        ).type.layout
        TILE: gl.constexpr = _vector_order(TILE_MEM)
        Z_VEC: gl.constexpr = _vector_order(Z_MEM)
        B_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [gl.num_warps(), 1],
                                                [1, 0])  # fmt: skip
        B_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)

        pid_m = gl.program_id(1 if COLS_FIRST else 0)
        n0 = gl.program_id(0 if COLS_FIRST else 1) * BLOCK_N
        t = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TILE))
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, TILE))
        t64 = t.to(gl.int64)
        mask = (t < n_rows)[:, None] & (n < inter)[None, :]
        if LORA:
            block = gl.minimum(pid_m, n_blocks)
            first = gl.load(block_offs_ptr + block)
            last = gl.load(block_offs_ptr + block + 1)
            slot = gl.load(block_slots_ptr + first, mask=first < last, other=-2)
            t_z = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, Z_VEC))
            slot_t = gl.load(token_slot_ptr + t_z, mask=t_z < n_tokens, other=-1)
        ptrs = gu_ptr + t64[:, None] * stride_gu + n[None, :]
        gate = gl.load(ptrs, mask=mask, other=0.0)
        up = gl.load(ptrs + inter, mask=mask, other=0.0)
        if LORA:  # noqa: SIM102 (LORA is a constexpr: False compiles no table read)
            if last > first:
                if RANK_ALIGNED:
                    z_ptr = gl.multiple_of((z_ptr.to(gl.int64) // 16 * 16).to(z_ptr.dtype), 16)
                    rank, stride_z = rank // 8 * 8, stride_z // 8 * 8
                    stride_b_out, stride_b_slot = stride_b_out // 8 * 8, stride_b_slot // 8 * 8
                z_rows = z_ptr + t_z.to(gl.int64) * stride_z
                bg_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_K], B_SMEM)
                bu_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_K], B_SMEM)
                dg = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, WG)
                du = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, WG)
                dg, du = _wg_add_slot(
                    dg, du, slot, z_rows, slot_t, bg_ptr, bu_ptr, bg_smem, bu_smem, n0, inter, rank, stride_b_slot,
                    stride_b_out, A_OP, Z_MEM, Z_VEC, B_LOAD, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                for e in range(first + 1, last):
                    dg, du = _wg_add_slot(
                        dg, du, gl.load(block_slots_ptr + e), z_rows, slot_t, bg_ptr, bu_ptr, bg_smem, bu_smem, n0,
                        inter, rank, stride_b_slot, stride_b_out, A_OP, Z_MEM, Z_VEC, B_LOAD, BLOCK_M, BLOCK_N,
                        BLOCK_K,
                    )  # fmt: skip
                dg = gl.convert_layout(_wg_tile_in_memory_order(dg, BLOCK_M, BLOCK_N), TILE)
                du = gl.convert_layout(_wg_tile_in_memory_order(du, BLOCK_M, BLOCK_N), TILE)
                gate = (gate.to(gl.float32) + dg).to(gate.dtype)
                up = (up.to(gl.float32) + du).to(up.dtype)
        g32 = gate.to(gl.float32)
        h = g32 / (1.0 + gl.exp(-g32)) * up.to(gl.float32)
        gl.store(out_ptr + t64[:, None] * stride_out + n[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)
