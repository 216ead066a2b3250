"""The shrink and expand kernels' launch shapes, swept per LoRA linear of one decoder layer on a prefill step.

    python3 -m loadtest.engine.bench_lora_tiles --out loadtest/results/gpu-lora-tiles   # on the GPU machine
    # results: loadtest/results/gpu-lora-tiles.{json,png}

For each model shape and rank (the step of ``bench_lora_kernels``: 16,384 tokens in groups of one adapter, 512
slots), times each kernel alone on each of the layer's four LoRA linears, in every launch shape of the sweep
(``Tiles``: rows per program, columns per tile or per iteration, warps, stages, and the expand's
grid order), the others at the default. Beside them, per linear: the base matmul, and an in-place add over y
(the expand's traffic, read and written once, at the rate torch's own kernel reaches). Reports each kernel's
bytes per second, the default shape's and the fastest shape's time per linear, and the layer's LoRA time with
the default shapes, with the one shape per kernel that is fastest over the layer, and with the fastest shape per
linear. Every shape's result is checked against the torch path. Each time is the device's alone: on CUDA --iters
calls replayed from one CUDA graph (``bench_lora_kernels.device_us``), since the wall time of --iters calls on
Qwen's layer is the host's launches (its shrinks read 19–37 µs in no order where the device's time is 90 µs for the
layer's four). Last, prints the ``PREFT_LORA_TILES`` setting of
the shapes fastest over everything it ran (also written alone to OUT.tiles, for the engine's environment:
``export PREFT_LORA_TILES="$(cat OUT.tiles)"``).
"""

from __future__ import annotations

import argparse
import itertools
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
from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import common, policy, split
from preft.vllm_plugin.kernels import expand as expand_kernel
from preft.vllm_plugin.kernels import shrink as shrink_kernel
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora
from preft.vllm_plugin.step.state import using
from preft.vllm_plugin.tiles import Tiles

PLANS = PlanCache()  # the kernels' plans, as a worker's slot state keeps them

BLOCK_ROWS = common.ROW_BLOCK  # the step's row blocks, as the engine cuts them


def shapes(kernel: str) -> list[Tiles]:
    """The sweep's launch shapes for one kernel (the default among them)."""
    rows = (16, 32, 64)  # up to the row block: a larger one would run as the whole block
    if kernel == "shrink":  # cols: input columns per iteration of its loop, stages: that loop's pipeline
        swept = [Tiles(r, c, 4, s) for r, c, s in itertools.product(rows, (32, 64, 128), (2, 3, 4))]
        swept += [Tiles(64, c, 8, 3) for c in (64, 128)]
    else:  # one tile per program: no loop to pipeline; the grid in either order
        swept = [
            Tiles(r, c, w, 3, o) for r, c, w, o in itertools.product(rows, (32, 64, 128, 256), (4, 8), (False, True))
        ]
    default = settings.current().lora_tiles[kernel]
    return swept if default in swept else [default, *swept]


def sweep(model: str, rank: int, tokens: int, group_size: int, slots: int, device: torch.device, iters: int) -> dict:
    modules, ys, groups = step(model, rank, tokens, group_size, slots, device, block_rows=BLOCK_ROWS)
    itemsize = ys[0].element_size()
    row: dict = {"model": model, "rank": rank, "tokens": tokens, "group_size": group_size, "slots": slots}
    references = []
    for (x, _, a, b, slices), y in zip(modules, ys, strict=True):
        y.zero_()
        with using():  # the torch path
            lora.lora_linear(y, x, a, b, slices, 1.0, groups, plans=PLANS)
        references.append(y.to(torch.float32, copy=True))
    linears = {}
    for name, (x, w, a, b, slices), y, want in zip(LINEARS, modules, ys, references, strict=True):
        n_in, n_out = x.shape[1], y.shape[1]
        traffic = {  # bytes each kernel must move: x read (shrink), y read and written (expand); z is small
            "shrink": tokens * n_in * itemsize,
            "expand": 2 * tokens * n_out * itemsize,
        }
        entry = {
            "in": n_in,
            "out": n_out,
            "base_matmul_us": device_us(lambda x=x, w=w, y=y: torch.matmul(x, w.t(), out=y), device, iters),
            "y_add_us": device_us(lambda y=y: y.add_(1.0), device, iters),
        }
        entry["y_add_gb_per_s"] = traffic["expand"] / entry["y_add_us"] / 1e3
        with using("expand", "shrink"):
            for kernel in ("shrink", "expand"):
                times = {}
                for tiles in shapes(kernel):
                    with policy.tiled(**{kernel: tiles}):
                        plan = split.split_plan(y, x, a, b, slices, plans=PLANS)
                        seconds = device_us(_launch(kernel, x, y, plan, groups), device, iters) / 1e6
                        y.zero_()
                        split.split_linear(y, x, plan, 1.0, groups, plans=PLANS)
                        diff = float((y.to(torch.float32) - want).abs().max() / want.abs().max())
                    times[tiles.label] = {
                        "us": seconds * 1e6,
                        "gb_per_s": traffic[kernel] / seconds / 1e9,
                        "max_rel_diff": diff,
                    }
                default = settings.current().lora_tiles[kernel].label
                best = min(times, key=lambda k: times[k]["us"])
                entry[kernel] = {"default": default, "best": best, "shapes": times}
        linears[name] = entry
    row["linears"] = linears
    row["summary"] = _summary(linears)
    return row


def _launch(kernel: str, x: torch.Tensor, y: torch.Tensor, plan: split.SplitPlan, groups: g.SlotGroups):
    """One call of this kernel alone on this linear (the expand adds a z made once)."""
    if kernel == "shrink":
        return lambda: shrink_kernel._shrink(x, plan.a, plan.a_table, 1.0, groups)
    z = shrink_kernel._shrink(x, plan.a, plan.a_table, 1.0, groups)
    return lambda: expand_kernel._expand(y, z, plan.expand, groups.rank, groups)


def _summary(linears: dict) -> dict:
    """The layer's LoRA time (µs) per kernel: default shapes, the one fastest shape, the fastest per linear."""
    out: dict = {"base_matmuls_us": sum(e["base_matmul_us"] for e in linears.values())}
    for kernel in ("shrink", "expand"):
        per = [e[kernel] for e in linears.values()]
        uniform = _fastest_shape([p["shapes"] for p in per])
        out[kernel] = {
            "default_us": sum(p["shapes"][p["default"]]["us"] for p in per),
            "uniform_best": uniform,
            "uniform_best_us": sum(p["shapes"][uniform]["us"] for p in per),
            "per_linear_best_us": sum(p["shapes"][p["best"]]["us"] for p in per),
        }
    for choice in ("default", "uniform_best", "per_linear_best"):
        lora = sum(out[k][f"{choice}_us"] for k in ("shrink", "expand"))
        out[f"lora_{choice}_over_base"] = lora / out["base_matmuls_us"]
    return out


def _fastest_shape(timings: list[dict]) -> str:
    """The label with the least time summed over these timings (each: label → {"us": ...}, the same labels)."""
    return min(timings[0], key=lambda label: sum(times[label]["us"] for times in timings))


def fastest_overall(rows: list[dict]) -> str:
    """The PREFT_LORA_TILES value of the sweep: per kernel, the shape with the least time summed over every
    model, rank and linear it ran (one shape serves them all in the engine)."""
    return ",".join(
        f"{kernel}={_fastest_shape([e[kernel]['shapes'] for row in rows for e in row['linears'].values()])}"
        for kernel in ("shrink", "expand")
    )


def write_plot(report: dict, out: Path) -> None:
    """OUT.png: per model and rank, the layer's shrink and expand time in each choice of shapes, over base."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    choices = ("default", "uniform_best", "per_linear_best")
    xs = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(choices)
    for i, choice in enumerate(choices):
        shrink = [r["summary"]["shrink"][f"{choice}_us"] / r["summary"]["base_matmuls_us"] for r in rows]
        expand = [r["summary"]["expand"][f"{choice}_us"] / r["summary"]["base_matmuls_us"] for r in rows]
        at = xs + (i - (len(choices) - 1) / 2) * width
        ax.bar(at, shrink, width, label=f"shrink, {choice}", color=f"C{i}", alpha=0.6)
        ax.bar(at, expand, width, bottom=shrink, label=f"expand, {choice}", color=f"C{i}")
    ax.set_xticks(xs, [f"{r['model']} r{r['rank']}" for r in rows])
    ax.set_ylabel("LoRA kernels' time ÷ base matmuls' time")
    first = rows[0]
    ax.set_title(f"one decoder layer, {first['tokens']} prefill tokens, launch shapes ({report['device']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def _print(row: dict) -> None:
    print(json.dumps({"model": row["model"], "rank": row["rank"], **row["summary"]}), flush=True)
    for name, e in row["linears"].items():
        best = {k: (e[k]["best"], round(e[k]["shapes"][e[k]["best"]]["us"], 1)) for k in ("shrink", "expand")}
        default = {k: round(e[k]["shapes"][e[k]["default"]]["us"], 1) for k in ("shrink", "expand")}
        print(
            f"  {name}: base {e['base_matmul_us']:.1f} us, y add {e['y_add_gb_per_s']:.0f} GB/s; "
            f"default {default}; best {best}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(ap, ranks="8,16", group_size=1024, iters=20)
    add_device_argument(ap)
    ap.add_argument("--tolerance", type=float, default=0.02, help="largest relative difference from the torch path")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.png")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = device_name(device)
    rows = []
    for model, rank in models_and_ranks(args):
        row = sweep(model, rank, args.tokens, args.group_size, args.slots, device, args.iters)
        rows.append(row)
        _print(row)
        if args.out:  # after each row: what a cut-short run measured stays
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tiles = fastest_overall(rows)
            timing = "device (CUDA graph replay)" if device.type == "cuda" else "wall"
            report = {"device": name, "torch": torch.__version__, "timing": timing, "tiles": tiles, "rows": rows}
            args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
            args.out.with_suffix(".tiles").write_text(tiles + "\n")
            write_plot(report, args.out)
    print(f"PREFT_LORA_TILES={fastest_overall(rows)}", flush=True)
    if args.out:
        print(
            f"wrote {args.out.with_suffix('.json')}, {args.out.with_suffix('.png')} and the setting alone in "
            f"{args.out.with_suffix('.tiles')}"
        )
    worst = max(
        s["max_rel_diff"]
        for row in rows
        for e in row["linears"].values()
        for k in ("shrink", "expand")
        for s in e[k]["shapes"].values()
    )
    if worst > args.tolerance:
        raise SystemExit(f"a launch shape disagrees with the torch path: max relative difference {worst:.3g}")


if __name__ == "__main__":
    main()
