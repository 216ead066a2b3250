"""One supervised child process group: how the local servers run; and the pid file of a detached supervisor (the
local stack's and the testbed's), which `up`/`down` find it by."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from preft.common.loopback import ServerError

SUPERVISOR_PID_FILE = "supervisor.pid"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def supervisor_pid(state_dir: Path) -> int | None:
    """The pid in `state_dir`'s supervisor pid file, if that process is alive; None without a file or a readable pid."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((state_dir / SUPERVISOR_PID_FILE).read_text().strip())
        return pid if pid > 0 and pid_alive(pid) else None
    return None


class ManagedProcess:
    """Owns one child process started in its own process group, so stopping it also ends anything it spawned.

    Output goes to `log_path`. The process is stopped at interpreter exit if the owner forgets. `launcher` is an argv
    prefix the command runs under, one that execs it in place (`ip netns exec NS`: a testbed host's network), so the
    pid and process group stay the command's own.
    """

    def __init__(self, name: str, log_path: Path, *, launcher: Sequence[str] = ()) -> None:
        self.name = name
        self.log_path = log_path
        self.launcher = tuple(launcher)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def spawn(self, argv: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None) -> None:
        if self.running:
            raise ServerError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [*self.launcher, *argv],
                cwd=cwd,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killpg reaches every child
            )
        atexit.register(self.stop)

    def exit_reason(self) -> str | None:
        """None while running; otherwise why it is not, with the end of its log."""
        if self._proc is None:
            return "not started"
        code = self._proc.poll()
        if code is None:
            return None
        return f"exited with code {code}; log {self.log_path}:\n{self.log_tail()}"

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, wait up to `timeout_s`, then SIGKILL it. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            self._signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
        # Children may outlive a leader that exited on its own; the group id stays the leader's pid.
        self._signal_group(proc.pid, signal.SIGKILL)
        proc.wait()

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
