"""The torch path: a step's adapter products as grouped matmuls over its groups, wherever the kernels do not serve
(off CUDA, a kernel not picked, a layout the kernels do not take) and for the DiReFT edit.

One grouped matmul per weight (``torch._grouped_mm``: one kernel for all groups on Hopper in bf16; elsewhere a loop
over the groups), over the adapted rows only.
"""

from __future__ import annotations

import logging

import torch

from preft.vllm_plugin.kernels.common import slot_matrices
from preft.vllm_plugin.step.groups import MAX_GROUPS, SlotGroups

logger = logging.getLogger(__name__)

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
    if _fast_path_failed or not hasattr(torch, "_grouped_mm") or b.shape[0] > MAX_GROUPS:
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


def shrink(xs: torch.Tensor, a_stacked: torch.Tensor, groups: SlotGroups, scale: float = 1.0) -> torch.Tensor:
    """[n, rank]: each row times its slot's A (stacked [slots, (1,) R, in]) transposed, times scale."""
    a = slot_matrices(a_stacked).index_select(0, groups.slots)[:, : groups.rank]  # [G, r, in]
    z = grouped_mm(xs.to(a.dtype), a.transpose(1, 2), groups)
    return z.mul_(scale) if scale != 1.0 else z


def expand(zs: torch.Tensor, b_stacked: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """[n, out]: each row's z times its slot's B (stacked [slots, (1,) out, R]) transposed."""
    b = slot_matrices(b_stacked).index_select(0, groups.slots)[:, :, : groups.rank]  # [G, out, r]
    return grouped_mm(zs[:, : groups.rank].to(b.dtype).contiguous(), b.transpose(1, 2), groups)


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
