"""The loopback address, free ports on it, and deadline waits: the basics that local servers (the stack's) and the
in-process test servers (the gateway's stub engine) share."""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A local server could not be found, started or reached."""


# Ports free_port() chooses from: above Ray's worker ports (10002-19999 by default) and below the OS's
# ephemeral range, which every outgoing connection and every bind to port 0 (Ray, vLLM, gRPC) draws from.
# An OS-picked port can be taken by then when the server meant for it starts minutes later (after Ray and
# vLLM came up); one outside that range is taken only by a program that names it.
_LOWEST_PORT = 20000
_handed_out: set[int] = set()  # never hand out a port twice in one process, bound yet or not


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def claim_ports(ports: Iterable[int]) -> None:
    """Mark ports chosen elsewhere (e.g. by the caller of a stack) so free_port() in this process avoids them."""
    _handed_out.update(ports)


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port on `host` that nothing is bound to now and that the OS does not hand out by itself.

    Picked from 20000 up to the OS's ephemeral range, starting at a random port (processes choosing ports
    side by side rarely meet) and never one this process returned or claimed before. Where the ephemeral
    range leaves no room above 20000 the OS picks.
    """
    span = _ephemeral_low() - _LOWEST_PORT
    if span < 1000:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    start = secrets.randbelow(span)  # not `random`: a test run may seed it the same in every process
    for i in range(span):
        port = _LOWEST_PORT + (start + i) % span
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise ServerError(f"no free TCP port on {host} in {_LOWEST_PORT}-{_LOWEST_PORT + span - 1}")


def wait_until(
    condition: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    abort: Callable[[], str | None] = lambda: None,
) -> float:
    """Poll `condition` until it returns True; return the seconds waited.

    Exceptions from `condition` count as "not yet". `abort` returns a reason to give up early (e.g. the process
    exited). Raises TimeoutError naming `what` and the last exception seen.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    last_error: BaseException | None = None
    while True:
        # Abort first: a dead child must not pass because something else answers on its port.
        reason = abort()
        if reason is not None:
            raise ServerError(f"{what}: {reason}")
        try:
            if condition():
                return time.monotonic() - start
        except Exception as e:
            last_error = e
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error is not None else ""
            raise TimeoutError(f"{what}: not ready after {timeout_s:.1f} s{detail}")
        time.sleep(interval_s)
