"""The gateway over real servers: Redis and S3 (parent conftest), a registry gRPC server in this process, the stub
engine and the gateway each served by uvicorn on 127.0.0.1 in a thread, and the official `openai` client."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from fastapi import FastAPI
from pydantic import SecretStr

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.settings import RegistrySettings
from preft.devtools.tiny import TinyModelSpec, build_direft, build_lora, build_model
from preft.gateway.app import create_app
from preft.gateway.core.tokenization import PromptTokenizer
from preft.gateway.settings import GatewaySettings
from preft.gateway.testing import STUB_ENGINE_TOKEN, StubEngine, ThreadedServer, create_stub_engine
from preft.registry.client import RegistryClient, scan_adapter_dir
from preft.registry.server import build_server, build_service
from tests.integration.conftest import S3Target, make_registry_settings, service_redis

REGISTRY_TOKEN = "gateway-test-registry-token"  # the admin's: the tests' operator client
# The gateways hold the registry's gateway role, not the admin token: every test shows the role covers what they call.
GATEWAY_REGISTRY_TOKEN = "gateway-test-gateway-role-token"
BASE = "tiny-llama"
MODES = {"prefill": apb.POSITION_MODE_PREFILL, "all": apb.POSITION_MODE_ALL}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gateway-models")
    model = build_model(root / "llama", TinyModelSpec(arch="llama", seed=5))
    return {
        "model": model,
        "lora": build_lora(root / "lora", model, rank=4, targets=("q_proj", "v_proj"), seed=51),
        "direft": build_direft(root / "direft", model, rank=4, layers=(1,), seed=52),
    }


@pytest.fixture(scope="session")
def tokenizer(tiny_models) -> PromptTokenizer:
    return PromptTokenizer.load(tiny_models["model"])


@dataclass
class Registry:
    """A registry gRPC server in this process, and an operator client for it."""

    address: str
    client: RegistryClient
    server: Any
    service: Any
    settings: RegistrySettings

    def tenant(self, tenant: str, *, rpm: int = 0, tpm: int = 0, ttl_s: int = 0) -> str:
        """Create the tenant (0 = the registry's default limit) and return a new API key for it."""
        limits = pb.TenantLimits(requests_per_min=rpm, tokens_per_min=tpm)
        self.client.call("CreateTenant", pb.CreateTenantRequest(id=tenant, limits=limits))
        return self.key(tenant, ttl_s=ttl_s)[1]

    def key(self, tenant: str, *, ttl_s: int = 0) -> tuple[str, str]:
        """(key id, secret) of a new key."""
        issued = self.client.call("IssueKey", pb.IssueKeyRequest(tenant=tenant, label="test", ttl_s=ttl_s))
        return issued.key.id, issued.secret

    def publish(self, tenant: str, name: str, adapter_dir: Path, *, mode: str = "prefill", alias: str = ""):
        files = scan_adapter_dir(adapter_dir)
        return self.client.upload_adapter(files, tenant=tenant, name=name, mode=MODES[mode], alias=alias).manifest

    def share(self, tenant: str, name: str, *, add: tuple[str, ...] = (), remove: tuple[str, ...] = ()) -> None:
        self.client.call("Share", pb.ShareRequest(tenant=tenant, name=name, add=add, remove=remove))


def start_registry(redis_url: str, s3: S3Target, base_config: str) -> Registry:
    settings = make_registry_settings(redis_url, s3, REGISTRY_TOKEN, gateway_token=SecretStr(GATEWAY_REGISTRY_TOKEN))
    service = build_service(settings)
    server, port = build_server(settings, service)
    address = f"127.0.0.1:{port}"
    client = RegistryClient(address, REGISTRY_TOKEN, timeout_s=30)
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id=BASE, config_json=base_config))
    return Registry(address, client, server, service, settings)


@pytest.fixture
def registry(redis_url, s3_bucket, tiny_models) -> Iterator[Registry]:
    reg = start_registry(redis_url, s3_bucket, (tiny_models["model"] / "config.json").read_text())
    yield reg
    reg.client.close()
    reg.server.stop(grace=None)


@pytest.fixture
def stub() -> StubEngine:
    return StubEngine()


@pytest.fixture
def engine(stub) -> Iterator[ThreadedServer]:
    with ThreadedServer(create_stub_engine(stub)) as server:
        yield server


@dataclass
class Gateway:
    """A running gateway: its URL, settings, and clients that talk HTTP to it."""

    server: ThreadedServer
    settings: GatewaySettings
    app: FastAPI
    clients: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def metrics_url(self) -> str:
        """Its /metrics, on the listener of its own (apart from the API's port)."""
        return f"http://127.0.0.1:{self.app.state.core.metrics_port}/metrics"

    def openai(self, api_key: str, **kw: Any) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30, **kw)
        self.clients.append(client)
        return client

    def http(self, api_key: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        self.clients.append(client)
        return client


GatewayFactory = Callable[..., Gateway]


def start_gateway(
    *,
    redis_url: str,
    registry_address: str,
    engine_url: str,
    model_dir: Path,
    tokenizer: PromptTokenizer | None,
    engine_client: Any = None,
    **overrides: Any,
) -> Gateway:
    """A gateway served by uvicorn in a thread; `tokenizer=None` makes the app load it from model_dir."""
    values: dict[str, Any] = {
        "environment": "prod",
        "redis": service_redis(redis_url, "gateway"),
        "registry_address": registry_address,
        "registry_token": SecretStr(GATEWAY_REGISTRY_TOKEN),
        "engine_url": engine_url,
        "engine_token": SecretStr(STUB_ENGINE_TOKEN),
        "model_dir": model_dir,
        "served_model_name": BASE,
        "max_model_len": 512,
        "max_prompt_tokens": 256,
        "default_max_tokens": 8,
        "usage_flush_interval_s": 0.1,
        "engine_connect_timeout_s": 0.5,
        "metrics_address": "127.0.0.1:0",
        **overrides,
    }
    settings = GatewaySettings(**values)
    app = create_app(settings, tokenizer=tokenizer, engine_client=engine_client)
    return Gateway(ThreadedServer(app).start(), settings, app)


def stop_gateway(gateway: Gateway) -> None:
    for client in gateway.clients:
        with contextlib.suppress(Exception):
            client.close()
    gateway.server.stop()


@pytest.fixture
def make_gateway(redis_url, registry, engine, tokenizer, tiny_models) -> Iterator[GatewayFactory]:
    """Start a gateway over this test's Redis, registry and stub engine; keyword arguments override settings
    (`inject_tokenizer=False` makes the app load the tokenizer itself from model_dir)."""
    started: list[Gateway] = []

    def make(*, inject_tokenizer: bool = True, **overrides: Any) -> Gateway:
        # (Redis's deadline 2 s, not 0.5: on this 2-core machine a loaded run has stalled one admission past 0.5 s;
        # the faults tests start their own gateways at the default)
        overrides = {"engine_url": engine.url, "redis_timeout_s": 2.0, **overrides}
        gateway = start_gateway(
            redis_url=redis_url,
            registry_address=registry.address,
            model_dir=tiny_models["model"],
            tokenizer=tokenizer if inject_tokenizer else None,
            **overrides,
        )
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        stop_gateway(gateway)


@pytest.fixture
def gateway(make_gateway) -> Gateway:
    return make_gateway()


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-shaped error object of a JSON error answer (asserting the shape)."""
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


def until(read: Callable[[], Any], done: Callable[[Any], bool], *, timeout_s: float, poll_s: float = 0.05) -> Any:
    """`read()` once `done` holds of it, polled every `poll_s`; fails with the last value read after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        assert time.monotonic() < deadline, value
        time.sleep(poll_s)
    return value


def redis_now_ms(store: redis.Redis) -> int:
    """Redis' clock in ms (what the quota scripts score reservations by), from a synchronous client."""
    seconds, micros = store.time()
    return seconds * 1000 + micros // 1000
