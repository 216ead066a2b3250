"""Which listening addresses count as loopback (the e2e port scan and start_local_ray's check rely on it)."""

from __future__ import annotations

import pytest

from preft.stack.ray_local import is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),  # a dual-stack socket bound to IPv4 loopback
        ("0.0.0.0", False),
        ("::", False),
        ("192.0.2.2", False),
        ("::ffff:192.0.2.2", False),
        ("fe80::1%eth0", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback
