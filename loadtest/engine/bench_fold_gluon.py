"""The fold on the Gluon kernel (``kernels.fold_gluon``) against the Triton fold (``kernels.act``), on the GPU machine.

    python3 -m loadtest.engine.bench_fold_gluon --models qwen05,llama8b --ranks 64,32,16,8 --out $OUT/gpu-fold-gluon

On a full prefill step of each model's gate/up projection (16,384 tokens in groups of 1,024 from 512 slots, as
``bench_lora_act``), device time a call (``bench_lora_kernels.device_us``: CUDA graph replays) of
``step.lora.lora_silu_and_mul`` with ``gluon`` picked and not (the Triton fold in its default shape), the Gluon
kernel in the engine's shape for the rank (``kernels.act.GLUON_SHAPES``) and in each shape of ``SHAPES``, each with how
far its output is from the LoRA added into gate/up by the expand then activated (gate_up random, so that the
products are added to something). Then down's shrink of the output: the engine's fold then the shrink kernel
(``step.lora.shrink_rows``), against the fold that computes it (``step.lora.lora_silu_and_mul``'s down), with how far
the second's z is from the first's. Needs a Hopper GPU (elsewhere the Triton fold serves both).
"""

from __future__ import annotations

import json
from unittest import mock

import torch

from loadtest.engine.bench_lora_act import folding_at
from loadtest.engine.bench_lora_kernels import device_us, step
from loadtest.engine.bench_lora_launch import per_model_main
from preft.vllm_plugin.kernels import act, common
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora
from preft.vllm_plugin.step.state import using

PLANS = PlanCache()  # the kernels' plans, as a worker's slot state keeps them
# the Gluon kernel's other launch shapes: 64 rows (a warpgroup) by 256-1,024 columns, rings of 2 and 3 stages
SHAPES = [act.GluonShape(64, cols, stages) for cols in (256, 512, 1024) for stages in (2, 3)]


def bench(model: str, rank: int, iters: int) -> dict:
    device = torch.device("cuda")
    modules, ys, groups = step(model, rank, 16384, 1024, 512, device)
    x, _, a, b, _ = modules[2]
    gate_up = torch.randn_like(ys[2]).div_(4)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, device=device, dtype=gate_up.dtype)
    none = g.empty_groups(device)
    row: dict = {"model": model, "rank": rank, "tokens": gate_up.shape[0], "inter": out.shape[1]}
    with using("expand", "shrink"):  # (the LoRA added into a copy of gate_up, then activated)
        lora.lora_silu_and_mul(out, gate_up.clone(), x, a, b, groups, plans=PLANS)
    reference = out.float()

    def cell(label: str) -> None:
        out.zero_()
        found = {
            "us": device_us(lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS), device, iters)
        }
        found["max_rel_diff"] = float((out.float() - reference).abs().max() / reference.abs().max())
        found["plain_us"] = device_us(
            lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, none, plans=PLANS), device, iters
        )
        row[label] = found
        print(model, rank, label, json.dumps(found), flush=True)

    with using("expand", "shrink", "act", "fold"), folding_at(rank):
        cell("triton")
    tile = act.rank_tile(rank, None)
    with using("expand", "shrink", "act", "fold", "gluon"), folding_at(rank):
        cell(f"gluon {act.GLUON_SHAPES[tile].label} (the engine's)")
        for shape in SHAPES:
            with mock.patch.dict(act.GLUON_SHAPES, {tile: shape}):
                cell(f"gluon {shape.label}")
    timed = [label for label, found in row.items() if isinstance(found, dict) and "us" in found]
    row["best"] = min(timed, key=lambda label: row[label]["us"])
    row["down"] = down_cells(x, a, b, modules[3][2][0], gate_up, out, groups, iters)
    print(model, rank, "down", json.dumps(row["down"]), flush=True)
    return row


def down_cells(x, a, b, a_down, gate_up, out, groups, iters: int) -> dict:
    """Device time of the fold, then down's shrink, against the fold with down's shrink folded in."""
    device, rank = gate_up.device, groups.rank
    apart, folded = (torch.zeros(gate_up.shape[0], a_down.shape[-2], device=device, dtype=out.dtype) for _ in "ab")

    def fold_then_shrink() -> None:
        lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS)
        lora.shrink_rows(apart, out, a_down, groups, plans=PLANS)

    with using("expand", "shrink", "act", "fold", "gluon", "down"), folding_at(rank):
        found = {"apart_us": device_us(fold_then_shrink, device, iters)}
        assert act.down_folds(gate_up, common.slot_matrices(a_down), folded, groups)
        found["folded_us"] = device_us(
            lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, (a_down, folded), plans=PLANS), device, iters
        )
    found["max_rel_diff"] = float((folded.float() - apart.float()).abs().max() / apart.float().abs().max())
    return found


def main() -> None:
    per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
