"""A single-node Ray whose every socket listens on loopback: the local stack's, the tests' and the benchmarks'.

On Linux, Ray 2.60 takes the node's address from the route to the outside and binds its servers to all interfaces
(GCS, raylet, object manager, core workers' gRPC: `::`; the metrics export port, the autoscaler's and the
dashboard head's metrics ports: `0.0.0.0`; the dashboard agent and runtime-env agent: the node's address). Each of
them binds loopback instead only where the node's address *is* loopback, and `ray.init(_node_ip_address=...)` turns
loopback back into the outside address (`ray._private.services.resolve_ip_for_localhost`) unless Ray believes it
runs single-node, its default on macOS and Windows. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` says so on Linux too; it
is read once, when `ray._private.ray_constants` is imported, and by every process Ray starts (they inherit it).

The Ray internals this touches (tested with ray 2.60.0): `ray._private.ray_constants.ENABLE_RAY_CLUSTER` and the
environment variable above. `start_local_ray` checks the outcome (the node's address) rather than trusting them.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from typing import Any

from preft.common.loopback import LOOPBACK

SINGLE_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (`::ffff:127.0.0.1`, what a dual-stack socket reports)."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init(**init_kwargs)` on a new single-node cluster whose sockets all listen on 127.0.0.1.

    Raises RuntimeError if Ray still chose another address for the node (a Ray whose knobs changed).
    """
    os.environ.update(SINGLE_NODE_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray imported before the variable was set: its reading of it is already made
        constants.ENABLE_RAY_CLUSTER = False

    import ray

    # address="local": a new cluster always. Without an address, ray.init joins the cluster named in
    # /tmp/ray/ray_current_cluster, which every `ray start` writes (a testbed's head, a user's own cluster) and
    # which outlives it.
    ray.init(address="local", _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **init_kwargs)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(f"Ray took {node_ip} for the local node, not loopback: its servers would listen on it")
