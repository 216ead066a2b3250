"""What the local stack's processes listen on: every socket on loopback, and no tenant id on a port another host
could reach (issue 53, item 6: Ray's metrics port served `ray_preft_*{tenant=...}` on all interfaces)."""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

import httpx
import psutil

from preft.stack.local import BASE_MODEL_ID, DEMO_TENANT
from preft.stack.ray_local import is_loopback

TENANT_LABEL = f'tenant="{DEMO_TENANT}"'
# The one Ray socket no knob moves off all interfaces in Ray 2.60: each Serve replica's inter-deployment gRPC server,
# bound to "[::]:0" (ray/serve/_private/replica.py, `_on_initialized`). It answers only calls carrying the cluster's
# Ray token (token auth, on by default in 2.60) and speaks gRPC, not HTTP: the scan for tenant ids still covers it.
SERVE_REPLICA = "ray::ServeReplica"


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    pid: int
    process: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port} ({self.process}, pid {self.pid})"


def listeners(root_pid: int) -> list[Listener]:
    """Every listening TCP socket of a process and its descendants (Ray's servers are the stack's children)."""
    root = psutil.Process(root_pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.name() if not proc.cmdline() else " ".join(proc.cmdline())[:60]
            conns = proc.net_connections(kind="inet")
        except psutil.Error:  # (a worker that exited in between)
            continue
        found += [Listener(c.laddr.ip, c.laddr.port, proc.pid, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return sorted(set(found), key=lambda s: (s.host, s.port))


def outside_addresses() -> list[str]:
    """This host's addresses that another host could connect to (what a wildcard bind also answers on)."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(a.address)
    ]


def reachable_from_outside(listener: Listener) -> list[str]:
    """The outside addresses on which `listener` answers: all of them for a wildcard bind, its own if not loopback."""
    if is_loopback(listener.host):
        return []
    if ipaddress.ip_address(listener.host.split("%", 1)[0]).is_unspecified:
        return outside_addresses()
    return [listener.host]


def metrics_text(host: str, port: int) -> str:
    """GET /metrics on host:port, "" where nothing answers it over HTTP."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    url_host = f"[{ip}]" if ip.version == 6 else str(ip)
    try:
        answer = httpx.get(f"http://{url_host}:{port}/metrics", timeout=2)
    except (httpx.HTTPError, OSError):
        return ""
    return answer.text if answer.status_code == 200 else ""


def test_no_port_reachable_from_outside_serves_a_tenant_id_and_every_ray_socket_is_loopback(stack):
    headers = {"Authorization": f"Bearer {stack.demo_key}"}
    body = {"model": BASE_MODEL_ID, "prompt": "the tenant's request", "max_tokens": 2, "temperature": 0}
    # (the session's stack may just have had Redis restarted by the fault tests: a pooled connection that died with it
    # answers one 503 before it is replaced, so the request is tried until it is answered)
    deadline = time.monotonic() + 60
    while (
        answer := httpx.post(f"{stack.base_url}/completions", json=body, headers=headers, timeout=120)
    ).status_code == 503:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.5)
    answer.raise_for_status()

    # The control: the tenant's id does reach Ray's metrics port (the replica's copy every 5 s, Ray's export every
    # 10 s), so a port that exposed it would be found below. Serve's port serves it too: not the one we look for.
    ray_ports = set()
    deadline = time.monotonic() + 90
    while True:
        found = listeners(stack.info.pid)
        ray_ports = {
            s.port
            for s in found
            if s.port != stack.info.ports.serve and TENANT_LABEL in metrics_text("127.0.0.1", s.port)
        }
        if ray_ports or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert ray_ports, "no port of the stack served the tenant's Ray metrics: the scan below would prove nothing"

    exposed = [
        f"{s} answers /metrics with {TENANT_LABEL} on {addr}"
        for s in found
        for addr in reachable_from_outside(s)
        if TENANT_LABEL in metrics_text(addr, s.port)
    ]
    assert not exposed, "\n".join(exposed)
    beyond = [s for s in found if not is_loopback(s.host)]
    replicas = [s for s in beyond if s.process.startswith(SERVE_REPLICA)]
    assert len(replicas) == len({s.pid for s in replicas}), "a Serve replica listens on more than its gRPC port"
    not_loopback = [str(s) for s in beyond if s not in replicas]
    assert not not_loopback, "listening beyond loopback:\n" + "\n".join(not_loopback)
