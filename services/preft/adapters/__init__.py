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

__all__ = [
    "ADAPTER_FILES",
    "AdapterCheck",
    "AdapterError",
    "AdapterInfo",
    "AdapterMethod",
    "ModelShape",
    "adapter_digest",
    "check_adapter",
    "content_digest",
    "file_sha256",
    "inspect_adapter",
    "load_direft_tensors",
]
