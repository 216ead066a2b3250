"""Per-worker PreFT state: what each adapter slot holds, this step's adapted tokens grouped by slot, and the LoRA
kernels' plans.

One instance per vLLM worker (attached to its LoRA managers and punica wrapper). It owns the DiReFT slot
buffers (a slot's contents change when an adapter takes the slot), a host-side record of every slot's
kind, rank and DiReFT layers, so each step's groups are built from numpy arrays without touching the device, and
the kernels' ``PlanCache``. Every state in the process is in ``STATES`` (the torch ops name it by its id), which
``using`` compiles the kernels it picks for.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from preft.adapters import ModelShape
from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import policy
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step.groups import SlotGroups, empty_groups
from preft.vllm_plugin.step.warmup import compile_kernels

_ids = itertools.count(1)
STATES: dict[int, PreftSlotState] = {}


@dataclass(frozen=True)
class StepGroups:
    """One step's adapted tokens: LoRA tokens, LoRA sampled rows (logits), and DiReFT tokens per layer."""

    lora_tokens: SlotGroups
    lora_sampled: SlotGroups
    direft_by_layer: tuple[SlotGroups, ...]
    has_adapter_tokens: bool = field(init=False)

    def __post_init__(self) -> None:
        adapted = not (self.lora_tokens.empty and self.lora_sampled.empty)
        object.__setattr__(self, "has_adapter_tokens", adapted or any(not g.empty for g in self.direft_by_layer))


class PreftSlotState:
    """Slot bookkeeping, DiReFT buffers, the current step's groups and the LoRA kernels' plans for one worker."""

    def __init__(
        self,
        *,
        shape: ModelShape,
        max_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.id = next(_ids)
        STATES[self.id] = self
        self.shape, self.max_slots, self.max_rank = shape, max_slots, max_rank
        self.device = torch.device(device)
        layers, hidden = shape.num_layers, shape.hidden_size
        self.direft_a = torch.zeros(layers, max_slots, max_rank, hidden, dtype=dtype, device=device)
        self.direft_b = torch.zeros(layers, max_slots, max_rank, hidden, dtype=dtype, device=device)
        self.direft_bias = torch.zeros(layers, max_slots, max_rank, dtype=dtype, device=device)
        # Host-side: what each slot holds (index max_slots stands for "no slot" and stays empty).
        self.slot_has_lora = np.zeros(max_slots + 1, dtype=bool)
        self.slot_direft_layers = np.zeros((max_slots + 1, layers), dtype=bool)
        self.slot_has_direft = np.zeros(max_slots + 1, dtype=bool)
        self.slot_rank = np.zeros(max_slots + 1, dtype=np.int64)
        empty = empty_groups(self.device)
        self.step = StepGroups(empty, empty, tuple(empty for _ in range(layers)))
        self.plans = PlanCache()
        self.warmed_up: tuple[torch.device, torch.dtype, int, int] | None = None  # compile_kernels' arguments
        self.warm_up(dtype, hidden, max_rank)

    def warm_up(self, dtype: torch.dtype, width: int, max_rank: int) -> None:
        """Compile, before serving, the kernels' variants serving uses (``warmup.compile_kernels``) where they
        serve; remembered, so that ``using`` compiles what it picks for every state of the process."""
        if policy.supported(torch.empty(0, device=self.device)):
            self.warmed_up = (self.device, dtype, width, max_rank)
            compile_kernels(*self.warmed_up, plans=self.plans)

    # --- slots -------------------------------------------------------------------------------------------
    def load_slot(self, slot: int, *, lora_rank: int | None, direft: dict | None) -> None:
        """Record what an adapter brings into `slot`: LoRA weights of `lora_rank`, or DiReFT tensors."""
        self.slot_has_lora[slot] = lora_rank is not None
        self.direft_a[:, slot].zero_()
        self.direft_b[:, slot].zero_()
        self.direft_bias[:, slot].zero_()
        self.slot_direft_layers[slot] = False
        rank = lora_rank or 0
        for layer, (a, _, _) in (direft or {}).items():
            rank = max(rank, a.shape[0])
            self.slot_direft_layers[slot, layer] = True
        self.write_direft(slot, direft or {})
        self.slot_has_direft[slot] = bool(direft)
        self.slot_rank[slot] = rank

    def write_direft(self, slot: int, direft: dict) -> None:
        """Copy DiReFT tensors (layer -> (A, B, b)) into `slot`'s buffers, in place: an adapter taking the slot, or
        new weights for the one in it (same layers and rank, so the host-side record stands)."""
        for layer, (a, b, bias) in direft.items():
            r = a.shape[0]
            self.direft_a[layer, slot, :r].copy_(a)
            self.direft_b[layer, slot, :r].copy_(b)
            self.direft_bias[layer, slot, :r].copy_(bias)

    # --- steps -------------------------------------------------------------------------------------------
    def set_step(self, token_slots: np.ndarray, sampled_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Group this step's tokens (slot per token, -1 none) by method, layer and slot.

        Returns the token and sampled slot maps with DiReFT-only slots turned into -1: what vLLM's own LoRA
        metadata should see.
        """
        token_slots = np.asarray(token_slots, dtype=np.int64)
        sampled_slots = np.asarray(sampled_slots, dtype=np.int64)
        safe_tokens = np.where(token_slots >= 0, token_slots, self.max_slots)
        safe_sampled = np.where(sampled_slots >= 0, sampled_slots, self.max_slots)
        lora_tokens = np.where(self.slot_has_lora[safe_tokens], token_slots, -1)
        lora_sampled = np.where(self.slot_has_lora[safe_sampled], sampled_slots, -1)
        build = dict(device=self.device, slot_ranks=self.slot_rank, max_rank=self.max_rank)
        empty = empty_groups(self.device)
        direft = [empty] * self.shape.num_layers
        direft_slots = np.unique(token_slots[self.slot_has_direft[safe_tokens]])
        if direft_slots.size:
            by_slot_set: dict[bytes, SlotGroups] = {}  # layers adapted by the same slots share one grouping
            for layer in range(self.shape.num_layers):
                in_layer = direft_slots[self.slot_direft_layers[direft_slots, layer]]
                if in_layer.size:
                    key = in_layer.tobytes()
                    if key not in by_slot_set:
                        mask = np.isin(token_slots, in_layer)
                        by_slot_set[key] = SlotGroups.build(np.where(mask, token_slots, -1), **build)
                    direft[layer] = by_slot_set[key]
        self.step = StepGroups(
            lora_tokens=SlotGroups.build(lora_tokens, **build),
            lora_sampled=SlotGroups.build(lora_sampled, **build),
            direft_by_layer=tuple(direft),
        )
        return lora_tokens, lora_sampled


@contextlib.contextmanager
def using(*kernels: str) -> Iterator[None]:
    """Only these kernels (none: the torch path) for everything run in this process meanwhile (A/B runs).

    Compiles them first for every state warmed up in this process, as its start would have.
    """
    with settings.override(lora_kernels=settings.parse_kernels(",".join(kernels))):
        for state in list(STATES.values()):
            if getattr(state, "warmed_up", None) is not None:
                compile_kernels(*state.warmed_up, plans=state.plans)
        yield
