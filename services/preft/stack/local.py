"""The local default platform in one supervisor process: Redis, SeaweedFS (S3), the registry, a Ray Serve engine
app on a generated tiny model, and the gateway, all on 127.0.0.1, with their state under one directory.

`preft up` starts `python -m preft.stack.local run` detached and waits for it to write `stack.json`;
`preft down` sends it SIGTERM, and it stops everything in reverse order. State (Redis AOF, S3 data, the model,
the adapter disk cache, the demo key) lives in the state directory, so a restart finds it again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from preft.common.loopback import LOOPBACK, claim_ports, wait_until
from preft.common.redis_acl import ADMIN_USER, SERVICES
from preft.stack.process import ManagedProcess
from preft.stack.servers import RedisServer, SeaweedS3

if TYPE_CHECKING:
    from preft.registry.client import RegistryClient

log = logging.getLogger("preft.stack")
STATE_FILE = "stack.json"
PIDS_FILE = "pids.json"
DEMO_FILE = "demo.json"
BASE_MODEL_ID = "tiny-llama"
DEMO_TENANT = "demo"


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


@dataclass(frozen=True)
class StackProfile:
    """What the stack serves and how big it is: the local default (a generated tiny model on 2 CPU cores) or a GPU
    host's (a model directory, GPU engine settings). The wiring between the parts is the stack's own."""

    model_dir: Path | None = None  # None: the tiny model generated in the state directory
    served_model_name: str = BASE_MODEL_ID
    # EngineSettings fields over TINY_ENGINE (nested ones as dicts: {"replica": {"num_gpus_per_replica": 1}})
    engine: dict[str, Any] = field(default_factory=dict)
    gateway_env: dict[str, str] = field(default_factory=dict)  # PREFT_GATEWAY__* beyond the wiring
    max_model_len: int = 2048
    max_prompt_tokens: int = 1536
    ray_num_cpus: int = 2
    ray_num_gpus: int = 0
    engine_start_timeout_s: float = 120.0
    demo: bool = True  # the demo tenant, its key and two adapters (they are built for the tiny model)


# The engine of the local default: one replica of the tiny model on vLLM's CPU backend.
TINY_ENGINE: dict[str, Any] = dict(
    dtype="float32",
    max_loras=4,
    max_cpu_loras=16,
    max_num_batched_tokens=512,
    gpu_memory_utilization=0.1,
    block_size=32,
    cpu_num_threads=2,
    disk_cache_max_bytes=1 << 30,
    prefetch_adapters=8,
    replica={"num_replicas": 1, "num_cpus_per_replica": 1, "max_adapters_per_replica": 16},
)


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


def _secret(state_dir: Path, name: str) -> str:
    """A random secret created once and kept (owner-only) in the state directory."""
    path = state_dir / "secrets.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    if name not in data:
        data[name] = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
    return data[name]


def local_admin_token(state_dir: Path, registry: str | None = None) -> tuple[str, str] | None:
    """(registry address, admin token) of the stack recorded in `state_dir`, if one is up there and `registry`
    (when given) is its address: `preft-admin` finds the local stack's token without being told it."""
    info, secrets_path = state_dir / STATE_FILE, state_dir / "secrets.json"
    try:
        address = json.loads(info.read_text())["registry_address"]
        token = json.loads(secrets_path.read_text())["registry_admin_token"]
    except (OSError, ValueError, KeyError):
        return None
    return (address, token) if registry in (None, address) else None


class LocalStack:
    """Owns every process of the local platform and the order they start and stop in."""

    def __init__(
        self, state_dir: Path, ports: StackPorts = StackPorts(), profile: StackProfile = StackProfile()
    ) -> None:
        self.state_dir = state_dir.resolve()
        self.ports = ports
        self.profile = profile
        self.state_dir.mkdir(parents=True, exist_ok=True)
        claim_ports(asdict(ports).values())  # the S3 server's internal ports must not land on one not bound yet
        self.admin_token = _secret(self.state_dir, "registry_admin_token")
        # The gateway and the engine get narrower credentials than the admin token: a compromised one of them cannot
        # administer tenants and keys, and no local process but the gateway can spend the engine (docs/security.md).
        self.gateway_registry_token = _secret(self.state_dir, "registry_gateway_token")
        self.reader_token = _secret(self.state_dir, "registry_reader_token")
        self.engine_token = _secret(self.state_dir, "engine_token")
        self.s3_secret = _secret(self.state_dir, "s3_secret_key")
        # one Redis ACL user per service (common.redis_acl), and the admin's own password, none of them for another
        self.redis_passwords = {
            user: _secret(self.state_dir, f"redis_{user}_password") for user in (ADMIN_USER, *SERVICES)
        }
        self.redis = RedisServer(self.state_dir / "redis", ports.redis, persist=True, passwords=self.redis_passwords)
        self.s3 = SeaweedS3(self.state_dir / "s3", ports.s3, access_key="preft-local", secret_key=self.s3_secret)
        logs = self.state_dir / "logs"
        self.registry = ManagedProcess("registry", logs / "registry.log")
        self.gateway = ManagedProcess("gateway", logs / "gateway.log")
        self._serve_started = False

    @property
    def model_dir(self) -> Path:
        return self.profile.model_dir or self.state_dir / "model"

    def _s3_env(self, prefix: str) -> dict[str, str]:
        return {
            f"{prefix}S3__ENDPOINT_URL": self.s3.endpoint_url,
            f"{prefix}S3__ACCESS_KEY": self.s3.access_key,
            f"{prefix}S3__SECRET_KEY": self.s3_secret,
            f"{prefix}S3__BUCKET": "preft-adapters",
        }

    def _redis_env(self, prefix: str, user: str) -> dict[str, str]:
        return {
            f"{prefix}REDIS__URL": self.redis.url,
            f"{prefix}REDIS__USERNAME": user,
            f"{prefix}REDIS__PASSWORD": self.redis_passwords[user],
        }

    def start(self, while_engine_starts: Callable[[], None] | None = None) -> StackInfo:
        """Start every part; `while_engine_starts` runs in a thread once the registry is up (an engine on a GPU
        takes minutes to start: a benchmark fills the registry meanwhile), and its error is raised here."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._ensure_model()
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

    def _ensure_model(self) -> None:
        if self.profile.model_dir is None and not (self.model_dir / "config.json").is_file():
            from preft.devtools.tiny import TinyModelSpec, build_model

            log.info("generating the tiny model in %s", self.model_dir)
            build_model(self.model_dir, TinyModelSpec())

    def _start_registry(self) -> None:
        env = {
            "PREFT_REGISTRY__ENVIRONMENT": "prod",
            "PREFT_REGISTRY__LISTEN_ADDRESS": f"{LOOPBACK}:{self.ports.registry}",
            "PREFT_REGISTRY__METRICS_ADDRESS": f"{LOOPBACK}:{self.ports.registry_metrics}",
            "PREFT_REGISTRY__ADMIN_TOKEN": self.admin_token,
            "PREFT_REGISTRY__GATEWAY_TOKEN": self.gateway_registry_token,
            "PREFT_REGISTRY__READER_TOKEN": self.reader_token,
            **self._redis_env("PREFT_REGISTRY__", "registry"),
            **self._s3_env("PREFT_REGISTRY__"),
        }
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
        """Base model, demo tenant, a demo key and two demo adapters (LoRA, DiReFT); kept across restarts."""
        from preft.api.v1 import adapter_pb2 as apb
        from preft.api.v1 import registry_pb2 as pb
        from preft.common.errors import AlreadyExists
        from preft.devtools.tiny import build_direft, build_lora
        from preft.registry.client import scan_adapter_dir

        demo_path = self.state_dir / DEMO_FILE
        with self.registry_client() as c:
            config = (self.model_dir / "config.json").read_text()
            name = self.profile.served_model_name
            c.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id=name, config_json=config))
            if not self.profile.demo:
                return
            with contextlib.suppress(AlreadyExists):
                c.call("CreateTenant", pb.CreateTenantRequest(id=DEMO_TENANT))
            if demo_path.is_file():
                return
            adapters = {
                "demo-lora": (
                    build_lora(self.state_dir / "adapters" / "lora", self.model_dir),
                    apb.POSITION_MODE_PREFILL,
                ),
                "demo-direft": (
                    build_direft(self.state_dir / "adapters" / "direft", self.model_dir),
                    apb.POSITION_MODE_PREFILL,
                ),
            }
            for name, (path, mode) in adapters.items():
                c.upload_adapter(scan_adapter_dir(path), tenant=DEMO_TENANT, name=name, mode=mode, uploader="preft up")
            key = c.call("IssueKey", pb.IssueKeyRequest(tenant=DEMO_TENANT, label="preft up"))
        fd = os.open(demo_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"tenant": DEMO_TENANT, "api_key": key.secret, "adapters": sorted(adapters)}, f)

    def _start_engine(self) -> None:
        """Ray (this process is the driver) and the engine's Serve application, as the profile sizes it."""
        from pydantic import SecretStr
        from ray import serve

        from preft.common.settings import RedisSettings, S3Settings
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
        settings = EngineSettings(
            **{**TINY_ENGINE, **p.engine},
            model_dir=self.model_dir,
            max_model_len=p.max_model_len,
            disk_cache_dir=self.state_dir / "adapter-cache",
            s3=S3Settings(
                endpoint_url=self.s3.endpoint_url,
                access_key=self.s3.access_key,
                secret_key=self.s3_secret,
                bucket="preft-adapters",
            ),
            redis=RedisSettings(
                url=self.redis.url, username="engine", password=SecretStr(self.redis_passwords["engine"])
            ),
            registry_address=f"{LOOPBACK}:{self.ports.registry}",
            registry_token=self.reader_token,
            api_token=self.engine_token,
        )
        settings.replica.metrics_tenant_label = True  # (every port that serves them listens on loopback here)
        serve.run(build_app(settings), name=settings.app_name, route_prefix=settings.route_prefix)
        wait_until(
            lambda: httpx.get(f"http://{LOOPBACK}:{self.ports.serve}/healthz", timeout=2).status_code == 200,
            timeout_s=p.engine_start_timeout_s,
            what="engine",
        )

    def gateway_env(self, port: int, metrics_port: int = 0) -> dict[str, str]:
        """A gateway's settings on this stack, listening on `port` and serving /metrics on `metrics_port` (the
        stack's own, or others beside them; metrics port 0: any free one)."""
        return {
            "PREFT_GATEWAY__ENVIRONMENT": "prod",
            "PREFT_GATEWAY__HOST": LOOPBACK,
            "PREFT_GATEWAY__PORT": str(port),
            "PREFT_GATEWAY__METRICS_ADDRESS": f"{LOOPBACK}:{metrics_port}",
            **self._redis_env("PREFT_GATEWAY__", "gateway"),
            "PREFT_GATEWAY__REGISTRY_ADDRESS": f"{LOOPBACK}:{self.ports.registry}",
            "PREFT_GATEWAY__REGISTRY_TOKEN": self.gateway_registry_token,
            "PREFT_GATEWAY__ENGINE_URL": f"http://{LOOPBACK}:{self.ports.serve}",
            "PREFT_GATEWAY__ENGINE_TOKEN": self.engine_token,
            "PREFT_GATEWAY__MODEL_DIR": str(self.model_dir),
            "PREFT_GATEWAY__SERVED_MODEL_NAME": self.profile.served_model_name,
            "PREFT_GATEWAY__MAX_MODEL_LEN": str(self.profile.max_model_len),
            "PREFT_GATEWAY__MAX_PROMPT_TOKENS": str(self.profile.max_prompt_tokens),
            "PREFT_GATEWAY__RESPONSES_STORE_TTL_S": "3600",  # (this machine's own data: keep responses an hour)
            **self._s3_env("PREFT_GATEWAY__"),  # (the Files and Batch APIs: files/ and batches/ beside the blobs)
            **self.profile.gateway_env,
        }

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
