"""The gateway's async face of the registry (gRPC, `grpc.aio`): the few calls a request path needs.

Statuses become domain errors as in the blocking client (`preft.registry.client.as_domain_error`). NotFound and
InvalidArgument pass through (the resolver turns them into 404s); every other failure (transport, deadline, a
refused admin token) reaches the caller as a plain "registry unavailable" 503, with the detail kept as the
error's cause for the log, never in the answer (it names internal addresses). The channel retries connecting
quickly (100 ms, at most 1 s apart), so a registry that comes back is used again within a second.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.api.v1 import registry_pb2_grpc
from preft.common.errors import InvalidArgument, NotFound, Unavailable
from preft.registry.client import as_domain_error

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
]


class AsyncRegistry:
    """Owns one gRPC channel to the registry; each method is one RPC under `timeout_s`, sent with the admin token."""

    def __init__(self, target: str, token: str, *, timeout_s: float) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = registry_pb2_grpc.RegistryStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._timeout_s = timeout_s

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, rpc: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, rpc)(request, metadata=self._metadata, timeout=self._timeout_s)
        except grpc.RpcError as e:
            error = as_domain_error(e)
        if isinstance(error, NotFound | InvalidArgument):
            raise error
        if not isinstance(error, Unavailable):
            # Not an outage: a wrong admin token or a registry bug. Say so loudly; the caller only sees a 503.
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

    async def check(self) -> None:
        """Raise Unavailable unless the registry answers an authenticated call (so a wrong token shows too)."""
        await self._call("ListBaseModels", pb.ListBaseModelsRequest())


class RegistryUnavailable(Unavailable):
    def __init__(self) -> None:
        super().__init__("the adapter registry is unavailable; retry later")
