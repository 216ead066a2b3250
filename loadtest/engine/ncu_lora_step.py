"""One decoder layer's LoRA kernels on a prefill step, each launched once inside a profiler range, for Nsight Compute.

    ncu --profile-from-start off --set full python3 -m loadtest.engine.ncu_lora_step --models qwen05 --ranks 64 \
        > $OUT/ncu.txt                                                  # on the GPU machine

The step is ``bench_lora_kernels``'s (16,384 tokens in groups of 1,024, 512 slots). Each (model, rank) runs, in
this order: the gate/up shrink and the activation with that LoRA folded in (``kernels.act``), the activation of a step
without LoRA tokens, and the shrink and the expand of q/k/v, o and down. They run ``--iters`` times first (3:
Triton compiles, the caches warm), then once between ``cudaProfilerStart`` and ``cudaProfilerStop``: ``ncu
--profile-from-start off`` profiles only those launches.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from loadtest.engine.bench_lora_kernels import add_step_arguments, models_and_ranks, step
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import groups as g
from preft.vllm_plugin.step import lora

GATE_UP = 2  # the step's modules: q/k/v, o, gate/up, down


PLANS = PlanCache()  # the kernels' plans, as a worker's slot state keeps them


def layer(
    model: str, rank: int, args: argparse.Namespace, device: torch.device
) -> tuple[Callable[[], None], list[torch.Tensor], torch.Tensor]:
    """A call that runs the layer's LoRA kernels once, on a step of this model and rank, and what it writes: the
    outputs of the LoRA linears (on CUDA gate/up's is only read: its LoRA is folded into the activation) and the
    activation's."""
    modules, ys, groups = step(model, rank, args.tokens, args.group_size, args.slots, device)
    x, _, a, b, _ = modules[GATE_UP]
    gate_up = ys[GATE_UP]
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, device=device, dtype=gate_up.dtype)
    none = g.empty_groups(device)

    def run() -> None:
        lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, plans=PLANS)
        lora.lora_silu_and_mul(out, gate_up, x, a, b, none, plans=PLANS)
        for i, (x_i, _, a_i, b_i, slices) in enumerate(modules):
            if i != GATE_UP:
                lora.lora_linear(ys[i], x_i, a_i, b_i, slices, 1.0, groups, plans=PLANS)

    return run, ys, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(ap, ranks="64", group_size=1024, iters=3)
    args = ap.parse_args()
    device = torch.device("cuda")
    for model, rank in models_and_ranks(args):
        run, _, _ = layer(model, rank, args, device)
        for _ in range(args.iters):
            run()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{model} rank {rank}: profiled", flush=True)


if __name__ == "__main__":
    main()
