"""DiReFT as a trainable torch module, saved and loaded in the format the registry serves.

h ← h + Bᵀ(A·h + b) on the output h of each listed decoder layer, with A, B of shape [rank, hidden] and b of
shape [rank] (``preft_config.json`` + ``adapter_model.safetensors`` holding ``layers.{l}.A/B/b``, as
``preft.adapters.formats`` validates them). The module owns the parameters and the arithmetic; *where* the
intervention applies (which positions) is decided per forward by ``preft.training.model``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from preft.adapters.formats import DIREFT_CONFIG, WEIGHTS, AdapterMethod, ModelShape, load_direft_tensors


@dataclass(frozen=True)
class DireftConfig:
    """A new DiReFT adapter: its rank and the decoder layers whose outputs it edits."""

    rank: int
    layers: tuple[int, ...]
    init_std: float | None = None  # A's init std; None: 1/sqrt(hidden). B and b start at 0 (a no-op adapter)
    seed: int | None = None  # A's init seed; None: torch's global generator


class DireftAdapter(nn.Module):
    """The A, B, b parameters of one DiReFT adapter, one set per edited layer (``layer_<l>.A`` …)."""

    def __init__(self, config: DireftConfig, hidden_size: int, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.rank <= 0 or not config.layers or len(set(config.layers)) != len(config.layers):
            raise ValueError(f"a DiReFT adapter needs a positive rank and distinct layers, got {config}")
        self.config = config
        self.hidden_size = hidden_size
        g = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        std = config.init_std if config.init_std is not None else hidden_size**-0.5
        self.edits = nn.ModuleDict()
        for layer in config.layers:
            edit = nn.Module()
            edit.A = nn.Parameter((torch.randn(config.rank, hidden_size, generator=g) * std).to(dtype))
            edit.B = nn.Parameter(torch.zeros(config.rank, hidden_size, dtype=dtype))
            edit.b = nn.Parameter(torch.zeros(config.rank, dtype=dtype))
            self.edits[str(layer)] = edit

    @property
    def layers(self) -> tuple[int, ...]:
        return self.config.layers

    def delta(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Bᵀ(A·h + b) for hidden states h [..., hidden], computed in the parameters' dtype, returned in h's."""
        edit = self.edits[str(layer)]
        return ((h.to(edit.A.dtype) @ edit.A.T + edit.b) @ edit.B).to(h.dtype)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The served tensors: ``layers.{l}.A/B/b``, detached, contiguous, on the CPU."""
        return {
            f"layers.{layer}.{part}": getattr(self.edits[str(layer)], part).detach().cpu().contiguous()
            for layer in self.layers
            for part in ("A", "B", "b")
        }

    def save_pretrained(self, out_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Path:
        """Write ``preft_config.json`` and ``adapter_model.safetensors`` (in `dtype`) to out_dir."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype) for k, v in self.state_tensors().items()}, str(out / WEIGHTS))
        config = {"method": AdapterMethod.DIREFT.value, "rank": self.config.rank, "layers": list(self.layers)}
        (out / DIREFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return out

    @classmethod
    def from_pretrained(
        cls, adapter_dir: str | Path, shape: ModelShape, *, max_rank: int, dtype: torch.dtype = torch.float32
    ) -> DireftAdapter:
        """Validate (``preft.adapters.formats``, naming the bad file and tensor) and load a saved adapter."""
        tensors = load_direft_tensors(adapter_dir, shape, max_rank=max_rank)
        rank = next(iter(tensors.values()))[0].shape[0]
        adapter = cls(DireftConfig(rank=rank, layers=tuple(tensors)), shape.hidden_size, dtype=dtype)
        with torch.no_grad():
            for layer, parts in tensors.items():
                for name, value in zip(("A", "B", "b"), parts, strict=True):
                    getattr(adapter.edits[str(layer)], name).copy_(value.to(dtype))
        return adapter
