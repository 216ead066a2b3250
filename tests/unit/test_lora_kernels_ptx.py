"""The LoRA kernels as the H200 runs them: compiled here for sm_90 (Triton ships ptxas), their PTX read.

The expand's cost is y's read and write: before its tiles' first columns were declared multiples of the tile
width, each thread moved y one 2-byte element at a time (on the H200 at half the bandwidth of
torch's own add over y). The shrink's is x's and A's reads: A's address comes from a table, and until it was
asserted aligned Triton loaded A one element at a time, outside the loop's pipeline.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from preft.vllm_plugin.kernels import act, common, expand, fused, shrink
from preft.vllm_plugin.tiles import DEFAULT_TILES

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# What the engine's calls specialize on: bf16 tensors, 16-aligned pointers, strides and widths that the
# model makes multiples of 16, the rank columns' strides of 1 (Triton specializes 1s) (the group tables'
# pointers and per-step integers are left unspecialized; B's row stride, the padded rank, may be 8)
TENSORS = ("x_ptr", "y_ptr", "z_ptr", "b0_ptr")  # the rest are tables: int64, offs int32
ALIGNED_ARGS = ("x_ptr", "y_ptr", "b0_ptr", "stride_x", "stride_y", "in_cols", "stride_a_slot", "stride_a_rank")
ONES = {"stride_z_col": 1, "stride_b_rank": 1}
ROWS = common.ROW_BLOCK  # each program's rows, as the engine's launches have them
SHRINK, EXPAND = DEFAULT_TILES["shrink"], DEFAULT_TILES["expand"]
MODULES = {"_shrink_kernel": shrink, "_expand_kernel": expand, "_lora_kernel": fused}  # (each kernel's file)
# Each kernel in the launch shape the engine gives it (the fused kernel: its own columns, warps and stages)
LAUNCHES = {
    "_shrink_kernel": ({"BLOCK_C": SHRINK.cols}, SHRINK.warps, SHRINK.stages),
    "_expand_kernel": (
        {"ALIGNED": True, "ADD": True, "BLOCK_N": EXPAND.cols},
        EXPAND.warps,
        EXPAND.stages,
    ),
    "_lora_kernel": (
        {"ALIGNED": True, "BLOCK_C": fused._BLOCK_C, "BLOCK_N": fused._BLOCK_N},
        fused._FUSED_WARPS,
        fused._FUSED_STAGES,
    ),
}


def global_accesses(
    kernel: str, use_span: bool, rank_block: int = 16, rank_aligned: bool = True, slices_per_program: int = 1
) -> Counter[str]:
    """How many of each global load and store and asynchronous copy instruction the kernel's sm_90 PTX holds
    (e.g. st.global.b16, cp.async.cg.shared.global), for ranks up to `rank_block` (the shrink: in programs of
    `slices_per_program` slices)."""
    fn = getattr(MODULES[kernel], kernel)
    names = fn.arg_names
    shape, warps, stages = LAUNCHES[kernel]
    rank = {"BLOCK_K" if kernel == "_expand_kernel" else "BLOCK_R": rank_block, "RANK_ALIGNED": rank_aligned}
    rank["COLS_FIRST"] = False  # (the expand's grid order: its accesses are the same either way)
    rank["SLICES_PER_PROGRAM"] = slices_per_program
    constexprs = shape | rank | {"USE_SPAN": use_span, "SPLIT": 1, "BLOCK_M": ROWS, "PRECISION": "tf32"} | ONES
    constexprs = {k: v for k, v in constexprs.items() if k in names}  # (the fused kernel has no RANK_ALIGNED)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16" if name in TENSORS else {"offs_ptr": "*i32"}.get(name, "*i64")
        else:
            signature[name] = {"scale": "fp32", "span_start": "i64"}.get(name, "i32")
    source = ASTSource(
        fn,
        signature,
        {(names.index(k),): v for k, v in constexprs.items()},
        {(names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED_ARGS if k in names},
    )
    ptx = triton.compile(source, target=HOPPER, options={"num_warps": warps, "num_stages": stages}).asm["ptx"]
    return Counter(re.findall(r"(?:ld|st)\.global[.a-z0-9]*|cp\.async\.[a-z]+\.shared\.global", ptx))


def _compiled(kernel: str, use_span: bool, **rank) -> Counter[str]:
    try:
        return global_accesses(kernel, use_span, **rank)
    except RuntimeError as error:  # a Triton without its CUDA backend's tools
        pytest.skip(f"cannot compile for sm_90 here: {error}")


@pytest.mark.parametrize("use_span", [False, True])
@pytest.mark.parametrize("kernel", ["_expand_kernel", "_lora_kernel"])
def test_y_is_read_and_written_in_16_byte_vectors(kernel, use_span):
    accesses = _compiled(kernel, use_span, rank_aligned=False)  # (z's and B's loads then not 16-byte vectors)
    shape, warps, _ = LAUNCHES[kernel]
    vectors = ROWS * shape["BLOCK_N"] * 2 // (32 * warps * 16)  # a bf16 tile of y, 16 bytes per thread at a time
    # y is the kernels' only store: every one a 16-byte vector, and as many 16-byte loads of it
    stores = {op: n for op, n in accesses.items() if op.startswith("st.")}
    assert stores == {"st.global.v4.b32": vectors}, accesses
    assert accesses["ld.global.v4.b32"] == vectors, accesses


@pytest.mark.parametrize("use_span", [False, True])
@pytest.mark.parametrize(("kernel", "per"), [("_shrink_kernel", 1), ("_shrink_kernel", 2), ("_lora_kernel", 1)])
def test_x_and_a_load_in_pipelined_16_byte_copies(kernel, per, use_span):
    """Each input tile, x's rows and A's (its address read from a table, asserted 16-byte aligned; with slices
    side by side, one address per slice's rank row), is fetched by cp.async ahead of the loop iteration that
    needs it; before, A came one bf16 at a time, every iteration waiting for it."""
    accesses = _compiled(kernel, use_span, slices_per_program=per)
    assert accesses["cp.async.cg.shared.global"] > 0, accesses
    if kernel == "_shrink_kernel":  # (the fused kernel still loads B's few rank columns one by one)
        assert "ld.global.b16" not in accesses, accesses


@pytest.mark.parametrize("rank_block", [16, 64])
@pytest.mark.parametrize(("kernel", "per"), [("_shrink_kernel", 1), ("_shrink_kernel", 2), ("_expand_kernel", 1)])
def test_z_and_b_move_in_vectors_where_the_rank_is_aligned(kernel, per, rank_block):
    """The rank-64 expand waited on memory latency (on the H200: 30% of DRAM's peak, 24% occupancy): each
    thread loaded z's and B's rank columns one bf16 at a time, 48 loads a thread at rank 64, and the shrink
    stored z so. Where the rank, z's and B's strides are multiples of 8 and z and B aligned (RANK_ALIGNED:
    the engine's padded ranks and weights), none is left; without it, they are there. (Triton 3.6, the
    H200's, keeps no tl.multiple_of on a value a jit function returns, so that alone left B loaded so.)"""
    aligned = _compiled(kernel, True, rank_block=rank_block, slices_per_program=per)
    assert not [op for op in aligned if op.endswith(".b16")], aligned
    unaligned = _compiled(kernel, True, rank_block=rank_block, rank_aligned=False, slices_per_program=per)
    assert [op for op in unaligned if op.endswith(".b16")], unaligned


def test_kernels_refuse_weights_that_are_not_16_byte_aligned():
    """The kernels assert the alignment of the addresses they read from tables: what lacks it goes elsewhere."""
    x = torch.zeros(4, 24)
    aligned = torch.zeros(2, 8, 24)
    shifted = torch.zeros(2 * 8 * 24 + 1)[1:].view(2, 8, 24)  # 4 bytes past an allocation's start
    b = torch.zeros(2, 40, 8)
    assert common.can_shrink(x, [aligned, aligned]) and fused.can_fuse(x, [aligned], [b])
    assert not common.can_shrink(x, [aligned, shifted])
    assert not fused.can_fuse(x, [aligned], [torch.zeros(2 * 40 * 8 + 1)[1:].view(2, 40, 8)])


def _activation(rank_aligned: bool, lora: bool, block_k: int = 16):
    """lora_act's kernel as the engine launches it (its default tiles, `block_k`-wide rank chunks), for sm_90."""
    fn = act._silu_mul_lora_kernel
    names = fn.arg_names
    tiles = DEFAULT_TILES["act"]
    constexprs = {"BLOCK_K": block_k, "BLOCK_M": tiles.rows, "BLOCK_N": tiles.cols, "PRECISION": "tf32"}
    constexprs |= {"RANK_ALIGNED": rank_aligned, "COLS_FIRST": tiles.cols_first, "LORA": lora, "stride_b_rank": 1}
    pointers = {"out_ptr": "*bf16", "gu_ptr": "*bf16", "z_ptr": "*bf16", "bg_ptr": "*bf16", "bu_ptr": "*bf16"}
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "*i64" if n.endswith("_ptr") else "i32") for n in names
    }
    aligned = ("out_ptr", "gu_ptr", "bg_ptr", "bu_ptr", "stride_out", "stride_gu", "inter", "stride_b_slot")
    source = ASTSource(
        fn,
        signature,
        {(names.index(k),): v for k, v in constexprs.items()},
        {(names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )
    try:
        return triton.compile(source, target=HOPPER, options={"num_warps": tiles.warps, "num_stages": 1}), tiles
    except RuntimeError as error:  # a Triton without its CUDA backend's tools
        pytest.skip(f"cannot compile for sm_90 here: {error}")


# (the rank chunks: 16 columns at ranks up to 16, act.RANK_CHUNK above)
CHUNKS = pytest.mark.parametrize("block_k", [16, act.RANK_CHUNK], ids=lambda k: f"k{k}")


@CHUNKS
@pytest.mark.parametrize("rank_aligned", [False, True])
def test_the_activation_reads_gate_up_and_writes_its_output_in_16_byte_vectors(rank_aligned, block_k):
    """The activation with the gate/up LoRA folded in (lora_act) moves gate, up and its output as the plain
    activation does: 16 bytes per thread at a time; its LoRA's z and B, where the rank is aligned, so too."""
    compiled, tiles = _activation(rank_aligned, lora=True, block_k=block_k)
    accesses = Counter(re.findall(r"(?:ld|st)\.global[.a-z0-9]*", compiled.asm["ptx"]))
    vectors = tiles.rows * tiles.cols * 2 // (32 * tiles.warps * 16)  # one bf16 tile
    assert {op: n for op, n in accesses.items() if op.startswith("st.")} == {"st.global.v4.b32": vectors}, accesses
    lora_vectors = sum(block_k * n * 2 // (32 * tiles.warps * 16) for n in (tiles.rows, tiles.cols))  # z's, B's
    # gate's and up's tiles, and their z's and B's twice: the first slot's products, then the other slots'
    assert accesses["ld.global.v4.b32"] == 2 * (vectors + rank_aligned * 2 * lora_vectors), accesses
    assert bool([op for op in accesses if op.endswith(".b16")]) != rank_aligned, accesses


def _registers(compiled) -> int:
    """Registers a thread of this compiled kernel takes (cuobjdump, which Triton ships beside ptxas)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump beside Triton's ptxas")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


@CHUNKS
def test_the_activation_holds_few_registers_so_enough_reads_stay_in_flight(block_k):
    """On the H200 the activation without LoRA once moved 2.6 TB/s where a plain kernel over the same gate/up moved ~4:
    its LoRA branch (four float32 tiles) took 122 registers a thread, in both variants, and so too few programs
    per SM. Now the variant without LoRA compiles without the branch (as few as the plain kernel: 32) and the
    folded one sums the products into gate's and up's own tiles, 16 or 32 rank columns at a time (64 at any
    rank; 80 in 64-wide chunks)."""
    plain, _ = _activation(rank_aligned=True, lora=False)
    accesses = Counter(re.findall(r"(?:ld|st)\.global[.a-z0-9]*", plain.asm["ptx"]))
    assert set(accesses) == {"ld.global.v4.b32", "st.global.v4.b32"}, accesses  # gate, up and out only
    assert _registers(plain) <= 40
    assert _registers(_activation(rank_aligned=True, lora=True, block_k=block_k)[0]) <= 80
