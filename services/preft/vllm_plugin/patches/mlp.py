"""With ``act`` picked (the default) on CUDA, each Llama/Qwen2 MLP with a LoRA gate/up projection runs its
activation through ``preft::lora_silu_and_mul``.

vLLM's MLP computes ``down_proj(act_fn(gate_up_proj(x)))``: the LoRA layer adds its LoRA into gate_up, which the
activation then reads. The patched forward runs the projection's base GEMM itself (as the LoRA layer's
``_apply_sync`` does) and hands gate_up, x and the LoRA weights to the op, which folds the LoRA into the
activation (``kernels.act``). Where down_proj is a LoRA layer over one tensor-parallel rank without bias
(``down_fits``), the forward runs its base GEMM too, and the op (``preft::lora_silu_and_mul_down``) also returns
down's shrink of the activation, which the activation's kernel computes as it writes it (``kernels.fold_gluon``'s
DOWN) instead of the shrink reading it back; ``preft::lora_expand`` then adds down's LoRA. MLPs of another shape
(a bias, a gathered or sharded output, another activation) keep vLLM's forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from preft.vllm_plugin import compat
from preft.vllm_plugin.kernels import policy
from preft.vllm_plugin.step import ops  # noqa: F401  (ops: torch.ops.preft.lora_silu_and_mul)

logger = logging.getLogger(__name__)
_CLASSES: dict[type, type] = {}


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    lora, down, state_id = self.gate_up_proj, self.down_proj, self.preft_state_id
    gate_up = lora._get_quant_method().apply(lora.base_layer, x, None)
    a, b = list(lora.lora_a_stacked), list(lora.lora_b_stacked)
    if not self.preft_down:
        h = torch.ops.preft.lora_silu_and_mul(gate_up, x, a, b, state_id)
        out, _ = down(h)
        return out
    h, z = torch.ops.preft.lora_silu_and_mul_down(gate_up, x, a, b, down.lora_a_stacked[0], state_id)
    out = down._get_quant_method().apply(down.base_layer, h, None)
    torch.ops.preft.lora_expand(out, z[None], [down.lora_b_stacked[0]], [out.shape[-1]], 0, True, state_id)
    return out


def _mlp_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Preft{base.__name__}", (base,), {"forward": _forward})
    return _CLASSES[base]


def fits(mlp: Any) -> bool:
    """Whether the patched forward computes what vLLM's does for this MLP."""
    lora = getattr(mlp, "gate_up_proj", None)
    base = getattr(lora, "base_layer", None)
    return (
        isinstance(mlp, compat.silu_mlp_classes())
        and type(mlp.act_fn) is compat.silu_and_mul_cls()
        and type(lora) is compat.merged_lora_cls()
        and base.bias is None
        and not (base.gather_output and lora.tp_size > 1)
        and len(lora.output_slices) == 2
        and lora.output_slices[0] == lora.output_slices[1]
    )


def down_fits(mlp: Any) -> bool:
    """Whether the patched forward also takes down_proj's LoRA: a row-parallel LoRA layer of one slice over one
    tensor-parallel rank (its forward then the base GEMM and the LoRA, no split and no all-reduce), without bias."""
    down = getattr(mlp, "down_proj", None)
    return (
        type(down) is compat.row_lora_cls()
        and down.tp_size == 1
        and down.base_layer.bias is None
        and len(down.lora_a_stacked) == 1
        and down.lora_a_stacked[0].shape[-1] == mlp.gate_up_proj.output_slices[0]
    )


def install(model: torch.nn.Module, state_id: int, device: torch.device) -> int:
    """Patch every decoder layer's MLP that `fits`, where the activation kernel is picked (``act``, the default)
    and serves (CUDA); how many were."""
    if "act" not in policy.chosen() or device.type != "cuda":
        return 0
    return patch(model, state_id)


def patch(model: torch.nn.Module, state_id: int) -> int:
    """Patch every decoder layer's MLP that `fits` (off CUDA the op adds the LoRA into gate/up and runs torch's
    activation: the tests' way to check the patched forward against vLLM's); how many were."""
    try:
        layers = compat.decoder_layers(model)
    except compat.UnsupportedVllmError:  # not a Llama-family model: its MLPs keep vLLM's forward
        return 0
    patched = down = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and fits(mlp):
            mlp.__class__ = _mlp_class(type(mlp))
            mlp.preft_state_id = state_id
            mlp.preft_down = down_fits(mlp)
            patched += 1
            down += mlp.preft_down
    logger.info(
        "preft: %d of %d decoder layers fold their gate/up LoRA into the activation (%d also take down's shrink there)",
        patched,
        len(layers),
        down,
    )
    return patched
