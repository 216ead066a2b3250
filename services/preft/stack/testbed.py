"""The platform on a testbed of hosts on one machine (`preft testbed up`): one network namespace per host
(`stack.netns`), each service on its host's own address, as on separate machines.

    host   address  what runs there
    data   .10      Redis (one ACL user per service), SeaweedFS (S3), the registry
    head   .11      the Ray head: GCS (its tables in the data host's Redis: GCS fault tolerance, as the RayService's),
                    the dashboard (whose Serve REST API takes the engine's Serve config), Serve's controller and a
                    proxy; no CPU for replicas (`--num-cpus=0`, as deploy/'s head)
    gw     .12      the gateway processes (:8080, :8081, ...), calling the engine through the head's Serve proxy
    w1, w2 .13 ...  Ray workers (`ray start --address=<head>:6379`): one engine replica each (vLLM on CPU), a proxy

A supervisor process (`stack.testbed_supervisor`) starts it all and restarts a service whose process exits, as
Kubernetes restarts a container, unless its host is held. This module is the outside view: where everything is
(`testbed.json`), starting and stopping the supervisor, and the fault hooks (cut and restore a host's link, kill a
host's processes, restart a service). `stop` removes every namespace and process, also after the supervisor was
killed: everything it made is named after the testbed id (`netns.sweep`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import httpx

from preft.common.loopback import ServerError
from preft.stack import netns
from preft.stack.process import SUPERVISOR_PID_FILE, pid_alive, supervisor_pid
from preft.stack.wiring import PlatformSecrets, stored_secret

if TYPE_CHECKING:
    import redis

    from preft.registry.client import RegistryClient

STATE_FILE = "testbed.json"
SERVICES_FILE = "services.json"
HELD_DIR = "held"
DATA, HEAD, GATEWAY = "data", "head", "gw"
RAY_HEAD, REDIS, S3, REGISTRY = "ray-head", "redis", "s3", "registry"


@dataclass(frozen=True)
class TestbedPorts:
    """The ports services listen on, each on its own host's address (every host has a whole port space)."""

    __test__: ClassVar[bool] = False  # (not a pytest class)

    redis: int = 6379
    s3: int = 8333
    registry: int = 50051
    registry_metrics: int = 9102
    gcs: int = 6379
    dashboard: int = 8265
    serve: int = 8000
    ray_metrics: int = 8080
    gateway: int = 8080  # the first gateway's; the next ones count up
    gateway_metrics: int = 9101  # the first gateway's /metrics; the next ones count up


@dataclass(frozen=True)
class TestbedLayout:
    """Which hosts a testbed has, their addresses, and where each service is."""

    __test__: ClassVar[bool] = False

    testbed_id: str
    subnet: str
    workers: int = 2
    gateways: int = 2
    ports: TestbedPorts = field(default_factory=TestbedPorts)

    @property
    def worker_hosts(self) -> list[str]:
        return [f"w{i + 1}" for i in range(self.workers)]

    @property
    def ray_hosts(self) -> list[str]:
        return [HEAD, *self.worker_hosts]

    @property
    def gateway_services(self) -> list[str]:
        return [f"gateway-{i + 1}" for i in range(self.gateways)]

    @cached_property
    def network(self) -> netns.Network:
        return netns.Network(self.testbed_id, self.subnet, [DATA, HEAD, GATEWAY, *self.worker_hosts])

    def address(self, host: str) -> str:
        return self.network.host(host).address

    @property
    def redis_url(self) -> str:
        return f"redis://{self.address(DATA)}:{self.ports.redis}/0"

    @property
    def s3_endpoint_url(self) -> str:
        return f"http://{self.address(DATA)}:{self.ports.s3}"

    @property
    def registry_address(self) -> str:
        return f"{self.address(DATA)}:{self.ports.registry}"

    @property
    def gcs_address(self) -> str:
        return f"{self.address(HEAD)}:{self.ports.gcs}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.address(HEAD)}:{self.ports.dashboard}"

    @property
    def engine_url(self) -> str:
        """The head's Serve proxy: what the gateways call (a Kubernetes Service would spread them over every node's)."""
        return f"http://{self.address(HEAD)}:{self.ports.serve}"

    def gateway_port(self, service: str) -> int:
        return self.ports.gateway + self.gateway_services.index(service)

    def gateway_metrics_port(self, service: str) -> int:
        return self.ports.gateway_metrics + self.gateway_services.index(service)

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://{self.address(GATEWAY)}:{self.gateway_port(g)}" for g in self.gateway_services]

    def service_host(self, service: str) -> str:
        if service in (REDIS, S3, REGISTRY):
            return DATA
        if service in self.gateway_services:
            return GATEWAY
        if service.startswith("ray-") and service[4:] in self.ray_hosts:
            return service[4:]
        raise ValueError(f"no service {service!r} (services: {', '.join(self.services)})")

    @property
    def services(self) -> list[str]:
        """Every service, in the order they start."""
        return [REDIS, S3, REGISTRY, *(f"ray-{h}" for h in self.ray_hosts), *self.gateway_services]

    @property
    def ray_temp_root(self) -> Path:
        """Where the Ray nodes keep their sessions, one directory per host: short, as Ray's socket paths must fit
        107 bytes."""
        return Path("/tmp") / f"preft-{self.testbed_id}"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TestbedLayout:
        return cls(**{**data, "ports": TestbedPorts(**data.get("ports", {}))})


@dataclass
class TestbedInfo:
    """What `testbed.json` holds: written before anything is made (so `stop` finds it after any crash), then again
    once every service answers."""

    __test__: ClassVar[bool] = False

    layout: TestbedLayout
    ready: bool = False
    supervisor_pid: int | None = None
    started_unix_s: float = field(default_factory=time.time)

    def write(self, state_dir: Path) -> None:
        tmp = state_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(state_dir / STATE_FILE)  # (readers never see half a file)

    @classmethod
    def read(cls, state_dir: Path) -> TestbedInfo | None:
        path = state_dir / STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(**{**data, "layout": TestbedLayout.from_json(data["layout"])})


def ray_token(state_dir: Path) -> str:
    """The Ray cluster's auth token (RAY_AUTH_TOKEN): its own, not the machine's ~/.ray/auth_token."""
    return stored_secret(state_dir, "ray_auth_token")


class Testbed:
    """A testbed seen from outside its supervisor: where everything is, what Ray and Serve report, and the fault
    hooks (a host's link, a host's processes, one service)."""

    __test__: ClassVar[bool] = False

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir).resolve()
        info = TestbedInfo.read(self.state_dir)
        if info is None:
            raise ServerError(f"no testbed in {self.state_dir} (no {STATE_FILE})")
        self.info = info
        self.layout = info.layout

    @property
    def network(self) -> netns.Network:
        return self.layout.network

    @property
    def gateway_urls(self) -> list[str]:
        return self.layout.gateway_urls

    @cached_property
    def secrets(self) -> PlatformSecrets:
        return PlatformSecrets.load(self.state_dir)

    def demo(self) -> dict[str, Any]:
        """The demo tenant, its API key and adapters (`demo.json`)."""
        return json.loads((self.state_dir / "demo.json").read_text())

    def registry_client(self) -> RegistryClient:
        """A registry client with the admin token."""
        from preft.registry.client import RegistryClient

        return RegistryClient(self.layout.registry_address, self.secrets.admin_token, timeout_s=10)

    def redis_admin(self) -> redis.Redis:
        """The data host's Redis as its admin (every key)."""
        import redis

        url = self.layout.redis_url
        password = self.secrets.redis_passwords["default"]
        return redis.Redis.from_url(url, password=password, decode_responses=True, socket_timeout=5)

    # -- what Ray and Serve report ---------------------------------------------------------------------------------

    def ray_api(self, path: str, *, method: str = "GET", body: Any = None, timeout_s: float = 10.0) -> Any:
        """A call to the head's dashboard (Ray's REST APIs, token-authenticated); its JSON."""
        response = httpx.request(
            method,
            f"{self.layout.dashboard_url}{path}",
            json=body,
            headers={"Authorization": f"Bearer {ray_token(self.state_dir)}"},
            timeout=timeout_s,
        )
        response.raise_for_status()
        return response.json() if response.content else None

    def ray_nodes(self) -> list[dict[str, Any]]:
        """The Ray nodes the GCS knows alive (`node_ip`, `is_head_node`, `node_id`, ...)."""
        data = self.ray_api("/api/v0/nodes?limit=1000&detail=true")
        return [n for n in data["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def serve_replicas(self) -> list[dict[str, Any]]:
        """The engine deployment's replicas as Serve reports them (`replica_id`, `node_ip`, `state`)."""
        data = self.ray_api("/api/serve/applications/")
        replicas = []
        for app in (data.get("applications") or {}).values():
            for deployment in app["deployments"].values():
                replicas += deployment["replicas"]
        return replicas

    def replicas_by_host(self) -> dict[str, list[dict[str, Any]]]:
        """RUNNING replicas on each Ray host (by their node's address)."""
        hosts = {self.layout.address(h): h for h in self.layout.ray_hosts}
        out: dict[str, list[dict[str, Any]]] = {h: [] for h in self.layout.ray_hosts}
        for r in self.serve_replicas():
            if r.get("state") == "RUNNING" and r.get("node_ip") in hosts:
                out[hosts[r["node_ip"]]].append(r)
        return out

    def services(self) -> dict[str, dict[str, Any]]:
        """Each service's host, pid, start count and readiness, as the supervisor last wrote them."""
        path = self.state_dir / SERVICES_FILE
        return json.loads(path.read_text()) if path.is_file() else {}

    # -- fault hooks -----------------------------------------------------------------------------------------------

    def cut_link(self, host: str) -> None:
        """Take the host's link down: its processes run on, unreachable (a pulled cable, a partition)."""
        self.network.cut(host)

    def restore_link(self, host: str) -> None:
        self.network.restore(host)

    def kill_host(self, host: str, *, hold: bool = False) -> list[int]:
        """SIGKILL every process on the host (a crash); the supervisor restarts its services unless `hold` (then
        they stay down until `release(host)`). Returns the pids killed."""
        if hold:
            self.hold(host)
        return self.network.kill(host)

    def hold(self, host: str) -> None:
        """Keep the supervisor from restarting the host's services (what stops stays stopped)."""
        self.network.host(host)
        (self.state_dir / HELD_DIR).mkdir(exist_ok=True)
        (self.state_dir / HELD_DIR / host).touch()

    def release(self, host: str) -> None:
        (self.state_dir / HELD_DIR / host).unlink(missing_ok=True)

    def restart_service(self, service: str, *, timeout_s: float = 300.0) -> float:
        """Stop one service (SIGTERM, SIGKILL after 10 s; a Ray node: its host's every process) and wait until the
        supervisor has started it again and it answers; the seconds that took."""
        host = self.layout.service_host(service)
        before = self.services().get(service, {}).get("starts", 0)
        started = time.monotonic()
        if service.startswith("ray-"):
            held = (self.state_dir / HELD_DIR / host).exists()
            self.hold(host)  # (else the supervisor may start it again between the SIGTERM and the SIGKILL)
            try:
                self.network.kill(host, signal.SIGTERM)
                _wait(lambda: not self.network.pids(host), 10.0)
                self.network.kill(host)
            finally:
                if not held:
                    self.release(host)
        else:
            pid = self.services()[service]["pid"]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            if not _wait(lambda: not pid_alive(pid), 10.0):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        restarted = _wait(
            lambda: (s := self.services().get(service, {})).get("starts", 0) > before and s.get("ready", False),
            timeout_s,
        )
        if not restarted:
            raise TimeoutError(f"{service} was not restarted within {timeout_s:.0f} s; see {self.state_dir}/logs")
        return time.monotonic() - started


def _wait(condition: Any, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def running(state_dir: Path) -> Testbed | None:
    """The testbed of this state directory if its supervisor is alive and it finished starting."""
    state_dir = Path(state_dir).resolve()
    info = TestbedInfo.read(state_dir)
    if info is None or not info.ready or supervisor_pid(state_dir) is None:
        return None
    return Testbed(state_dir)


def start(
    state_dir: Path,
    *,
    testbed_id: str | None = None,
    subnet: str | None = None,
    workers: int = 2,
    gateways: int = 2,
    timeout_s: float = 900.0,
) -> Testbed:
    """Start a testbed's supervisor detached and wait until every service answers; raise ServerError with the end
    of its log if it fails (it removes what it made), TimeoutError-like ServerError after `timeout_s`.

    The id is kept from an earlier run in `state_dir` unless given; the subnet is a free /24 unless given."""
    state_dir = Path(state_dir).resolve()
    if supervisor_pid(state_dir) is not None:
        if (bed := running(state_dir)) is not None:
            return bed
        raise ServerError(f"a testbed is starting or stuck in {state_dir}; `preft testbed down` stops it")
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    stop(state_dir)  # what a killed supervisor left (processes, namespaces)
    earlier = TestbedInfo.read(state_dir)
    testbed_id = testbed_id or (earlier.layout.testbed_id if earlier else None) or netns.new_id()
    layout = TestbedLayout(testbed_id, subnet or netns.free_subnet(), workers=workers, gateways=gateways)
    layout.network  # noqa: B018 (checks the id, the subnet and the host names now, not in the supervisor)
    TestbedInfo(layout).write(state_dir)
    shutil.rmtree(state_dir / HELD_DIR, ignore_errors=True)
    (state_dir / SERVICES_FILE).unlink(missing_ok=True)
    log_path = state_dir / "logs" / "supervisor.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "preft.stack.testbed_supervisor", "run", "--state-dir", str(state_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the CLI that started it
        )
    (state_dir / SUPERVISOR_PID_FILE).write_text(str(proc.pid))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = TestbedInfo.read(state_dir)
        if info is not None and info.ready:
            return Testbed(state_dir)
        if proc.poll() is not None:
            tail = log_path.read_bytes()[-6000:].decode(errors="replace")
            stop(state_dir)
            raise ServerError(f"the testbed exited with code {proc.returncode}; log {log_path}:\n{tail}")
        time.sleep(0.5)
    stop(state_dir)
    raise ServerError(f"the testbed was not ready after {timeout_s:.0f} s; see {log_path}")


def stop(state_dir: Path, *, timeout_s: float = 60.0) -> bool:
    """SIGTERM the supervisor (it stops the services in order) and wait for it, SIGKILL it after `timeout_s`; then
    sweep whatever is left: every process in the testbed's namespaces, its links and namespaces, the Ray nodes'
    temporary directories. Works after the supervisor was killed. True if there was anything to stop."""
    state_dir = Path(state_dir).resolve()
    pid = supervisor_pid(state_dir)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        if not _wait(lambda: not pid_alive(pid) or _reap(pid), timeout_s):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _wait(lambda: not pid_alive(pid) or _reap(pid), 10.0)
    info = TestbedInfo.read(state_dir)
    removed = netns.sweep(info.layout.testbed_id) if info is not None else []
    if info is not None:
        shutil.rmtree(info.layout.ray_temp_root, ignore_errors=True)
        if info.ready:
            info.ready = False
            info.write(state_dir)
    (state_dir / SUPERVISOR_PID_FILE).unlink(missing_ok=True)
    return pid is not None or bool(removed)


def _reap(pid: int) -> bool:
    """Reap `pid` if it is this process's exited child (a supervisor started here); whether it is gone."""
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    return False
