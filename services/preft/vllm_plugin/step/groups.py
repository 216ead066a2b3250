"""A step's adapted tokens grouped by slot, built once per step on the host.

``SlotGroups.build`` takes the step's token -> slot map as a numpy array (-1: no adapter; known on the host,
so nothing waits on the device) and orders the adapted tokens by slot. Every adapter computation of the step
then runs over those rows only (``step.lora``: the LoRA kernels or the torch path's grouped matmuls), never over
tokens without an adapter and never over idle slots. Its cost follows the adapted tokens, not the number of slots
or adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from preft.vllm_plugin.kernels.common import ROW_BLOCK
from preft.vllm_plugin.kernels.staging import to_device

RANK_ALIGNMENT = 8  # ranks are rounded up to this: grouped-matmul operands need 16-byte strides in bf16
MAX_GROUPS = 1023  # torch._grouped_mm's limit


@dataclass(frozen=True, eq=False)
class SlotGroups:
    """The adapted tokens of a step, as groups of rows with one slot each.

    A group is a run of consecutive tokens with the same slot (a request's prompt chunk, or its decode
    token), so rows stay in token order. When the adapted tokens form one contiguous range (every prefill
    step of prefill-only adapters, every step where all requests have adapters) ``span`` says so and the
    computations read and write that range in place: no gather, no scatter.
    """

    rows: torch.Tensor  # int64 [n]: the adapted token rows, in group order
    slots: torch.Tensor  # int64 [G]: the slot of each group
    offs: torch.Tensor  # int32 [G]: cumulative end of each group in rows (grouped-matmul offsets)
    row_group: torch.Tensor  # int64 [n]: the group of each row
    block_group: torch.Tensor  # int64 [B]: the group of each block of ≤ block_rows rows (the kernels' grid)
    block_start: torch.Tensor  # int64 [B]: the block's first row (position in rows)
    bounds: tuple[tuple[int, int, int], ...]  # host copy: (slot, start, end) per group
    rank: int  # weight rows in use: the largest rank among these slots, rounded up (0 when empty)
    span: tuple[int, int] | None = None  # rows == range(*span)
    block_rows: int = ROW_BLOCK
    launch_args: dict = field(default_factory=dict, repr=False)  # the LoRA kernels' per-step arguments, once made
    token_slots: np.ndarray | None = field(default=None, repr=False)  # host: the slot map it was built from

    @property
    def empty(self) -> bool:
        return not self.bounds

    @classmethod
    def build(
        cls,
        token_slots: np.ndarray,
        device: torch.device | str,
        *,
        slot_ranks: np.ndarray,
        max_rank: int,
        block_rows: int = ROW_BLOCK,
    ) -> SlotGroups:
        """Group the tokens whose slot is >= 0; `slot_ranks[s]` is the rank of what slot s holds. The kernels'
        programs take each group's rows in blocks of `block_rows` (or parts of those blocks)."""
        token_slots = np.asarray(token_slots, dtype=np.int64)
        rows = np.flatnonzero(token_slots >= 0)
        if rows.size == 0:
            return empty_groups(device)
        slots_of_rows = token_slots[rows]
        breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(slots_of_rows) != 0)) + 1
        span = (int(rows[0]), int(rows[-1]) + 1) if rows[-1] - rows[0] + 1 == rows.size else None
        if breaks.size + 1 > MAX_GROUPS:  # too many runs for one grouped matmul: group by slot instead
            order = np.argsort(slots_of_rows, kind="stable")
            rows, slots_of_rows, span = rows[order], slots_of_rows[order], None
            breaks = np.flatnonzero(np.diff(slots_of_rows) != 0) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [rows.size]))
        slots = slots_of_rows[starts]
        rank = int(slot_ranks[slots].max())
        rank = min(max_rank, -(-max(rank, 1) // RANK_ALIGNMENT) * RANK_ALIGNMENT)
        row_group = np.repeat(np.arange(slots.size, dtype=np.int64), ends - starts)
        block_group, block_start = _row_blocks(starts, ends, block_rows)
        arrays = (rows, slots, ends, row_group, block_group, block_start)
        rows_t, slots_t, ends_t, row_group_t, block_group_t, block_start_t = to_device(arrays, torch.device(device))
        return cls(
            rows=rows_t,
            slots=slots_t,
            offs=ends_t.to(torch.int32),
            row_group=row_group_t,
            block_group=block_group_t,
            block_start=block_start_t,
            bounds=tuple(zip(slots.tolist(), starts.tolist(), ends.tolist(), strict=True)),
            rank=rank,
            span=span,
            block_rows=block_rows,
            token_slots=token_slots,
        )

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a 2-D tensor: a view for a span, else a gathered copy."""
        if self.span is not None:
            return t[self.span[0] : self.span[1]]
        return t.index_select(0, self.rows)

    def put_back(self, t: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows obtained from `take` back into t (a no-op for a span: they were a view)."""
        if self.span is None:
            t.index_copy_(0, self.rows, rows)


def _row_blocks(starts: np.ndarray, ends: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's rows cut into blocks of at most `size`: (group, first row) per block."""
    counts = -(-(ends - starts) // size)
    block_group = np.repeat(np.arange(starts.size, dtype=np.int64), counts)
    first_block = np.cumsum(counts) - counts
    block_start = starts[block_group] + (np.arange(block_group.size) - first_block[block_group]) * size
    return block_group, block_start


_EMPTY: dict[str, SlotGroups] = {}


def empty_groups(device: torch.device | str = "cpu") -> SlotGroups:
    key = str(device)
    if key not in _EMPTY:
        z = torch.zeros(0, dtype=torch.long, device=device)
        _EMPTY[key] = SlotGroups(z, z, z.to(torch.int32), z, z, z, (), 0)
    return _EMPTY[key]
