"""The shrink's device time per LoRA linear of one decoder layer, by how many slices a program takes.

    python3 -m loadtest.engine.bench_lora_shrink --out loadtest/results/gpu-lora-shrink   # on the GPU machine
    # results: loadtest/results/gpu-lora-shrink.{json,png}

On the step of ``bench_lora_kernels`` (16,384 tokens in groups of one adapter, 512 slots), times the shrink
alone on each of the layer's four LoRA linears at each ``kernels.shrink.SHRINK_WIDTH`` of --widths (0: one slice a
program, each re-reading x; wider: a module's slices side by side in one program, x read once for them), the
widths alternated over --rounds. On CUDA each time is --iters launches replayed from one CUDA graph, so it is the
device's alone (``bench_lora_kernels.device_us``); elsewhere the wall time of a call. Checks each width's z against
the one-slice-a-program form. Reports per linear the fastest round per width, and the layer's sum per width.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from loadtest.engine.bench_lora_kernels import (
    LINEARS,
    add_device_argument,
    add_step_arguments,
    device_name,
    device_us,
    models_and_ranks,
    step,
)
from preft.vllm_plugin.kernels import common, split
from preft.vllm_plugin.kernels import shrink as shrink_kernel
from preft.vllm_plugin.kernels.plans import PlanCache

PLANS = PlanCache()  # the kernels' plans, as a worker's slot state keeps them


def bench(
    model: str,
    rank: int,
    tokens: int,
    group_size: int,
    slots: int,
    device: torch.device,
    iters: int,
    widths: list[int],
    rounds: int,
) -> dict:
    modules, ys, groups = step(model, rank, tokens, group_size, slots, device, block_rows=common.ROW_BLOCK)
    before = shrink_kernel.SHRINK_WIDTH
    linears = {}
    try:
        for name, (x, _w, a, b, slices), y in zip(LINEARS, modules, ys, strict=True):
            plan = split.split_plan(y, x, a, b, slices, plans=PLANS)

            def shrink(plan=plan, x=x) -> torch.Tensor:
                return shrink_kernel._shrink(x, plan.a, plan.a_table, 1.0, groups)

            times: dict[int, list[float]] = {w: [] for w in widths}
            for _ in range(rounds):
                for width in widths:
                    shrink_kernel.SHRINK_WIDTH = width
                    times[width].append(device_us(shrink, device, iters))
            shrink_kernel.SHRINK_WIDTH = 0
            want = shrink().float()
            diffs, per_program = {}, {}
            for width in widths:
                shrink_kernel.SHRINK_WIDTH = width
                diffs[width] = float((shrink().float() - want).abs().max() / want.abs().max())
                per_program[width] = shrink_kernel.slices_per_program(len(slices), rank)
            linears[name] = {
                "slices": len(slices),
                "slices_per_program": per_program,
                "us": {w: min(t) for w, t in times.items()},
                "rounds_us": times,
                "max_rel_diff_from_one_slice_a_program": diffs,
            }
    finally:
        shrink_kernel.SHRINK_WIDTH = before
    layer = {w: sum(e["us"][w] for e in linears.values()) for w in widths}
    return {"model": model, "rank": rank, "tokens": tokens, "linears": linears, "layer_us": layer}


def width_list(value: str) -> list[int]:
    """--widths: comma-separated SHRINK_WIDTH values, each 0 or more (a usage error otherwise)."""
    try:
        widths = [int(w) for w in value.split(",")]
    except ValueError:
        widths = []
    if not widths or min(widths) < 0:
        raise argparse.ArgumentTypeError(f"widths must be comma-separated whole numbers, 0 or more, not {value!r}")
    return widths


def write_plot(report: dict, out: Path) -> None:
    """OUT.png: per model and rank, each linear's shrink time at each width, over the one-slice-a-program form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, widths = report["rows"], report["widths"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        xs = np.arange(len(LINEARS))
        bar = 0.8 / len(widths)
        for i, width in enumerate(widths):
            us = [row["linears"][name]["us"][width] for name in LINEARS]
            ax.bar(xs + (i - (len(widths) - 1) / 2) * bar, us, bar, label=f"SHRINK_WIDTH {width}")
        ax.set_xticks(xs, LINEARS, fontsize=8)
        ax.set_title(f"{row['model']} r{row['rank']}", fontsize=9)
        ax.set_ylabel("µs (device)" if ax is axes[0][0] else "")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"the shrink per LoRA linear, {rows[0]['tokens']} prefill tokens ({report['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(ap, ranks="64,8", group_size=1024, iters=50)
    ap.add_argument("--widths", type=width_list, default="0,128,256", help="SHRINK_WIDTH values, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    add_device_argument(ap)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.png")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = device_name(device)
    rows = []
    for model, rank in models_and_ranks(args):
        row = bench(model, rank, args.tokens, args.group_size, args.slots, device, args.iters, args.widths, args.rounds)
        rows.append(row)
        per = {n: {w: round(e["us"][w], 1) for w in args.widths} for n, e in row["linears"].items()}
        print(json.dumps({"model": model, "rank": rank, "layer_us": row["layer_us"], **per}), flush=True)
        if args.out:  # after each row: what a cut-short run measured stays
            args.out.parent.mkdir(parents=True, exist_ok=True)
            report = {"device": name, "torch": torch.__version__, "widths": args.widths, "rows": rows}
            args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
            write_plot(report, args.out)


if __name__ == "__main__":
    main()
