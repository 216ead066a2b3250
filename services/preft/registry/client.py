"""A blocking client for the registry: adds the admin token, turns statuses back into domain errors, and
uploads adapter directories (only the blobs the registry lacks, streamed in chunks)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import grpc

from preft.adapters import file_sha256
from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.api.v1 import registry_pb2_grpc
from preft.common.errors import ERRORS_BY_GRPC_CODE, InvalidArgument, PreftError, Unavailable

CHUNK_BYTES = 1024 * 1024
Progress = Callable[[int], None]  # called with bytes just sent


@dataclass(frozen=True)
class LocalFile:
    """A file of an adapter directory, hashed."""

    path: Path
    sha256: str
    size_bytes: int


def scan_adapter_dir(directory: Path) -> list[LocalFile]:
    """The regular files of an adapter directory with their digests (subdirectories are refused)."""
    if not directory.is_dir():
        raise InvalidArgument(f"{directory} is not a directory")
    entries = sorted(directory.iterdir())
    nested = [p.name for p in entries if p.is_dir()]
    if nested:
        raise InvalidArgument(f"{directory}: an adapter is a flat directory; remove the subdirectories {nested}")
    return [LocalFile(p, file_sha256(p), p.stat().st_size) for p in entries if p.is_file()]


class RegistryClient:
    """Calls registry RPCs by name: `client.call("ListTenants", pb.ListTenantsRequest())`."""

    def __init__(self, target: str, token: str, *, timeout_s: float = 10.0, upload_timeout_s: float = 3600.0) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)])
        self.stub = registry_pb2_grpc.RegistryStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.timeout_s = timeout_s
        self.upload_timeout_s = upload_timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, rpc: str, request: Any, *, timeout_s: float | None = None) -> Any:
        try:
            return getattr(self.stub, rpc)(request, metadata=self.metadata, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise as_domain_error(e) from None

    def resolve(self, tenant: str, ref: str) -> apb.AdapterManifest:
        return self.call("Resolve", pb.ResolveRequest(tenant=tenant, ref=ref))

    def token_usage(
        self, tenant: str, start: date | str, end: date | str, *, by_model: bool = False
    ) -> pb.GetTokenUsageResponse:
        """A tenant's metered use per UTC day (and model, `by_model`) from start to end, both included."""
        request = pb.GetTokenUsageRequest(
            tenant=tenant, start_date=str(start), end_date=str(end), group_by_model=by_model
        )
        return self.call("GetTokenUsage", request)

    def upload_blob(self, file: LocalFile, progress: Progress | None = None) -> None:
        def messages() -> Iterator[pb.UploadBlobChunk]:
            with file.path.open("rb") as f:
                data = f.read(CHUNK_BYTES)
                yield pb.UploadBlobChunk(sha256=file.sha256, size_bytes=file.size_bytes, data=data)
                while True:
                    if progress:
                        progress(len(data))
                    if not (data := f.read(CHUNK_BYTES)):
                        return
                    yield pb.UploadBlobChunk(data=data)

        try:
            self.stub.UploadBlob(messages(), metadata=self.metadata, timeout=self.upload_timeout_s)
        except grpc.RpcError as e:
            raise as_domain_error(e) from None

    def upload_adapter(
        self,
        files: list[LocalFile],
        *,
        tenant: str,
        name: str,
        mode: int = apb.POSITION_MODE_PREFILL,
        alias: str = "",
        base_model: str = "",
        uploader: str = "",
        progress: Progress | None = None,
    ) -> pb.PublishResponse:
        """Upload the blobs the registry lacks, then publish them as the next version of tenant/name."""
        missing = set(self.call("MissingBlobs", pb.MissingBlobsRequest(sha256=[f.sha256 for f in files])).sha256)
        for f in files:
            if f.sha256 in missing:
                self.upload_blob(f, progress)
                missing.discard(f.sha256)  # identical files in one directory go up once
            elif progress:
                progress(f.size_bytes)
        request = pb.PublishRequest(
            tenant=tenant,
            name=name,
            files=[apb.AdapterFile(path=f.path.name, sha256=f.sha256, size_bytes=f.size_bytes) for f in files],
            default_mode=mode,
            alias=alias,
            base_model=base_model,
            uploader=uploader or os.environ.get("USER", ""),
        )
        return self.call("Publish", request, timeout_s=max(self.timeout_s, 60.0))


def as_domain_error(e: grpc.RpcError) -> PreftError:
    """The domain error a gRPC status stands for (Unavailable for transport failures and timeouts)."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"registry unavailable: {details}")
    cls = ERRORS_BY_GRPC_CODE.get(code.name if code else "", PreftError)
    return cls(details)
