"""New weights for an adapter that is already served: what they must match, checked before anything is written.

An update names tensors as the adapter's own ``adapter_model.safetensors`` does (PEFT's
``base_model.model.model.layers.{l}.{block}.{proj}.lora_{A,B}.weight``, DiReFT's ``layers.{l}.{A,B,b}``); each
named tensor replaces the served one, the others keep theirs. The adapter's manifest (every tensor's shape and dtype,
read from that file's header) is what an update is checked against: same names, shapes and dtypes (a trainer that
changed any of them has a new adapter, not new weights), and only finite values. Nothing here touches an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preft.adapters.errors import AdapterError
from preft.adapters.formats import WEIGHTS, read_safetensors_header

# safetensors' dtype names ↔ torch's, for the dtypes adapters may hold (formats.FLOAT_DTYPES)
TORCH_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_MAX_NAMES_SHOWN = 3


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an adapter as served: its shape and its safetensors dtype (F32, F16, BF16)."""

    shape: tuple[int, ...]
    dtype: str


WeightManifest = Mapping[str, TensorSpec]


class WeightUpdateError(AdapterError):
    """Weights that cannot replace an adapter's: unknown names, other shapes or dtypes, NaN or infinite values."""


def weight_manifest(adapter_dir: str | Path) -> dict[str, TensorSpec]:
    """The adapter's tensors (name → shape and dtype), from its safetensors header alone."""
    header = read_safetensors_header(Path(adapter_dir) / WEIGHTS)
    return {name: TensorSpec(tuple(meta["shape"]), meta["dtype"]) for name, meta in header.items()}


def dtype_name(tensor: Any) -> str:
    """A torch tensor's dtype as safetensors names it (``F32``…), or torch's own name for others."""
    torch_name = str(tensor.dtype).removeprefix("torch.")
    return next((st for st, name in TORCH_DTYPE_NAMES.items() if name == torch_name), torch_name)


def check_weight_update(manifest: WeightManifest, tensors: Mapping[str, Any], *, finite: bool = True) -> None:
    """Raise WeightUpdateError unless every tensor names one of the adapter's, with its shape and dtype (and, with
    `finite`, holds no NaN or infinity: the check that reads every value, done once, where the weights are applied).
    """
    import torch

    if not tensors:
        raise WeightUpdateError("the update holds no tensors")
    unknown = sorted(name for name in tensors if name not in manifest)
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:_MAX_NAMES_SHOWN])
        more = f" and {len(unknown) - _MAX_NAMES_SHOWN} more" if len(unknown) > _MAX_NAMES_SHOWN else ""
        example = next(iter(manifest), "")
        raise WeightUpdateError(f"unknown tensor names {shown}{more}: this adapter's are named like {example!r}")
    for name, tensor in tensors.items():
        spec = manifest[name]
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"is a {type(tensor).__name__}, not a tensor", tensor=name)
        if tuple(tensor.shape) != spec.shape:
            raise WeightUpdateError(f"has shape {list(tensor.shape)}, the adapter's is {list(spec.shape)}", tensor=name)
        if dtype_name(tensor) != spec.dtype:
            raise WeightUpdateError(f"has dtype {dtype_name(tensor)}, the adapter's is {spec.dtype}", tensor=name)
        if finite and not bool(torch.isfinite(tensor).all()):
            raise WeightUpdateError("holds NaN or infinite values", tensor=name)
