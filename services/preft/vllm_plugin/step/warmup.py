"""Compiling the picked LoRA kernels before serving: the variants serving uses, for one worker's model.

Run with the model's hidden size as the input and output width and the engine's largest rank as the weights'
padded rank, these are the variants every linear of a model with 16-divisible sizes uses (others compile once, on
first use): span and gathered rows, at every rank block. A Triton build that cannot compile them leaves the
process on the torch path.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import common, expand, fused, policy, shrink
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import lora
from preft.vllm_plugin.step.groups import SlotGroups

logger = logging.getLogger(__name__)


def compile_kernels(device: torch.device, dtype: torch.dtype, width: int, max_rank: int, *, plans: PlanCache) -> None:
    """Compile the picked kernels' serving variants (see the module's note); on a failure, no kernels from now on."""
    kernels = settings.current().lora_kernels
    if not kernels:
        return
    tokens = common.ROW_BLOCK + 1
    y2 = torch.zeros(tokens, width, device=device, dtype=dtype)
    a = [torch.zeros(2, max_rank, width, device=device, dtype=dtype)]
    b = torch.zeros(2, width, max_rank, device=device, dtype=dtype)
    gate_up = torch.zeros(tokens, 2 * width, device=device, dtype=dtype)
    try:
        for rank in {common.block(int(r)): int(r) for r in np.arange(8, max_rank + 1, 8)}.values():
            for token_slots in ([0] * tokens, [0, -1] + [1] * (tokens - 2)):  # a span; rows gathered
                slot_ranks = np.full(3, rank)
                groups = SlotGroups.build(np.asarray(token_slots), device, slot_ranks=slot_ranks, max_rank=rank)
                _compile_step(y2, a, b, gate_up, groups, kernels, plans)
    except Exception as e:  # a Triton build that cannot compile them: serve on the torch path
        settings.replace(lora_kernels=frozenset())
        logger.warning("preft: LoRA kernels unavailable (%s: %s); using the torch path", type(e).__name__, e)


def _compile_step(y2, a, b, gate_up, groups: SlotGroups, kernels: frozenset[str], plans: PlanCache) -> None:
    """Each picked kernel once over these groups (a rank block's span, or its gathered rows)."""
    rank, width, device = groups.rank, y2.shape[1], y2.device
    if "shrink" in kernels:
        z = shrink.shrink(y2, a, 1.0, groups, plans=plans)
        for slices in (2, 3):  # (modules of 2 and 3 slices side by side: gate/up, q/k/v)
            shrink.shrink(y2, a * slices, 1.0, groups, plans=plans)
    else:
        z = y2[: len(groups.rows), :rank]
    if "expand" in kernels:
        expand.expand_add(y2, z, b, 0, width, groups, plans=plans)
    if policy.fuses(rank, kernels):  # (rank: the largest of its block, so a threshold inside one counts)
        fused.lora_linear(y2, y2, a, [b], [width], 1.0, groups, plans=plans)
    if "act" in kernels:  # (a gate/up projection of the model's width; then no LoRA tokens)
        slot_ranks = np.full(3, rank)
        none = SlotGroups.build(np.full(y2.shape[0], -1), device, slot_ranks=slot_ranks, max_rank=rank)
        for step in (groups, none):
            lora.lora_silu_and_mul(torch.empty_like(y2), gate_up, y2, a * 2, [b, b], step, plans=plans)
