"""Hosts on one machine: one Linux network namespace per host, each joined to a bridge by a veth link, with its own
address in a private /24. The mechanics only (iproute2's `ip`); what runs on which host is `stack.testbed`'s.

Everything made for testbed `ID` is named `preft-ID-*`: namespace `preft-ID-HOST`, the link's end outside it (what a
cut takes down) likewise, the bridge `preft-ID-br`. So `sweep(ID)` finds it all again from the names alone, after
the process that made it was killed. Inside a namespace the link is `eth0`; the bridge holds the subnet's first
address, so this machine's own processes (a supervisor, a test, curl) reach every host. There is no route out.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from preft.common.loopback import ServerError

PREFIX = "preft-"
_NAME = re.compile(r"^[a-z0-9]{1,4}$")  # `preft-ID-HOST` must fit an interface name's 15 bytes
DEFAULT_POOL = "10.77.0.0/16"  # where free_subnet() looks for a /24 (private, rarely routed)


class NetnsError(ServerError):
    """A namespace, link or bridge could not be made or changed."""


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS`; its stdout, or NetnsError with its stderr."""
    binary = shutil.which("ip")
    if binary is None:
        raise NetnsError("`ip` not found on PATH; install it with: apt-get install -y iproute2")
    done = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done.stdout


def prefix_of(testbed_id: str) -> str:
    if not _NAME.match(testbed_id):
        raise ValueError(f"a testbed id is 1-4 lowercase letters or digits, not {testbed_id!r}")
    return f"{PREFIX}{testbed_id}-"


def new_id() -> str:
    """A random testbed id (4 letters or digits)."""
    return "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(4))


def namespaces() -> list[str]:
    """Names of this machine's named network namespaces (`ip netns list`)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def links() -> list[str]:
    """Names of the interfaces in this process's namespace."""
    return [link["ifname"] for link in json.loads(ip("-j", "link", "show") or "[]")]


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the processes in `namespace` (none once it is gone)."""
    out = ip("netns", "pids", namespace, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace(namespace: str, sig: int = signal.SIGKILL, *, timeout_s: float = 10.0) -> list[int]:
    """Send `sig` to every process in `namespace`; with SIGKILL, repeat until none is left (a dying parent may still
    fork) or `timeout_s` passes. Returns the pids signalled."""
    signalled: list[int] = []
    deadline = time.monotonic() + timeout_s
    while pids := namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        signalled += [p for p in pids if p not in signalled]
        if sig != signal.SIGKILL or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return signalled


def sweep(testbed_id: str) -> list[str]:
    """Remove everything made for `testbed_id`: kill every process in its namespaces, delete its links (the bridge
    too) and its namespaces. Idempotent; returns what it removed."""
    prefix = prefix_of(testbed_id)
    ours = [n for n in namespaces() if n.startswith(prefix)]
    for namespace in ours:
        kill_namespace(namespace)
    removed = []
    for link in links():
        if link.startswith(prefix):
            ip("link", "del", link, check=False)  # (a veth's peer goes with it)
            removed.append(link)
    for namespace in ours:
        ip("netns", "del", namespace, check=False)
        removed.append(namespace)
    return removed


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    used = []
    for link in json.loads(ip("-j", "-4", "addr", "show") or "[]"):
        for a in link.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(ip("-j", "-4", "route", "show") or "[]"):
        if route.get("dst") not in (None, "default"):
            used.append(ipaddress.ip_network(route["dst"], strict=False))
    return used


def free_subnet(pool: str = DEFAULT_POOL) -> str:
    """A /24 of `pool` that overlaps no address or route of this machine (another testbed's bridge included)."""
    used = _networks_in_use()
    for candidate in ipaddress.ip_network(pool).subnets(new_prefix=24):
        if not any(candidate.overlaps(u) for u in used):
            return str(candidate)
    raise NetnsError(f"no free /24 left in {pool}")


@dataclass(frozen=True)
class Host:
    """One host of a testbed: its namespace, the name of its link's outer end, its address."""

    name: str
    namespace: str
    link: str
    address: str

    def launcher(self) -> list[str]:
        """The argv prefix that runs a command on this host (`ip netns exec` execs it in place: same pid)."""
        return ["ip", "netns", "exec", self.namespace]


class Network:
    """Owns one testbed's bridge and its hosts' namespaces and links: creates them, cuts and restores a host's link,
    signals a host's processes, and removes it all (`sweep`)."""

    def __init__(self, testbed_id: str, subnet: str, host_names: Sequence[str]) -> None:
        self.testbed_id = testbed_id
        self.prefix = prefix_of(testbed_id)
        self.subnet = ipaddress.ip_network(subnet)
        if self.subnet.num_addresses < 10 + len(host_names) + 1:
            raise ValueError(f"{subnet} is too small for {len(host_names)} hosts (they start at its 10th address)")
        for name in host_names:
            if not _NAME.match(name) or name == "br":
                raise ValueError(f"a host name is 1-4 lowercase letters or digits (not 'br'), not {name!r}")
        self.bridge = f"{self.prefix}br"
        self.bridge_address = str(self.subnet[1])
        self.hosts = {
            name: Host(name, f"{self.prefix}{name}", f"{self.prefix}{name}", str(self.subnet[10 + i]))
            for i, name in enumerate(host_names)
        }

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise ValueError(
                f"no host {name!r} in testbed {self.testbed_id} (hosts: {', '.join(self.hosts)})"
            ) from None

    def create(self) -> None:
        """Make the bridge, then each host's namespace, link and address. Refuses where leftovers of the same id are
        (`sweep` them first) or the subnet is in use; on failure removes what it made."""
        leftovers = [n for n in (*namespaces(), *links()) if n.startswith(self.prefix)]
        if leftovers:
            raise NetnsError(f"testbed {self.testbed_id} has leftovers ({', '.join(leftovers)}): sweep them first")
        taken = [u for u in _networks_in_use() if self.subnet.overlaps(u)]
        if taken:
            raise NetnsError(f"{self.subnet} overlaps {', '.join(map(str, taken))}, in use on this machine")
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for host in self.hosts.values():
                self._add_host(host)
        except BaseException:
            sweep(self.testbed_id)
            raise

    def _add_host(self, host: Host) -> None:
        ip("netns", "add", host.namespace)
        ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        ip("link", "set", host.link, "master", self.bridge, "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")

    def cut(self, name: str) -> None:
        """Take the host's link down: nothing reaches it or leaves it, its processes keep running (a pulled cable)."""
        ip("link", "set", self.host(name).link, "down")

    def restore(self, name: str) -> None:
        ip("link", "set", self.host(name).link, "up")

    def link_up(self, name: str) -> bool:
        (link,) = json.loads(ip("-j", "link", "show", self.host(name).link))
        return "UP" in link.get("flags", [])

    def pids(self, name: str) -> list[int]:
        return namespace_pids(self.host(name).namespace)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process on the host (SIGKILL: a crash of all of them at once); the pids signalled."""
        return kill_namespace(self.host(name).namespace, sig)

    def destroy(self) -> list[str]:
        return sweep(self.testbed_id)
