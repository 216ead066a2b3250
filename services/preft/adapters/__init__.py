"""Adapter formats (PEFT LoRA, PreFT DiReFT): detection, validation against a base model, digests, loading."""

from preft.adapters.errors import AdapterError
from preft.adapters.formats import (
    AdapterInfo,
    AdapterMethod,
    ModelShape,
    adapter_digest,
    inspect_adapter,
    load_direft_tensors,
)

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "AdapterMethod",
    "ModelShape",
    "adapter_digest",
    "inspect_adapter",
    "load_direft_tensors",
]
