"""Grouped adapter computations (the plugin's ops) against a per-token reference, on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preft.adapters import ModelShape
from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import common, expand, fused, policy, shrink, split, staging, variants
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora, state, torch_path, warmup
from preft.vllm_plugin.step.state import using
from preft.vllm_plugin.tiles import Tiles

SLOTS, RANK, IN, OUT = 5, 16, 24, 40


def _groups(token_slots, ranks=(8, 8, 16, 8, 8), block_rows=common.ROW_BLOCK):
    slot_ranks = np.asarray([*ranks, 0])
    return g.SlotGroups.build(
        np.asarray(token_slots), "cpu", slot_ranks=slot_ranks, max_rank=RANK, block_rows=block_rows
    )


def _stacked(gen, rows, cols, ranks=(8, 8, 16, 8, 8), rank_dim=-2):
    """[slots, 1, rows, cols] with the rows (or cols) past each slot's rank zeroed, as vLLM pads."""
    w = torch.randn(SLOTS, 1, rows, cols, generator=gen, dtype=torch.get_default_dtype())
    for s, r in enumerate(ranks):
        if rank_dim == -2:
            w[s, :, r:] = 0
        else:
            w[s, :, :, r:] = 0
    return w


def test_build_groups_runs_of_one_slot_in_token_order():
    groups = _groups([3, -1, 0, 0, 1, -1, 0])
    assert groups.rows.tolist() == [0, 2, 3, 4, 6]
    assert groups.slots.tolist() == [3, 0, 1, 0]
    assert groups.offs.tolist() == [1, 3, 4, 5]
    assert groups.row_group.tolist() == [0, 1, 1, 2, 3]
    assert groups.bounds == ((3, 0, 1), (0, 1, 3), (1, 3, 4), (0, 4, 5))
    assert groups.span is None
    assert groups.rank == 8
    assert _groups([-1, -1]).empty
    assert _groups([2]).rank == 16


def test_contiguous_adapted_tokens_are_a_span():
    groups = _groups([-1, -1, 4, 4, 1, 1, 1, -1])
    assert groups.span == (2, 7)
    assert groups.bounds == ((4, 0, 2), (1, 2, 5))
    t = torch.arange(16.0).view(8, 2)
    assert groups.take(t).data_ptr() == t[2].data_ptr()  # a view, not a copy


def test_too_many_runs_fall_back_to_grouping_by_slot(monkeypatch):
    monkeypatch.setattr(g, "MAX_GROUPS", 3)
    groups = _groups([0, 1, 0, 1, 0])
    assert groups.span is None
    assert groups.rows.tolist() == [0, 2, 4, 1, 3]
    assert groups.bounds == ((0, 0, 3), (1, 3, 5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "token_slots", [[2, -1, 0, 2, 4, -1, 1, 1, 3], [-1, -1, -1], [0] * 7, [-1, 3, 3, 1, 1, -1], [1, 0, 2]]
)
def test_lora_linear_matches_per_token_reference(token_slots, dtype):
    torch.set_default_dtype(dtype)
    try:
        _check_lora_linear(token_slots)
    finally:
        torch.set_default_dtype(torch.float32)
    assert not torch_path._fast_path_failed


def _check_lora_linear(token_slots, slices=(OUT, 8), in_cols=IN, block_rows=common.ROW_BLOCK, plans=None, **tolerance):
    gen = torch.Generator().manual_seed(0)
    n = len(token_slots)
    x = torch.randn(n, in_cols, generator=gen, dtype=torch.get_default_dtype())
    a = [_stacked(gen, RANK, in_cols) for _ in slices]
    b = [_stacked(gen, s, RANK, rank_dim=-1) for s in slices]
    y = torch.randn(n, sum(slices), generator=gen, dtype=torch.get_default_dtype())
    expected = y.clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        offset = 0
        for ai, bi, size in zip(a, b, slices, strict=True):
            expected[t, offset : offset + size] += (x[t] @ ai[slot, 0].T * 0.5) @ bi[slot, 0].T
            offset += size
    groups = _groups(token_slots, block_rows=block_rows)
    lora.lora_linear(y, x, a, b, list(slices), 0.5, groups, plans=plans or PlanCache())
    torch.testing.assert_close(y, expected, **tolerance)


@pytest.mark.parametrize("token_slots", [[1, -1, 1, 0], [-1, 1, 1, 0]])
def test_shrink_then_expand_as_vllm_buffers(token_slots):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, IN, generator=gen, dtype=torch.get_default_dtype())
    a, b = [_stacked(gen, RANK, IN)], [_stacked(gen, OUT, RANK, rank_dim=-1)]
    groups = _groups(token_slots)
    buffer = torch.zeros(1, 4, RANK, dtype=torch.get_default_dtype())
    lora.lora_shrink(buffer, x, a, 2.0, groups)
    y = torch.zeros(4, OUT, dtype=torch.get_default_dtype())
    lora.lora_expand(y, buffer, b, [OUT], 0, True, groups, plans=PlanCache())
    for t, slot in enumerate(token_slots):
        want = (
            torch.zeros(OUT, dtype=torch.get_default_dtype())
            if slot < 0
            else (x[t] @ a[0][slot, 0].T * 2.0) @ b[0][slot, 0].T
        )
        torch.testing.assert_close(y[t], want)


@pytest.mark.parametrize("token_slots", [[0, -1, 2, 0], [-1, 2, 2, 0]])
def test_direft_apply_edits_only_adapted_rows_and_keeps_the_sum_order(token_slots):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, IN, generator=gen, dtype=torch.get_default_dtype())
    residual = torch.randn(4, IN, generator=gen, dtype=torch.get_default_dtype())
    a = torch.randn(SLOTS, RANK, IN, generator=gen, dtype=torch.get_default_dtype())
    b = torch.randn(SLOTS, RANK, IN, generator=gen, dtype=torch.get_default_dtype())
    bias = torch.randn(SLOTS, RANK, generator=gen, dtype=torch.get_default_dtype())
    a[:, 8:], b[:, 8:], bias[:, 8:] = 0, 0, 0
    stream = hidden + residual
    h0, r0 = hidden.clone(), residual.clone()
    torch_path.direft_apply(hidden, residual, a, b, bias, _groups(token_slots, ranks=(8, 8, 8, 8, 8)))
    for t, slot in enumerate(token_slots):
        if slot < 0:
            assert torch.equal(hidden[t], h0[t]) and torch.equal(residual[t], r0[t])
            continue
        delta = (a[slot] @ stream[t] + bias[slot]) @ b[slot]
        assert torch.equal(residual[t], stream[t])
        torch.testing.assert_close(hidden[t] + residual[t], stream[t] + delta)


def test_loop_fallback_matches_grouped_mm():
    gen = torch.Generator().manual_seed(3)
    groups = _groups([1, 1, 3, 0, 3])
    a = torch.randn(5, IN, generator=gen)
    w = torch.randn(len(groups.bounds), IN, 8, generator=gen)
    fast = torch_path.grouped_mm(a, w, groups)
    torch_path._fast_path_failed = True
    try:
        slow = torch_path.grouped_mm(a, w, groups)
    finally:
        torch_path._fast_path_failed = False
    torch.testing.assert_close(fast, slow)


def test_staged_puts_host_arrays_end_to_end_in_one_int64_tensor():
    parts = (np.array([1, 2], dtype=np.int32), np.array([[3, 4], [5, 6]]), np.zeros(0, dtype=np.int64))
    host = staging.staged(parts, pinned=False)
    assert host.dtype == torch.int64 and host.tolist() == [1, 2, 3, 4, 5, 6]
    assert [t.tolist() for t in staging.to_device(parts[:1] + parts[2:], torch.device("cpu"))] == [[1, 2], []]


def test_row_blocks_cut_each_group_into_kernel_blocks():
    block_group, block_start = g._row_blocks(np.array([0, 1, 3]), np.array([1, 3, 140]), 64)
    assert block_group.tolist() == [0, 1, 2, 2, 2]
    assert block_start.tolist() == [0, 1, 3, 67, 131]
    groups = _groups([4] * 70 + [-1, 2])
    assert groups.block_group.tolist() == [0, 0, 1]
    assert groups.block_start.tolist() == [0, 64, 70]


LONG_RUNS = [3] * 70 + [-1] * 5 + [0] * 3 + [2] * 66  # groups across the kernel's 64-row blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("token_slots", [LONG_RUNS, LONG_RUNS[75:], [2, -1, 0, 2, 4, -1, 1, 1, 3], [-1, -1]])
def test_lora_kernels_matches_per_token_reference(lora_kernels_interpreted, token_slots, dtype):
    torch.set_default_dtype(dtype)
    try:  # the kernel accumulates in float32, the reference in dtype: fp16 agrees to its rounding
        _check_lora_linear(token_slots, **({"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {}))
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("slices", [(272, 16, 16), (640,)])
def test_lora_kernels_on_wide_slices(lora_kernels_interpreted, slices, monkeypatch):
    """Slices wider than one column tile, 16-aligned: programs that cover several tiles, several per slice."""
    launched = []
    launch = fused.lora_linear
    monkeypatch.setattr(fused, "lora_linear", lambda *args, **kw: launched.append(1) or launch(*args, **kw))
    _check_lora_linear(LONG_RUNS[60:], slices=slices, in_cols=32)
    assert len(launched) == policy.available(torch.zeros(1), "fused")


@pytest.mark.parametrize(("width", "per_program"), [(0, 1), (32, 2), (64, 4)])
def test_the_shrink_takes_a_modules_slices_side_by_side(lora_kernels_interpreted, monkeypatch, width, per_program):
    """Three slices of rank 16: one a program, two (the second program's other slice past the last), all."""
    monkeypatch.setattr(shrink, "SHRINK_WIDTH", width)
    assert shrink.slices_per_program(3, RANK) == per_program
    assert shrink.slices_per_program(1, RANK) == 1
    _check_lora_linear(LONG_RUNS[60:], slices=(OUT, 8, 16))


def test_shrink_and_expand_kernels_make_two_launches_per_lora_linear(lora_kernels_interpreted, monkeypatch):
    """Whatever its number of slices, and with widths that are and are not multiples of 16."""
    launches = []
    for name in ("launch_shrink", "launch_expand"):
        launch = getattr(split, name)
        monkeypatch.setattr(split, name, lambda *args, _f=launch, _n=name: launches.append(_n) or _f(*args))
    with using("expand", "shrink"):
        _check_lora_linear(LONG_RUNS, slices=(OUT, 8, 16))
        _check_lora_linear(LONG_RUNS[60:], slices=(272, 16, 16), in_cols=32)
        _check_lora_linear([2, -1, 0, 2], slices=(OUT,))
    assert launches == ["launch_shrink", "launch_expand"] * 3


def test_steps_from_the_fused_rank_on_take_the_fused_kernel(lora_kernels_interpreted, monkeypatch):
    """With the pair and the fused kernel picked (``expand,shrink,fused``), a step's rank picks between them;
    either way the reference's result. Slot 2 has rank 16, the others 8."""
    launches = []
    for module, name in ((fused, "lora_linear"), (split, "split_linear")):
        launch = getattr(module, name)

        def recording(*args, _f=launch, _n=name, **kw):
            launches.append(_n)
            return _f(*args, **kw)

        monkeypatch.setattr(module, name, recording)
    monkeypatch.setattr(policy, "FUSED_FROM_RANK", 16)
    with using("expand", "shrink", "fused"):
        _check_lora_linear([0, 1, -1, 4], slices=(OUT, 8, 16))  # rank 8
        _check_lora_linear(LONG_RUNS, slices=(OUT, 8, 16))  # rank 16 (slot 2)
    assert launches == ["split_linear", "lora_linear"]
    picked = frozenset({"expand", "shrink", "fused"})
    assert [policy.fuses(r, picked) for r in (8, 15, 16, 64)] == [False, False, True, True]
    assert policy.fuses(8, frozenset({"fused", "expand"})) and not policy.fuses(64, picked - {"fused"})


def _lora_reference(y, x, a, b, slices, scale, token_slots):
    out = y.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            cols = np.cumsum([0, *slices])
            for i, (ai, bi) in enumerate(zip(a, b, strict=True)):
                out[t, cols[i] : cols[i + 1]] += (x[t] @ ai[slot, 0].T * scale) @ bi[slot, 0].T
    return out


def test_a_module_keeps_its_plan_and_the_step_its_arguments(lora_kernels_interpreted, monkeypatch):
    """Two modules (three slices and one) over two steps, each module called twice a step, as a model's layers
    call them: the results of the torch path; each module's plan made once and found again by its weights'
    identity; each step's group arguments made once; z's buffer reused, wider steps widening it."""
    made = []
    make = split.make_split_plan
    monkeypatch.setattr(split, "make_split_plan", lambda *args, **kw: made.append(1) or make(*args, **kw))
    plans = PlanCache()
    gen = torch.Generator().manual_seed(3)
    modules = []
    for slices in ((OUT, 8, 16), (OUT,)):
        a = [_stacked(gen, RANK, IN) for _ in slices]
        b = [_stacked(gen, size, RANK, rank_dim=-1) for size in slices]
        modules.append((a, b, list(slices)))
    with using("expand", "shrink"):
        for token_slots in (LONG_RUNS[60:], LONG_RUNS):
            groups = _groups(token_slots)
            x = torch.randn(len(token_slots), IN, generator=gen, dtype=torch.get_default_dtype())
            for a, b, slices in modules * 2:
                y = torch.randn(len(token_slots), sum(slices), generator=gen, dtype=torch.get_default_dtype())
                expected = _lora_reference(y, x, a, b, slices, 0.5, token_slots)
                lora.lora_linear(y, x, a, b, slices, 0.5, groups, plans=plans)
                torch.testing.assert_close(y, expected)
            assert list(groups.launch_args) == [common.ROW_BLOCK]  # (the shrink's and expand's rows agree)
            (z,) = plans.scratch_buffers.values()
            assert z.numel() >= len(groups.rows) * 3 * groups.rank
    assert len(made) == len(modules)
    a, b, slices = modules[0]
    y = torch.zeros(len(LONG_RUNS), sum(slices))
    plan = split.split_plan(y, x, a, b, slices, plans=plans)
    assert len(made) == len(modules)
    assert not plan.serves(y, x, a, b, [OUT, 16, 8]) and not plan.serves(y, x, [a[1], a[0], a[2]], b, slices)
    assert not plan.serves(y, x.double(), a, b, slices) and plan.serves(y, x, a, b, slices)


@pytest.mark.parametrize(
    ("block_rows", "shrink", "expand"),
    [
        (64, Tiles(rows=32, cols=16), Tiles(rows=16, cols=32, stages=1)),
        (128, Tiles(rows=128, cols=32, stages=4), Tiles(rows=64, cols=256, warps=8)),
        (64, Tiles(rows=32, cols=16), Tiles(rows=32, cols=32, cols_first=True)),
    ],
)
def test_lora_kernels_in_other_tiles_match_the_reference(lora_kernels_interpreted, block_rows, shrink, expand):
    """Several programs per row block, wider and narrower tiles, the expand's grid in either order: what a
    tuning sweep tries."""
    with using("expand", "shrink"), policy.tiled(shrink=shrink, expand=expand):
        _check_lora_linear(LONG_RUNS, slices=(OUT, 8, 16), block_rows=block_rows)
        _check_lora_linear(LONG_RUNS[60:], slices=(272, 16, 16), in_cols=32, block_rows=block_rows)
        _check_lora_linear([2, -1, 0, 2, 4, -1, 1, 1, 3], block_rows=block_rows)


def test_tiled_restores_the_tiles_and_refuses_what_cannot_run(lora_kernels_interpreted):
    before = dict(settings.current().lora_tiles)
    with pytest.raises(ValueError, match="unknown kernels"), policy.tiled(fused=Tiles(16, 16)):
        pass
    odd = Tiles(rows=64, cols=16)  # 64 rows per program do not divide a row block of 96
    with (
        using("expand", "shrink"),
        policy.tiled(shrink=odd),
        pytest.raises(ValueError, match="divide"),
    ):
        _check_lora_linear(LONG_RUNS, block_rows=96)
    assert before == dict(settings.current().lora_tiles)


def test_column_ranges_bound_the_rereads_of_x():
    assert fused.column_ranges([40, 8], 24) == ([(0, 0), (1, 0)], 128)  # one program per slice
    assert fused.column_ranges([272, 16], 32) == ([(0, 0), (0, 128), (0, 256), (1, 0)], 128)
    # 5 tiles, at most 1 + 2·640/640 = 3 programs: 2 tiles each
    assert fused.column_ranges([640], 640) == ([(0, 0), (0, 256), (0, 512)], 256)
    assert fused.column_ranges([0, 300], 4096) == ([(1, 0)], 384)  # an empty slice gets no program


@pytest.mark.parametrize("token_slots", [[1, -1, 1, 0], [-1, 1, 1, 0]])
def test_lora_kernels_as_vllm_buffers(lora_kernels_interpreted, token_slots):
    test_shrink_then_expand_as_vllm_buffers(token_slots)


def test_lora_kernels_warm_up_covers_every_variant(lora_kernels_interpreted, monkeypatch):
    launched = []
    launch = expand.expand_add

    def recording(y2, z, b, offset, width, groups, *, plans):
        launched.append((groups.span is not None, max(16, 1 << (groups.rank - 1).bit_length())))
        launch(y2, z, b, offset, width, groups, plans=plans)

    monkeypatch.setattr(expand, "expand_add", recording)
    warmup.compile_kernels(torch.device("cpu"), torch.float32, 32, 40, plans=PlanCache())
    assert sorted(launched) == [(span, k) for span in (False, True) for k in (16, 32, 64)]


def test_lora_kernels_that_cannot_compile_leave_the_torch_path(lora_kernels_interpreted, monkeypatch, caplog):
    def fails(*args, **kwargs):
        raise RuntimeError("no such target")

    monkeypatch.setattr(shrink, "shrink", fails)
    monkeypatch.setattr(fused, "lora_linear", fails)
    warmup.compile_kernels(torch.device("cpu"), torch.float32, 32, 8, plans=PlanCache())
    assert not policy.available(torch.zeros(1)) and "no such target" in caplog.text
    _check_lora_linear([0, 0, -1, 2])  # served by the torch path


def test_using_compiles_the_picked_kernels_for_every_engine_then_restores(lora_kernels_interpreted, monkeypatch):
    launched = []
    launch = expand.expand_add
    monkeypatch.setattr(expand, "expand_add", lambda *args, **kw: launched.append(1) or launch(*args, **kw))
    monkeypatch.setattr(state, "STATES", {})  # (this test's engine only)
    settings.replace(lora_kernels=frozenset())  # the default: the torch path
    shape = ModelShape("LlamaForCausalLM", 32, 2, 2, 2, 16, 64, 100)
    engine = state.PreftSlotState(shape=shape, max_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    assert not launched and not policy.available(torch.zeros(1)) and engine.warmed_up is not None
    with using("expand"):
        assert len(launched) == 2 and policy.available(torch.zeros(1))
        assert not policy.available(torch.zeros(1), "shrink")
    assert not policy.available(torch.zeros(1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests before it compile kernels")
def test_compiled_variants_are_counted_from_tritons_caches():
    """The pinned Triton's JIT layout is the one read: nothing compiled on this CPU-only machine."""
    assert variants.compiled_variants() == 0


def test_the_expand_stores_the_delta_without_reading_y(lora_kernels_interpreted):
    """split_linear(add=False) (bench_lora_addmm's delta first): the adapted rows of y become the LoRA's product,
    whatever they held; the other rows keep theirs."""
    gen = torch.Generator().manual_seed(4)
    slices, token_slots = [OUT, 8], LONG_RUNS[60:]
    x = torch.randn(len(token_slots), IN, generator=gen, dtype=torch.get_default_dtype())
    a = [_stacked(gen, RANK, IN) for _ in slices]
    b = [_stacked(gen, s, RANK, rank_dim=-1) for s in slices]
    y = torch.full((len(token_slots), sum(slices)), float("nan"))
    expected = _lora_reference(torch.zeros_like(y), x, a, b, slices, 0.5, token_slots)
    with using("expand", "shrink"):
        plans = PlanCache()
        plan = split.split_plan(y, x, a, b, slices, plans=plans)
        split.split_linear(y, x, plan, 0.5, _groups(token_slots), add=False, plans=plans)
    adapted = torch.tensor(token_slots) >= 0
    torch.testing.assert_close(y[adapted], expected[adapted], rtol=1e-5, atol=1e-5)
    assert y[~adapted].isnan().all()


def test_the_kernels_load_rank_columns_in_vectors_only_where_they_are_aligned(lora_kernels_interpreted, monkeypatch):
    """Padded ranks of 8 and 16 take the shrink's and the expand's variant that moves z's and B's rank columns
    in 16-byte vectors (RANK_ALIGNED); a padded rank of 4 (a max_lora_rank below 8), whose rows are not 16-byte
    multiples, and B with its rank columns strided, the variant that moves them element by element. Each, the
    reference's result."""
    seen: list[tuple[str, bool]] = []
    for module, name in ((shrink, "_SHRINK"), (expand, "_EXPAND")):
        launcher = getattr(module, name)

        def recording(grid, key, args, *rest, _launch=launcher, _name=name):
            seen.append((_name, args[_launch.fn.arg_names.index("RANK_ALIGNED")]))
            _launch(grid, key, args, *rest)

        monkeypatch.setattr(module, name, recording)
    gen = torch.Generator().manual_seed(5)
    token_slots = [2, -1, 0, 2, 2, 1, 1, -1, 0]
    x = torch.randn(len(token_slots), IN, generator=gen)
    with using("expand", "shrink"):
        for rank, b_strided, slices in ((16, False, [OUT, 16]), (4, False, [OUT, 16]), (16, True, [OUT])):
            a = [torch.randn(3, 1, rank, IN, generator=gen) for _ in slices]
            b = [torch.randn(3, 1, rank, size, generator=gen).transpose(2, 3) for size in slices]
            if not b_strided:
                b = [t.contiguous() for t in b]
            groups = g.SlotGroups.build(np.asarray(token_slots), "cpu", slot_ranks=np.full(4, rank), max_rank=rank)
            y = torch.randn(len(token_slots), sum(slices), generator=gen)
            expected = _lora_reference(y, x, a, b, slices, 0.5, token_slots)
            seen.clear()
            lora.lora_linear(y, x, a, b, slices, 0.5, groups, plans=PlanCache())
            torch.testing.assert_close(y, expected)
            assert [name for name, _ in seen] == ["_SHRINK", "_EXPAND"], (rank, b_strided, seen)
            assert dict(seen) == {"_SHRINK": rank % 8 == 0, "_EXPAND": rank % 8 == 0 and not b_strided}, seen
