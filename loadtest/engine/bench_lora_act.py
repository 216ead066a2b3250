"""The MLP's activation with the gate/up LoRA folded in (``kernels.act``), in each launch shape, on the GPU machine.

    python3 -m loadtest.engine.bench_lora_act --out $OUT/gpu-lora-act   # on the GPU machine

On a full prefill step (16,384 tokens in groups of 1,024, 512 slots, rank 8 or --ranks) of each model's gate/up
projection, times in one process: vLLM's activation kernel alone (``_C.silu_and_mul``), torch's product of the two
halves (the same traffic: what a generic elementwise kernel reaches) and of the same halves copied into tensors of
their own (whether reading both halves of gate_up's rows is what costs), the LoRA added into gate/up by the shrink
and expand kernels then vLLM's activation (what the engine ran before ``act`` became a default kernel) or then the
activation kernel without LoRA (``act`` without ``fold``), and the activation kernel in each launch shape of ``SHAPES``,
each in both grid orders (row blocks or column tiles first), with the LoRA folded in
(``fold``; and how far its result is from the added LoRA's) and with no LoRA token (its activation on steps without
adapters); above rank 16, the ``PIPELINED`` shapes folded again in the other rank chunks than
``kernels.act.RANK_CHUNK`` that change the kernel (16 and 64, labelled `` k16`` and `` k64``: what
``RANK_CHUNK`` is chosen from), and the default shape on a step where every other prompt has no
adapter (``mixed_half_base``, beside the ideal: half its blocks at the folded cost, half at the plain one). Prints
ms per call and the bandwidth each plain activation moves (gate, up and the output once each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from unittest import mock

import torch

from loadtest.engine.bench_lora_kernels import _timed, step, step_groups
from loadtest.engine.bench_lora_launch import per_model_main
from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import act, policy
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora
from preft.vllm_plugin.step.state import using
from preft.vllm_plugin.tiles import Tiles

PLANS = PlanCache()  # the kernels' plans, as a worker's slot state keeps them

SHAPES = [Tiles(r, c, w, 1) for r, c, w in ((64, 32, 4), (64, 64, 4), (64, 64, 8), (64, 128, 4), (64, 128, 8))]
SHAPES += [Tiles(r, c, w, 1) for r, c, w in ((32, 64, 4), (32, 128, 4), (16, 128, 4), (128, 32, 4), (32, 32, 4))]
SHAPES += [Tiles(128, 64, 8, 1)]  # (rank 64: B's tile over more rows)
SHAPES += [Tiles(r, c, w, 1) for r, c, w in ((16, 256, 4), (32, 256, 8), (64, 256, 8), (128, 128, 8))]
SHAPES += [dataclasses.replace(t, cols_first=True) for t in SHAPES]  # (each in the grid's other order)
# (the rank loop's z and B loads pipelined, two and three deep: rank 64 runs two 32-wide chunks, four 16-wide)
PIPELINED = ((32, 64, 4), (32, 128, 4), (64, 64, 8), (64, 128, 8))
SHAPES += [Tiles(r, c, w, s, True) for r, c, w in PIPELINED for s in (2, 3)]


def folding_at(rank: int) -> contextlib.AbstractContextManager[None]:
    """The fold taken at this rank, above ``kernels.policy.FOLD_MAX_RANK`` too: the bench measures the ranks that
    set it. (Without this, a rank above it would time the expand's add into gate/up, not the fold.)"""
    return mock.patch.object(policy, "FOLD_MAX_RANK", max(policy.FOLD_MAX_RANK, rank))


def bench(model: str, rank: int, iters: int) -> dict:
    device = torch.device("cuda")
    modules, ys, groups = step(model, rank, 16384, 1024, 512, device)
    x, _, a, b, _ = modules[2]
    gate_up = ys[2]
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, device=device, dtype=gate_up.dtype)
    moved = (gate_up.numel() + out.numel()) * gate_up.element_size()
    none = g.empty_groups(device)
    row: dict = {"model": model, "rank": rank, "tokens": gate_up.shape[0], "inter": out.shape[1]}

    def timed(fn) -> float:
        return _timed(fn, device, iters)[0] * 1e3

    if hasattr(getattr(torch.ops, "_C", None), "silu_and_mul"):  # (vLLM's kernels loaded: main)
        row["vllm_ms"] = timed(lambda: torch.ops._C.silu_and_mul(out, gate_up))
    half = out.shape[1]
    row["torch_mul_ms"] = timed(lambda: torch.mul(gate_up[:, :half], gate_up[:, half:], out=out))  # (same traffic)
    row["torch_mul_TB_s"] = moved / row["torch_mul_ms"] / 1e9
    gate, up = gate_up[:, :half].contiguous(), gate_up[:, half:].contiguous()
    row["torch_mul_apart_ms"] = timed(lambda: torch.mul(gate, up, out=out))  # (the halves in tensors of their own)
    row["torch_mul_apart_TB_s"] = moved / row["torch_mul_apart_ms"] / 1e9
    with using("expand", "shrink"):  # (each call adds the LoRA into gate_up again)
        row["added_then_vllm_ms"] = timed(lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS))
        gate_up.zero_()
        lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS)
        reference = out.float()
        expand = dataclasses.replace(settings.current().lora_tiles["expand"], cols_first=True)
        with policy.tiled(expand=expand):  # (the expand's grid in its other order)
            row["added_cols_first_then_vllm_ms"] = timed(
                lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS)
            )
    with using("expand", "shrink", "act"):  # (the default act tiles)
        row["added_then_plain_ms"] = timed(lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS))
    with using("expand", "shrink", "act", "fold"), folding_at(rank):
        if lora.fold_plan(gate_up, x, a, b, groups.rank, plans=PLANS) is None:
            raise RuntimeError(f"{model} rank {rank}: the LoRA would be added into gate/up, not folded")
        wide = [t for t in SHAPES if t.stages == 1 and t.cols_first and (t.rows, t.cols, t.warps) in PIPELINED]
        tile = act.rank_tile(rank, act.RANK_CHUNK)
        other = [k for k in (16, 32, 64) if act.rank_tile(rank, k) != tile]  # (chunks that change the kernel)
        cells = [(t, act.RANK_CHUNK) for t in SHAPES] + [(t, k) for k in other for t in wide]
        for tiles, chunk in cells:
            label = tiles.label + f" k{chunk}" * (chunk != act.RANK_CHUNK)
            with policy.tiled(act=tiles), mock.patch.object(act, "RANK_CHUNK", chunk):
                gate_up.zero_()
                cell = {"folded_ms": timed(lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS))}
                cell["max_rel_diff"] = float((out.float() - reference).abs().max() / reference.abs().max())
                cell["plain_ms"] = timed(lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, none, plans=PLANS))
            cell["plain_TB_s"] = moved / cell["plain_ms"] / 1e9
            row[label] = cell
            print(model, label, json.dumps({k: round(v, 4) for k, v in cell.items()}), flush=True)
        # A step where every other prompt has no adapter (base requests among adapted ones): its row blocks
        # without adapted rows skip the products but, compiled as one kernel, still take gate and up through the
        # products' layout (sm_90 compile, Triton 3.6); "ideal": half the blocks at the folded cost, half plain.
        mixed = step_groups(rank, gate_up.shape[0], 1024, 512, device, base_every=2)
        gate_up.zero_()
        default = row[settings.current().lora_tiles["act"].label]
        row["mixed_half_base"] = {
            "folded_ms": timed(lambda: lora.lora_silu_and_mul(out, gate_up, x, a, b, mixed, plans=PLANS)),
            "ideal_ms": (default["folded_ms"] + default["plain_ms"]) / 2,
        }
        print(model, "mixed_half_base", json.dumps(row["mixed_half_base"]), flush=True)
    labels = [label for label, cell in row.items() if isinstance(cell, dict) and "plain_ms" in cell]
    row["best"] = min(labels, key=lambda label: row[label]["folded_ms"])
    row["best_plain"] = min(labels, key=lambda label: row[label]["plain_ms"])
    row["folded_speedup_over_added"] = row["added_then_vllm_ms"] / row[row["best"]]["folded_ms"]
    row["folded_speedup_over_added_then_plain"] = row["added_then_plain_ms"] / row[row["best"]]["folded_ms"]
    return row


def main() -> None:
    try:
        __import__("vllm._custom_ops")  # loads vLLM's kernels (torch.ops._C.silu_and_mul)
    except ImportError:  # (no vLLM on the machine: its kernel's cell is left out, torch's activation stands in)
        print("vLLM is not installed: no vllm_ms cell, and the added LoRA's cells run torch's activation", flush=True)
    per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
