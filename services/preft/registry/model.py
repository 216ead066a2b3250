"""The registry's records, as plain values (the gRPC layer converts them to and from proto messages)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from preft.adapters import AdapterMethod
from preft.common.modes import PositionMode

__all__ = [
    "AdapterMethod",
    "AdapterSummary",
    "ApiKeyRecord",
    "BaseModelRecord",
    "FileEntry",
    "GcReport",
    "HotEntry",
    "Manifest",
    "PositionMode",
    "ShareOffer",
    "TenantLimits",
    "TenantRecord",
]


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits; the gateway enforces the rates and the monthly quota, the registry the storage.

    `tokens_per_month` (prompt + generated tokens per UTC calendar month) is 0 for no quota; None only in a
    request, where it means "not given" (no quota on create, keep the current one on a change).
    """

    requests_per_min: int
    tokens_per_min: int
    max_adapters: int
    max_bytes: int
    tokens_per_month: int | None = None


@dataclass(frozen=True)
class TenantRecord:
    """A tenant with its limits and what it owns."""

    id: str
    disabled: bool
    limits: TenantLimits
    adapter_count: int
    bytes_used: int
    created_unix_ms: int


@dataclass(frozen=True)
class ApiKeyRecord:
    """An API key's public record; the secret itself is never stored."""

    id: str
    tenant: str
    label: str
    created_unix_ms: int
    expires_unix_ms: int = 0
    revoked_unix_ms: int = 0


@dataclass(frozen=True)
class BaseModelRecord:
    """A base model adapters are validated against."""

    id: str
    architecture_digest: str
    config_json: str
    created_unix_ms: int


@dataclass(frozen=True)
class FileEntry:
    """One file of a version: its name, blob digest and size."""

    path: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Manifest:
    """One immutable adapter version."""

    tenant: str
    name: str
    version: int
    digest: str
    method: AdapterMethod
    default_mode: PositionMode
    rank: int
    target_modules: tuple[str, ...]
    layers: tuple[int, ...]
    base_model: str
    base_model_digest: str
    size_bytes: int
    files: tuple[FileEntry, ...]
    created_unix_ms: int
    uploader: str

    def to_json(self) -> str:
        """Stored form (the version number is the Redis hash field, so it is not repeated here)."""
        data = asdict(self)
        del data["tenant"], data["name"], data["version"]
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, tenant: str, name: str, version: int, text: str | bytes) -> Manifest:
        data: dict[str, Any] = json.loads(text)
        return cls(
            tenant=tenant,
            name=name,
            version=version,
            digest=data["digest"],
            method=AdapterMethod(data["method"]),
            default_mode=PositionMode(data["default_mode"]),
            rank=data["rank"],
            target_modules=tuple(data["target_modules"]),
            layers=tuple(data["layers"]),
            base_model=data["base_model"],
            base_model_digest=data["base_model_digest"],
            size_bytes=data["size_bytes"],
            files=tuple(FileEntry(**f) for f in data["files"]),
            created_unix_ms=data["created_unix_ms"],
            uploader=data["uploader"],
        )

    @property
    def ref(self) -> str:
        return f"{self.tenant}/{self.name}@v{self.version}"


@dataclass(frozen=True)
class AdapterSummary:
    """An adapter: its aliases, sharing (accepted shares, pending offers), and latest version."""

    tenant: str
    name: str
    aliases: dict[str, int]
    shared_with: tuple[str, ...]
    version_count: int
    latest: Manifest
    offered_to: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShareOffer:
    """An adapter offered to a tenant or, once accepted, shared with it; `adapter` is None once declined or left."""

    owner: str
    name: str
    accepted: bool
    adapter: AdapterSummary | None = None


@dataclass(frozen=True)
class HotEntry:
    """A version and its decayed use count as of now."""

    manifest: Manifest
    score: float


@dataclass
class GcReport:
    """What a garbage collection pass removed (or would remove, in a dry run)."""

    deleted_blobs: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    aborted_uploads: int = 0
    kept_blobs: int = 0
