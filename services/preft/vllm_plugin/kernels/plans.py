"""What the LoRA kernels keep between calls, owned by one worker's slot state (``step.state.PreftSlotState``).

A module's weights stay where vLLM allocated them, so what a launch needs of them (tables of their addresses,
widths and columns, the plans of ``split``, ``expand`` and ``fused``) is made once and kept, keyed by the weights'
addresses; the shrink's z lies in a kept scratch buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from preft.vllm_plugin.kernels import triton_launch


class PlanCache:
    """One worker's kernel plans, their device tables, and the shrink's z buffers."""

    def __init__(self) -> None:
        self.tables: dict[tuple[int, ...], torch.Tensor] = {}  # device copies of int64 tables, by their values
        self.plans: dict[tuple, object] = {}  # each LoRA linear's kernel plan, by its weights' addresses
        self.split: dict[int, object] = {}  # the split plans again, by the id of their module's first stacked A
        self.scratch_buffers: dict[tuple, torch.Tensor] = {}  # the shrink's z buffers (``scratch``)

    def table(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """An int64 device tensor of these values, kept (they describe weights, which stay where they are)."""
        table = self.tables.get(values)
        if table is None:
            if len(self.tables) > 4096:  # engines come and go in one process (tests, benchmarks)
                self.tables.clear()
                self.plans.clear()
                self.split.clear()
            table = self.tables[values] = torch.tensor(values, dtype=torch.int64, device=device)
        return table

    def pointer_table(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors' addresses as a device int64 tensor."""
        return self.table(tuple(t.data_ptr() for t in tensors), tensors[0].device)

    def scratch(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A buffer of at least `numel` elements in like's dtype on its device, kept per device, dtype and stream:
        ``split.plan_shrink``'s z (each call's shrink writes it and its expand or activation reads it, in stream
        order)."""
        device = like.get_device()
        key = (device, like.dtype, triton_launch.stream(device) if device >= 0 else None)
        buffer = self.scratch_buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            size = max(numel, 2 * buffer.numel() if buffer is not None else 0)
            buffer = self.scratch_buffers[key] = torch.empty(size, device=like.device, dtype=like.dtype)
        return buffer
