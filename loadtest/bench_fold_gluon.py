"""The fold in Gluon (``lora_fold_gluon``) against the Triton fold (``lora_act``), on the GPU machine.

    python3 -m loadtest.bench_fold_gluon --ranks 8,64 --out $OUT/gpu-fold-gluon   # on the GPU machine

On a full prefill step of each model's gate/up projection (16,384 tokens in groups of 1,024 from 512 slots, as
``bench_lora_act``), device time a call (``bench_lora_kernels.device_us``: CUDA graph replays) of the Triton fold
in its default shape, and of the Gluon kernel in each of ``SHAPES`` and rank chunks, each with how far its output
is from the LoRA added into gate/up by the expand then activated (gate_up random, so the products are added to
something), and the Triton kernel's difference beside it.
"""

from __future__ import annotations

import json
from unittest import mock

import torch

from loadtest.bench_lora_act import folding_at
from loadtest.bench_lora_kernels import device_us, step
from loadtest.bench_lora_launch import per_model_main
from preft.vllm_plugin import groups as g
from preft.vllm_plugin import lora_act, lora_fold_gluon, lora_kernels, triton_launch
from preft.vllm_plugin.tiles import Tiles

WGMMA_8 = Tiles(128, 64, 8, 1, True)  # (two warpgroups)
# (kernel, shapes): the mma_v2 kernel's best of run 178 beside the wgmma kernel's (rows: 16 a warp)
KERNELS = {
    "fold_kernel": [Tiles(64, 64, 4, 1, True)],
    "fold_kernel_wgmma": [Tiles(64, 64, 4, 1, True), Tiles(64, 64, 4, 1), Tiles(64, 128, 4, 1, True), WGMMA_8],
}
CHUNKS = (16, 32, 64)


def bench(model: str, rank: int, iters: int) -> dict:
    device = torch.device("cuda")
    modules, ys, groups = step(model, rank, 16384, 1024, 512, device)
    x, _, a, b, _ = modules[2]
    gate_up = torch.randn_like(ys[2]).div_(4)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, device=device, dtype=gate_up.dtype)
    none = g.empty_groups(device)
    row: dict = {"model": model, "rank": rank, "tokens": gate_up.shape[0], "inter": out.shape[1]}
    with lora_kernels.using("expand", "shrink"):  # (the LoRA added into a copy of gate_up, then activated)
        lora_act.lora_silu_and_mul(out, gate_up.clone(), x, a, b, groups)
    reference = out.float()

    def cell() -> dict:
        out.zero_()
        found = {"us": device_us(lambda: lora_act.lora_silu_and_mul(out, gate_up, x, a, b, groups), device, iters)}
        found["max_rel_diff"] = float((out.float() - reference).abs().max() / reference.abs().max())
        found["plain_us"] = device_us(lambda: lora_act.lora_silu_and_mul(out, gate_up, x, a, b, none), device, iters)
        return found

    with lora_kernels.using("expand", "shrink", "act", "fold"), folding_at(rank):
        row["triton"] = cell()
        print(model, rank, "triton", json.dumps(row["triton"]), flush=True)
        for kernel, shapes in KERNELS.items():
            gluon = triton_launch.Launcher(getattr(lora_fold_gluon, kernel))
            for tiles, chunk in ((t, c) for t in shapes for c in CHUNKS):
                if chunk > max(16, rank) and chunk != CHUNKS[0]:
                    continue
                label = f"{kernel} {tiles.label} k{chunk}"
                with (
                    lora_kernels.tiled(act=tiles),
                    mock.patch.object(lora_act, "RANK_CHUNK", chunk),
                    mock.patch.object(lora_act, "_ACT", gluon),
                ):
                    try:
                        row[label] = cell()
                    except Exception as error:  # (a shape the kernel cannot take: recorded, the rest run)
                        row[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                print(model, rank, label, json.dumps(row[label]), flush=True)
    timed = [label for label, found in row.items() if isinstance(found, dict) and "us" in found]
    row["best"] = min(timed, key=lambda label: row[label]["us"])
    return row


def main() -> None:
    per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
