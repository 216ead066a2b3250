"""The whole local platform (`preft up`'s stack) on free loopback ports, once per session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from preft.common.loopback import free_port
from preft.stack import control
from preft.stack.local import LocalStack, StackInfo, StackPorts
from preft.stack.servers import LocalServer


@dataclass(frozen=True)
class Stack:
    state_dir: Path
    info: StackInfo
    demo_key: str
    # servers a fault test started in place of the stack's own (killed) ones: they serve the rest of the package's
    # tests and are stopped with the stack
    replacements: list[LocalServer] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"{self.info.gateway_url}/v1"

    def local(self) -> LocalStack:
        return LocalStack(self.state_dir, self.info.ports)


@pytest.fixture(scope="package")  # stopped once tests/e2e is done: its engine holds memory other tests need
def stack(tmp_path_factory) -> Iterator[Stack]:
    state_dir = tmp_path_factory.mktemp("stack")
    ports = StackPorts(**{name: free_port() for name in asdict(StackPorts())})
    info = control.start(state_dir, ports, timeout_s=400)
    replacements: list[LocalServer] = []
    try:
        demo = json.loads((state_dir / "demo.json").read_text())
        yield Stack(state_dir, info, demo["api_key"], replacements)
    finally:
        control.stop(state_dir)
        for server in replacements:
            server.stop()
