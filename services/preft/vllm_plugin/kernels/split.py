"""One LoRA linear on the shrink and expand kernels: two launches whatever its number of slices.

A ``SplitPlan`` holds what a module's weights fix of both launches (kept per module in the worker's
``PlanCache``: on Qwen's prefill steps issuing the launches is the cost), so the host work per call is two
launches; the shrink's z lies in the cache's scratch buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels.common import Args, Groups, can_shrink, slot_matrices
from preft.vllm_plugin.kernels.expand import ExpandPlan, expand_plan, launch_expand, slice_columns
from preft.vllm_plugin.kernels.plans import PlanCache
from preft.vllm_plugin.kernels.shrink import launch_shrink, shrink_args


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """One LoRA linear on the shrink and expand kernels: two launches, whatever its number of slices."""

    a: tuple[torch.Tensor, ...]  # per slice [slots, R, in]
    a_table: torch.Tensor  # their addresses
    expand: ExpandPlan
    b: tuple[torch.Tensor, ...]  # held, as `a` is: no other tensor can take their addresses (the plan's key)
    stacked: tuple[torch.Tensor, ...]  # vLLM's stacked A then B it was made from, held: `serves` reads their ids
    ids: tuple[int, ...]
    x_dtype: torch.dtype
    in_cols: int
    y_cols: int
    output_slices: tuple[int, ...]
    shrink_args: dict[int, Args]  # by the shrink's tile columns

    def serves(self, y2: torch.Tensor, x2: torch.Tensor, a_stacked, b_stacked, output_slices) -> bool:
        """Whether this is the plan of these arguments: the same weight tensors (these very objects: vLLM
        allocates a layer's stacked weights once and writes its slots in place), x's dtype, unit column
        stride and width, y's width, the slices and the expand's tile width."""
        return (
            self.ids == (*map(id, a_stacked), *map(id, b_stacked))
            and x2.dtype == self.x_dtype
            and x2.stride(1) == 1
            and x2.size(1) == self.in_cols
            and y2.size(1) == self.y_cols
            and self.output_slices == tuple(output_slices)
            and self.expand.block_n == settings.current().lora_tiles["expand"].cols
        )

    def shrink(self, cols: int) -> Args:
        """The shrink's run of arguments this plan fixes, for tiles of `cols` columns."""
        kept = self.shrink_args.get(cols)
        if kept is None:
            kept = self.shrink_args[cols] = shrink_args(self.x_dtype, self.a, self.a_table, self.in_cols, cols)
        return kept


def split_plan(
    y2: torch.Tensor,
    x2: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    b_stacked: Sequence[torch.Tensor],
    output_slices: Sequence[int],
    *,
    plans: PlanCache,
) -> SplitPlan | None:
    """The plan for this module's weights (vLLM's stacked [slots, (1,) R, in] / [slots, (1,) out, R]), kept
    per module: None when the kernels cannot take them (the caller then serves it otherwise).

    Looked up on every call: first by the identity of the module's weight tensors (``SplitPlan.serves``),
    else by what the plan is made from: the weights' addresses and shapes (a plan holds its weights, so
    while it is kept no other tensor has those addresses), the first's strides, x's dtype, column stride and
    width (``can_shrink``), y's width (each slice's columns) and the expand's tile width."""
    plan = plans.split.get(id(a_stacked[0]))
    if plan is not None and plan.serves(y2, x2, a_stacked, b_stacked, output_slices):
        return plan
    key = (
        "split",
        settings.current().lora_tiles["expand"].cols,
        x2.dtype,
        x2.stride(-1),
        x2.shape[1],
        y2.shape[1],
        *output_slices,
        *(t.data_ptr() for t in a_stacked),
        *(t.data_ptr() for t in b_stacked),
        *(t.shape for t in a_stacked),
        *(t.shape for t in b_stacked),
        a_stacked[0].stride(),
        b_stacked[0].stride(),
    )
    if key not in plans.plans:
        plans.plans[key] = make_split_plan(y2, x2, a_stacked, b_stacked, output_slices, plans=plans)
    plan = plans.plans[key]
    if plan is not None:
        plans.split[id(a_stacked[0])] = plan
    return plan


def make_split_plan(y2, x2, a_stacked, b_stacked, output_slices, *, plans: PlanCache) -> SplitPlan | None:
    a = tuple(slot_matrices(t) for t in a_stacked)
    b = tuple(slot_matrices(t) for t in b_stacked)
    if not can_shrink(x2, a):
        return None
    expand = expand_plan(b, slice_columns(output_slices, b, y2.shape[1]), plans=plans)
    if expand is None:
        return None
    stacked = (*a_stacked, *b_stacked)
    return SplitPlan(
        a=a,
        a_table=plans.pointer_table(a),
        expand=expand,
        b=b,
        stacked=stacked,
        ids=tuple(map(id, stacked)),
        x_dtype=x2.dtype,
        in_cols=x2.shape[1],
        y_cols=y2.shape[1],
        output_slices=tuple(output_slices),
        shrink_args={},
    )


def plan_shrink(
    x2: torch.Tensor,
    plan: SplitPlan,
    scale: float,
    groups: Groups,
    rows: int,
    by_row: bool = False,
    *,
    plans: PlanCache,
) -> tuple[torch.Tensor, int]:
    """The plan's shrink into the kept z buffer (``PlanCache.scratch``) of `rows` rows: (z, its row stride), z at each
    row's position in group order (by_row: at its token row, `rows` then covering every token)."""
    stride_z = len(plan.a) * groups.rank
    z = plans.scratch(x2, rows * stride_z)
    cols = settings.current().lora_tiles["shrink"].cols
    launch_shrink(x2, z, stride_z, float(scale), len(plan.a), plan.shrink(cols), groups, by_row)
    return z, stride_z


def split_linear(
    y2: torch.Tensor,
    x2: torch.Tensor,
    plan: SplitPlan,
    scale: float,
    groups: Groups,
    add: bool = True,
    *,
    plans: PlanCache,
) -> None:
    """y2[rows, slice i] += (scale · x2[rows] @ A_i[slot]ᵀ) @ B_i[slot]ᵀ for every slice: shrink, then expand
    (not add: y2[rows, slice i] = the product, y2's rows not read: the delta first, a base GEMM may then add itself).

    z lies in a kept buffer (``PlanCache.scratch``), and the plan and the step's groups hold every other argument but
    x's, y's and the scale: little host work between the two launches."""
    z, stride_z = plan_shrink(x2, plan, scale, groups, groups.rows.shape[0], plans=plans)
    plan_expand(y2, z, stride_z, plan, groups, add)


def plan_expand(
    y2: torch.Tensor, z: torch.Tensor, stride_z: int, plan: SplitPlan, groups: Groups, add: bool = True
) -> None:
    """The plan's expand of `plan_shrink`'s z (in group order) into y2's rows: added (add) or stored."""
    launch_expand(y2, z, stride_z, 1, groups.rank, plan.expand, groups, add)
