"""Turning a local adapter directory into what the gateway sends an engine replica (AdapterSpec) and what the
registry would have put in S3 (one blob per file); the engine side of a pager for tests."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from preft.adapters import AdapterInfo, ModelShape, adapter_digest, file_sha256, inspect_adapter
from preft.common.engine_contract import AdapterFileSpec, AdapterSpec
from preft.common.errors import NotFound, Unavailable
from preft.engine.paging.pager import Pager
from preft.engine.service import EngineService


def spec_for(adapter_dir: Path, ref: str = "t/adapter@v1", *, method: str | None = None) -> AdapterSpec:
    files = sorted(p for p in Path(adapter_dir).iterdir() if p.is_file())
    detected = "direft" if (Path(adapter_dir) / "preft_config.json").is_file() else "lora"
    return AdapterSpec(
        digest=adapter_digest(adapter_dir),
        method=method or detected,
        files=[AdapterFileSpec(path=p.name, sha256=file_sha256(p), size_bytes=p.stat().st_size) for p in files],
        ref=ref,
    )


def upload(blobs, adapter_dir: Path) -> AdapterSpec:
    """Put every file of the directory into a BlobStore; return its spec."""
    spec = spec_for(adapter_dir)
    for f in spec.files:
        data = (Path(adapter_dir) / f.path).read_bytes()
        blobs.put(f.sha256, len(data), [data])
    return spec


class CountingBlobs:
    """Wraps a blob source: counts downloads per digest and can hold them until released (single-flight tests)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self._lock = threading.Lock()

    def download(self, digest: str, dest: Path) -> None:
        with self._lock:
            self.calls[digest] = self.calls.get(digest, 0) + 1
        self.started.set()
        self.gate.wait(timeout=30)
        self.inner.download(digest, dest)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class RecordingHost:
    """The engine side of the pager: validates like the real engine and records add/remove calls."""

    def __init__(self, model_dir: Path) -> None:
        self.shape = ModelShape.from_model_dir(model_dir)
        self.loaded: set[str] = set()
        self.prepared: list[Path] = []  # (prepare_lora's calls: add_lora's reads ahead)
        self.calls: list[tuple[str, str]] = []

    @property
    def adds(self) -> int:
        return sum(1 for kind, _ in self.calls if kind == "add")

    async def prepare_lora(self, adapter_dir: Path) -> None:
        self.prepared.append(adapter_dir)

    async def add_lora(self, adapter_dir: Path) -> AdapterInfo:
        info = inspect_adapter(adapter_dir, self.shape, max_rank=16)
        self.calls.append(("add", info.digest))
        self.loaded.add(info.digest)
        return info

    async def remove_lora(self, digest: str) -> None:
        self.calls.append(("remove", digest))
        self.loaded.discard(digest)


def make_pager(**options) -> Pager:
    """A pager with test-sized tiers (2 adapters in host memory, 1 GB of disk); `options` set or change any option."""
    return Pager(**{"disk_max_bytes": 10**9, "host_max_adapters": 2, "download_timeout_s": 30.0, **options})


class MemoryBlobs:
    """Blobs held in memory; `download` checks the sha256 like BlobStore.download."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add_dir(self, adapter_dir: Path) -> None:
        for p in adapter_dir.iterdir():
            self.data[hashlib.sha256(p.read_bytes()).hexdigest()] = p.read_bytes()

    def download(self, digest: str, dest: Path) -> None:
        if digest not in self.data:
            raise NotFound(f"blob {digest[:12]} is not in the blob store")
        body = self.data[digest]
        if hashlib.sha256(body).hexdigest() != digest:
            raise Unavailable(f"blob {digest[:12]} is corrupt")
        dest.write_bytes(body)


def service_over(engine, adapter_dirs, disk_dir: Path, **options) -> EngineService:
    """An EngineService over `engine`, its pager fed from MemoryBlobs holding `adapter_dirs` (make_pager's tiers;
    `options` go to the pager, `max_live_adapters` to the service)."""
    blobs = MemoryBlobs()
    for d in adapter_dirs:
        blobs.add_dir(d)
    service_options = {k: options.pop(k) for k in ("max_live_adapters",) if k in options}
    pager = make_pager(host=engine, blobs=blobs, disk_dir=disk_dir, **options)
    return EngineService(engine=engine, pager=pager, **service_options)
