"""Ray's GCS on the platform's Redis as the `ray` ACL user (`common.redis_acl`), as the RayService's
gcsFaultToleranceOptions runs it: the GCS starts, takes a driver (its job counter), and writes its tables
(RAY<namespace>@*) with no command or key refused, and KubeRay's cleanup of a removed cluster's keys works as that user
too."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import redis

from preft.common.loopback import free_port
from preft.stack import RedisServer

pytestmark = pytest.mark.integration
NAMESPACE = "preft-test-cluster"


def test_the_gcs_runs_and_cleans_up_as_the_ray_user(redis_server: RedisServer, redis_url: str, tmp_path: Path):
    pytest.importorskip("ray")
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    admin.execute_command("ACL", "LOG", "RESET")
    ray_url = urlsplit(redis_server.url_for("ray"))
    password = unquote(ray_url.password or "")
    env = {
        **os.environ,
        "RAY_REDIS_ADDRESS": f"{ray_url.hostname}:{ray_url.port}",
        "RAY_external_storage_namespace": NAMESPACE,  # KubeRay sets it to the RayCluster's uid
        # the cluster's own token, which the driver below needs too (not this machine's ~/.ray/auth_token)
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    args = [ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=0", "--include-dashboard=false"]
    args += ["--redis-username=ray", f"--redis-password={password}", "--node-ip-address=127.0.0.1"]
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    args += ["--disable-usage-stats", f"--temp-dir={temp_dir}"]
    args += [f"--min-worker-port={port + 1}", f"--max-worker-port={port + 50}"]
    head = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "ray-start.log").open("wb"),
        start_new_session=True,  # its own process group: stopped below without `ray stop` (which stops every Ray)
    )
    try:
        deadline = time.monotonic() + 90
        while not admin.exists(f"RAY{NAMESPACE}@NODE") and time.monotonic() < deadline:
            assert head.poll() is None, (tmp_path / "ray-start.log").read_text()[-2000:]
            time.sleep(0.5)
        assert admin.exists(f"RAY{NAMESPACE}@NODE"), "the GCS wrote no node table"
        # a driver connects (as the dashboard does for the first Serve deploy): the GCS counts jobs in Redis
        driver = "import ray, sys; ray.init(address=sys.argv[1]); ray.shutdown()"
        ran = subprocess.run(
            [sys.executable, "-c", driver, f"127.0.0.1:{port}"], env=env, timeout=120, capture_output=True, text=True
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert int(admin.get(f"RAY{NAMESPACE}@JobCounter") or 0) >= 1
        time.sleep(2)  # a few heartbeats' worth of writes
        assert head.poll() is None, (tmp_path / "ray-start.log").read_text()[-2000:]
        assert admin.execute_command("ACL", "LOG") == [], "Redis refused a command or key of the GCS"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        _kill_left_over(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert all(k.startswith(f"RAY{NAMESPACE}@") for k in admin.scan_iter("RAY*"))

    from ray._private.gcs_utils import cleanup_redis_storage

    assert cleanup_redis_storage(ray_url.hostname, ray_url.port, password, False, NAMESPACE, username="ray")
    assert not list(admin.scan_iter(f"RAY{NAMESPACE}@*"))
    assert admin.execute_command("ACL", "LOG") == []


def _kill_left_over(marker: str) -> None:
    """Ray processes of this test's head (their command lines name its temp dir) still running: a Ray process that
    left the process group."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass
