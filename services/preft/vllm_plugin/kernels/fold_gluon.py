"""The fold (``act``'s activation with gate/up's LoRA folded in) written in Gluon, for Hopper's wgmma.

Triton's fold (``act._silu_mul_lora_kernel``) runs its products on wgmma, whose accumulator's layout is not the
one gate and up load in: each program takes gate and up through shared memory into it and the output back out,
beside staging z's and B's chunks there, and waits on each tile's loads before its products. Here the kernel
picks every layout and the order of its copies itself (Gluon: ``triton.experimental.gluon``):

- Every operand is copied by cp.async into shared memory, STAGES - 1 tiles ahead of the products and the
  activation (a ring of STAGES buffers): gate's and up's tiles, B's tiles, and once a program the block's first
  slot's z. The copies in flight hold no registers, so the reads of gate and up, the stream that bounds the
  kernel, go on while the products run.
- The products run on wgmma from shared memory; the accumulator [rows, columns] is what gate and up are read into
  and h stores from: the tile's columns are taken in an order (B's rows copied in that order) that puts each
  thread's columns of a row in runs of 8 in memory, so those accesses are 16-byte vectors in the accumulator's own
  layout (a reshape and a permute of it, which move no data, then each thread's registers reordered).
- A program covers BLOCK_N columns in tiles of 64.

What it computes is the Triton kernel's: out[t, n] = silu(gate + Δg) · (up + Δu), Δ summed in float32 over the
block's slots, gate + Δ rounded once to gate_up's dtype; its outputs are as close to the LoRA added in float32 as
the Triton kernel's (the same largest difference in every measured cell, within two units of the last place of
them in tests/unit/test_lora_fold_gluon.py). It takes less device time than the Triton fold at every rank measured,
and the copies ahead are what pays: the same kernel loading gate and up into registers and staging B at each tile
is slower (``loadtest/engine/bench_fold_gluon``; docs/kernels.md). Steps without LoRA tokens keep the Triton
kernel's plain variant.

With DOWN it also computes the down projection's shrink of its output (zd = h · A_downᵀ at each adapted row),
which the shrink kernel would otherwise compute by reading h back from memory, 16,384 × 4,864 on Qwen's step: each
program takes whole rows, copies each tile's A_down tile into the ring with the tile's others, and takes the tile's
h through shared memory into one more product: less device time than the fold then down's shrink at the ranks
measured (docs/kernels.md).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (Triton 3.6's name; 3.9's)
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # (3.9; 3.6)
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
    def _tile_in_memory_order(acc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """wgmma's accumulator [rows, columns in mma's order] in memory order (no data moves): its column
        n = 8j + 2q + p, j = 4a + b, is the tile's column 32a + 8q + 2b + p (the inverse: the same)."""
        return acc.reshape([BLOCK_M, BLOCK_N // 32, 4, 4, 2]).permute([0, 1, 3, 2, 4]).reshape([BLOCK_M, BLOCK_N])

    @gluon.jit
    def _column_of(n):
        """The tile's column in memory of wgmma's column n (as ``_tile_in_memory_order`` places it)."""
        return (n // 32) * 32 + ((n // 2) % 4) * 8 + ((n // 8) % 4) * 2 + n % 2

    @gluon.jit
    def _copy_rows(smem, row_ptrs, rows_in, rank, LOAD: gl.constexpr, BLOCK_K: gl.constexpr):
        """The rows' first BLOCK_K columns (zero past rank, and in rows not rows_in) into smem, asynchronously
        (cp.async, 16-byte vectors; a group of its own is the caller's to commit)."""
        k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LOAD))
        _async_load(smem, row_ptrs[:, None] + k[None, :], mask=rows_in[:, None] & (k < rank)[None, :])

    @gluon.jit
    def _copy_b(smem, b_ptr, slot, n0, inter, rank, stride_b_slot, stride_b_out, LOAD: gl.constexpr,
                BLOCK_K: gl.constexpr):  # fmt: skip
        """The slot's Bᵀ tile [the tile's columns in mma's order, rank columns] into smem (``_copy_rows``)."""
        cols = n0 + _column_of(gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LOAD)))
        rows = b_ptr + slot.to(gl.int64) * stride_b_slot + cols.to(gl.int64) * stride_b_out
        _copy_rows(smem, rows, cols < inter, rank, LOAD, BLOCK_K)

    @gluon.jit
    def _copy_z(zg, zu, z_rows, rows_in, rank, LOAD: gl.constexpr, BLOCK_K: gl.constexpr):
        """The rows' z into smem (``_copy_rows``): gate's rank columns into zg, up's (after them in z) into zu."""
        _copy_rows(zg, z_rows, rows_in, rank, LOAD, BLOCK_K)
        _copy_rows(zu, z_rows + rank, rows_in, rank, LOAD, BLOCK_K)

    @gluon.jit
    def _copy_bs(bg, bu, bg_ptr, bu_ptr, slot, n0, inter, rank, stride_b_slot, stride_b_out, LOAD: gl.constexpr,
                 BLOCK_K: gl.constexpr):  # fmt: skip
        """The slot's gate and up Bᵀ tiles into bg and bu (``_copy_b``)."""
        _copy_b(bg, bg_ptr, slot, n0, inter, rank, stride_b_slot, stride_b_out, LOAD, BLOCK_K)
        _copy_b(bu, bu_ptr, slot, n0, inter, rank, stride_b_slot, stride_b_out, LOAD, BLOCK_K)

    @gluon.jit
    def _copy_a(smem, a_ptr, slot, n0, inter, rank, stride_a_slot, stride_a_rank, LOAD: gl.constexpr,
                BLOCK_K: gl.constexpr):  # fmt: skip
        """The slot's A tile [BLOCK_K rank rows (zero past rank), the TILE_N columns from n0] into smem,
        asynchronously (cp.async, 16-byte vectors; the caller commits the group)."""
        r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, LOAD))
        n = n0 + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, LOAD))
        ptrs = a_ptr + slot.to(gl.int64) * stride_a_slot + r.to(gl.int64)[:, None] * stride_a_rank + n[None, :]
        _async_load(smem, ptrs, mask=(r < rank)[:, None] & (n < inter)[None, :])

    @gluon.jit
    def _down_product(h_s, h, rows_of, ad_s, zd):
        """zd + (h's rows_of rows, zero elsewhere) · the A tile ᵀ: h stored into h_s (every warp's store landed
        before the product reads it; the caller's barrier before the next store), the product on wgmma."""
        h_s.store(gl.where(rows_of, h, gl.zeros_like(h)))
        fence_async_shared()
        _barrier()
        zd = warpgroup_mma(h_s, ad_s.permute([1, 0]), zd, is_async=True)
        return warpgroup_mma_wait(0, deps=[zd])

    @gluon.jit
    def _products(zg_smem, zu_smem, bg_smem, bu_smem, dg, du):
        """(Δg, Δu) + z · Bᵀ of the staged tiles, gate's and up's products issued back to back."""
        dg = warpgroup_mma(zg_smem, bg_smem.permute([1, 0]), dg, is_async=True)
        du = warpgroup_mma(zu_smem, bu_smem.permute([1, 0]), du, is_async=True)
        return warpgroup_mma_wait(0, deps=[dg, du])

    @gluon.jit
    def _issue_tile(gs, us, bg, bu, gu_rows, rows_in, bg_ptr, bu_ptr, slot, adapted, n0, n_end, inter, rank,
                    stride_b_slot, stride_b_out, GU_LOAD: gl.constexpr, LOAD: gl.constexpr,
                    BLOCK_K: gl.constexpr, ad, ad_ptr, stride_ad_slot, stride_ad_rank, DOWN: gl.constexpr):  # fmt: skip
        """One tile's gate and up (and, adapted, the slot's B tiles, and with DOWN its down A tile into ad) copied
        into a stage's buffers: one group."""
        n = n0 + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, GU_LOAD))
        mask = rows_in[:, None] & (n < n_end)[None, :]
        _async_load(gs, gu_rows[:, None] + n[None, :], mask=mask)
        _async_load(us, gu_rows[:, None] + (inter + n)[None, :], mask=mask)
        if adapted:
            _copy_bs(bg, bu, bg_ptr, bu_ptr, slot, n0, inter, rank, stride_b_slot, stride_b_out, LOAD, BLOCK_K)
            if DOWN:
                _copy_a(ad, ad_ptr, slot, n0, inter, rank, stride_ad_slot, stride_ad_rank, GU_LOAD, BLOCK_K)
        async_copy.commit_group()

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
        STAGES: gl.constexpr,
        ad_ptr,
        zd_ptr,
        stride_ad_slot,
        stride_ad_rank,
        stride_zd,
        DOWN: gl.constexpr,
    ):
        """out[t, n] = silu(gu[t, n] + Δg) · (gu[t, inter + n] + Δu), Δ = z[t] · B[slot(t)][n] where t has a slot,
        as ``act._silu_mul_lora_kernel`` (its arguments, less what is fixed here). Program (columns, rows):
        BLOCK_M rows (16 a warp, the step's tables' row blocks) by BLOCK_N columns in tiles of TILE_N, its copies in a
        ring of STAGES (≥ 2) buffers. BLOCK_K: the padded rank's tile (16, 32 or 64), one product a slot. The
        caller's guarantees: rank, z's row stride and B's strides multiples of 8, z, B, gu and its row stride 16-byte
        aligned, inter a multiple of 8, B's rank columns contiguous.

        DOWN: also the down projection's shrink of out, zd[t] = out[t] · A_down[slot(t)]ᵀ at each row with a slot
        (ad: [slots, rank rows, inter], its columns contiguous; zd's other rows untouched), summed in float32 over
        the row and rounded once, as the shrink kernel would. Each program then covers whole rows (BLOCK_N ≥
        inter: one program a row block), its A tiles copied with the tile's others and each tile's out stored
        through shared memory into the product. ad and zd 16-byte aligned, ad's strides multiples of 16 (as
        Triton then specializes them: kept as arguments, they take no registers)."""
        WG: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                     instr_shape=[16, TILE_N, 16])  # fmt: skip
        TILE: gl.constexpr = _vector_order(
            _tile_in_memory_order(gl.full([BLOCK_M, TILE_N], 0, gl.float32, WG), BLOCK_M, TILE_N).type.layout
        )
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [gl.num_warps(), 1],
                                              [1, 0])  # fmt: skip
        GU_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (TILE_N // 8), TILE_N // 8], [gl.num_warps(), 1],
                                                 [1, 0])  # fmt: skip
        GU_SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
        Z_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], z_ptr.dtype.element_ty)
        B_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, BLOCK_K], bg_ptr.dtype.element_ty)

        # (16-byte copies: gu's row stride and inter, z's and B's strides and the rank multiples of 8, as the
        # compiler then knows them)
        stride_gu, inter = stride_gu // 8 * 8, inter // 8 * 8
        pid_m = gl.program_id(1)
        first_col = gl.program_id(0) * BLOCK_N
        n_end = gl.minimum(first_col + BLOCK_N, inter)
        tiles = gl.cdiv(n_end - first_col, TILE_N)
        t = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TILE))
        block = gl.minimum(pid_m, n_blocks)  # (the table has one more entry: rows past its blocks have none)
        first = gl.load(block_offs_ptr + block)
        last = gl.load(block_offs_ptr + block + 1)
        slot = gl.load(block_slots_ptr + first, mask=first < last, other=-2)
        t_z = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
        slot_t = gl.load(token_slot_ptr + t_z, mask=t_z < n_tokens, other=-1)
        z_ptr = gl.multiple_of((z_ptr.to(gl.int64) // 16 * 16).to(z_ptr.dtype), 16)
        gu_ptr = gl.multiple_of((gu_ptr.to(gl.int64) // 16 * 16).to(gu_ptr.dtype), 16)
        rank, stride_z = rank // 8 * 8, stride_z // 8 * 8
        stride_b_out, stride_b_slot = stride_b_out // 8 * 8, stride_b_slot // 8 * 8
        z_rows = z_ptr + t_z.to(gl.int64) * stride_z
        t_l = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, GU_LOAD))
        gu_rows = gu_ptr + t_l.to(gl.int64) * stride_gu
        rows_in_l = t_l < n_rows
        zg = gl.allocate_shared_memory(z_ptr.dtype.element_ty, [BLOCK_M, BLOCK_K], Z_SMEM)
        zu = gl.allocate_shared_memory(z_ptr.dtype.element_ty, [BLOCK_M, BLOCK_K], Z_SMEM)
        bg = gl.allocate_shared_memory(bg_ptr.dtype.element_ty, [STAGES, TILE_N, BLOCK_K], B_SMEM)
        bu = gl.allocate_shared_memory(bu_ptr.dtype.element_ty, [STAGES, TILE_N, BLOCK_K], B_SMEM)
        if DOWN:
            WD: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_K, 16])  # fmt: skip
            AD_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, TILE_N], ad_ptr.dtype.element_ty)
            H_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, TILE_N], gu_ptr.dtype.element_ty)
            ad = gl.allocate_shared_memory(ad_ptr.dtype.element_ty, [STAGES, BLOCK_K, TILE_N], AD_SMEM)
            h_s = gl.allocate_shared_memory(gu_ptr.dtype.element_ty, [BLOCK_M, TILE_N], H_SMEM)
            zd = gl.zeros([BLOCK_M, BLOCK_K], gl.float32, WD)
            slot_row = gl.load(token_slot_ptr + t, mask=t < n_tokens, other=-1)[:, None]
        else:
            ad = bg
        gs = gl.allocate_shared_memory(gu_ptr.dtype.element_ty, [STAGES, BLOCK_M, TILE_N], GU_SMEM)
        us = gl.allocate_shared_memory(gu_ptr.dtype.element_ty, [STAGES, BLOCK_M, TILE_N], GU_SMEM)
        adapted = last > first
        if adapted:  # (in the first tile's group)
            _copy_z(zg, zu, z_rows, slot_t == slot, rank, LOAD, BLOCK_K)
        for s in gl.static_range(STAGES - 1):
            _issue_tile(gs.index(s), us.index(s), bg.index(s), bu.index(s), gu_rows, rows_in_l, bg_ptr, bu_ptr, slot,
                        adapted, first_col + s * TILE_N, n_end, inter, rank, stride_b_slot, stride_b_out, GU_LOAD,
                        LOAD, BLOCK_K, ad.index(s), ad_ptr, stride_ad_slot, stride_ad_rank, DOWN)  # fmt: skip
        out_rows = out_ptr + t.to(gl.int64)[:, None] * stride_out
        rows_in = (t < n_rows)[:, None]
        for i in range(tiles):
            n0 = first_col + i * TILE_N
            stage = i % STAGES
            async_copy.wait_group(STAGES - 2)  # (this thread's copies of tile i landed)
            fence_async_shared()
            _barrier()  # (every thread's, and every warp done with tile i - 1's stage, which the next copies take)
            ahead = (i + STAGES - 1) % STAGES
            _issue_tile(gs.index(ahead), us.index(ahead), bg.index(ahead), bu.index(ahead), gu_rows, rows_in_l, bg_ptr,
                        bu_ptr, slot, adapted, n0 + (STAGES - 1) * TILE_N, n_end, inter, rank, stride_b_slot,
                        stride_b_out, GU_LOAD, LOAD, BLOCK_K, ad.index(ahead), ad_ptr, stride_ad_slot, stride_ad_rank,
                        DOWN)  # fmt: skip
            gate = gs.index(stage).load(TILE)
            up = us.index(stage).load(TILE)
            if adapted:
                zero = gl.zeros([BLOCK_M, TILE_N], gl.float32, WG)
                dg, du = _products(zg, zu, bg.index(stage), bu.index(stage), zero, zero)
                if last > first + 1:  # (the block's other slots, B into this tile's stage; then the first's z back)
                    for e in range(first + 1, last):
                        other = gl.load(block_slots_ptr + e)
                        _barrier()
                        _copy_z(zg, zu, z_rows, slot_t == other, rank, LOAD, BLOCK_K)
                        _copy_bs(bg.index(stage), bu.index(stage), bg_ptr, bu_ptr, other, n0, inter, rank,
                                 stride_b_slot, stride_b_out, LOAD, BLOCK_K)  # fmt: skip
                        async_copy.commit_group()
                        async_copy.wait_group(0)
                        fence_async_shared()
                        _barrier()
                        dg, du = _products(zg, zu, bg.index(stage), bu.index(stage), dg, du)
                    _barrier()
                    _copy_z(zg, zu, z_rows, slot_t == slot, rank, LOAD, BLOCK_K)
                    async_copy.commit_group()
                    async_copy.wait_group(0)
                dg = gl.convert_layout(_tile_in_memory_order(dg, BLOCK_M, TILE_N), TILE)
                du = gl.convert_layout(_tile_in_memory_order(du, BLOCK_M, TILE_N), TILE)
                gate = (gate.to(gl.float32) + dg).to(gate.dtype)
                up = (up.to(gl.float32) + du).to(up.dtype)
            g32 = gate.to(gl.float32)
            h = g32 / (1.0 + gl.exp(-g32)) * up.to(gl.float32)
            n = n0 + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, TILE))
            h = h.to(out_ptr.dtype.element_ty)
            gl.store(out_rows + n[None, :], h, mask=rows_in & (n < n_end)[None, :])
            if DOWN:  # noqa: SIM102  (a constexpr branch: without DOWN its body is not compiled)
                if adapted:
                    zd = _down_product(h_s, h, slot_row == slot, ad.index(stage), zd)
                    if last > first + 1:  # (each other slot's A tile into this tile's stage, its rows' product)
                        for e in range(first + 1, last):
                            other = gl.load(block_slots_ptr + e)
                            _barrier()
                            _copy_a(ad.index(stage), ad_ptr, other, n0, inter, rank, stride_ad_slot, stride_ad_rank,
                                    GU_LOAD, BLOCK_K)  # fmt: skip
                            async_copy.commit_group()
                            async_copy.wait_group(0)
                            zd = _down_product(h_s, h, slot_row == other, ad.index(stage), zd)
        async_copy.wait_group(0)
        if DOWN:  # noqa: SIM102  (a constexpr branch: without DOWN its body is not compiled)
            if adapted:
                td = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, WD))
                slot_d = gl.load(token_slot_ptr + td, mask=td < n_tokens, other=-1)
                kd = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, WD))
                ptrs = zd_ptr + td.to(gl.int64)[:, None] * stride_zd + kd[None, :]
                gl.store(ptrs, zd.to(zd_ptr.dtype.element_ty), mask=(slot_d >= 0)[:, None] & (kd < rank)[None, :])
