"""A step's LoRA computations over its groups: each call served by the LoRA kernel the policy picks
(``kernels.policy``), else by the torch path (``torch_path``).

These are what the torch ops (``ops``) run: vLLM's LoRA linear, logits, embedding, shrink and expand, and the MLP's
activation with the gate/up LoRA. The kernels keep their plans in the worker's ``PlanCache`` (``plans``, owned by
its ``PreftSlotState``).
"""

from __future__ import annotations

import torch

from preft.vllm_plugin.kernels import act, expand, fused, policy, shrink, split
from preft.vllm_plugin.kernels.common import can_shrink, slot_matrices
from preft.vllm_plugin.kernels.expand import slice_columns
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.step import torch_path
from preft.vllm_plugin.step.groups import SlotGroups, empty_groups


def lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: list[torch.Tensor],
    b_stacked: list[torch.Tensor],
    output_slices: list[int],
    scale: float,
    groups: SlotGroups,
    *,
    plans: PlanCache,
) -> None:
    """y[rows, slice i] += (x[rows] @ A_i[slot]ᵀ · scale) @ B_i[slot]ᵀ for each output slice, in place.

    On GPU (the LoRA kernels picked) one launch of the fused LoRA kernel (``policy.fuses``: at the
    step's rank), or two: one shrink and one expand for all slices, added into y's rows; elsewhere grouped
    matmuls (the slices' A gathered and stacked).
    """
    if groups.empty:
        return
    y2 = y if y.dim() == 2 else y.view(-1, y.shape[-1])
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    kernels = policy.picked(y2)
    if policy.fuses(groups.rank, kernels):
        a_slots = [slot_matrices(a) for a in a_stacked]
        b_slots = [slot_matrices(b) for b in b_stacked]
        if fused.can_fuse(x2, a_slots, b_slots):
            fused.lora_linear(y2, x2, a_slots, b_slots, output_slices, scale, groups, plans=plans)
            return
    if "shrink" in kernels and "expand" in kernels:
        plan = split.split_plan(y2, x2, a_stacked, b_stacked, output_slices, plans=plans)
        if plan is not None:  # (kept per module: the per-call host work is two launches)
            split.split_linear(y2, x2, plan, scale, groups, plans=plans)
            return
    r = groups.rank
    a_slots = [slot_matrices(a) for a in a_stacked]
    if "shrink" in kernels and can_shrink(x2, a_slots):
        z = shrink.shrink(x2, a_slots, scale, groups, plans=plans)
    elif len(a_stacked) == 1:
        z = torch_path.shrink(groups.take(x2), a_stacked[0], groups, scale)
    else:
        a = torch.cat([ai.index_select(0, groups.slots)[:, :r] for ai in a_slots], dim=1)
        z = torch_path.grouped_mm(groups.take(x2).to(a.dtype), a.transpose(1, 2), groups)
        z = z.mul_(scale) if scale != 1.0 else z
    zs = [z[:, i * r : (i + 1) * r] for i in range(len(b_stacked))]
    _add_expanded(y2, zs, b_stacked, output_slices, 0, True, groups, plans)


def lora_shrink(
    buffer: torch.Tensor, x: torch.Tensor, a_stacked: list[torch.Tensor], scale: float, groups: SlotGroups
) -> None:
    """buffer[i][rows, :r] += x[rows] @ A_i[slot]ᵀ · scale (vLLM's add_shrink)."""
    if groups.empty:
        return
    xs = groups.take(x.reshape(-1, x.shape[-1]))
    for i, a in enumerate(a_stacked):
        z = torch_path.shrink(xs, a, groups, scale)
        bi = buffer[i].view(-1, buffer[i].shape[-1])
        target = groups.take(bi)
        target[:, : z.shape[1]] += z.to(bi.dtype)
        groups.put_back(bi, target)


def shrink_rows(
    z: torch.Tensor, x: torch.Tensor, a_stacked: torch.Tensor, groups: SlotGroups, *, plans: PlanCache
) -> None:
    """z[rows, :r] = x[rows] @ A[slot]ᵀ at the groups' token rows (z: [tokens, ≥ r], by token row as vLLM's
    shrink buffer; x: [tokens, in]); z's other rows untouched. On the shrink kernel where it serves z."""
    if groups.empty:
        return
    x2 = x.reshape(-1, x.shape[-1])
    a = slot_matrices(a_stacked)
    if policy.available(z, "shrink") and can_shrink(x2, [a]) and z.dtype == x2.dtype:
        shrink.shrink_rows(z, x2, a, groups, plans=plans)
        return
    target = groups.take(z)
    target[:, : groups.rank] = torch_path.shrink(groups.take(x2), a_stacked, groups).to(z.dtype)
    groups.put_back(z, target)


def lora_expand(
    y: torch.Tensor,
    buffer: torch.Tensor,
    b_stacked: list[torch.Tensor],
    output_slices: list[int],
    offset_start: int,
    add_inputs: bool,
    groups: SlotGroups,
    *,
    plans: PlanCache,
) -> None:
    """y[rows, slice i] (+)= buffer[i][rows] @ B_i[slot]ᵀ (vLLM's add_expand and add_lora_embedding)."""
    if groups.empty:
        return
    y2 = y.view(-1, y.shape[-1])
    zs = [groups.take(buffer[i].reshape(-1, buffer[i].shape[-1])) for i in range(len(b_stacked))]
    _add_expanded(y2, zs, b_stacked, output_slices, offset_start, add_inputs, groups, plans)


def _add_expanded(
    y2: torch.Tensor,
    zs: list[torch.Tensor],
    b_stacked: list[torch.Tensor],
    output_slices: list[int],
    offset: int,
    add_inputs: bool,
    groups: SlotGroups,
    plans: PlanCache,
) -> None:
    """y2[rows, slice i] (+)= zs[i] @ B_i[slot]ᵀ, the slices side by side from column `offset`.

    On GPU the expand kernel adds into y2's rows in place; elsewhere each slice's delta is a grouped matmul
    added into the rows taken from y2.
    """
    in_place = add_inputs and policy.available(y2)
    target = None if in_place else groups.take(y2)
    columns = slice_columns(output_slices, b_stacked, y2.shape[1], offset)
    for z, b, (col, width) in zip(zs, b_stacked, columns, strict=True):
        b = slot_matrices(b)
        if in_place:
            expand.expand_add(y2, z, b, col, width, groups, plans=plans)
        else:
            delta = torch_path.expand(z, b, groups)[:, :width]
            part = target[:, col : col + width]
            if add_inputs:
                part += delta.to(y2.dtype)
            else:
                part.copy_(delta)
    if target is not None:
        groups.put_back(y2, target)


# --- the MLP's activation ------------------------------------------------------------------------------------


def silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """out = silu(gate) · up, gate and up the halves of gate_up's last dim, as vLLM's SiluAndMul computes it
    on the platform: its CUDA kernel on GPU, torch's ops on CPU (``forward_native``)."""
    kernel = getattr(getattr(torch.ops, "_C", None), "silu_and_mul", None) if out.is_cuda else None
    if kernel is not None:
        kernel(out, gate_up)
    else:
        half = out.shape[-1]
        torch.mul(torch.nn.functional.silu(gate_up[..., :half]), gate_up[..., half:], out=out)


def fold_plan(
    gate_up: torch.Tensor, x: torch.Tensor, a_stacked, b_stacked, rank: int, *, plans: PlanCache
) -> split.SplitPlan | None:
    """The gate/up projection's plan when its LoRA is folded into the activation (``policy.folds``: ``act``,
    ``fold`` and ``shrink`` picked, CUDA, the step's rank at most ``FOLD_MAX_RANK``; the gate's and up's B alike):
    None to add the LoRA into gate/up instead."""
    if not policy.folds(rank, policy.picked(gate_up)):
        return None
    half = gate_up.shape[-1] // 2
    plan = split.split_plan(gate_up, x, a_stacked, b_stacked, [half, half], plans=plans)
    if plan is None or len(plan.b) != 2 or plan.b[0].stride() != plan.b[1].stride():
        return None
    return plan


def lora_silu_and_mul(
    out: torch.Tensor,
    gate_up: torch.Tensor,
    x: torch.Tensor,
    a_stacked: list[torch.Tensor],
    b_stacked: list[torch.Tensor],
    groups: SlotGroups,
    down: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    plans: PlanCache,
) -> None:
    """out = silu(gate) · up of gate_up + LoRA(x) over the groups' rows (slices: gate, then up; scale 1); with down
    = (A_down, z_down), also the down projection's shrink of out: z_down[t, :rank] = out[t] · A_down[slot(t)]ᵀ at
    each of the groups' token rows (A_down: vLLM's stacked [slots, (1,) R, inter]; z_down: [tokens, ≥ rank], its
    other rows untouched).

    Folded in the kernel (``kernels.act``), gate_up is only read; otherwise the LoRA is added into it first. The
    activation of gate_up as it then is: the kernel without LoRA (``act`` picked) or vLLM's. Down's shrink is
    computed inside the Gluon fold where ``act.down_folds``, else by the shrink kernel after it (``shrink_rows``)."""
    gate_up2, out2 = gate_up.view(-1, gate_up.shape[-1]), out.view(-1, out.shape[-1])
    plan, shrunk = None, False
    if not groups.empty:
        x2 = x.reshape(-1, x.shape[-1])
        plan = fold_plan(gate_up2, x2, a_stacked, b_stacked, groups.rank, plans=plans)
        if plan is None:
            half = gate_up.shape[-1] // 2
            lora_linear(gate_up, x, a_stacked, b_stacked, [half, half], 1.0, groups, plans=plans)
    if plan is not None:
        folding = None
        if down is not None:
            a_down = slot_matrices(down[0])
            folding = (a_down, down[1]) if act.down_folds(gate_up2, a_down, down[1], groups) else None
        z, stride_z = split.plan_shrink(x2, plan, 1.0, groups, gate_up2.shape[0], by_row=True, plans=plans)
        shrunk = act.launch(out2, gate_up2, z, stride_z, plan.b, groups, folding)
    elif act.triton is not None and "act" in policy.picked(gate_up2) and gate_up2.shape[0]:
        none = empty_groups(gate_up2.device)
        act.launch(out2, gate_up2, gate_up2, 0, (gate_up2, gate_up2), none)  # (no slot: z and B are not read)
    else:
        silu_and_mul(out, gate_up)
    if down is not None and not shrunk:
        shrink_rows(down[1], out2, down[0], groups, plans=plans)
