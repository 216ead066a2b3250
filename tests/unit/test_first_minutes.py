"""A new user's first minutes (issues 53 and 54): what `preft up` prints pastes as is, `preft-admin` finds the local
stack's token, and `preft up` on a running stack says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from preft.api.v1 import registry_pb2 as pb
from preft.cli import admin as admin_cli
from preft.cli import main as main_cli
from preft.common.settings import DEV_TOKEN
from preft.stack import control
from preft.stack.local import StackInfo, StackPorts

runner = CliRunner()
DEMO = {"tenant": "demo", "api_key": "preft_demo", "adapters": ["demo-direft", "demo-lora"]}


def _write_stack(state_dir: Path, pid: int, registry_port: int = 50999) -> StackInfo:
    """The files a running `preft up` leaves: stack.json, secrets.json (0600) and demo.json."""
    state_dir.mkdir(parents=True, exist_ok=True)
    info = StackInfo(
        pid=pid,
        ports=StackPorts(registry=registry_port),
        gateway_url="http://127.0.0.1:8080",
        registry_address=f"127.0.0.1:{registry_port}",
        redis_url="redis://127.0.0.1:6390/0",
        s3_endpoint_url="http://127.0.0.1:8333",
        engine_url="http://127.0.0.1:8000",
        model_dir=str(state_dir / "model"),
    )
    (state_dir / "stack.json").write_text(json.dumps(asdict(info)))
    fd = os.open(state_dir / "secrets.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"registry_admin_token": "local-secret", "s3_secret_key": "s3"}, f)
    (state_dir / "demo.json").write_text(json.dumps(DEMO))
    return info


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_up_message_names_the_environments_scripts(tmp_path):
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("preft", "preft-admin"):
        (bin_dir / name).touch()
    state_dir = tmp_path / ".preft" / "stack"
    info = _write_stack(state_dir, pid=1)
    text = main_cli.up_message(info, DEMO, state_dir, executable=bin_dir / "python", cwd=tmp_path)
    assert ".venv/bin/preft adapters upload my-lora .preft/stack/adapters/lora" in text
    assert "\n.venv/bin/python - <<'PY'\n" in text  # the venv's python has openai; the system one may not
    assert "\n.venv/bin/preft-admin tenant list\n" in text  # default state dir: nothing to tell preft-admin
    assert "stop with `.venv/bin/preft down`" in text
    lines = text.splitlines()
    assert not [line for line in lines if line.startswith(("python ", "preft ", "preft-admin "))]
    assert not [line for line in lines if " preft adapters" in line or "python -" in line.replace("bin/python -", "")]
    assert "randomly initialised" in text and "noise" in text and "--model MODEL_DIR" in text
    assert "already running" not in text


def test_up_message_without_scripts_and_elsewhere(tmp_path):
    """Run as `python -m` from an interpreter outside the working directory, on another state directory."""
    state_dir = tmp_path / "other state"
    info = _write_stack(state_dir, pid=1)
    exe = tmp_path / "env" / "bin" / "python"
    text = main_cli.up_message(info, DEMO, state_dir, executable=exe, cwd=tmp_path / "work", already_running=True)
    assert f"{exe} -m preft.cli.main adapters upload my-lora '{state_dir}/adapters/lora'" in text
    assert f"\nPREFT_ADMIN__STACK_DIR='{state_dir}' {exe} -m preft.cli.admin tenant list\n" in text
    assert f"\n{exe} - <<'PY'\n" in text
    assert text.startswith("preft-serve is already running: gateway http://127.0.0.1:8080")


class FakeRegistryClient:
    """Records which registry and token `preft-admin` would call."""

    seen: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, target: str, token: str, **_: object) -> None:
        FakeRegistryClient.seen.append((target, token))

    def call(self, method: str, request: object) -> pb.ListTenantsResponse:
        return pb.ListTenantsResponse()

    def close(self) -> None:
        pass


@pytest.fixture
def admin(monkeypatch, tmp_path):
    for var in ("PREFT_ADMIN__REGISTRY", "PREFT_ADMIN__TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PREFT_ADMIN__STACK_DIR", str(tmp_path / "stack"))
    monkeypatch.setattr(admin_cli, "RegistryClient", FakeRegistryClient)
    FakeRegistryClient.seen = []

    def run(*args: str) -> tuple[str, str]:
        result = runner.invoke(admin_cli.app, [*args, "tenant", "list"])
        assert result.exit_code == 0, result.output
        return FakeRegistryClient.seen[-1]

    return run


def test_admin_finds_the_local_stacks_token(admin, tmp_path, monkeypatch):
    assert admin() == ("127.0.0.1:50051", DEV_TOKEN)  # no stack: the defaults, as before
    _write_stack(tmp_path / "stack", pid=os.getpid(), registry_port=50999)
    assert admin() == ("127.0.0.1:50999", "local-secret")  # its registry (ports of its own) and token
    assert admin("--registry", "127.0.0.1:50999") == ("127.0.0.1:50999", "local-secret")
    # another registry, or a token given, is not the local stack's business
    assert admin("--registry", "10.0.0.1:50051") == ("10.0.0.1:50051", DEV_TOKEN)
    assert admin("--token", "mine") == ("127.0.0.1:50051", "mine")
    monkeypatch.setenv("PREFT_ADMIN__TOKEN", "from-env")
    assert admin() == ("127.0.0.1:50051", "from-env")


def test_running_sees_a_live_supervisor_only(tmp_path):
    assert control.running(tmp_path) is None
    _write_stack(tmp_path, pid=os.getpid())
    assert control.running(tmp_path).gateway_url == "http://127.0.0.1:8080"
    _write_stack(tmp_path, pid=_dead_pid())  # a killed supervisor leaves stack.json behind
    assert control.running(tmp_path) is None


def test_up_on_a_running_stack_says_so(tmp_path, monkeypatch):
    _write_stack(tmp_path, pid=os.getpid())

    def no_start(*_: object, **__: object) -> None:
        raise AssertionError("a running stack is not started again")

    monkeypatch.setattr(control, "start", no_start)
    result = runner.invoke(main_cli.app, ["up", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "already running" in result.output and "starting" not in result.output
    assert "gateway http://127.0.0.1:8080" in result.output
