"""The MLP activation with the gate/up LoRA folded in (kernels.act, step.lora), against the LoRA added into gate/up
first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preft.vllm_plugin.kernels import act, policy
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora
from preft.vllm_plugin.tiles import Tiles

SLOTS, IN, INTER = 4, 32, 48
# Runs across the kernel's 64-row blocks: a block with three slots, one with a slot's tokens on both sides of
# another's (the same slot twice in a block), tokens without an adapter between and at the end
TOKEN_SLOTS = [2] * 70 + [-1] * 5 + [0] * 3 + [1] * 10 + [0] * 4 + [3] * 60 + [-1] * 9


def _case(token_slots, rows, ranks=(8, 16, 8, 8), seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.get_default_dtype()
    x = torch.randn(rows, IN, generator=gen, dtype=dtype)
    gate_up = torch.randn(rows, 2 * INTER, generator=gen, dtype=dtype)
    rank = max(ranks)  # (vLLM's slots: the largest rank, the others padded with zeros)
    a = [torch.randn(SLOTS, 1, rank, IN, generator=gen, dtype=dtype) / IN**0.5 for _ in range(2)]
    b = [torch.randn(SLOTS, 1, INTER, rank, generator=gen, dtype=dtype) / rank**0.5 for _ in range(2)]
    for s, r in enumerate(ranks):  # vLLM's padding past each slot's rank
        for w in a:
            w[s, :, r:] = 0
        for w in b:
            w[s, :, :, r:] = 0
    groups = g.SlotGroups.build(np.asarray(token_slots), "cpu", slot_ranks=np.asarray([*ranks, 0]), max_rank=rank)
    return x, gate_up, a, b, groups


def _reference(x, gate_up, a, b, token_slots):
    y = gate_up.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            for i in range(2):
                y[t, i * INTER : (i + 1) * INTER] += (x[t] @ a[i][slot, 0].T) @ b[i][slot, 0].T
    return torch.nn.functional.silu(y[:, :INTER]) * y[:, INTER:]


@pytest.mark.parametrize("cols_first", [False, True], ids=["rows-first", "cols-first"])  # the grid's order
@pytest.mark.parametrize("padding", [0, 7])  # rows past the step's tokens (a padded batch) have no adapter
@pytest.mark.parametrize("token_slots", [TOKEN_SLOTS, [-1] * 3 + [1] * 130 + [-1] * 2], ids=["gathered", "span"])
# (in 16-wide rank chunks, 24: two; 40: three, the last one partial; in 32-wide, 24: one partial, 40: two)
@pytest.mark.parametrize("ranks", [(8, 16, 8, 8), (24, 8, 16, 24), (40, 8, 16, 40)], ids=["r16", "r24", "r40"])
@pytest.mark.parametrize("chunk", [16, 32], ids=lambda k: f"k{k}")
def test_the_kernel_matches_the_lora_added_into_gate_up(
    lora_kernels_interpreted, monkeypatch, token_slots, padding, cols_first, ranks, chunk
):
    monkeypatch.setattr(act, "RANK_CHUNK", chunk)
    x, gate_up, a, b, groups = _case(token_slots, len(token_slots) + padding, ranks)
    expected = _reference(x, gate_up, a, b, token_slots)
    before = gate_up.clone()
    launched = []
    launch = act._ACT
    monkeypatch.setattr(act, "_ACT", lambda grid, key, *rest: launched.append(key[-1]) or launch(grid, key, *rest))
    out = torch.empty(gate_up.shape[0], INTER)
    with policy.tiled(act=Tiles(rows=32, cols=16, warps=4, stages=1, cols_first=cols_first)):
        lora.lora_silu_and_mul(
            out, gate_up, x, a, b, groups, plans=PlanCache()
        )  # (a grid of 4-5 row blocks by 3 column tiles)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # (another order of the products' sums)
    picked = policy.picked(gate_up)
    assert launched == ["fold" in picked] * ("act" in picked)  # the variant with LoRA, or without it after the add
    assert torch.equal(gate_up, before) == ("fold" in picked)  # folded, gate_up is only read


def test_a_step_above_the_fold_rank_adds_its_lora_into_gate_up_then_runs_the_kernel_without_it(
    lora_kernels_interpreted, monkeypatch
):
    x, gate_up, a, b, groups = _case(TOKEN_SLOTS, len(TOKEN_SLOTS))  # (the step's rank: 16)
    expected = _reference(x, gate_up, a, b, TOKEN_SLOTS)
    before = gate_up.clone()
    monkeypatch.setattr(policy, "FOLD_MAX_RANK", 8)
    launches = []
    launch = act._ACT
    monkeypatch.setattr(act, "_ACT", lambda grid, key, *rest: launches.append(key[-1]) or launch(grid, key, *rest))
    out = torch.empty(gate_up.shape[0], INTER)
    lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PlanCache())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(gate_up, before)  # the LoRA was added into gate/up
    assert launches == [False] * ("act" in policy.picked(gate_up))  # the kernel's variant without LoRA


def test_a_step_makes_its_slot_table_once_and_each_block_lists_its_slots(lora_kernels_interpreted):
    x, gate_up, a, b, groups = _case(TOKEN_SLOTS, len(TOKEN_SLOTS))
    if "fold" not in policy.picked(gate_up):
        pytest.skip("this choice does not fold the LoRA into the activation kernel")
    out = torch.empty(gate_up.shape[0], INTER)
    with policy.tiled(act=Tiles(rows=64, cols=32, warps=4, stages=1)):
        for _ in range(2):
            lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PlanCache())
    tables = groups.launch_args["row blocks", 64, act.RANK_CHUNK].tensors
    token_slot, offs, slots = tables[:3]
    assert token_slot.tolist() == TOKEN_SLOTS
    per_block = [slots[offs[i] : offs[i + 1]].tolist() for i in range(len(offs) - 1)]
    assert per_block == [[2], [0, 1, 2, 3], [3], []]  # (64-row blocks; the last entry: rows past the table)


def test_without_lora_tokens_it_is_the_plain_activation():
    x, gate_up, a, b, _ = _case([-1] * 5, 5)
    out = torch.empty(5, INTER)
    lora.lora_silu_and_mul(out, gate_up, x, a, b, g.empty_groups(), plans=PlanCache())
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:])


def test_the_kernel_without_lora_tokens_is_the_plain_activation(lora_kernels_interpreted):
    x, gate_up, a, b, _ = _case([-1] * 70, 70)
    out = torch.empty(70, INTER)
    lora.lora_silu_and_mul(out, gate_up, x, a, b, g.empty_groups(), plans=PlanCache())
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:])


def test_where_the_gluon_fold_cannot_build_triton_s_fold_serves_and_says_why(
    lora_kernels_interpreted, monkeypatch, caplog
):
    x, gate_up, a, b, groups = _case(TOKEN_SLOTS, len(TOKEN_SLOTS))
    if "fold" not in policy.picked(gate_up):
        pytest.skip("this choice does not fold the LoRA into the activation kernel")
    expected = _reference(x, gate_up, a, b, TOKEN_SLOTS)
    monkeypatch.setattr(act, "gluon_folds", lambda *args: True)  # (as on a Hopper GPU)
    monkeypatch.setattr(act, "_GLUON_ARCHS", {})

    def cannot_build(*args):
        raise RuntimeError("this Triton's Gluon has no warpgroup_mma")

    monkeypatch.setattr(act, "_launch_gluon", cannot_build)
    out = torch.empty(gate_up.shape[0], INTER)
    lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PlanCache())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert act._GLUON_ARCHS[gate_up.get_device()] is False  # (gluon_folds then says no on that device)
    assert "the Gluon fold is unavailable (RuntimeError: this Triton's Gluon has no warpgroup_mma)" in caplog.text


@pytest.mark.parametrize("token_slots", [TOKEN_SLOTS, [-1] * 3 + [1] * 130 + [-1] * 2], ids=["gathered", "span"])
def test_with_down_s_shrink_it_returns_the_activation_and_down_s_z_at_each_adapted_row(
    lora_kernels_interpreted, token_slots
):
    rows, ranks = len(token_slots) + 7, (24, 8, 16, 24)
    x, gate_up, a, b, groups = _case(token_slots, rows, ranks)
    a_down = torch.randn(SLOTS, 1, max(ranks), INTER, generator=torch.Generator().manual_seed(3)) / INTER**0.5
    for s, r in enumerate(ranks):
        a_down[s, :, r:] = 0
    expected = _reference(x, gate_up, a, b, token_slots)
    out, z = torch.empty(rows, INTER), torch.full((rows, max(ranks)), 7.0)
    lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, (a_down, z), plans=PlanCache())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    r = groups.rank  # (the step's: its slots' largest, 8 in the span)
    for t in range(rows):  # (the shrink of the activation as returned: down's input)
        slot = token_slots[t] if t < len(token_slots) else -1
        if slot >= 0:
            torch.testing.assert_close(z[t, :r], out[t] @ a_down[slot, 0, :r].T, rtol=1e-5, atol=1e-5)
        else:
            assert (z[t] == 7.0).all()  # rows without an adapter are left as they were


def test_without_lora_tokens_down_s_shrink_writes_nothing():
    x, gate_up, a, b, _ = _case([-1] * 5, 5)
    out, z = torch.empty(5, INTER), torch.full((5, 8), 7.0)
    lora.lora_silu_and_mul(
        out, gate_up, x, a, b, g.empty_groups(), (torch.zeros(SLOTS, 1, 8, INTER), z), plans=PlanCache()
    )
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:])
    assert (z == 7.0).all()
