"""One decoder layer's LoRA on a full prefill step: the expand kernel against the torch path, and the base matmuls.

    python3 -m loadtest.bench_lora_kernels --out loadtest/results/gpu-lora-kernels   # on the GPU machine
    # results: loadtest/results/gpu-lora-kernels.{json,png}

For each model shape and LoRA rank: the step's tokens (vLLM's default max_num_batched_tokens, 16384) in
groups of one adapter each, drawn from 512 slots, through the layer's four LoRA linears (fused q/k/v, o,
fused gate/up, down). Times, in one process on one device, the base layer's own matmuls, `groups.lora_linear`
with the expand kernel and `groups.lora_linear` on the torch path (grouped matmul into a delta, added into y's
slice), and prints the LoRA cost as a fraction of the base matmuls. Also checks both paths agree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from preft.vllm_plugin import expand_kernel
from preft.vllm_plugin import groups as g

# hidden, (q, k, v) widths, intermediate
SHAPES = {"qwen05": (896, (896, 128, 128), 4864), "llama8b": (4096, (4096, 1024, 1024), 14336)}


def _layer(hidden: int, qkv: tuple[int, ...], inter: int) -> list[tuple[int, tuple[int, ...]]]:
    """(input width, output slices) of each LoRA linear of one decoder layer."""
    return [(hidden, qkv), (qkv[0], (hidden,)), (hidden, (inter, inter)), (inter, (hidden,))]


def _timed(fn, device: torch.device, iters: int) -> float:
    """Seconds per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def bench(model: str, rank: int, tokens: int, group_size: int, slots: int, device: torch.device, iters: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(rank)
    token_slots = np.repeat(np.random.default_rng(rank).integers(0, slots, tokens // group_size), group_size)
    groups = g.SlotGroups.build(token_slots, device, slot_ranks=np.full(slots, rank), max_rank=rank)
    modules = []
    for width, slices in _layer(*SHAPES[model]):
        x = torch.randn(tokens, width, generator=gen).to(device, dtype)
        w = torch.randn(sum(slices), width, generator=gen).to(device, dtype) / width**0.5
        a = [(torch.randn(slots, 1, rank, width, generator=gen) / width**0.5).to(device, dtype) for _ in slices]
        b = [(torch.randn(slots, 1, out, rank, generator=gen) / rank**0.5).to(device, dtype) for out in slices]
        modules.append((x, w, a, b, list(slices)))
    ys = [torch.zeros(tokens, sum(m[4]), device=device, dtype=dtype) for m in modules]

    def base():
        for (x, w, *_), y in zip(modules, ys, strict=True):
            torch.matmul(x, w.t(), out=y)

    def lora():
        for (x, _, a, b, slices), y in zip(modules, ys, strict=True):
            g.lora_linear(y, x, a, b, slices, 1.0, groups)

    row = {"model": model, "rank": rank, "tokens": tokens, "group_size": group_size, "slots": slots}
    row["base_matmuls_ms"] = _timed(base, device, iters) * 1e3
    outputs = {}
    for path in ("torch", "kernel") if expand_kernel.available(ys[0]) else ("torch",):
        with expand_kernel.disabled() if path == "torch" else contextlib.nullcontext():
            row[f"lora_{path}_ms"] = _timed(lora, device, iters) * 1e3
            row[f"lora_{path}_over_base"] = row[f"lora_{path}_ms"] / row["base_matmuls_ms"]
            for y in ys:
                y.zero_()
            lora()
            outputs[path] = [y.float() for y in ys]
    if "kernel" in outputs:
        row["kernel_speedup"] = row["lora_torch_ms"] / row["lora_kernel_ms"]
        row["max_rel_diff"] = max(
            float((k - t).abs().max() / t.abs().max()) for k, t in zip(outputs["kernel"], outputs["torch"], strict=True)
        )
    return row


def write_plot(report: dict, out: Path) -> None:
    """OUT.png: each configuration's LoRA time over the base matmuls', torch path and kernel side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"{r['model']} r{r['rank']}" for r in rows]
    xs = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, path in enumerate(("torch", "kernel")):
        values = [r.get(f"lora_{path}_over_base", 0.0) for r in rows]
        ax.bar(xs + (i - 0.5) * 0.4, values, 0.4, label=f"LoRA, {path} expand")
    ax.set_xticks(xs, labels)
    ax.set_ylabel("LoRA time ÷ base matmuls' time")
    first = rows[0]
    ax.set_title(f"one decoder layer, {first['tokens']} prefill tokens, {first['slots']} slots ({report['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen05,llama8b")
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--group-size", type=int, default=256, help="tokens per group (a prompt of the workload)")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tolerance", type=float, default=0.02, help="largest relative difference of the two paths")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for model in args.models.split(","):
        for rank in (int(r) for r in args.ranks.split(",")):
            row = bench(model, rank, args.tokens, args.group_size, args.slots, device, args.iters)
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        report = {"device": name, "torch": torch.__version__, "rows": rows}
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        write_plot(report, args.out)
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    worst = max((row.get("max_rel_diff", 0.0) for row in rows), default=0.0)
    if worst > args.tolerance:
        raise SystemExit(f"the expand kernel and the torch path disagree: max relative difference {worst:.3g}")


if __name__ == "__main__":
    main()
