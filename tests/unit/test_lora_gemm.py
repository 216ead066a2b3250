"""The LoRA linear in one GEMM (lora_gemm), under Triton's interpreter, against x·Wᵀ + b plus each row's LoRA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from preft.vllm_plugin import groups as g
from preft.vllm_plugin import lora_gemm, lora_kernels

SLOTS, RANK, IN = 4, 16, 40  # (IN: not a multiple of the GEMM's depth, so its last step is masked)
SLICES = [64, 32, 32]  # q, k, v: each a whole number of the test's 32-column tiles
TILES = lora_gemm.GemmTiles(rows=64, cols=32, depth=16, group=2, warps=4, stages=1)
# Across the 64-row blocks: a block with three slots, tokens without an adapter between and at the end
TOKEN_SLOTS = [2] * 70 + [-1] * 5 + [0] * 3 + [1] * 10 + [3] * 40 + [-1] * 9


def _case(token_slots, rows, ranks=(8, 16, 8, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=gen)
    w = torch.randn(sum(SLICES), IN, generator=gen) / IN**0.5
    bias = torch.randn(sum(SLICES), generator=gen)
    a = [torch.randn(SLOTS, 1, RANK, IN, generator=gen) / IN**0.5 for _ in SLICES]
    b = [torch.randn(SLOTS, 1, out, RANK, generator=gen) / RANK**0.5 for out in SLICES]
    for s, r in enumerate(ranks):  # vLLM's padding past each slot's rank
        for t in (*a, *(t.transpose(-1, -2) for t in b)):
            t[s, :, r:] = 0
    groups = g.SlotGroups.build(np.asarray(token_slots), "cpu", slot_ranks=np.asarray(ranks), max_rank=RANK)
    return x, w, bias, a, b, groups


def _reference(x, w, bias, a, b, token_slots):
    y = x @ w.T + bias
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            y[t] += torch.cat([(x[t] @ a[i][slot, 0].T) @ b[i][slot, 0].T for i in range(len(SLICES))])
    return y


def _plan(x, a, b, y):
    split = lora_kernels.split_plan(y, x, a, b, SLICES)
    assert split is not None
    return lora_gemm.gemm_plan(split, y.shape[1], TILES.cols)


@pytest.mark.parametrize("padding", [0, 7])  # rows past the step's tokens (a padded batch) have no adapter
@pytest.mark.parametrize("token_slots", [TOKEN_SLOTS, [-1] * 3 + [1] * 130 + [-1] * 2], ids=["gathered", "span"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_the_gemm_adds_each_rows_lora(lora_kernels_interpreted, token_slots, padding, with_bias, tma):
    x, w, bias, a, b, groups = _case(token_slots, len(token_slots) + padding)
    expected = _reference(x, w, bias if with_bias else torch.zeros_like(bias), a, b, token_slots)
    y = torch.full((x.shape[0], sum(SLICES)), float("nan"))
    tiles = dataclasses.replace(TILES, tma=tma)
    lora_gemm.gemm_lora(y, x, w, bias if with_bias else None, _plan(x, a, b, y), groups, tiles)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_without_lora_tokens_it_is_the_plain_gemm(lora_kernels_interpreted):
    x, w, bias, a, b, _ = _case(TOKEN_SLOTS, len(TOKEN_SLOTS))
    y = torch.full((x.shape[0], sum(SLICES)), float("nan"))
    plan = _plan(x, a, b, y)
    none = g.SlotGroups.build(np.full(x.shape[0], -1), "cpu", slot_ranks=np.zeros(SLOTS, dtype=np.int64), max_rank=RANK)
    lora_gemm.gemm_lora(y, x, w, bias, plan, none, TILES)
    torch.testing.assert_close(y, x @ w.T + bias, rtol=1e-5, atol=1e-5)


def test_a_tile_across_two_slices_has_no_plan(lora_kernels_interpreted):
    x, _, _, a, b, _ = _case(TOKEN_SLOTS, len(TOKEN_SLOTS))
    y = torch.empty(x.shape[0], sum(SLICES))
    split = lora_kernels.split_plan(y, x, a, b, SLICES)
    assert lora_gemm.gemm_plan(split, y.shape[1], 64) is None  # k's 32 columns would share a tile with v's
    assert lora_gemm.gemm_plan(split, y.shape[1], 32) is not None
