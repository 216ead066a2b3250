"""A fleet like a real one: tenants with keys and limits, thousands of adapters uploaded through the registry API.

Adapters are LoRA (all seven projections of every layer) and DiReFT, written in the model's dtype. Random weights
cost the run nothing to compute with but a lot to store (a rank-16 LoRA of Llama-3.1-8B is 84 MB: 4,096 of them
would be 344 GB), so the fleet's adapters share `distinct_weights` weight files per method and differ in their
config (a `preft_bench_copy` number): each is its own content digest, so the registry, the gateway and the
engine's tiers (S3 → disk → host → GPU slot) treat every one as a separate adapter, and the engine fetches each
from S3 on its first use. The cold-start adapters have weights of their own, and so have the two broken ones:
published like the others, then their weight blob deleted from S3 (`broken-missing`) or overwritten with other
bytes (`broken-corrupt`), which the engine finds only when it first pages them in.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.platform.model import BenchModel
from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import AlreadyExists
from preft.devtools.tiny import build_direft, build_lora
from preft.registry.blobstore import BlobStore
from preft.registry.client import LocalFile, RegistryClient

UPLOAD_THREADS = 8


@dataclass(frozen=True)
class FleetSpec:
    tenants: int = 64
    lora: int = 2048  # LoRA adapters (rank lora_rank, all seven projections)
    direft: int = 2048  # DiReFT adapters (rank direft_rank, on direft_layers layers spread over the depth)
    lora_rank: int = 16
    direft_rank: int = 8
    direft_layers: int = 4
    distinct_weights: int = 16  # weight files per method the fleet's adapters share
    cold: int = 50  # LoRA adapters with weights of their own, for the cold-start measurement


BROKEN = ("missing", "corrupt")  # how each broken adapter's weight blob is broken, in S3, after its upload


@dataclass(frozen=True)
class Target:
    """One adapter a load user may call: the tenant's key and the adapter's name."""

    api_key: str
    model: str
    tenant: str


@dataclass
class Fleet:
    """What the load and the cold-start measurement need: keys and adapters by kind; written as fleet.json."""

    base_model: str
    keys: list[str]
    lora: list[Target]
    direft: list[Target]
    cold: list[Target]
    lora_dirs: Path  # one directory per LoRA adapter, named as the model: `vllm serve`'s resolver reads it
    broken: list[Target] = field(default_factory=list)  # published, their weight blob then missing or corrupt

    def save(self, path: Path) -> None:
        data = asdict(self)
        data["lora_dirs"] = str(self.lora_dirs)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # (API keys)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)

    @classmethod
    def load(cls, path: Path) -> Fleet:
        data = json.loads(path.read_text())
        kinds = {k: [Target(**t) for t in data.get(k, [])] for k in ("lora", "direft", "cold", "broken")}
        return cls(data["base_model"], data["keys"], **kinds, lora_dirs=Path(data["lora_dirs"]))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class _Hashes:
    """sha256 of files by inode: the fleet's weight files are hard links of a few, each hashed once."""

    def __init__(self) -> None:
        self._by_inode: dict[tuple[int, int], str] = {}

    def local_file(self, path: Path) -> LocalFile:
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        if key not in self._by_inode:
            self._by_inode[key] = _sha256(path)
        return LocalFile(path, self._by_inode[key], st.st_size)


def build_adapters(model: BenchModel, spec: FleetSpec, root: Path) -> dict[str, list[Path]]:
    """Adapter directories by kind (lora, direft, cold), made once under root and reused by later runs."""
    weights = root / "weights"
    step = max(1, model.num_layers // spec.direft_layers)
    layers = tuple(range(0, model.num_layers, step))[: spec.direft_layers]

    def shared(kind: str, k: int) -> Path:
        src = weights / f"{kind}-{k}"
        if not (src / "adapter_model.safetensors").exists():
            if kind == "lora":
                build_lora(src, model.path, rank=spec.lora_rank, alpha=2.0 * spec.lora_rank, seed=k, dtype=model.dtype)
            else:
                build_direft(src, model.path, rank=spec.direft_rank, layers=layers, seed=k, dtype=model.dtype)
        return src

    def copies(kind: str, n: int, config_name: str, own_weights: bool) -> list[Path]:
        out = []
        for i in range(n):
            d = root / "adapters" / f"{kind}-{i}"
            if not (d / config_name).exists():
                src = shared(
                    kind if kind != "cold" else "lora", (1000 + i) if own_weights else i % spec.distinct_weights
                )
                d.mkdir(parents=True, exist_ok=True)
                weights_file = d / "adapter_model.safetensors"
                if not weights_file.exists():
                    os.link(src / "adapter_model.safetensors", weights_file)
                config = json.loads((src / config_name).read_text())
                # base_model_name_or_path: what `vllm serve`'s filesystem resolver matches against its model path
                config.update(preft_bench_copy=i, base_model_name_or_path=str(model.path))
                (d / config_name).write_text(json.dumps(config))
            out.append(d)
        return out

    return {
        "lora": copies("lora", spec.lora, "adapter_config.json", False),
        "direft": copies("direft", spec.direft, "preft_config.json", False),
        "cold": copies("cold", spec.cold, "adapter_config.json", True),
        "broken": [
            build_direft(root / "adapters" / f"broken-{how}", model.path, rank=spec.direft_rank, layers=layers,
                         seed=3000 + i, dtype=model.dtype)
            for i, how in enumerate(BROKEN)
        ],
    }  # fmt: skip


def create(
    client: RegistryClient, s3: Any, bucket: str, model: BenchModel, base_model: str, spec: FleetSpec, root: Path
) -> Fleet:
    """Tenants (limits far above the load), one key each, and every adapter uploaded and published as `prefill`;
    then the broken adapters' weight blobs deleted or overwritten through `s3` (a boto3 client of the stack's S3)."""
    dirs = build_adapters(model, spec, root)
    limits = pb.TenantLimits(requests_per_min=10_000_000, tokens_per_min=2_000_000_000)
    tenants = [f"bench-{t:02d}" for t in range(spec.tenants)]
    keys = []
    for tenant in tenants:
        try:
            client.call("CreateTenant", pb.CreateTenantRequest(id=tenant, limits=limits))
        except AlreadyExists:
            client.call("SetTenantLimits", pb.SetTenantLimitsRequest(id=tenant, limits=limits))
        keys.append(client.call("IssueKey", pb.IssueKeyRequest(tenant=tenant, label="platform bench")).secret)
    hashes = _Hashes()

    def upload(item: tuple[int, Path]) -> Target:
        i, d = item
        files = [hashes.local_file(p) for p in sorted(d.iterdir()) if p.is_file()]
        tenant = i % spec.tenants
        client.upload_adapter(
            files, tenant=tenants[tenant], name=d.name, mode=apb.POSITION_MODE_PREFILL, uploader="platform bench"
        )
        return Target(keys[tenant], d.name, tenants[tenant])

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        targets = {}
        for kind, paths in dirs.items():
            # the adapters with the shared weight files first (each its own file), so that no two threads send
            # one blob at once; the others then find every blob in the registry
            first = len(paths) if kind in ("cold", "broken") else spec.distinct_weights
            targets[kind] = list(pool.map(upload, enumerate(paths[:first])))
            targets[kind] += list(pool.map(upload, enumerate(paths[first:], start=first)))
    for how, d in zip(BROKEN, dirs["broken"], strict=True):
        key = BlobStore.key(hashes.local_file(d / "adapter_model.safetensors").sha256)
        if how == "missing":
            s3.delete_object(Bucket=bucket, Key=key)
        else:  # the same size, other bytes: only the digest check can tell
            s3.put_object(Bucket=bucket, Key=key, Body=bytes((d / "adapter_model.safetensors").stat().st_size))
    return Fleet(base_model, keys, **targets, lora_dirs=root / "adapters")
