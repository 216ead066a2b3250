"""The host's time per LoRA kernel launch, piece by piece, on the GPU machine.

    python3 -m loadtest.engine.bench_lora_launch --out $OUT/gpu-lora-launch   # on the GPU machine

On Qwen2.5-0.5B's prefill steps the LoRA calls are host-bound. This times, in one process,
what issuing one LoRA linear (the fused gate/up projection of Qwen2.5-0.5B, rank 8) is made of: the whole
call (``groups.lora_linear``) with the engine's direct launches and with Triton's own launch path, the
same through the custom op as the compiled model calls it (``torch.ops.preft.lora_linear``), one
shrink launch through the engine's launcher, its compiled variant's launcher called straight (with tensors,
and with their addresses as integers), Triton's ``kernel[grid](...)``, and, for scale, torch's allocation of
z and a one-element torch kernel. Each is timed over many calls with the device kept ahead of the host
(--tokens: a small step, whose kernels take less time than their launches), then again on a full step
(16,384 tokens), where the device is busy.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from loadtest.engine.bench_lora_kernels import add_model_and_rank_arguments, models_and_ranks, step
from preft.vllm_plugin.kernels import shrink as shrink_kernel
from preft.vllm_plugin.kernels import split, triton_launch
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora, ops  # noqa: F401  (ops: the torch.ops.preft namespace)
from preft.vllm_plugin.step.state import STATES, using

PLANS = PlanCache()  # the kernels' plans, as a worker's slot state keeps them


def _host_us(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(host, wall) µs per call: the time to issue `calls` calls, and until the device has run them."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def _shrink_launch(x2: torch.Tensor, plan: split.SplitPlan, groups: g.SlotGroups) -> tuple:
    """What `kernels.shrink._shrink` hands its launcher for this call: (grid, key, args, warps, stages, addresses)."""
    calls = []
    real = shrink_kernel._SHRINK
    shrink_kernel._SHRINK = lambda *launch: calls.append(launch)
    try:
        shrink_kernel._shrink(x2, plan.a, plan.a_table, 1.0, groups)
    finally:
        shrink_kernel._SHRINK = real
    return calls[0]


def bench(tokens: int, group_size: int, calls: int) -> dict:
    device = torch.device("cuda")
    modules, ys, groups = step("qwen05", 8, tokens, group_size, 512, device)
    x, _, a, b, slices = modules[2]  # gate/up
    y = ys[2]
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    row: dict = {"tokens": tokens, "group_size": group_size, "calls": calls}

    def linear() -> None:
        lora.lora_linear(y, x, a, b, slices, 1.0, groups, plans=PLANS)

    state = max(STATES, default=0) + 1  # the op reads its step's groups from a worker's state
    STATES[state] = SimpleNamespace(step=SimpleNamespace(lora_tokens=groups), plans=PLANS)
    op = torch.ops.preft.lora_linear.default

    def through_op() -> None:  # as the compiled model calls it
        op(y, x, a, b, slices, 1.0, state, False)

    with using("expand", "shrink"):
        for mode in ("direct", "triton"):
            with triton_launch.launching(mode):
                row[f"lora_linear_{mode}"] = _host_us(linear, calls)
        row["lora_linear_op_direct"] = _host_us(through_op, calls)
        plan = split.split_plan(y2, x2, a, b, slices, plans=PLANS)
        grid, key, args, warps, stages, addresses = _shrink_launch(x2, plan, groups)
        launcher, dev = shrink_kernel._SHRINK, torch.cuda.current_device()
        row["shrink_launcher"] = _host_us(lambda: launcher(grid, key, args, warps, stages, addresses), calls)
        compiled = launcher.variants[dev, key]  # (the direct passes put it there)
        stream = torch.cuda.current_stream().cuda_stream
        handles = (grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None)
        row["compiled_run_tensors"] = _host_us(lambda: compiled.run(*handles, *args), calls)
        row["compiled_run_ints"] = _host_us(lambda: compiled.run(*handles, *addresses), calls)
        fn = launcher.fn
        row["triton_kernel_grid"] = _host_us(lambda: fn[grid](*args, num_warps=warps, num_stages=stages), calls)
        row["get_stream"] = _host_us(lambda: triton_launch.driver.active.get_current_stream(dev), calls)
    n = groups.rows.shape[0]
    row["torch_empty_z"] = _host_us(lambda: torch.empty(n, 16, device=device, dtype=x.dtype), calls)
    one = torch.zeros(1, device=device)
    row["torch_add_one_element"] = _host_us(lambda: one.add_(1), calls)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="the small step's tokens")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    rows = [bench(args.tokens, args.group_size, args.calls), bench(16384, 1024, 200)]
    for row in rows:
        print(json.dumps({k: [round(u, 1) for u in v] if isinstance(v, tuple) else v for k, v in row.items()}))
    if args.out:
        write_rows(rows, args.out)


def per_model_main(doc: str, bench: Callable[[str, int, int], dict]) -> None:
    """A GPU bench's command line: --models, --ranks, --iters and --out; `bench(model, rank, iters)` for each
    model (Qwen then Llama) and rank (8), each row printed as JSON, all written to OUT.json."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_rank_arguments(ap, "8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args()
    rows = [bench(model, rank, args.iters) for model, rank in models_and_ranks(args)]
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        write_rows(rows, args.out)


def write_rows(rows: list[dict], out: Path) -> None:
    """OUT.json: the device, torch's version and the rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
