"""Adapter affinity through Ray Serve's multiplexing, without vLLM: two replicas with the test engine injected
(`engine_cls=`), adapters fetched from the real S3 server, residency read back from the real Redis."""

from __future__ import annotations

import concurrent.futures
import functools
import time
import uuid

import httpx
import pytest
import redis
from pydantic import SecretStr

from preft.common.engine_contract import MULTIPLEX_HEADER
from preft.common.settings import RedisSettings, S3Settings
from preft.devtools.tiny import build_lora
from preft.engine.residency import KEY_PREFIX
from preft.engine.settings import EngineSettings, ReplicaSettings
from preft.registry.blobstore import BlobStore
from preft.stack import free_port
from tests.adapter_specs import upload
from tests.fake_engine import OverlapWitnessEngine

ENGINE_TOKEN = "engine-test-token"
AUTH = {"authorization": f"Bearer {ENGINE_TOKEN}"}  # (the client's default: every request is the gateway's)
APP = "preft-routing-test"


@pytest.fixture(scope="module")
def routed(model_dirs, adapters, s3_server, redis_server, tmp_path_factory):
    witness = tmp_path_factory.mktemp("add-witness")
    import ray
    from ray import serve

    from preft.engine.serve_app import build_app
    from preft.stack.ray_local import start_local_ray

    bucket = f"test-{uuid.uuid4().hex[:24]}"
    s3_server.client().create_bucket(Bucket=bucket)
    s3 = S3Settings(
        endpoint_url=s3_server.endpoint_url,
        bucket=bucket,
        access_key=s3_server.access_key,
        secret_key=SecretStr(s3_server.secret_key),
    )
    store = BlobStore(s3)
    specs = {name: upload(store, path) for name, path in adapters["llama"].items()}
    redis.Redis.from_url(redis_server.admin_url).flushall()
    settings = EngineSettings(
        model_dir=model_dirs["llama"],
        max_cpu_loras=4,
        disk_cache_dir=tmp_path_factory.mktemp("routing-cache"),
        s3=s3,
        redis=RedisSettings(url=redis_server.url_for("engine")),
        residency_heartbeat_s=0.5,
        residency_ttl_s=5.0,
        replica=ReplicaSettings(num_replicas=2, num_cpus_per_replica=0.5, max_adapters_per_replica=4),
        app_name=APP,
        api_token=SecretStr(ENGINE_TOKEN),
    )
    port = free_port()
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_cls = functools.partial(OverlapWitnessEngine, witness_dir=witness)
        serve.run(build_app(settings, engine_cls=engine_cls), name=APP, route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=60) as client:
            yield client, specs, settings, witness
    finally:
        serve.shutdown()
        ray.shutdown()


def _residency(redis_url: str) -> dict[str, set[str]]:
    r = redis.Redis.from_url(redis_url)
    return {k.decode(): {m.decode() for m in r.smembers(k)} for k in r.scan_iter(f"{KEY_PREFIX}*")}


def test_requests_for_an_adapter_stick_to_the_replica_that_holds_it(routed, redis_server):
    client, specs, settings, _ = routed
    names = ("lora_a", "lora_b", "direft_a")
    for name in names:  # first request per adapter: Serve picks a replica, which pages the adapter in
        spec = specs[name]
        r = client.post(
            "/generate",
            json={"request_id": f"{name}-0", "prompt_token_ids": [1, 2], "max_tokens": 2, "adapter": spec.model_dump()},
            headers={MULTIPLEX_HEADER: spec.digest},
        )
        assert r.status_code == 200, r.text
    time.sleep(1.0)  # routers learn the replicas' model ids (pushed every 0.1 s through the controller)
    for i in range(1, 13):
        spec = specs[names[i % len(names)]]
        r = client.post(
            "/generate",
            json={"request_id": f"r{i}", "prompt_token_ids": [1, 2], "max_tokens": 2, "adapter": spec.model_dump()},
            headers={MULTIPLEX_HEADER: spec.digest},
        )
        assert r.status_code == 200, r.text
    time.sleep(1.5)  # a heartbeat or two
    held = _residency(redis_server.admin_url)
    # Serve picks a replica for an adapter it has not seen by load, so one replica may hold all three (a replica
    # holding nothing has no key: Redis drops empty sets).
    assert 1 <= len(held) <= 2, held
    for name in names:
        holders = [replica for replica, digests in held.items() if specs[name].digest in digests]
        assert len(holders) == 1, f"{name} was paged into {len(holders)} replicas: routing did not stick"
    slots = sorted(p.name for p in settings.disk_cache_dir.iterdir())
    assert slots == ["slot-0", "slot-1"]  # one disk cache per replica


def test_generate_through_the_proxy_needs_the_engine_token(routed):
    client, _, _, _ = routed
    body = {"request_id": "anon", "prompt_token_ids": [1, 2], "max_tokens": 2}
    for auth in ("", "Bearer not-the-token"):
        r = client.post("/generate", json=body, headers={MULTIPLEX_HEADER: "base", "authorization": auth})
        assert r.status_code == 401 and r.json()["type"] == "unauthenticated"
    assert client.post("/generate", json=body, headers={MULTIPLEX_HEADER: "base"}).status_code == 200
    assert client.get("/healthz", headers={"authorization": ""}).status_code == 200


def test_a_replica_pages_several_cold_adapters_in_at_once(routed, model_dirs, tmp_path):
    """Serve runs a replica's multiplexed loader calls one at a time: the adapters are paged in before it, so that the
    adds of several cold adapters overlap (the test engine's adds each wait for another beside it)."""
    client, _, settings, witness = routed
    store = BlobStore(settings.s3)
    cold = [
        upload(store, build_lora(tmp_path / f"cold{i}", model_dirs["llama"], rank=4, seed=100 + i)) for i in range(4)
    ]

    def ask(spec) -> httpx.Response:
        body = {"request_id": f"cold-{spec.digest[:8]}", "prompt_token_ids": [1, 2], "max_tokens": 2}
        return client.post(
            "/generate", json={**body, "adapter": spec.model_dump()}, headers={MULTIPLEX_HEADER: spec.digest}
        )

    (witness / "hold").touch()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(cold)) as pool:
            answers = list(pool.map(ask, cold))
    finally:
        (witness / "hold").unlink()
    assert [r.status_code for r in answers] == [200] * len(cold), [r.text for r in answers]
    most = max(int(p.read_text()) for p in witness.glob("most-*"))
    assert most >= 2, "each replica added its cold adapters one at a time"
