"""The testbed's network mechanics (`stack.netns`) on real namespaces: hosts reach each other and this machine over
the bridge, a cut link stops a host's traffic both ways until it is restored, and `sweep` leaves nothing of a
testbed id behind, processes included, from the names alone."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import pytest

from preft.stack import netns

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen()
while True:
    c, _ = s.accept(); c.sendall(b"hello from " + sys.argv[1].encode()); c.close()
"""
CLIENT = """
import socket, sys
print(socket.create_connection((sys.argv[1], 7000), timeout=2).recv(100).decode())
"""


def _fetch(address: str, timeout_s: float = 2.0) -> str:
    with socket.create_connection((address, 7000), timeout=timeout_s) as s:
        return s.recv(100).decode()


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _until(call, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def network():
    net = netns.Network(netns.new_id(), netns.free_subnet(), ["a", "b"])
    net.create()
    try:
        yield net
    finally:
        net.destroy()


def test_hosts_talk_over_the_bridge_and_a_cut_link_silences_one(network):
    a, b = network.host("a"), network.host("b")
    servers = [
        subprocess.Popen([*h.launcher(), sys.executable, "-c", SERVER, h.address], start_new_session=True)
        for h in (a, b)
    ]
    assert _until(lambda: _fetch(a.address)) == f"hello from {a.address}"  # (this machine, through the bridge)
    from_b = subprocess.run([*b.launcher(), sys.executable, "-c", CLIENT, a.address], capture_output=True, text=True)
    assert from_b.stdout.strip() == f"hello from {a.address}", from_b.stderr
    assert set(network.pids("a")) == {servers[0].pid} and network.link_up("a")

    network.cut("a")
    assert not network.link_up("a")
    with pytest.raises(OSError):
        _fetch(a.address, timeout_s=1.0)
    cut_off = subprocess.run([*b.launcher(), sys.executable, "-c", CLIENT, a.address], capture_output=True, text=True)
    assert cut_off.returncode != 0  # (b cannot reach a either)
    assert _fetch(b.address) == f"hello from {b.address}"  # (the other host is not affected)
    assert servers[0].poll() is None  # (a's process runs on)

    network.restore("a")
    assert _until(lambda: _fetch(a.address)) == f"hello from {a.address}"

    assert network.kill("a") == [servers[0].pid]
    assert servers[0].wait(timeout=5) == -9 and network.pids("a") == []
    for s in servers:
        with contextlib.suppress(ProcessLookupError):
            s.kill()
        s.wait()


def test_sweep_removes_a_testbed_from_its_id_alone(network):
    host = network.host("b")
    child = subprocess.Popen(  # (a process whose parent is not ours, as after the supervisor was killed)
        [*host.launcher(), "sh", "-c", "sleep 300 & wait"], start_new_session=True
    )
    _wait_for(lambda: len(network.pids("b")) == 2)
    prefix = f"preft-{network.testbed_id}-"
    removed = netns.sweep(network.testbed_id)
    assert child.wait(timeout=5) == -9
    assert {f"{prefix}a", f"{prefix}b", f"{prefix}br"} <= set(removed)
    assert not [n for n in (*netns.namespaces(), *netns.links()) if n.startswith(prefix)]
    assert netns.sweep(network.testbed_id) == []  # (idempotent: nothing left to remove)


def test_a_used_subnet_and_leftovers_are_refused(network):
    with pytest.raises(netns.NetnsError, match="overlaps"):
        netns.Network("zz" + network.testbed_id[:2], str(network.subnet), ["a"]).create()
    with pytest.raises(netns.NetnsError, match="leftovers"):
        netns.Network(network.testbed_id, netns.free_subnet(), ["a"]).create()
    assert netns.free_subnet() != str(network.subnet)
    with pytest.raises(ValueError):
        netns.Network("TOO-LONG", "10.77.0.0/24", ["a"])
