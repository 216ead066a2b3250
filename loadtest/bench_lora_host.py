"""The host's work to issue one decoder layer's LoRA on the kernel paths, launches left out: runs without a GPU.

    .venv/bin/python -m loadtest.bench_lora_host          # any machine; CPU tensors, no kernel runs

On a prefill step of Qwen2.5-0.5B the LoRA kernels are host-bound: issuing them takes as long as running them
(README, "The LoRA kernels"). This times `groups.lora_linear` over a layer's four LoRA linears (fused q/k/v,
o, fused gate/up, down) on a full step (16,384 tokens in groups of 1,024, 512 slots) with every kernel's
launcher replaced by a no-op that looks up its key and counts: what remains is our Python between the
launches, the part a change to it moves. Prints µs per layer and launches per layer for the default choice
(shrink + expand) and the fused kernel. The launches' own cost comes on top (on the H200:
`loadtest/bench_lora_kernels.py`'s host times, with the engine's direct launches and with Triton's). Also
times one adapted step's LoRA mapping, vLLM's tuples against our numpy arrays, and its ids turned into slots
(`bench_mapping`), and all of our host work for one adapted step before its forward (`bench_step`).
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import numpy as np
import torch

from loadtest.bench_lora_kernels import SHAPES, _layer, _timed, add_step_arguments, models_and_ranks, step_groups
from preft.vllm_plugin import groups as g
from preft.vllm_plugin import lora_kernels

CHOICES = {"expand+shrink": ("expand", "shrink"), "fused": ("fused",)}  # ("expand" alone runs a torch shrink)


class _CountedLaunch:
    """Stands in for a kernel's `triton_launch.Launcher`: looks its key up, as the launcher does, and counts."""

    def __init__(self, counts: list[int]) -> None:
        self.counts, self.variants = counts, {}

    def __call__(self, grid: tuple, key: tuple, args: tuple, num_warps: int, num_stages: int, addresses=None) -> None:
        self.variants.setdefault(key, grid)
        self.counts[0] += 1


def bench(model: str, rank: int, tokens: int, group_size: int, slots: int, iters: int) -> dict:
    groups = step_groups(rank, tokens, group_size, slots, "cpu")
    modules = []
    for width, slices in _layer(*SHAPES[model]):  # the weights' values do not matter: nothing is computed
        x, y = torch.empty(tokens, width, dtype=torch.bfloat16), torch.empty(tokens, sum(slices), dtype=torch.bfloat16)
        a = [torch.empty(slots, 1, rank, width, dtype=torch.bfloat16) for _ in slices]
        b = [torch.empty(slots, 1, out, rank, dtype=torch.bfloat16) for out in slices]
        modules.append((y, x, a, b, list(slices)))

    def layer() -> None:
        for y, x, a, b, slices in modules:
            g.lora_linear(y, x, a, b, slices, 1.0, groups)

    row = {"model": model, "rank": rank, "tokens": tokens, "group_size": group_size, "slots": slots}
    counts = [0]
    stub = _CountedLaunch(counts)
    kernels = {name: stub for name in ("_SHRINK", "_EXPAND", "_FUSED")}
    with mock.patch.multiple(lora_kernels, supported=lambda y: True, **kernels):
        for choice, picked in CHOICES.items():
            with mock.patch.object(lora_kernels, "_KERNELS", frozenset(picked)):
                for _ in range(20):
                    layer()
                counts[0] = 0
                start = time.perf_counter()
                for _ in range(iters):
                    layer()
                row[f"{choice}_host_us_per_layer"] = (time.perf_counter() - start) / iters * 1e6
                row[f"{choice}_launches_per_layer"] = counts[0] / iters
    return row


def bench_mapping(tokens: int, group_size: int, slots: int, iters: int) -> dict:
    """One adapted step's LoRA mapping, as vLLM's LoRA manager and our punica wrapper handle it: built,
    compared with the step before (`LoRAModelManager.set_adapter_mapping`) and read back as arrays.

    vLLM's own mapping holds per-token tuples (its model runner builds them with `tuple(array)`, we read them
    with `np.asarray`); ours keeps the numpy arrays (`worker_patch.array_mapping`)."""
    from vllm.lora.layers import LoRAMapping

    from preft.vllm_plugin.punica import _ids_to_slots
    from preft.vllm_plugin.worker_patch import array_mapping, mapping_ids

    rng = np.random.default_rng(0)
    token_ids = np.repeat(rng.integers(1, slots + 1, tokens // group_size), group_size)
    sampled_ids = token_ids[group_size - 1 :: group_size].copy()

    def vllms(last):
        mapping = LoRAMapping(tuple(token_ids.tolist()), tuple(sampled_ids.tolist()), is_prefill=True)
        changed = last != mapping
        return mapping, changed, np.asarray(mapping.index_mapping), np.asarray(mapping.prompt_mapping)

    def ours(last):
        mapping = array_mapping(token_ids, sampled_ids)
        return mapping, last != mapping, *mapping_ids(mapping)

    row = {"tokens": tokens}
    for name, step in (("vllm_tuples", vllms), ("numpy_arrays", ours)):
        last = step(None)[0]
        start = time.perf_counter()
        for _ in range(iters):
            step(last)
        row[f"mapping_{name}_us"] = (time.perf_counter() - start) / iters * 1e6
    row["mapping_speedup"] = row["mapping_vllm_tuples_us"] / row["mapping_numpy_arrays_us"]
    lora_index_to_id = [int(i) for i in rng.permutation(np.arange(1, slots + 1))]  # every id in a slot
    cpu = torch.device("cpu")
    row["ids_to_slots_us"] = _timed(lambda: _ids_to_slots(token_ids, lora_index_to_id), cpu, iters)[0] * 1e6
    return row


def bench_step(tokens: int, group_size: int, slots: int, iters: int) -> dict:
    """Our host work for one adapted prefill step, as a worker does it before the step's forward: the step's
    mapping from its requests, ids to slots, the slot groups (`PreftSlotState.set_step`) and vLLM's LoRA index
    metadata (`punica._write_base_metadata`), Qwen2.5-0.5B's shape, every slot holding a rank-8 LoRA."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from loadtest.bench_engine import ARCH_CONFIGS
    from preft.adapters import ModelShape
    from preft.vllm_plugin.punica import _ids_to_slots, _write_base_metadata
    from preft.vllm_plugin.state import PreftSlotState
    from preft.vllm_plugin.token_mapping import build_step_mapping

    shape = ModelShape.from_config(ARCH_CONFIGS["qwen05"])
    state = PreftSlotState(shape=shape, max_slots=slots, max_rank=8, dtype=torch.bfloat16, device="cpu")
    for slot in range(slots):
        state.load_slot(slot, lora_rank=8, direft=None)
    wrapper = PunicaWrapperCPU(tokens, slots, "cpu")
    lora_index_to_id = list(range(1, slots + 1))
    requests = tokens // group_size
    signed_ids = -np.random.default_rng(0).permutation(np.arange(1, slots + 1))[:requests]  # prefill-only
    lengths, no_tokens = np.full(requests, group_size), np.zeros(requests, dtype=np.int64)

    def one_step() -> None:
        mapping = build_step_mapping(signed_ids, lengths, no_tokens, lengths, np.ones(requests, dtype=np.int64))
        token_slots = _ids_to_slots(mapping.token_ids, lora_index_to_id)
        sampled_slots = _ids_to_slots(mapping.sampled_ids, lora_index_to_id)
        _write_base_metadata(wrapper, *state.set_step(token_slots, sampled_slots), slots + 1, shape.vocab_size)

    elapsed = _timed(one_step, torch.device("cpu"), iters)[0]
    lora_tokens = state.step.lora_tokens  # (what the timed steps built: one group per request, one span)
    return {
        "tokens": tokens,
        "requests": requests,
        "slots": slots,
        "groups": len(lora_tokens.bounds),
        "adapted_span": lora_tokens.span,
        "step_host_us": elapsed * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(ap, ranks="8,16", group_size=1024, iters=500)
    args = ap.parse_args()
    for model, rank in models_and_ranks(args):
        row = bench(model, rank, args.tokens, args.group_size, args.slots, args.iters)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    for row in (
        bench_mapping(args.tokens, args.group_size, args.slots, 50),
        bench_step(args.tokens, args.group_size, args.slots, 200),
    ):
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
