"""The gateway's async face of the registry (gRPC, `grpc.aio`): the calls a request path needs, and those of tenants
managing their own adapters (`preft.gateway.manage.adapters`).

Statuses become domain errors as in the blocking client (`preft.registry.client.as_domain_error`). NotFound and
InvalidArgument pass through (the resolver turns them into 404s), and for management calls also the registry's
conflicts, quotas and refusals; every other failure (transport, deadline, a
refused admin token) reaches the caller as a plain "registry unavailable" 503, with the detail kept as the
error's cause for the log, never in the answer (it names internal addresses). The channel retries connecting
quickly (100 ms, at most 1 s apart), so a registry that comes back is used again within a second.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.api.v1 import registry_pb2_grpc
from preft.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PreftError,
    ResourceExhausted,
    Unavailable,
)
from preft.registry.client import CHUNK_BYTES, as_domain_error

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
]
# The registry's refusals a tenant managing its adapters is told as they are (the request path: not found, invalid)
REQUEST_ERRORS: tuple[type[PreftError], ...] = (NotFound, InvalidArgument)
MANAGEMENT_ERRORS = (*REQUEST_ERRORS, AlreadyExists, FailedPrecondition, PermissionDenied, ResourceExhausted)


@dataclass(frozen=True)
class BlobUpload:
    """A file to upload as a blob: its name in the adapter, its digest and size, and its bytes (`source`: async
    `seek` and `read`, as Starlette's UploadFile)."""

    path: str
    sha256: str
    size_bytes: int
    source: Any

    async def chunks(self) -> AsyncIterator[pb.UploadBlobChunk]:
        await self.source.seek(0)
        data = await self.source.read(CHUNK_BYTES)
        yield pb.UploadBlobChunk(sha256=self.sha256, size_bytes=self.size_bytes, data=data)
        while data := await self.source.read(CHUNK_BYTES):
            yield pb.UploadBlobChunk(data=data)


class AsyncRegistry:
    """Owns one gRPC channel to the registry; each method is one RPC under `timeout_s`, sent with its registry token."""

    def __init__(self, target: str, token: str, *, timeout_s: float, upload_timeout_s: float = 600.0) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = registry_pb2_grpc.RegistryStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._timeout_s = timeout_s
        self._upload_timeout_s = upload_timeout_s

    async def close(self) -> None:
        await self.channel.close()

    async def _call(
        self,
        rpc: str,
        request: Any,
        *,
        passthrough: tuple[type[PreftError], ...] = REQUEST_ERRORS,
        timeout_s: float | None = None,
    ) -> Any:
        """One RPC (`request`: a message, or an async iterator of them for a client stream); the registry's refusals
        of the `passthrough` kinds are raised as they are, anything else as RegistryUnavailable."""
        try:
            return await getattr(self._stub, rpc)(
                request, metadata=self._metadata, timeout=timeout_s or self._timeout_s
            )
        except grpc.RpcError as e:
            error = as_domain_error(e)
        if isinstance(error, passthrough):
            raise error
        if not isinstance(error, Unavailable):
            # Not an outage: a wrong or too narrow token, or a registry bug. Say so loudly; the caller only sees a 503.
            log.error("registry %s refused the gateway: %s", rpc, error.message)
        raise RegistryUnavailable() from error

    async def resolve(self, tenant: str, ref: str) -> apb.AdapterManifest:
        """The manifest `ref` names as `tenant` sees it; NotFound also for adapters the tenant may not use."""
        return await self._call("Resolve", pb.ResolveRequest(tenant=tenant, ref=ref))

    async def list_adapters(self, tenant: str) -> Sequence[pb.Adapter]:
        """Adapters the tenant owns or that are shared with it."""
        return (await self._call("ListAdapters", pb.ListAdaptersRequest(tenant=tenant))).adapters

    async def record_use(self, tenant: str, name: str, version: int, weight: float) -> None:
        await self._call("RecordUse", pb.RecordUseRequest(tenant=tenant, name=name, version=version, weight=weight))

    async def manage(self, rpc: str, request: Any) -> Any:
        """A call for a tenant managing its adapters: the registry's refusals (not found, invalid, conflicts, quotas)
        pass through as they are."""
        return await self._call(rpc, request, passthrough=MANAGEMENT_ERRORS)

    async def publish(
        self, tenant: str, name: str, blobs: Sequence[BlobUpload], *, mode: int, alias: str, uploader: str
    ) -> pb.PublishResponse:
        """Upload the files (every one: asking which blobs exist would tell a tenant about others' files), then publish
        them as the next version of tenant/name (validated by the registry)."""
        for blob in {b.sha256: b for b in blobs}.values():
            await self._call(
                "UploadBlob", blob.chunks(), passthrough=MANAGEMENT_ERRORS, timeout_s=self._upload_timeout_s
            )
        request = pb.PublishRequest(
            tenant=tenant,
            name=name,
            files=[apb.AdapterFile(path=b.path, sha256=b.sha256, size_bytes=b.size_bytes) for b in blobs],
            default_mode=mode,  # type: ignore[arg-type]
            alias=alias,
            uploader=uploader,
        )
        return await self._call(
            "Publish", request, passthrough=MANAGEMENT_ERRORS, timeout_s=max(self._upload_timeout_s, self._timeout_s)
        )

    async def check(self) -> None:
        """Raise Unavailable unless the registry answers an authenticated call (so a wrong token shows too)."""
        await self._call("ListBaseModels", pb.ListBaseModelsRequest())


class RegistryUnavailable(Unavailable):
    def __init__(self) -> None:
        super().__init__("the adapter registry is unavailable; retry later")
