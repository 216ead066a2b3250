"""DiReFT inside vLLM: adapter loading into slots, and the decoder-layer hook that applies it.

A DiReFT adapter travels through vLLM's LoRA machinery (one LoRA id, one slot, one token->slot map, one
scheduler limit), as a LoRAModel with no LoRA weights that carries its DiReFT tensors. When it takes a slot
its tensors are copied into per-slot buffers (``step.state.PreftSlotState``). Each decoder layer is given a subclass
whose forward ends with ``preft::direft_apply``: for every token of the step whose slot holds a DiReFT
adapter with this layer, the residual stream h after the layer becomes h + Bᵀ(A·h + b), computed over those
tokens only, grouped by slot (``step.torch_path.direft_apply``); other tokens, and every step without DiReFT tokens,
run exactly the base layer.
"""

from __future__ import annotations

from typing import Any

import torch

from preft.adapters import AdapterMethod, ModelShape, load_direft_tensors
from preft.adapters.formats import detect_method
from preft.vllm_plugin import compat
from preft.vllm_plugin.patches import adapter_weights, gc_freeze, load_ahead, mlp
from preft.vllm_plugin.patches.patching import wrap_method
from preft.vllm_plugin.step import ops  # noqa: F401  (ops registers torch.ops.preft.direft_apply)
from preft.vllm_plugin.step.state import PreftSlotState

# --- the layer hook ------------------------------------------------------------------------------------------

_LAYER_CLASSES: dict[type, type] = {}


def _direft_layer_class(base: type) -> type:
    if base not in _LAYER_CLASSES:
        base_forward = base.forward

        def forward(self, positions, hidden_states, residual, *args: Any, **kwargs: Any):
            hidden_states, residual = base_forward(self, positions, hidden_states, residual, *args, **kwargs)
            torch.ops.preft.direft_apply(hidden_states, residual, self.preft_layer_index, self.preft_state_id)
            return hidden_states, residual

        _LAYER_CLASSES[base] = type(f"Direft{base.__name__}", (base,), {"forward": forward})
    return _LAYER_CLASSES[base]


def install_layers(model: torch.nn.Module, state: PreftSlotState) -> bool:
    """Give every decoder layer the DiReFT edit; False (and DiReFT refused) for unsupported architectures."""
    if compat.model_architecture(model) not in compat.DIREFT_ARCHITECTURES:
        return False
    for index, layer in enumerate(compat.decoder_layers(model)):
        if type(layer).__name__.startswith("PPMissing"):
            continue
        layer.__class__ = _direft_layer_class(type(layer))
        layer.preft_layer_index = index
        layer.preft_state_id = state.id
    return True


# --- vLLM LoRA manager hooks ---------------------------------------------------------------------------------


def _create_lora_manager(original):
    def create_lora_manager(self, model, vllm_config, *args: Any, **kwargs: Any):
        if vllm_config.use_v2_model_runner:
            raise compat.UnsupportedVllmError(
                "PreFT needs vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0 (preft's engine does)"
            )
        result = original(self, model, vllm_config, *args, **kwargs)
        manager = self._adapter_manager
        lora_config = vllm_config.lora_config
        shape = ModelShape.from_config(vllm_config.model_config.hf_config.get_text_config().to_dict())
        state = PreftSlotState(
            shape=shape,
            max_slots=lora_config.max_loras,
            max_rank=lora_config.max_lora_rank,
            dtype=vllm_config.model_config.dtype,
            device=self.device,
        )
        self.preft_state = manager.preft_state = state
        for wrapper in manager.punica_wrapper_mapping.values():
            wrapper.preft_state = state
        state.direft_supported = install_layers(manager.model, state)
        state.fused_mlps = mlp.install(manager.model, state.id, state.device)
        return result

    return create_lora_manager


def _load_adapter(original):
    def load_adapter(self, lora_request, *args: Any, **kwargs: Any):
        read = load_ahead.take(lora_request)
        if read is not None:
            return read
        gc_freeze.adapter_loaded()
        if detect_method(lora_request.lora_path) is not AdapterMethod.DIREFT:
            model = original(self, lora_request, *args, **kwargs)
        else:
            model = _load_direft(self, lora_request)
        adapter_weights.record_load(self, lora_request, model)
        return model

    return load_adapter


def _load_direft(worker_manager, lora_request):
    state: PreftSlotState = worker_manager.preft_state
    if not getattr(state, "direft_supported", False):
        raise compat.UnsupportedVllmError(
            f"DiReFT adapters need one of {compat.DIREFT_ARCHITECTURES}, not {state.shape.architecture}"
        )
    tensors = load_direft_tensors(lora_request.lora_path, state.shape, max_rank=state.max_rank)
    rank = max(a.shape[0] for a, _, _ in tensors.values())
    model = worker_manager._lora_model_cls(lora_request.lora_int_id, rank, {})
    model.preft_direft = tensors
    return model


def _activate_adapter(original):
    def activate_adapter(self, lora_id: int, *args: Any, **kwargs: Any) -> bool:
        activated = original(self, lora_id, *args, **kwargs)
        state: PreftSlotState | None = getattr(self, "preft_state", None)
        if activated and state is not None:
            lora_model = self._registered_adapters[lora_id]
            slot = self.lora_index_to_id.index(lora_id)
            state.load_slot(
                slot,
                lora_rank=lora_model.rank if lora_model.loras else None,
                direft=getattr(lora_model, "preft_direft", None),
            )
        return activated

    return activate_adapter


def _create_merged_loras_inplace(original):
    def create_merged_loras_inplace(self, lora_model, *args: Any, **kwargs: Any) -> None:
        if not lora_model.loras:  # a DiReFT-only adapter has no LoRA weights to pack
            return None
        return original(self, lora_model, *args, **kwargs)

    return create_merged_loras_inplace


def install() -> None:
    worker_base, worker_lru = compat.worker_lora_manager_classes()
    for cls in (worker_base, worker_lru):
        wrap_method(cls, "create_lora_manager", _create_lora_manager)
    wrap_method(worker_base, "_load_adapter", _load_adapter)
    manager = compat.lora_model_manager_cls()
    wrap_method(manager, "activate_adapter", _activate_adapter)
    wrap_method(manager, "_create_merged_loras_inplace", _create_merged_loras_inplace)
