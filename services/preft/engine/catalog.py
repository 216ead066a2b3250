"""Adapter catalog of one engine: validated adapters, each with a stable LoRA id and a content-digest name."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from preft.adapters import AdapterInfo, ModelShape, inspect_adapter


@dataclass(frozen=True)
class CatalogEntry:
    info: AdapterInfo
    lora_int_id: int

    @property
    def lora_name(self) -> str:
        # Prefix-cache blocks are keyed by this name: the content digest, so equal names mean equal adapters.
        return f"{self.info.method.value}-{self.info.digest}"


class AdapterCatalog:
    """Validates adapter directories against the engine's model and assigns each distinct content one id.

    Validation results are cached per (path, size, mtime) of the weight and config files, so a directory that
    changes on disk is validated and digested again.
    """

    def __init__(self, shape: ModelShape, *, max_rank: int) -> None:
        self._shape, self._max_rank = shape, max_rank
        self._by_digest: dict[str, int] = {}
        self._by_stamp: dict[tuple, CatalogEntry] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _stamp(path: Path) -> tuple:
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
        return (str(path), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))

    def resolve(self, adapter_dir: str | os.PathLike) -> CatalogEntry:
        """Validate (raising AdapterError) and return the adapter's catalog entry."""
        path = Path(adapter_dir).expanduser().resolve()
        stamp = self._stamp(path)
        with self._lock:
            cached = self._by_stamp.get(stamp)
        if cached is not None:
            return cached
        info = inspect_adapter(path, self._shape, max_rank=self._max_rank)
        with self._lock:
            lora_id = self._by_digest.setdefault(info.digest, len(self._by_digest) + 1)
            entry = CatalogEntry(info=info, lora_int_id=lora_id)
            self._by_stamp[stamp] = entry
        return entry
