"""Adapter formats (PEFT LoRA, PreFT DiReFT): detection, validation against a base model, digests, loading."""

from preft.adapters.errors import AdapterError
from preft.adapters.formats import (
    ADAPTER_FILES,
    AdapterCheck,
    AdapterInfo,
    AdapterMethod,
    ModelShape,
    adapter_digest,
    check_adapter,
    content_digest,
    file_sha256,
    inspect_adapter,
    load_direft_tensors,
)
from preft.adapters.updates import TensorSpec, WeightUpdateError, check_weight_update, weight_manifest

__all__ = [
    "ADAPTER_FILES",
    "AdapterCheck",
    "AdapterError",
    "AdapterInfo",
    "AdapterMethod",
    "ModelShape",
    "TensorSpec",
    "WeightUpdateError",
    "adapter_digest",
    "check_adapter",
    "check_weight_update",
    "content_digest",
    "file_sha256",
    "inspect_adapter",
    "load_direft_tensors",
    "weight_manifest",
]
