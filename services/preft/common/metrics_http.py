"""A process's Prometheus endpoint on a listener of its own, apart from the port that serves clients.

A service's public port (the gateway's API, behind an Ingress; the registry's gRPC) never serves /metrics: what an
Ingress or a Service exposes to clients cannot then leak the metrics' labels (tenant ids), and the NetworkPolicy
admits Prometheus to the metrics port alone. prometheus_client's own threaded HTTP server serves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server


@dataclass(frozen=True)
class MetricsListener:
    """A running /metrics endpoint: the port it bound (the one asked for, or the free one port 0 got)."""

    port: int
    _server: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" ("[::1]:9101" for IPv6; an empty host binds every interface)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def serve_metrics(address: str, *, registry: CollectorRegistry = REGISTRY) -> MetricsListener:
    """Serve `registry` at http://`address`/metrics ("host:port"; port 0 = any free one) from a daemon thread."""
    host, port = split_address(address)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsListener(server.server_port, server)
