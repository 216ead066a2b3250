"""Per-worker PreFT state: what each adapter slot holds and this step's token-to-slot maps.

One instance per vLLM worker (attached to its LoRA managers and punica wrapper). It owns the DiReFT slot
buffers, which are static so CUDA graphs can read them: a slot's contents change when an adapter takes the
slot, the token-to-slot map changes every step, their addresses never change.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from preft.adapters import ModelShape

_ids = itertools.count(1)
STATES: dict[int, PreftSlotState] = {}


class PreftSlotState:
    """Slot bookkeeping and DiReFT buffers for one worker."""

    def __init__(
        self,
        *,
        shape: ModelShape,
        max_slots: int,
        max_rank: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.id = next(_ids)
        STATES[self.id] = self
        self.shape, self.max_slots, self.max_rank = shape, max_slots, max_rank
        self.device = torch.device(device)
        self.eager = self.device.type == "cpu"
        layers, hidden = shape.num_layers, shape.hidden_size
        self.direft_a = torch.zeros(layers, max_slots, max_rank, hidden, dtype=dtype, device=device)
        self.direft_b = torch.zeros(layers, max_slots, max_rank, hidden, dtype=dtype, device=device)
        self.direft_bias = torch.zeros(layers, max_slots, max_rank, dtype=dtype, device=device)
        self.slot_has_lora = torch.zeros(max_slots + 1, dtype=torch.bool, device=device)  # [-1] stays False
        self.slot_has_direft = torch.zeros(max_slots + 1, dtype=torch.bool, device=device)
        self.direft_token_slots = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.lora_ids_with_lora: set[int] = set()
        self.lora_ids_with_direft: set[int] = set()
        self.step_num_lora_adapters = 0
        # Eager (CPU) path: the step's tokens that have a DiReFT slot, and those slots.
        self.step_direft_rows = torch.zeros(0, dtype=torch.long)
        self.step_direft_row_slots = torch.zeros(0, dtype=torch.long)

    # --- slots -------------------------------------------------------------------------------------------
    def load_slot(self, slot: int, lora_id: int, *, has_lora: bool, direft: dict | None) -> None:
        """Record what adapter `lora_id` brings into `slot`; copy its DiReFT tensors (zeros elsewhere)."""
        self.slot_has_lora[slot] = has_lora
        (self.lora_ids_with_lora.add if has_lora else self.lora_ids_with_lora.discard)(lora_id)
        self.direft_a[:, slot].zero_()
        self.direft_b[:, slot].zero_()
        self.direft_bias[:, slot].zero_()
        for layer, (a, b, bias) in (direft or {}).items():
            r = a.shape[0]
            self.direft_a[layer, slot, :r].copy_(a)
            self.direft_b[layer, slot, :r].copy_(b)
            self.direft_bias[layer, slot, :r].copy_(bias)
        self.slot_has_direft[slot] = bool(direft)
        (self.lora_ids_with_direft.add if direft else self.lora_ids_with_direft.discard)(lora_id)

    # --- steps -------------------------------------------------------------------------------------------
    def count_lora_adapters(self, active_lora_ids: np.ndarray) -> int:
        """Adapters with tokens in this step that carry LoRA weights (what graph dispatch must know)."""
        self.step_num_lora_adapters = sum(int(i) in self.lora_ids_with_lora for i in active_lora_ids)
        return self.step_num_lora_adapters

    def split_slots(self, token_slots: torch.Tensor) -> torch.Tensor:
        """From the step's token->slot map, record the DiReFT map; return the map for the LoRA kernels."""
        safe = self._indexable(token_slots)
        n = token_slots.shape[0]
        direft_slots = torch.where(self.slot_has_direft[safe], token_slots, -1)
        self.direft_token_slots[:n].copy_(direft_slots)
        if self.eager:
            self.step_direft_rows = torch.nonzero(direft_slots >= 0).squeeze(1)
            self.step_direft_row_slots = direft_slots[self.step_direft_rows]
        return torch.where(self.slot_has_lora[safe], token_slots, -1)

    def lora_slots(self, token_slots: torch.Tensor) -> torch.Tensor:
        """The map with slots that hold no LoRA weights (DiReFT-only adapters) turned into -1."""
        return torch.where(self.slot_has_lora[self._indexable(token_slots)], token_slots, -1)

    def _indexable(self, token_slots: torch.Tensor) -> torch.Tensor:
        """-1 ("no adapter") replaced by the extra always-False entry at index max_slots of the slot masks."""
        return torch.where(token_slots >= 0, token_slots, self.max_slots)
