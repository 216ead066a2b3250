"""One decoder layer's LoRA on a full prefill step: the LoRA kernels against the torch path, and the base matmuls.

    python3 -m loadtest.engine.bench_lora_kernels --out loadtest/results/gpu-lora-kernels   # on the GPU machine
    # results: loadtest/results/gpu-lora-kernels.{json,png}

For each model shape and LoRA rank: the step's tokens (vLLM's default max_num_batched_tokens, 16384) in
groups of one adapter each, drawn from 512 slots, through the layer's four LoRA linears (fused q/k/v, o,
fused gate/up, down). Times, in one process on one device, the base layer's own matmuls and
`groups.lora_linear` on each path: the torch path (A and B gathered per group, grouped matmuls, each slice's
delta added into y's slice), the expand kernel, the shrink and expand kernels, and the fused kernel (one
launch per linear) (``preft.vllm_plugin.kernels``), the last two also through Triton's own launch path in place of the
engine's direct launches (``triton_launch``); prints each LoRA cost as a fraction of the base matmuls, with
the host's time to issue the calls (near the wall time: host-bound). Also checks every path agrees with the
torch path, and that the direct launches ran the variants Triton picks (``triton_launch``'s check mode).
(The MLP's gate/up LoRA folded into its activation: ``loadtest/engine/bench_lora_act``.)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from preft.vllm_plugin.kernels import policy, triton_launch
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora
from preft.vllm_plugin.step.state import using

PLANS = PlanCache()  # the kernels' plans, as a worker's slot state keeps them

# hidden, (q, k, v) widths, intermediate
SHAPES = {"qwen05": (896, (896, 128, 128), 4864), "llama8b": (4096, (4096, 1024, 1024), 14336)}
# path: (the LoRA kernels it picks, how they are launched: triton_launch's direct launches, or Triton's own,
# whether the shrink and expand move z's and B's rank columns in vectors: lora_kernels.rank_vectors; off, the
# element-at-a-time baseline)
PATHS = {
    "torch": ((), "direct", True),
    "expand": (("expand",), "direct", True),
    "expand+shrink": (("expand", "shrink"), "direct", True),
    "expand+shrink, rank by element": (("expand", "shrink"), "direct", False),
    "expand+shrink, Triton's launch": (("expand", "shrink"), "triton", True),
    "fused": (("fused",), "direct", True),
    "fused, Triton's launch": (("fused",), "triton", True),
}


LINEARS = ("qkv", "o", "gate_up", "down")  # the names of a layer's LoRA linears, in `_layer`'s order


def _layer(hidden: int, qkv: tuple[int, ...], inter: int) -> list[tuple[int, tuple[int, ...]]]:
    """(input width, output slices) of each LoRA linear of one decoder layer (named in LINEARS)."""
    return [(hidden, qkv), (qkv[0], (hidden,)), (hidden, (inter, inter)), (inter, (hidden,))]


def _timed(fn, device: torch.device, iters: int) -> tuple[float, float]:
    """(wall, host) seconds per call, after two warm-up calls.

    Host: the time to issue the calls, before waiting for the device. Close to wall, the calls are host-bound
    (launches and Python); well under it, the device's work is what takes the time.
    """
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    issued = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters, (issued - start) / iters


def device_us(fn, device: torch.device, iters: int) -> float:
    """µs per call of fn, the device's alone: on CUDA `iters` calls captured in one CUDA graph and replayed
    (after one replay to warm), so the host's launches do not count (on Qwen's layer they take longer than
    a shrink); elsewhere the wall time of `iters` calls (``_timed``)."""
    if device.type != "cuda":
        return _timed(fn, device, iters)[0] * 1e6
    fn()  # (compiles, and builds the step's tables outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def max_rel_diff(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    """The largest of each output's max |difference| from its reference, relative to the reference's max |value|."""
    return max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(outputs, references, strict=True))


def model_list(value: str) -> list[str]:
    """--models: comma-separated names of ``SHAPES``."""
    models = [m.strip() for m in value.split(",") if m.strip()]
    unknown = sorted(set(models) - set(SHAPES))
    if unknown or not models:
        raise argparse.ArgumentTypeError(f"models must be some of {sorted(SHAPES)}, not {value!r}")
    return models


def rank_list(value: str) -> list[int]:
    """--ranks: comma-separated ranks, each 1 to 256."""
    try:
        ranks = [int(r) for r in value.split(",")]
    except ValueError:
        ranks = []
    if not ranks or not all(1 <= r <= 256 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks must be comma-separated integers from 1 to 256, not {value!r}")
    return ranks


def add_model_and_rank_arguments(ap: argparse.ArgumentParser, ranks: str) -> None:
    """--models (default both) and --ranks (default `ranks`), checked as they are parsed."""
    ap.add_argument("--models", type=model_list, default="qwen05,llama8b", help=f"some of {sorted(SHAPES)}")
    ap.add_argument("--ranks", type=rank_list, default=ranks, help=f"comma-separated (default {ranks})")


def add_step_arguments(ap: argparse.ArgumentParser, *, ranks: str, group_size: int, iters: int) -> None:
    """The benchmark step's options, shared by the LoRA kernel benches: models, ranks, tokens, group size,
    slots, and the timed iterations (with these defaults)."""
    add_model_and_rank_arguments(ap, ranks)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--group-size", type=int, default=group_size, help="tokens per group (a prompt of the workload)")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--iters", type=int, default=iters)


def add_device_argument(ap: argparse.ArgumentParser) -> None:
    """--device: where the step runs (default CUDA where there is one)."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    """How a report names the device it ran on."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def models_and_ranks(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """Each (model, rank) of --models and --ranks, models outermost."""
    for model in args.models:
        for rank in args.ranks:
            yield model, rank


def step_groups(
    rank: int, tokens: int, group_size: int, slots: int, device, *, base_every: int = 0, **build
) -> g.SlotGroups:
    """The step's groups: `group_size` tokens each, their slots drawn from `slots` (seeded by the rank); with
    `base_every` k > 0, every k-th group (the 2nd, 4th, ... for k = 2) a prompt without an adapter (slot -1)."""
    group_slots = np.random.default_rng(rank).integers(0, slots, tokens // group_size)
    if base_every > 0:
        group_slots[base_every - 1 :: base_every] = -1
    token_slots = np.repeat(group_slots, group_size)
    return g.SlotGroups.build(token_slots, device, slot_ranks=np.full(slots, rank), max_rank=rank, **build)


def step(
    model: str, rank: int, tokens: int, group_size: int, slots: int, device: torch.device, **build
) -> tuple[list, list[torch.Tensor], g.SlotGroups]:
    """One prefill step of this model's layer: (x, W, A, B, slices) per LoRA linear, their outputs y (zeros), and
    the step's groups (`group_size` tokens each, drawn from `slots` slots; `build`: SlotGroups.build's options)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(rank)

    def randn(*shape: int, fan_in: int) -> torch.Tensor:  # drawn on the device: 512 slots of 8B-sized weights
        return torch.randn(*shape, generator=gen, device=device).div_(fan_in**0.5).to(dtype)

    groups = step_groups(rank, tokens, group_size, slots, device, **build)
    modules = []
    for width, slices in _layer(*SHAPES[model]):
        x, w = randn(tokens, width, fan_in=1), randn(sum(slices), width, fan_in=width)
        a = [randn(slots, 1, rank, width, fan_in=width) for _ in slices]
        b = [randn(slots, 1, out, rank, fan_in=rank) for out in slices]
        modules.append((x, w, a, b, list(slices)))
    ys = [torch.zeros(tokens, sum(m[4]), device=device, dtype=dtype) for m in modules]
    return modules, ys, groups


def bench(model: str, rank: int, tokens: int, group_size: int, slots: int, device: torch.device, iters: int) -> dict:
    modules, ys, groups = step(model, rank, tokens, group_size, slots, device)

    def base():
        for (x, w, *_), y in zip(modules, ys, strict=True):
            torch.matmul(x, w.t(), out=y)

    def adapted():
        for (x, _, a, b, slices), y in zip(modules, ys, strict=True):
            lora.lora_linear(y, x, a, b, slices, 1.0, groups, plans=PLANS)

    row = {"model": model, "rank": rank, "tokens": tokens, "group_size": group_size, "slots": slots}
    row["base_matmuls_ms"] = _timed(base, device, iters)[0] * 1e3
    outputs = {}
    paths = PATHS.items() if policy.supported(ys[0]) else [("torch", PATHS["torch"])]
    for path, (kernels, launch, vectors) in paths:
        with using(*kernels), triton_launch.launching(launch), policy.rank_vectors(vectors):
            if not all(policy.available(ys[0], k) for k in kernels):  # they failed to compile (logged)
                raise SystemExit(f"the {path} path's kernels are unavailable on this machine")
            wall, host = _timed(adapted, device, iters)
            row[f"lora_{path}_ms"], row[f"lora_{path}_host_ms"] = wall * 1e3, host * 1e3
            row[f"lora_{path}_over_base"] = row[f"lora_{path}_ms"] / row["base_matmuls_ms"]
            for y in ys:
                y.zero_()
            with triton_launch.launching("check" if launch == "direct" else launch):  # the launcher's keys hold
                adapted()
            outputs[path] = [y.to(torch.float32, copy=True) for y in ys]
    for path in outputs.keys() - {"torch"}:
        row[f"{path}_speedup"] = row["lora_torch_ms"] / row[f"lora_{path}_ms"]
        row[f"{path}_max_rel_diff"] = max_rel_diff(outputs[path], outputs["torch"])
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
    shown = ("torch", "expand+shrink, rank by element", "expand+shrink", "fused")
    paths = [p for p in shown if f"lora_{p}_over_base" in rows[0]]
    width = 0.8 / len(paths)
    for i, path in enumerate(paths):
        values = [r[f"lora_{path}_over_base"] for r in rows]
        ax.bar(xs + (i - (len(paths) - 1) / 2) * width, values, width, label=f"LoRA, {path} path")
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
    add_step_arguments(ap, ranks="8,16,64", group_size=256, iters=20)
    add_device_argument(ap)
    ap.add_argument("--tolerance", type=float, default=0.02, help="largest relative difference of the two paths")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for model, rank in models_and_ranks(args):
        row = bench(model, rank, args.tokens, args.group_size, args.slots, device, args.iters)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"device": device_name(device), "torch": torch.__version__, "rows": rows}
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        write_plot(report, args.out)
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    worst = max((v for row in rows for k, v in row.items() if k.endswith("max_rel_diff")), default=0.0)
    if worst > args.tolerance:
        raise SystemExit(f"the LoRA kernels and the torch path disagree: max relative difference {worst:.3g}")


if __name__ == "__main__":
    main()
