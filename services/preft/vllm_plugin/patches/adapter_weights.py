"""New weights for an adapter a worker holds, written in place: its host copy (vLLM's LoRAModel, or the DiReFT tensors
it carries) and, when it sits in a slot, that slot (vLLM's stacked LoRA buffers, our DiReFT buffers).

Nothing is allocated, unloaded or reloaded: the buffers keep their addresses (the kernels' plans hold them) and no
CUDA graph holds adapter weights (only no-LoRA graphs are captured, ``patches.worker``), so nothing is recaptured.

When an adapter is loaded (``record_load``) it is given what an update is checked and applied against: its manifest
(every tensor's shape and dtype, from its safetensors header); for a LoRA, each tensor's vLLM module and whether it is
A or B, as vLLM's loader names them (``parse_fine_tuned_lora_name`` with the model's unstacked weights mapper), and
each module's scaling before vLLM folds it into B.

An update (``apply_update``, run in every worker by the engine core) loads the tensors from the file the engine wrote,
checks all of them (names, shapes, dtypes, finite values), converts all of them, and only then writes: A as vLLM's
loader converts it (to the LoRA dtype), B likewise then times its scaling (``LoRALayerWeights.optimize``), so the host
copy is bitwise what a fresh load of the new weights would hold; a slot is rewritten by each layer's own ``set_lora``
(tensor-parallel slicing included). Bad weights return their error and change nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from preft.adapters.formats import DIREFT_TENSOR
from preft.adapters.updates import WeightUpdateError, check_weight_update, weight_manifest
from preft.vllm_plugin import compat

MANIFEST = "preft_manifest"  # on a loaded LoRAModel: tensor name -> TensorSpec
LORA_NAMES = "preft_lora_names"  # on a loaded LoRA: tensor name -> (vLLM module name, is A)
SCALING = "preft_scaling"  # on a loaded LoRA: vLLM module name -> the scaling vLLM folds into B
_DIREFT_PARTS = {"A": 0, "B": 1, "b": 2}


def record_load(worker_manager: Any, lora_request: Any, lora_model: Any) -> None:
    """Note on an adapter vLLM just read (before packing) what ``apply_update`` needs."""
    setattr(lora_model, MANIFEST, weight_manifest(Path(lora_request.lora_path)))
    if getattr(lora_model, "preft_direft", None) is not None:
        return
    mapper = compat.lora_weights_mapper(worker_manager._adapter_manager.model)
    parse = compat.parse_lora_name
    setattr(lora_model, LORA_NAMES, {name: parse(name, mapper) for name in getattr(lora_model, MANIFEST)})
    setattr(lora_model, SCALING, {module: weights.scaling for module, weights in lora_model.loras.items()})


def apply_update(worker: Any, lora_id: int, path: str) -> str | None:
    """In a worker (the engine core's collective_rpc): replace adapter `lora_id`'s tensors with those in the
    safetensors file at `path`. None once written; the reason, with nothing written, for weights that do not fit."""
    from safetensors.torch import load_file

    models = compat.worker_lora_manager(worker)._adapter_manager
    lora_model = models._registered_adapters.get(lora_id)
    if lora_model is None or not hasattr(lora_model, MANIFEST):
        return f"adapter {lora_id} is not loaded in this worker"
    try:
        tensors = load_file(path)
        check_weight_update(getattr(lora_model, MANIFEST), tensors)
    except (WeightUpdateError, OSError) as e:
        return str(e)
    slot = models.lora_index_to_id.index(lora_id) if lora_id in models.lora_index_to_id else None
    state = models.preft_state
    if getattr(lora_model, "preft_direft", None) is not None:
        _update_direft(state, lora_model, slot, tensors)
    else:
        _update_lora(models, lora_model, slot, tensors)
    if state.device.type == "cuda":
        # the slot's copies read pinned host memory the next update rewrites: done before this call returns
        torch.cuda.current_stream(state.device).synchronize()
    return None


def _update_lora(models: Any, lora_model: Any, slot: int | None, tensors: dict[str, torch.Tensor]) -> None:
    packed = {sub: (name, i) for name, subs in models.packed_modules.items() for i, sub in enumerate(subs)}
    names, scaling = getattr(lora_model, LORA_NAMES), getattr(lora_model, SCALING)
    writes, touched = [], set()
    for name, tensor in tensors.items():
        module, is_a = names[name]
        owner, index = (module, None) if module in lora_model.loras else packed[module]
        weights = lora_model.loras[owner]
        dest = weights.lora_a if is_a else weights.lora_b
        dest = dest if index is None else dest[index]
        value = tensor.to(dtype=dest.dtype)
        if not is_a and scaling[module] != 1:
            value *= scaling[module]  # (as LoRALayerWeights.optimize: in the LoRA dtype, after the conversion)
        writes.append((dest, value))
        touched.add(owner)
    for dest, value in writes:
        dest.copy_(value)
    if slot is not None:
        for owner in touched & models.modules.keys():  # (a pipeline stage holds its own layers' modules only)
            weights = models._get_lora_layer_weights(lora_model, owner)
            models.modules[owner].set_lora(slot, weights.lora_a, weights.lora_b)


def _update_direft(state: Any, lora_model: Any, slot: int | None, tensors: dict[str, torch.Tensor]) -> None:
    host = dict(lora_model.preft_direft)  # layer -> (A, B, b), float32 as load_direft_tensors reads them
    for name, tensor in tensors.items():
        m = DIREFT_TENSOR.match(name)
        layer, part = int(m["layer"]), _DIREFT_PARTS[m["part"]]
        parts = list(host[layer])
        parts[part] = tensor.float()
        host[layer] = tuple(parts)
    lora_model.preft_direft = host
    if slot is not None:
        state.write_direft(slot, host)
