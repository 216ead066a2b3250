"""The registry's Prometheus side: an interceptor that counts and times every RPC, the index's size read on scrape,
and the HTTP endpoint that serves them (`RegistrySettings.metrics_address`).

The interceptor sits outside `GuardInterceptor` (first in the server's list), so it sees the status every caller
got, UNAUTHENTICATED and the mapped domain errors included. The health service's RPCs (kubelet probes) are left out.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry

from preft.common import metrics
from preft.common.errors import PreftError
from preft.common.metrics_http import MetricsListener
from preft.common.metrics_http import serve_metrics as serve_process_metrics
from preft.registry.index import RedisIndex

log = logging.getLogger(__name__)

INDEX_KINDS = ("tenants", "adapters", "base_models", "blobs")


def method_name(full_method: str) -> str:
    """The RPC's own name ("/preft.api.v1.Registry/Resolve" -> "Resolve"): a label bounded by the proto."""
    return full_method.rsplit("/", 1)[-1]


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every registry RPC by method and status code (preft_registry_rpcs_total) and times it
    (preft_registry_rpc_duration_seconds); unary and client-streaming calls, the registry's two kinds."""

    def __init__(self, *, skip_prefixes: tuple[str, ...] = ("/grpc.health.",)) -> None:
        self._skip = skip_prefixes

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._skip):
            return handler
        method = method_name(handler_call_details.method)
        for kind in ("unary_unary", "stream_unary"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return getattr(grpc, f"{kind}_rpc_method_handler")(
                    _measured(behavior, method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


def _measured(behavior: Callable, method: str) -> Callable:
    def measured(request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            response = behavior(request, context)
            code = context.code() or grpc.StatusCode.OK  # (a handler may set a code without raising)
            return response
        except BaseException:
            # context.abort raises after setting the code; anything else reaches the caller as UNKNOWN
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        finally:
            metrics.REGISTRY_RPCS.labels(method, code.name).inc()
            metrics.REGISTRY_RPC_SECONDS.labels(method).observe(time.perf_counter() - started)

    return measured


class IndexEntries:
    """Reads the index's entry counts at most once per `max_age_s` (one Redis round trip serves every kind of one
    scrape); NaN while Redis cannot be read (the failure is counted in preft_store_errors_total)."""

    def __init__(self, index: RedisIndex, *, max_age_s: float = 1.0) -> None:
        self._index, self._max_age_s = index, max_age_s
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._counts: dict[str, float] = {}

    def get(self, kind: str) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= self._max_age_s:
                try:
                    self._counts = {k: float(v) for k, v in self._index.entry_counts().items()}
                except PreftError as e:
                    log.warning("the index's size could not be read for /metrics: %s", e.message)
                    self._counts = {}
                self._read_at = now
            return self._counts.get(kind, math.nan)

    def install(self) -> None:
        """Make preft_registry_index_entries read this index (the gauge is per process, so the last one wins)."""
        for kind in INDEX_KINDS:
            metrics.REGISTRY_INDEX_ENTRIES.labels(kind).set_function(lambda k=kind: self.get(k))


def serve_metrics(
    address: str, index: RedisIndex, *, registry: CollectorRegistry = REGISTRY, index_max_age_s: float = 1.0
) -> MetricsListener:
    """Serve the process's metrics (the index's size read from `index`, at most every `index_max_age_s`) at
    http://`address`/metrics ("host:port"; port 0 = any free one) from a daemon thread."""
    IndexEntries(index, max_age_s=index_max_age_s).install()
    return serve_process_metrics(address, registry=registry)
