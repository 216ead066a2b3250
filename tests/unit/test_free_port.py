"""free_port(): bindable, never twice, and outside the OS's ephemeral range that Ray and vLLM also draw from."""

from __future__ import annotations

import socket

import pytest

from preft.common import loopback as process
from preft.common.loopback import LOOPBACK, ServerError, claim_ports, free_port


@pytest.fixture(autouse=True)
def _fresh_handed_out(monkeypatch):
    monkeypatch.setattr(process, "_handed_out", set())


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ephemeral_low = process._ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= p < ephemeral_low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind((LOOPBACK, port))


def test_a_bound_or_claimed_port_is_never_returned(monkeypatch):
    monkeypatch.setattr(process, "_LOWEST_PORT", process._ephemeral_low() - 1000)
    lowest = process._LOWEST_PORT
    with socket.socket() as holder:
        holder.bind((LOOPBACK, lowest + 3))  # bound by another socket, not listening yet: still taken
        claim_ports(range(lowest, lowest + 1000))
        process._handed_out -= {lowest + 3, lowest + 7}
        assert free_port() == lowest + 7
        with pytest.raises(ServerError, match="no free TCP port"):
            free_port()


def test_no_room_above_20000_lets_the_os_pick(monkeypatch):
    ephemeral_low = process._ephemeral_low()
    monkeypatch.setattr(process, "_ephemeral_low", lambda: 20500)
    port = free_port()
    assert port >= ephemeral_low
    with socket.socket() as s:
        s.bind((LOOPBACK, port))
