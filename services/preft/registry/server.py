"""Run the registry: `python -m preft.registry.server` (settings from PREFT_REGISTRY__* variables)."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from preft.api.v1 import registry_pb2_grpc
from preft.common.settings import RegistrySettings
from preft.registry.blobstore import BlobStore
from preft.registry.grpc_service import GuardInterceptor, RegistryServicer
from preft.registry.index import RedisIndex
from preft.registry.metrics import MetricsInterceptor, serve_metrics
from preft.registry.roles import TokenRoles
from preft.registry.service import RegistryService

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def build_service(settings: RegistrySettings) -> RegistryService:
    blobs = BlobStore(settings.s3)
    blobs.ensure_bucket()
    return RegistryService(settings, index=RedisIndex(settings.redis), blobs=blobs)


def build_server(settings: RegistrySettings, service: RegistryService | None = None) -> tuple[grpc.Server, int]:
    """A started gRPC server (registry + standard health service) and the port it bound."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.worker_threads, thread_name_prefix="registry"),
        # (the metrics interceptor first: outermost, it sees the status the guard answers too)
        interceptors=[MetricsInterceptor(), GuardInterceptor(TokenRoles.from_settings(settings))],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(service or build_service(settings)), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("preft.api.v1.Registry", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(settings.listen_address)
    if port == 0:
        raise RuntimeError(f"cannot bind {settings.listen_address}")
    server.start()
    return server, port


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = RegistrySettings()
    service = build_service(settings)
    server, port = build_server(settings, service)
    log.info("registry listening on %s (port %d)", settings.listen_address, port)
    if settings.metrics_address:
        listener = serve_metrics(settings.metrics_address, service.index)
        log.info("registry metrics on %s (port %d)", settings.metrics_address, listener.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("registry draining")
    server.stop(grace=10).wait()


if __name__ == "__main__":
    main()
