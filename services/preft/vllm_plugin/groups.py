"""A step's adapted tokens grouped by slot, built once per step on the host, and the grouped matmuls over them.

``SlotGroups.build`` takes the step's token -> slot map as a numpy array (-1: no adapter; known on the host,
so nothing waits on the device) and orders the adapted tokens by slot. Every adapter computation of the step
then runs over those rows only, one grouped matmul per weight (``torch._grouped_mm``: one kernel for all
groups on Hopper in bf16), never over tokens without an adapter and never over idle slots. Its cost follows
the adapted tokens, not the number of slots or adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from preft.vllm_plugin import lora_kernels

logger = logging.getLogger(__name__)

RANK_ALIGNMENT = 8  # ranks are rounded up to this: grouped-matmul operands need 16-byte strides in bf16
_MAX_GROUPS = 1023  # torch._grouped_mm's limit


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
    block_rows: int = lora_kernels.ROW_BLOCK
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
        block_rows: int = lora_kernels.ROW_BLOCK,
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
        if breaks.size + 1 > _MAX_GROUPS:  # too many runs for one grouped matmul: group by slot instead
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


def staged(arrays: Sequence[np.ndarray], pinned: bool) -> torch.Tensor:
    """Host arrays end to end in one new int64 host tensor (pinned: for a copy to CUDA), written by numpy.

    One allocation and one pass: ``pin_memory()`` of an array allocates and copies again, and torch splits a
    long CPU copy across its thread pool, whose threads then spin, on every adapted step.
    """
    sizes = [np.size(a) for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pinned)
    np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays], out=host.numpy())
    return host


def to_device(arrays: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays as device tensors, through one staging buffer and one copy.

    On CUDA the buffer is pinned: a copy from pageable memory first waits for all work queued on the stream,
    and with vLLM's async scheduling the next step is prepared while the current one runs on the GPU.
    """
    host = staged(arrays, pinned=device.type == "cuda")
    if device.type != "cpu":
        host = host.to(device, non_blocking=True)
    return list(torch.split(host, [len(a) for a in arrays]))


_EMPTY: dict[str, SlotGroups] = {}


def empty_groups(device: torch.device | str = "cpu") -> SlotGroups:
    key = str(device)
    if key not in _EMPTY:
        z = torch.zeros(0, dtype=torch.long, device=device)
        _EMPTY[key] = SlotGroups(z, z, z.to(torch.int32), z, z, z, (), 0)
    return _EMPTY[key]


# --- grouped matmul ------------------------------------------------------------------------------------------

_fast_path_failed = False


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: one unit stride in the last two dims, the other 16-byte aligned."""
    align = 16 // t.element_size()
    s0, s1 = t.stride(-2), t.stride(-1)
    if s1 == 1:
        return s0 % align == 0 and s0 >= t.shape[-1]
    if s0 == 1:
        return s1 % align == 0 and s1 >= t.shape[-2]
    return False


def _use_fast_path(a: torch.Tensor, b: torch.Tensor) -> bool:
    if _fast_path_failed or not hasattr(torch, "_grouped_mm") or b.shape[0] > _MAX_GROUPS:
        return False
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if a.device.type == "cuda":  # the fused kernel is bf16 only (other dtypes fall back to a synchronizing loop)
        if not (a.dtype == b.dtype == torch.bfloat16) or a.data_ptr() % 16 or b.data_ptr() % 16:
            return False
    elif a.device.type != "cpu":
        return False
    return _aligned(a) and _aligned(b)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """out[rows of group g] = a[rows of group g] @ b[g], for a [n, K] ordered by group and b [G, K, N]."""
    global _fast_path_failed
    if _use_fast_path(a, b):
        try:
            return torch._grouped_mm(a, b, offs=groups.offs)
        except RuntimeError as e:  # an unsupported shape or build: keep serving through the loop below
            _fast_path_failed = True
            logger.warning("torch._grouped_mm unavailable (%s); using a per-adapter loop", e)
    out = a.new_empty(a.shape[0], b.shape[-1])
    for g, (_, start, end) in enumerate(groups.bounds):
        torch.mm(a[start:end], b[g], out=out[start:end])
    return out


# --- adapter computations over the groups ---------------------------------------------------------------------


def shrink(xs: torch.Tensor, a_stacked: torch.Tensor, groups: SlotGroups, scale: float = 1.0) -> torch.Tensor:
    """[n, rank]: each row times its slot's A (stacked [slots, (1,) R, in]) transposed, times scale."""
    a = lora_kernels.slot_matrices(a_stacked).index_select(0, groups.slots)[:, : groups.rank]  # [G, r, in]
    z = grouped_mm(xs.to(a.dtype), a.transpose(1, 2), groups)
    return z.mul_(scale) if scale != 1.0 else z


def expand(zs: torch.Tensor, b_stacked: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """[n, out]: each row's z times its slot's B (stacked [slots, (1,) out, R]) transposed."""
    b = lora_kernels.slot_matrices(b_stacked).index_select(0, groups.slots)[:, :, : groups.rank]  # [G, out, r]
    return grouped_mm(zs[:, : groups.rank].to(b.dtype).contiguous(), b.transpose(1, 2), groups)


def lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: list[torch.Tensor],
    b_stacked: list[torch.Tensor],
    output_slices: list[int],
    scale: float,
    groups: SlotGroups,
) -> None:
    """y[rows, slice i] += (x[rows] @ A_i[slot]ᵀ · scale) @ B_i[slot]ᵀ for each output slice, in place.

    On GPU (the LoRA kernels picked) one launch of the fused LoRA kernel (``lora_kernels.fuses``: at the
    step's rank), or two: one shrink and one expand for all slices, added into y's rows; elsewhere grouped
    matmuls (the slices' A gathered and stacked).
    """
    if groups.empty:
        return
    y2 = y if y.dim() == 2 else y.view(-1, y.shape[-1])
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    kernels = lora_kernels.picked(y2)
    if lora_kernels.fuses(groups.rank, kernels):
        a_slots = [lora_kernels.slot_matrices(a) for a in a_stacked]
        b_slots = [lora_kernels.slot_matrices(b) for b in b_stacked]
        if lora_kernels.can_fuse(x2, a_slots, b_slots):
            lora_kernels.lora_linear(y2, x2, a_slots, b_slots, output_slices, scale, groups)
            return
    if "shrink" in kernels and "expand" in kernels:
        plan = lora_kernels.split_plan(y2, x2, a_stacked, b_stacked, output_slices)
        if plan is not None:  # (kept per module: the per-call host work is two launches)
            lora_kernels.split_linear(y2, x2, plan, scale, groups)
            return
    r = groups.rank
    a_slots = [lora_kernels.slot_matrices(a) for a in a_stacked]
    if "shrink" in kernels and lora_kernels.can_shrink(x2, a_slots):
        z = lora_kernels.shrink(x2, a_slots, scale, groups)
    elif len(a_stacked) == 1:
        z = shrink(groups.take(x2), a_stacked[0], groups, scale)
    else:
        a = torch.cat([ai.index_select(0, groups.slots)[:, :r] for ai in a_slots], dim=1)
        z = grouped_mm(groups.take(x2).to(a.dtype), a.transpose(1, 2), groups)
        z = z.mul_(scale) if scale != 1.0 else z
    _add_expanded(
        y2, [z[:, i * r : (i + 1) * r] for i in range(len(b_stacked))], b_stacked, output_slices, 0, True, groups
    )


def lora_shrink(
    buffer: torch.Tensor, x: torch.Tensor, a_stacked: list[torch.Tensor], scale: float, groups: SlotGroups
) -> None:
    """buffer[i][rows, :r] += x[rows] @ A_i[slot]ᵀ · scale (vLLM's add_shrink)."""
    if groups.empty:
        return
    xs = groups.take(x.reshape(-1, x.shape[-1]))
    for i, a in enumerate(a_stacked):
        z = shrink(xs, a, groups, scale)
        bi = buffer[i].view(-1, buffer[i].shape[-1])
        target = groups.take(bi)
        target[:, : z.shape[1]] += z.to(bi.dtype)
        groups.put_back(bi, target)


def shrink_rows(z: torch.Tensor, x: torch.Tensor, a_stacked: torch.Tensor, groups: SlotGroups) -> None:
    """z[rows, :r] = x[rows] @ A[slot]ᵀ at the groups' token rows (z: [tokens, ≥ r], by token row as vLLM's
    shrink buffer; x: [tokens, in]); z's other rows untouched. On the shrink kernel where it serves z."""
    if groups.empty:
        return
    x2 = x.reshape(-1, x.shape[-1])
    a = lora_kernels.slot_matrices(a_stacked)
    if lora_kernels.available(z, "shrink") and lora_kernels.can_shrink(x2, [a]) and z.dtype == x2.dtype:
        lora_kernels.shrink_rows(z, x2, a, groups)
        return
    target = groups.take(z)
    target[:, : groups.rank] = shrink(groups.take(x2), a_stacked, groups).to(z.dtype)
    groups.put_back(z, target)


def lora_expand(
    y: torch.Tensor,
    buffer: torch.Tensor,
    b_stacked: list[torch.Tensor],
    output_slices: list[int],
    offset_start: int,
    add_inputs: bool,
    groups: SlotGroups,
) -> None:
    """y[rows, slice i] (+)= buffer[i][rows] @ B_i[slot]ᵀ (vLLM's add_expand and add_lora_embedding)."""
    if groups.empty:
        return
    y2 = y.view(-1, y.shape[-1])
    zs = [groups.take(buffer[i].reshape(-1, buffer[i].shape[-1])) for i in range(len(b_stacked))]
    _add_expanded(y2, zs, b_stacked, output_slices, offset_start, add_inputs, groups)


def _add_expanded(
    y2: torch.Tensor,
    zs: list[torch.Tensor],
    b_stacked: list[torch.Tensor],
    output_slices: list[int],
    offset: int,
    add_inputs: bool,
    groups: SlotGroups,
) -> None:
    """y2[rows, slice i] (+)= zs[i] @ B_i[slot]ᵀ, the slices side by side from column `offset`.

    On GPU the expand kernel adds into y2's rows in place; elsewhere each slice's delta is a grouped matmul
    added into the rows taken from y2.
    """
    in_place = add_inputs and lora_kernels.available(y2)
    target = None if in_place else groups.take(y2)
    columns = lora_kernels.slice_columns(output_slices, b_stacked, y2.shape[1], offset)
    for z, b, (col, width) in zip(zs, b_stacked, columns, strict=True):
        b = lora_kernels.slot_matrices(b)
        if in_place:
            lora_kernels.expand_add(y2, z, b, col, width, groups)
        else:
            delta = expand(z, b, groups)[:, :width]
            part = target[:, col : col + width]
            if add_inputs:
                part += delta.to(y2.dtype)
            else:
                part.copy_(delta)
    if target is not None:
        groups.put_back(y2, target)


def direft_apply(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor,
    groups: SlotGroups,
) -> None:
    """At the rows, the residual stream h = hidden + residual gets the DiReFT edit h + Bᵀ(A·h + b), in place.

    The rows' residual becomes h and their hidden becomes the delta, so the next fused add (the next layer's
    norm) computes delta + h, the same sum as the reference; other rows are not touched. a, b: [slots, R, H]
    for this layer, bias [slots, R].
    """
    if groups.empty:
        return
    r = groups.rank
    hs, rs = groups.take(hidden), groups.take(residual)
    h = hs + rs
    a_g = a.index_select(0, groups.slots)[:, :r]  # [G, r, H]
    z = grouped_mm(h.to(a_g.dtype), a_g.transpose(1, 2), groups)
    z = z + bias.index_select(0, groups.slots)[:, :r].index_select(0, groups.row_group)
    b_g = b.index_select(0, groups.slots)[:, :r]  # [G, r, H]
    delta = grouped_mm(z.to(b_g.dtype).contiguous(), b_g, groups)
    rs.copy_(h)
    hs.copy_(delta)
    groups.put_back(residual, rs)
    groups.put_back(hidden, hs)
