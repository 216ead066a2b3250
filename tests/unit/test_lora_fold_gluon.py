"""The Gluon fold (``kernels.fold_gluon``): compiled here for sm_90 as a Hopper GPU runs it, and run where there is one.

What the kernel is for (docs/engine.md, "The LoRA kernels"): Triton's fold takes gate, up and h through shared memory
between their loaded layout and wgmma's accumulator's, and waits on each tile's loads; this one copies every operand
by cp.async in 16-byte vectors into a ring of buffers tiles ahead of its products, reads gate and up from it and
stores h in 16-byte vectors straight in the accumulator's layout. Off a Hopper GPU the compile tests run (Triton
ships ptxas); the numeric tests need one (the device tool's H100 or H200).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
import torch

from preft.vllm_plugin.kernels import act, fold_gluon
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora
from preft.vllm_plugin.step.state import using

triton = pytest.importorskip("triton")
if fold_gluon.gluon is None:
    pytest.skip("this Triton has no Gluon", allow_module_level=True)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

# What the engine's calls specialize on (as tests/unit/test_lora_kernels_ptx.py's): bf16 tensors, 16-aligned
# pointers but z's and the tables', strides and widths that the model makes multiples of 16
TENSORS = ("out_ptr", "gu_ptr", "z_ptr", "bg_ptr", "bu_ptr", "ad_ptr", "zd_ptr")
ALIGNED = ("out_ptr", "gu_ptr", "bg_ptr", "bu_ptr", "stride_out", "stride_gu", "stride_b_slot", "stride_b_out", "inter")
# (with down's shrink: A_down's and z_down's pointers and A_down's strides too, as kernels.act.down_folds has them)
DOWN_ALIGNED = (*ALIGNED, "ad_ptr", "zd_ptr", "stride_ad_slot", "stride_ad_rank")


def _compiled(block_k: int, down: bool = False):
    fn = fold_gluon.fold_kernel
    names = fn.arg_names
    shape = act.GLUON_SHAPES[block_k]
    stages = act.GLUON_DOWN_STAGES[block_k] if down else shape.stages
    constexprs = {"BLOCK_K": block_k, "BLOCK_M": shape.rows, "BLOCK_N": shape.cols, "STAGES": stages, "DOWN": down}
    signature = {
        name: "constexpr" if name in constexprs else ("*bf16" if name in TENSORS else "*i64")
        if name.endswith("_ptr") else "i32"
        for name in names
    }  # fmt: skip
    source = GluonASTSource(
        fn,
        signature,
        {(names.index(k),): v for k, v in constexprs.items()},
        {(names.index(k),): [["tt.divisibility", 16]] for k in (DOWN_ALIGNED if down else ALIGNED)},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": shape.warps})


@pytest.mark.parametrize("block_k", [16, 32, 64])  # (the padded rank's tile: one product a slot)
def test_it_compiles_for_hopper_with_every_copy_async_and_gate_up_and_h_in_16_byte_vectors(block_k):
    compiled = _compiled(block_k)
    ptx = compiled.asm["ptx"]
    accesses = Counter(re.findall(r"(?:ld|st)\.(?:global|shared)[.a-z0-9]*", ptx))
    copies = Counter(re.findall(r"cp\.async\.[a-z.]+ \[[^]]*\], \[[^]]*\], (\w+)", ptx))
    # each thread's share of a 64 × 64 tile of h: 32 elements, four 16-byte stores; of gate and up four reads each
    # from the ring; gate, up, B and z reach it by 16-byte copies alone (no load of them into registers)
    assert accesses["st.global.v4.b32"] == 4
    assert accesses["ld.shared.v4.b32"] == 8
    assert "ld.global.v4.b32" not in accesses and set(copies) == {"0x10"}
    assert not [a for a in accesses if a.endswith((".b16", ".u16"))]  # (no access an element at a time)
    assert "wgmma.mma_async" in ptx
    # shared memory: z's gate and up tiles, then per stage gate's and up's tiles (64 × 64) and B's (64 × the rank's)
    stages = act.GLUON_SHAPES[block_k].stages
    assert compiled.metadata.shared == 2 * 64 * block_k * 2 + stages * (2 * 64 * 64 * 2 + 2 * 64 * block_k * 2)


@pytest.mark.parametrize("block_k", [16, 32, 64])
def test_with_down_s_shrink_it_compiles_for_hopper_with_each_tile_of_h_through_shared_memory(block_k):
    compiled = _compiled(block_k, down=True)
    ptx = compiled.asm["ptx"]
    accesses = Counter(re.findall(r"(?:ld|st)\.(?:global|shared)[.a-z0-9]*", ptx))
    copies = Counter(re.findall(r"cp\.async\.[a-z.]+ \[[^]]*\], \[[^]]*\], (\w+)", ptx))
    # as without it, and each tile's h stored into shared memory in 16-byte vectors (four a thread) for the block's
    # first slot's product, and again for each other slot's; A_down's tiles by 16-byte copies
    assert accesses["st.global.v4.b32"] == 4 and accesses["ld.shared.v4.b32"] == 8
    assert accesses["st.shared.v4.b32"] == 8
    assert "ld.global.v4.b32" not in accesses and set(copies) == {"0x10"}
    assert f"wgmma.mma_async.sync.aligned.m64n{block_k}k16" in ptx  # (down's product: rank columns)
    stages = act.GLUON_DOWN_STAGES[block_k]
    ring = stages * (2 * 64 * 64 * 2 + 2 * 64 * block_k * 2 + block_k * 64 * 2)  # (gate, up, their B, A_down)
    assert compiled.metadata.shared == 2 * 64 * block_k * 2 + ring + 64 * 64 * 2  # (z; the ring; h's tile)


def test_off_a_cuda_device_lora_act_does_not_take_it():
    gate_up = torch.zeros(4, 32, dtype=torch.bfloat16)
    b = (torch.zeros(2, 16, 8, dtype=torch.bfloat16),) * 2
    assert not act.gluon_folds(gate_up, gate_up, b, rank_aligned=True)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# Runs across the 64-row blocks: a block with three slots, a slot's tokens on both sides of another's, tokens
# without an adapter between and at the end (test_lora_act's), then a long request
TOKEN_SLOTS = [2] * 70 + [-1] * 5 + [0] * 3 + [1] * 10 + [0] * 4 + [3] * 60 + [-1] * 9 + [1] * 200


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("ranks", [(8, 16, 8, 8), (24, 8, 16, 24), (40, 8, 16, 40), (64, 8, 64, 32)], ids=str)
@pytest.mark.parametrize("inter", [320, 4864])  # (one program's columns and a part; Qwen2.5-0.5B's: 19 programs)
def test_on_a_hopper_gpu_it_folds_as_the_triton_kernel_does(monkeypatch, dtype, ranks, inter):
    gen = torch.Generator("cuda").manual_seed(sum(ranks))
    rows, width, rank, slots = len(TOKEN_SLOTS) + 7, 128, max(ranks), len(ranks)  # (7 padding rows: no adapter)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    x, gate_up = randn(rows, width), randn(rows, 2 * inter, scale=0.5)
    a = [randn(slots, 1, rank, width, scale=width**-0.5) for _ in range(2)]
    b = [randn(slots, 1, inter, rank, scale=rank**-0.5) for _ in range(2)]
    for s, r in enumerate(ranks):  # vLLM's padding past each slot's rank
        for w in a:
            w[s, :, r:] = 0
        for w in b:
            w[s, :, :, r:] = 0
    token_slots = np.asarray(TOKEN_SLOTS)
    groups = g.SlotGroups.build(token_slots, "cuda", slot_ranks=np.asarray([*ranks, 0]), max_rank=rank)
    launched = []
    fold = act._FOLD
    monkeypatch.setattr(act, "_FOLD", lambda *args: launched.append(args[1]) or fold(*args))
    outs = {}
    for kernels in (("expand", "shrink", "act", "fold", "gluon"), ("expand", "shrink", "act", "fold")):
        with using(*kernels):
            out = torch.empty(rows, inter, device="cuda", dtype=dtype)
            lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PlanCache())
            outs[kernels[-1]] = out.float()
    assert len(launched) == 1  # the Gluon kernel folded the first; Triton's the second
    # the reference: each row's z = x·Aᵀ rounded to the dtype (as the shrink stores it), z·Bᵀ in float32 added
    # into gate/up, rounded once, then the activation
    y = gate_up.float().clone()
    for s in range(slots):
        on = torch.from_numpy(np.r_[token_slots, [-1] * 7] == s).to("cuda")
        for i in range(2):
            z = (x[on].float() @ a[i][s, 0].float().T).to(dtype).float()
            y[on, i * inter : (i + 1) * inter] += z @ b[i][s, 0].float().T
    y = y.to(dtype).float()
    expected = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
    # A sum in another order may round gate or up a unit apart, which moves h by a unit of gate's and up's scale
    # (~1) even where h is near 0; against the float32 reference, h's own rounding adds to that (on an H100, fp16:
    # both kernels 3.7734 where the reference has 3.7694, two units of h apart)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(outs["gluon"], expected, rtol=4 * ulp, atol=2 * ulp)
    torch.testing.assert_close(outs["gluon"], outs["fold"], rtol=2 * ulp, atol=2 * ulp)  # (Triton's sums' order)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("ranks", [(8, 16, 8, 8), (24, 8, 16, 24), (64, 8, 64, 32)], ids=str)
@pytest.mark.parametrize("inter", [320, 4864])
def test_on_a_hopper_gpu_down_s_shrink_folded_in_gives_the_shrink_kernel_s_z(monkeypatch, ranks, inter):
    gen = torch.Generator("cuda").manual_seed(sum(ranks))
    rows, width, rank, slots = len(TOKEN_SLOTS) + 7, 128, max(ranks), len(ranks)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x, gate_up = randn(rows, width), randn(rows, 2 * inter, scale=0.5)
    a = [randn(slots, 1, rank, width, scale=width**-0.5) for _ in range(2)]
    b = [randn(slots, 1, inter, rank, scale=rank**-0.5) for _ in range(2)]
    a_down = randn(slots, 1, rank, inter, scale=inter**-0.5)
    for s, r in enumerate(ranks):
        for w in [*a, a_down]:
            w[s, :, r:] = 0
        for w in b:
            w[s, :, :, r:] = 0
    groups = g.SlotGroups.build(np.asarray(TOKEN_SLOTS), "cuda", slot_ranks=np.asarray([*ranks, 0]), max_rank=rank)
    launched = []
    fold = act._FOLD
    monkeypatch.setattr(act, "_FOLD", lambda *args: launched.append(args[2][-1]) or fold(*args))
    outs = {}
    for sms in (1, 10**6):  # (a GPU of one SM takes down's shrink into the fold; one of a million leaves it apart)
        monkeypatch.setattr(act, "_SMS", {torch.cuda.current_device(): sms})
        with using("expand", "shrink", "act", "fold", "gluon", "down"):
            out, z = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16), torch.zeros_like(x[:, :rank])
            lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, (a_down, z), plans=PlanCache())
            outs[sms] = out, z
    assert launched == [True, False]  # (DOWN, the kernel's last argument)
    (folded, z_folded), (apart, z_apart) = outs[1], outs[10**6]
    assert torch.equal(folded, apart)  # the same activation
    adapted = torch.from_numpy(np.r_[TOKEN_SLOTS, [-1] * 7] >= 0).to("cuda")
    assert not z_folded[~adapted].any()  # (rows without an adapter untouched)
    # z summed over the row in another order than the shrink kernel's, rounded once to bf16 by both
    scale = z_apart.float().abs().max()
    torch.testing.assert_close(z_folded.float(), z_apart.float(), rtol=2**-6, atol=2**-7 * scale)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
def test_on_a_hopper_gpu_gate_up_rows_out_of_16_byte_vectors_are_left_to_the_triton_fold():
    inter, rank = 320, 16
    wide = torch.zeros(64, 2 * inter + 8, device="cuda", dtype=torch.bfloat16)  # (rows 16-byte aligned)
    z = torch.zeros(64, 2 * rank, device="cuda", dtype=torch.bfloat16)
    b = (torch.zeros(2, 1, inter, rank, device="cuda", dtype=torch.bfloat16),) * 2
    with using("expand", "shrink", "act", "fold", "gluon"):
        assert act.gluon_folds(wide[:, : 2 * inter], z, b, rank_aligned=True)
        assert not act.gluon_folds(wide[:, 2 : 2 * inter + 2], z, b, rank_aligned=True)  # (4 bytes in)
        assert not act.gluon_folds(wide[:, : 2 * inter - 8], z, b, rank_aligned=True)  # (inter % 8 = 4)
        odd_rows = torch.zeros(64, 2 * inter + 4, device="cuda", dtype=torch.bfloat16)  # (rows 8 bytes apart of 16)
        assert not act.gluon_folds(odd_rows[:, : 2 * inter], z, b, rank_aligned=True)
