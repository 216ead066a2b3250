"""A real registry (gRPC server in this process) over the real Redis and S3 servers the parent conftest starts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from pydantic import SecretStr

from preft.common.settings import RegistrySettings
from preft.devtools.tiny import TinyModelSpec, build_direft, build_lora, build_model
from preft.registry.client import RegistryClient
from preft.registry.server import build_server, build_service
from preft.registry.service import RegistryService
from tests.integration.conftest import make_registry_settings

TOKEN = "test-admin-token"
GATEWAY_TOKEN = "test-gateway-role-token"
READER_TOKEN = "test-reader-role-token"
MAX_RANK = 16


@pytest.fixture
def registry_settings(redis_url, s3_bucket) -> RegistrySettings:
    return make_registry_settings(
        redis_url,
        s3_bucket,
        TOKEN,
        gateway_token=SecretStr(GATEWAY_TOKEN),
        reader_token=SecretStr(READER_TOKEN),
        max_rank=MAX_RANK,
        max_adapter_bytes=64 * 1024 * 1024,
        max_config_bytes=64 * 1024,
        default_max_adapters=5,
    )


@pytest.fixture
def service(registry_settings) -> RegistryService:
    return build_service(registry_settings)


@pytest.fixture
def registry_address(registry_settings, service) -> Iterator[str]:
    server, port = build_server(registry_settings, service)
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def client(registry_address) -> Iterator[RegistryClient]:
    with RegistryClient(registry_address, TOKEN, timeout_s=30) as c:
        yield c


@pytest.fixture
def redis_client(redis_url) -> Iterator[redis_lib.Redis]:
    r = redis_lib.Redis.from_url(redis_url, decode_responses=False)
    yield r
    r.close()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (its config is the registered base model) and adapters for it."""
    root = tmp_path_factory.mktemp("registry-models")
    model = build_model(root / "llama", TinyModelSpec(arch="llama", seed=3))
    return {
        "model": model,
        "lora": build_lora(root / "lora", model, rank=8, seed=31),
        "lora2": build_lora(root / "lora2", model, rank=4, targets=("q_proj", "v_proj"), seed=32),
        "direft": build_direft(root / "direft", model, rank=4, layers=(0, 2), seed=33),
    }


@pytest.fixture
def base_config(tiny) -> str:
    return (tiny["model"] / "config.json").read_text()


def state_snapshot(r: redis_lib.Redis, s3_client, bucket: str) -> dict:
    """Every registry key's serialized value plus the bucket's object keys: equal snapshots = unchanged state.

    `preft:blobtouch` (gc's recency bookkeeping) is left out: uploads refresh it by design.
    """
    keys = sorted(k for k in r.scan_iter("preft:*") if k != b"preft:blobtouch")
    objects = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))
    return {"redis": {k: r.dump(k) for k in keys}, "s3": objects}


def config_json(model_dir: Path, **changes) -> str:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    return json.dumps(cfg)
