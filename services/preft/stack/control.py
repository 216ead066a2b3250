"""Start and stop the local stack's supervisor from another process (`preft up`, `preft down`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from preft.common.loopback import ServerError
from preft.stack.local import PIDS_FILE, STATE_FILE, StackInfo, StackPorts
from preft.stack.process import SUPERVISOR_PID_FILE, pid_alive, supervisor_pid


def running(state_dir: Path) -> StackInfo | None:
    """The stack serving from this state directory, if its supervisor is alive and it finished starting."""
    info = StackInfo.read(state_dir.resolve())
    # stack.json outlives a supervisor that was killed (it is removed only on a clean stop): check its pid
    return info if info is not None and pid_alive(info.pid) else None


def start(state_dir: Path, ports: StackPorts | None = None, *, timeout_s: float = 600.0) -> StackInfo:
    """Start the supervisor detached and wait until it reports ready; raise ServerError with its log if it dies."""
    state_dir = state_dir.resolve()
    pid = supervisor_pid(state_dir)
    if pid is not None:
        info = StackInfo.read(state_dir)
        if info is not None:
            return info
        raise ServerError(f"a stack (pid {pid}) is starting or stuck in {state_dir}; `preft down` stops it")
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    _stop_leftovers(state_dir)  # servers of a supervisor that died would hold the ports and data directories
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    log_path = state_dir / "logs" / "stack.log"
    port_args = [x for name, port in asdict(ports or StackPorts()).items() for x in (f"--{name}-port", str(port))]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "preft.stack.local", "run", "--state-dir", str(state_dir), *port_args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the CLI; its process group holds every server it starts
        )
    (state_dir / SUPERVISOR_PID_FILE).write_text(str(proc.pid))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = StackInfo.read(state_dir)
        if info is not None:
            return info
        if proc.poll() is not None:
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            raise ServerError(f"the stack exited with code {proc.returncode}; log {log_path}:\n{tail}")
        time.sleep(0.5)
    stop(state_dir)
    raise ServerError(f"the stack was not ready after {timeout_s:.0f} s; see {log_path}")


def stop(state_dir: Path, *, timeout_s: float = 90.0) -> bool:
    """SIGTERM the supervisor (it stops every server in order), SIGKILL its group after the timeout."""
    state_dir = state_dir.resolve()
    pid = supervisor_pid(state_dir)
    if pid is None:
        (state_dir / SUPERVISOR_PID_FILE).unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.2)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    _stop_leftovers(state_dir)
    (state_dir / SUPERVISOR_PID_FILE).unlink(missing_ok=True)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return True


def _stop_leftovers(state_dir: Path) -> None:
    """Kill the process groups of servers a supervisor recorded but did not stop (it crashed or was killed)."""
    path = state_dir / PIDS_FILE
    if not path.is_file():
        return
    for pid in json.loads(path.read_text()).values():
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
