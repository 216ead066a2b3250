"""How the platform's services are wired to each other, wherever they run: the secrets of a state directory, what the
stack serves (its profile), each service's environment given where the others are, the engine's Serve-config args
and its secrets apart from them, and the registry's first contents.

One definition for the one-host stack (`stack.local`, everything on 127.0.0.1) and the testbed (`stack.testbed`,
services on network-namespace hosts): only the addresses differ.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preft.common.redis_acl import ADMIN_USER, SERVICES

if TYPE_CHECKING:
    from preft.registry.client import RegistryClient

BASE_MODEL_ID = "tiny-llama"
DEMO_TENANT = "demo"
DEMO_FILE = "demo.json"
SECRETS_FILE = "secrets.json"
S3_ACCESS_KEY = "preft-local"
S3_BUCKET = "preft-adapters"


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


def stored_secret(state_dir: Path, name: str) -> str:
    """A random secret created once and kept (owner-only) in the state directory's secrets file."""
    path = state_dir / SECRETS_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    if name not in data:
        data[name] = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
    return data[name]


@dataclass(frozen=True)
class PlatformSecrets:
    """The secrets of one state directory: the registry's three tokens, the engine's token, the S3 secret, and one
    Redis password per ACL user. The gateway and the engine get narrower credentials than the admin token: a
    compromised one of them cannot administer tenants and keys, and no process but the gateway can spend the engine
    (docs/security.md)."""

    admin_token: str
    gateway_registry_token: str
    reader_token: str
    engine_token: str
    s3_secret: str
    redis_passwords: dict[str, str]

    @classmethod
    def load(cls, state_dir: Path) -> PlatformSecrets:
        """The state directory's secrets, each created on first use (a restart finds the same ones)."""
        return cls(
            admin_token=stored_secret(state_dir, "registry_admin_token"),
            gateway_registry_token=stored_secret(state_dir, "registry_gateway_token"),
            reader_token=stored_secret(state_dir, "registry_reader_token"),
            engine_token=stored_secret(state_dir, "engine_token"),
            s3_secret=stored_secret(state_dir, "s3_secret_key"),
            redis_passwords={
                user: stored_secret(state_dir, f"redis_{user}_password") for user in (ADMIN_USER, *SERVICES)
            },
        )


@dataclass(frozen=True)
class Wiring:
    """Where the platform's shared services are (addresses as their clients dial them) and the secrets to reach them:
    what every service's environment is made of."""

    secrets: PlatformSecrets
    profile: StackProfile
    model_dir: Path
    redis_url: str  # (no credentials: each service adds its own ACL user's)
    s3_endpoint_url: str
    registry_address: str
    engine_url: str

    def s3_env(self, prefix: str) -> dict[str, str]:
        return {
            f"{prefix}S3__ENDPOINT_URL": self.s3_endpoint_url,
            f"{prefix}S3__ACCESS_KEY": S3_ACCESS_KEY,
            f"{prefix}S3__SECRET_KEY": self.secrets.s3_secret,
            f"{prefix}S3__BUCKET": S3_BUCKET,
        }

    def redis_env(self, prefix: str, user: str) -> dict[str, str]:
        return {
            f"{prefix}REDIS__URL": self.redis_url,
            f"{prefix}REDIS__USERNAME": user,
            f"{prefix}REDIS__PASSWORD": self.secrets.redis_passwords[user],
        }

    def registry_env(self, listen_address: str, metrics_address: str) -> dict[str, str]:
        """The registry's settings, serving gRPC on `listen_address` and metrics on `metrics_address`."""
        s = self.secrets
        return {
            "PREFT_REGISTRY__ENVIRONMENT": "prod",
            "PREFT_REGISTRY__LISTEN_ADDRESS": listen_address,
            "PREFT_REGISTRY__METRICS_ADDRESS": metrics_address,
            "PREFT_REGISTRY__ADMIN_TOKEN": s.admin_token,
            "PREFT_REGISTRY__GATEWAY_TOKEN": s.gateway_registry_token,
            "PREFT_REGISTRY__READER_TOKEN": s.reader_token,
            **self.redis_env("PREFT_REGISTRY__", "registry"),
            **self.s3_env("PREFT_REGISTRY__"),
        }

    def gateway_env(self, host: str, port: int, metrics_port: int = 0) -> dict[str, str]:
        """A gateway's settings, listening on `host`:`port` and serving /metrics on `host`:`metrics_port` (0: any
        free port)."""
        p = self.profile
        return {
            "PREFT_GATEWAY__ENVIRONMENT": "prod",
            "PREFT_GATEWAY__HOST": host,
            "PREFT_GATEWAY__PORT": str(port),
            "PREFT_GATEWAY__METRICS_ADDRESS": f"{host}:{metrics_port}",
            **self.redis_env("PREFT_GATEWAY__", "gateway"),
            "PREFT_GATEWAY__REGISTRY_ADDRESS": self.registry_address,
            "PREFT_GATEWAY__REGISTRY_TOKEN": self.secrets.gateway_registry_token,
            "PREFT_GATEWAY__ENGINE_URL": self.engine_url,
            "PREFT_GATEWAY__ENGINE_TOKEN": self.secrets.engine_token,
            "PREFT_GATEWAY__MODEL_DIR": str(self.model_dir),
            "PREFT_GATEWAY__SERVED_MODEL_NAME": p.served_model_name,
            "PREFT_GATEWAY__MAX_MODEL_LEN": str(p.max_model_len),
            "PREFT_GATEWAY__MAX_PROMPT_TOKENS": str(p.max_prompt_tokens),
            "PREFT_GATEWAY__RESPONSES_STORE_TTL_S": "3600",  # (this machine's own data: keep responses an hour)
            **self.s3_env("PREFT_GATEWAY__"),  # (the Files and Batch APIs: files/ and batches/ beside the blobs)
            **p.gateway_env,
        }

    def engine_args(self, disk_cache_dir: Path, **overrides: Any) -> dict[str, Any]:
        """The engine's settings without its secrets: a Serve config's `args` (`serve_app.app_builder` refuses secrets
        there). `overrides` go over the profile's engine settings, as they over TINY_ENGINE (nested dicts whole)."""
        p = self.profile
        args: dict[str, Any] = {**TINY_ENGINE, **p.engine, **overrides}
        # tenant ids on the engine's traffic metrics: every port that serves them is the platform's own here
        args["replica"] = {**args.get("replica", {}), "metrics_tenant_label": True}
        return {
            **args,
            "model_dir": str(self.model_dir),
            "max_model_len": p.max_model_len,
            "disk_cache_dir": str(disk_cache_dir),
            "registry_address": self.registry_address,
            "redis": {"url": self.redis_url},
            "s3": {"endpoint_url": self.s3_endpoint_url, "bucket": S3_BUCKET},
        }

    def engine_secrets(self) -> dict[str, Any]:
        """The engine's secret settings, nested as EngineSettings' fields (what a Ray node's environment carries)."""
        s = self.secrets
        return {
            "api_token": s.engine_token,
            "registry_token": s.reader_token,
            "redis": {"username": "engine", "password": s.redis_passwords["engine"]},
            "s3": {"access_key": S3_ACCESS_KEY, "secret_key": s.s3_secret},
        }

    def engine_secret_env(self) -> dict[str, str]:
        """`engine_secrets` as PREFT_ENGINE__* variables: how a Ray node's processes (the Serve app's builder, the
        replicas) get them, as the RayService's pods do from Kubernetes Secrets."""
        return {f"PREFT_ENGINE__{name.upper()}": value for name, value in _flatten(self.engine_secrets())}


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}__")
        else:
            out.append((f"{prefix}{key}", str(value)))
    return out


def merge_settings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into `base`, nested dicts key by key (settings from two sources: args and secrets)."""
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_settings(out[key], value) if nested else value
    return out


def ensure_model(profile: StackProfile, model_dir: Path) -> None:
    """Generate the tiny model into `model_dir` unless the profile names one or it is there already."""
    if profile.model_dir is None and not (model_dir / "config.json").is_file():
        from preft.devtools.tiny import TinyModelSpec, build_model

        build_model(model_dir, TinyModelSpec())


def bootstrap_registry(client: RegistryClient, state_dir: Path, model_dir: Path, profile: StackProfile) -> None:
    """Base model, demo tenant, a demo key and two demo adapters (LoRA, DiReFT), recorded in DEMO_FILE; kept across
    restarts (a second run finds them and adds nothing)."""
    from preft.api.v1 import adapter_pb2 as apb
    from preft.api.v1 import registry_pb2 as pb
    from preft.common.errors import AlreadyExists
    from preft.devtools.tiny import build_direft, build_lora
    from preft.registry.client import scan_adapter_dir

    demo_path = state_dir / DEMO_FILE
    config = (model_dir / "config.json").read_text()
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id=profile.served_model_name, config_json=config))
    if not profile.demo:
        return
    with contextlib.suppress(AlreadyExists):
        client.call("CreateTenant", pb.CreateTenantRequest(id=DEMO_TENANT))
    if demo_path.is_file():
        return
    adapters = {
        "demo-lora": (build_lora(state_dir / "adapters" / "lora", model_dir), apb.POSITION_MODE_PREFILL),
        "demo-direft": (build_direft(state_dir / "adapters" / "direft", model_dir), apb.POSITION_MODE_PREFILL),
    }
    for name, (path, mode) in adapters.items():
        client.upload_adapter(scan_adapter_dir(path), tenant=DEMO_TENANT, name=name, mode=mode, uploader="preft up")
    key = client.call("IssueKey", pb.IssueKeyRequest(tenant=DEMO_TENANT, label="preft up"))
    fd = os.open(demo_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"tenant": DEMO_TENANT, "api_key": key.secret, "adapters": sorted(adapters)}, f)
