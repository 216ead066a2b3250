"""The local default platform in one supervisor process: Redis, SeaweedFS (S3), the registry, a Ray Serve engine
app on a generated tiny model, and the gateway, all on 127.0.0.1, with their state under one directory.

`preft up` starts `python -m preft.stack.local run` detached and waits for it to write `stack.json`;
`preft down` sends it SIGTERM, and it stops everything in reverse order. State (Redis AOF, S3 data, the model,
the adapter disk cache, the demo key) lives in the state directory, so a restart finds it again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from preft.common.loopback import LOOPBACK, claim_ports, wait_until
from preft.stack.process import ManagedProcess
from preft.stack.servers import RedisServer, SeaweedS3
from preft.stack.wiring import BASE_MODEL_ID as BASE_MODEL_ID
from preft.stack.wiring import DEMO_FILE as DEMO_FILE
from preft.stack.wiring import DEMO_TENANT as DEMO_TENANT
from preft.stack.wiring import (
    S3_ACCESS_KEY,
    SECRETS_FILE,
    PlatformSecrets,
    Wiring,
    bootstrap_registry,
    ensure_model,
    merge_settings,
)
from preft.stack.wiring import StackProfile as StackProfile

if TYPE_CHECKING:
    from preft.registry.client import RegistryClient

log = logging.getLogger("preft.stack")
STATE_FILE = "stack.json"
PIDS_FILE = "pids.json"
DEFAULT_PROFILE = StackProfile()


@dataclass(frozen=True)
class StackPorts:
    """Loopback ports of the local stack's public endpoints."""

    gateway: int = 8080
    registry: int = 50051
    redis: int = 6390
    s3: int = 8333
    serve: int = 8000
    registry_metrics: int = 9102
    gateway_metrics: int = 9101


@dataclass
class StackInfo:
    """What `preft up` prints and `preft down` needs: written to stack.json once everything answers."""

    pid: int
    ports: StackPorts
    gateway_url: str
    registry_address: str
    redis_url: str
    s3_endpoint_url: str
    engine_url: str
    model_dir: str
    started_unix_s: float = field(default_factory=time.time)

    @property
    def metrics_urls(self) -> list[str]:
        """Prometheus endpoints of the gateway (its metrics port) and the engine replica(s)."""
        return [f"http://{LOOPBACK}:{self.ports.gateway_metrics}/metrics", f"{self.engine_url}/metrics"]

    @classmethod
    def read(cls, state_dir: Path) -> StackInfo | None:
        path = state_dir / STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        data["ports"] = StackPorts(**data["ports"])
        return cls(**data)


def local_admin_token(state_dir: Path, registry: str | None = None) -> tuple[str, str] | None:
    """(registry address, admin token) of the stack recorded in `state_dir`, if one is up there and `registry`
    (when given) is its address: `preft-admin` finds the local stack's token without being told it."""
    info, secrets_path = state_dir / STATE_FILE, state_dir / SECRETS_FILE
    try:
        address = json.loads(info.read_text())["registry_address"]
        token = json.loads(secrets_path.read_text())["registry_admin_token"]
    except (OSError, ValueError, KeyError):
        return None
    return (address, token) if registry in (None, address) else None


class LocalStack:
    """Owns every process of the local platform and the order they start and stop in."""

    def __init__(
        self, state_dir: Path, ports: StackPorts = StackPorts(), profile: StackProfile = DEFAULT_PROFILE
    ) -> None:
        self.state_dir = state_dir.resolve()
        self.ports = ports
        self.profile = profile
        self.state_dir.mkdir(parents=True, exist_ok=True)
        claim_ports(asdict(ports).values())  # the S3 server's internal ports must not land on one not bound yet
        self.secrets = secrets = PlatformSecrets.load(self.state_dir)
        self.admin_token = secrets.admin_token
        self.gateway_registry_token = secrets.gateway_registry_token
        self.reader_token = secrets.reader_token
        self.engine_token = secrets.engine_token
        self.s3_secret = secrets.s3_secret
        # one Redis ACL user per service (common.redis_acl), and the admin's own password, none of them for another
        self.redis_passwords = secrets.redis_passwords
        self.redis = RedisServer(self.state_dir / "redis", ports.redis, persist=True, passwords=self.redis_passwords)
        self.s3 = SeaweedS3(self.state_dir / "s3", ports.s3, access_key=S3_ACCESS_KEY, secret_key=self.s3_secret)
        self.wiring = Wiring(
            secrets=secrets,
            profile=profile,
            model_dir=self.model_dir,
            redis_url=self.redis.url,
            s3_endpoint_url=self.s3.endpoint_url,
            registry_address=f"{LOOPBACK}:{ports.registry}",
            engine_url=f"http://{LOOPBACK}:{ports.serve}",
        )
        logs = self.state_dir / "logs"
        self.registry = ManagedProcess("registry", logs / "registry.log")
        self.gateway = ManagedProcess("gateway", logs / "gateway.log")
        self._serve_started = False

    @property
    def model_dir(self) -> Path:
        return self.profile.model_dir or self.state_dir / "model"

    def start(self, while_engine_starts: Callable[[], None] | None = None) -> StackInfo:
        """Start every part; `while_engine_starts` runs in a thread once the registry is up (an engine on a GPU
        takes minutes to start: a benchmark fills the registry meanwhile), and its error is raised here."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log.info("making sure the model is in %s", self.model_dir)
        ensure_model(self.profile, self.model_dir)
        log.info("starting redis and s3")
        self.redis.start()
        self._record_pids()
        self.s3.start(timeout_s=60)
        self._record_pids()
        self._start_registry()
        self._record_pids()
        self._bootstrap_registry()
        with ThreadPoolExecutor(1) as pool:
            meanwhile = pool.submit(while_engine_starts) if while_engine_starts else None
            self._start_engine()
            self._start_gateway()
            self._record_pids()
            if meanwhile is not None:
                meanwhile.result()
        info = StackInfo(
            pid=os.getpid(),
            ports=self.ports,
            gateway_url=f"http://{LOOPBACK}:{self.ports.gateway}",
            registry_address=f"{LOOPBACK}:{self.ports.registry}",
            redis_url=self.redis.url,
            s3_endpoint_url=self.s3.endpoint_url,
            engine_url=f"http://{LOOPBACK}:{self.ports.serve}",
            model_dir=str(self.model_dir),
        )
        (self.state_dir / STATE_FILE).write_text(json.dumps(asdict(info), indent=2))
        return info

    def stop(self) -> None:
        """Stop every part, newest first; one part failing to stop does not keep the others running."""
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)
        steps = [
            ("gateway", lambda: self.gateway.stop(timeout_s=10)),
            ("engine", self._stop_engine),
            ("registry", lambda: self.registry.stop(timeout_s=10)),
            ("s3", self.s3.stop),
            ("redis", self.redis.stop),
        ]
        for name, step in steps:
            try:
                step()
                log.info("stopped %s", name)
            except Exception:
                log.exception("stopping %s failed", name)
        (self.state_dir / PIDS_FILE).unlink(missing_ok=True)

    def _stop_engine(self) -> None:
        if self._serve_started:
            import ray
            from ray import serve

            self._serve_started = False
            serve.shutdown()
            ray.shutdown()

    def _record_pids(self) -> None:
        """Pids of the servers, so `preft down` can still stop them if this supervisor dies first."""
        pids = {
            name: part.pid
            for name, part in (
                ("redis", self.redis),
                ("s3", self.s3),
                ("registry", self.registry),
                ("gateway", self.gateway),
            )
            if part.pid is not None
        }
        (self.state_dir / PIDS_FILE).write_text(json.dumps(pids))

    # -- parts -----------------------------------------------------------------------------------------------------

    def _start_registry(self) -> None:
        env = self.wiring.registry_env(f"{LOOPBACK}:{self.ports.registry}", f"{LOOPBACK}:{self.ports.registry_metrics}")
        self.registry.spawn([sys.executable, "-m", "preft.registry.server"], cwd=self.state_dir, env=env)
        wait_until(self._registry_answers, timeout_s=30, what="registry", abort=self.registry.exit_reason)

    def registry_client(self) -> RegistryClient:
        from preft.registry.client import RegistryClient

        return RegistryClient(f"{LOOPBACK}:{self.ports.registry}", self.admin_token, timeout_s=10)

    def _registry_answers(self) -> bool:
        from preft.api.v1 import registry_pb2 as pb

        with self.registry_client() as c:
            c.call("ListTenants", pb.ListTenantsRequest())
        return True

    def _bootstrap_registry(self) -> None:
        with self.registry_client() as c:
            bootstrap_registry(c, self.state_dir, self.model_dir, self.profile)

    def _start_engine(self) -> None:
        """Ray (this process is the driver) and the engine's Serve application, as the profile sizes it."""
        from ray import serve

        from preft.engine.serve_app import build_app
        from preft.engine.settings import EngineSettings
        from preft.stack.ray_local import start_local_ray

        p = self.profile
        log.info("starting ray serve and the engine (%s)", "vLLM on GPU" if p.ray_num_gpus else "vLLM on CPU")
        start_local_ray(  # every Ray socket on 127.0.0.1, as the stack's own servers
            num_cpus=p.ray_num_cpus,
            num_gpus=p.ray_num_gpus,
            object_store_memory=1 << 30,  # (the engine passes no large objects through Ray)
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        self._serve_started = True
        serve.start(http_options={"host": LOOPBACK, "port": self.ports.serve})
        args = self.wiring.engine_args(self.state_dir / "adapter-cache")
        settings = EngineSettings(**merge_settings(args, self.wiring.engine_secrets()))
        serve.run(build_app(settings), name=settings.app_name, route_prefix=settings.route_prefix)
        wait_until(
            lambda: httpx.get(f"http://{LOOPBACK}:{self.ports.serve}/healthz", timeout=2).status_code == 200,
            timeout_s=p.engine_start_timeout_s,
            what="engine",
        )

    def gateway_env(self, port: int, metrics_port: int = 0) -> dict[str, str]:
        """A gateway's settings on this stack, listening on `port` and serving /metrics on `metrics_port` (the
        stack's own, or others beside them; metrics port 0: any free one)."""
        return self.wiring.gateway_env(LOOPBACK, port, metrics_port)

    def _start_gateway(self) -> None:
        env = self.gateway_env(self.ports.gateway, self.ports.gateway_metrics)
        self.gateway.spawn([sys.executable, "-m", "preft.gateway"], cwd=self.state_dir, env=env)
        wait_until(
            lambda: httpx.get(f"http://{LOOPBACK}:{self.ports.gateway}/healthz", timeout=2).status_code == 200,
            timeout_s=60,
            what="gateway",
            abort=self.gateway.exit_reason,
        )


def run(state_dir: Path, ports: StackPorts) -> None:
    """Run the stack in this process until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    def install_handlers() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    install_handlers()
    stack = LocalStack(state_dir, ports)
    try:
        info = stack.start()
        install_handlers()  # ray.init replaces SIGTERM's handler with one that exits at once
        log.info("ready: gateway %s", info.gateway_url)
        stop.wait()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second `preft down` must not cut the shutdown short
        log.info("stopping")
        stack.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run the local preft-serve stack in the foreground.")
    ap.add_argument("command", choices=["run"])
    ap.add_argument("--state-dir", type=Path, default=Path(".preft/stack"))
    for name, default in asdict(StackPorts()).items():
        ap.add_argument(f"--{name}-port", type=int, default=default)
    args = ap.parse_args(argv)
    ports = StackPorts(**{name: getattr(args, f"{name}_port") for name in asdict(StackPorts())})
    run(args.state_dir, ports)


if __name__ == "__main__":
    main()
