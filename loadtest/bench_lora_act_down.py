"""Down's shrink folded into the activation kernel (``lora_act.lora_silu_and_mul_down``), on the GPU machine.

    python3 -m loadtest.bench_lora_act_down --models qwen05,llama8b --ranks 64,8 --out $OUT/gpu-lora-act-down

On a full prefill step (16,384 tokens in groups of 1,024 from 512 slots) of each model's MLP, device time (CUDA
graph replay) of: the engine's order (the folded activation, then down's shrink reading its output again), and the
activation that also computes down's shrink of each tile it writes, over `tiles_per_program` column tiles a
program (float32 atomic adds into z, zeroed first), in a few launch shapes; each against the engine's result.
"""

from __future__ import annotations

import json

import torch

from loadtest.bench_lora_act import folding_at
from loadtest.bench_lora_kernels import device_us, step
from loadtest.bench_lora_launch import per_model_main
from preft.vllm_plugin import lora_act, lora_kernels
from preft.vllm_plugin.tiles import Tiles

SHAPES = [Tiles(64, 64, 8, 1, True), Tiles(32, 64, 4, 1, True), Tiles(64, 128, 8, 1, True), Tiles(64, 32, 4, 1, True)]
PER_PROGRAM = (1, 4, 8, 16, 32, 1024)
STEP = (16384, 1024, 512)  # tokens, tokens per group (a prompt), slots


def bench(model: str, rank: int, iters: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (elsewhere: a smoke run, interpreted)
    modules, ys, groups = step(model, rank, *STEP, device)
    x, _, a, b, _ = modules[2]
    _, _, a_down, b_down, down_slices = modules[3]
    gate_up, y_down = ys[2], ys[3]
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, device=device, dtype=gate_up.dtype)
    zd = torch.zeros(rows, rank, device=device, dtype=torch.float32)
    row: dict = {"model": model, "rank": rank, "tokens": rows, "inter": inter}
    with lora_kernels.using("expand", "shrink", "act", "fold"), folding_at(rank):
        plan = lora_kernels.split_plan(y_down, out, a_down, b_down, down_slices)

        def engine() -> None:
            lora_act.lora_silu_and_mul(out, gate_up, x, a, b, groups)
            lora_kernels.plan_shrink(out, plan, 1.0, groups, rows, by_row=True)

        row["fold_us"] = device_us(lambda: lora_act.lora_silu_and_mul(out, gate_up, x, a, b, groups), device, iters)
        row["down_shrink_us"] = device_us(
            lambda: lora_kernels.plan_shrink(out, plan, 1.0, groups, rows, by_row=True), device, iters
        )
        row["engine_us"] = device_us(engine, device, iters)
        engine()
        want_out = out.to(torch.float32, copy=True)
        z, stride_z = lora_kernels.plan_shrink(out, plan, 1.0, groups, rows, by_row=True)
        want_z = z[: rows * stride_z].view(rows, stride_z)[:, :rank].to(torch.float32, copy=True)
        row["zero_us"] = device_us(zd.zero_, device, iters)
        for tiles in SHAPES:
            for per in PER_PROGRAM:
                label = f"{tiles.label} p{per}"
                with lora_kernels.tiled(act=tiles):

                    def folded(per=per) -> None:
                        zd.zero_()
                        lora_act.lora_silu_and_mul_down(out, zd, gate_up, x, a, b, a_down[0], groups, per)

                    cell = {"us": device_us(folded, device, iters)}
                    folded()
                cell["out_rel_diff"] = float((out.float() - want_out).abs().max() / want_out.abs().max())
                cell["z_rel_diff"] = float((zd - want_z).abs().max() / want_z.abs().max())
                cell["over_engine"] = cell["us"] / row["engine_us"]
                row[label] = cell
                print(model, rank, label, json.dumps({k: round(v, 4) for k, v in cell.items()}), flush=True)
    print(model, rank, {k: round(v, 1) for k, v in row.items() if k.endswith("_us")}, flush=True)
    return row


def main() -> None:
    per_model_main(__doc__, bench)


if __name__ == "__main__":
    main()
