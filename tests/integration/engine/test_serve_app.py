"""The engine application on a real local Ray Serve: one replica of the real vLLM engine on the tiny Llama, adapters
fetched from the real S3 server by digest, requests through Serve's HTTP proxy with the multiplex header.

One Serve application is shared by the module's tests (engine start dominates); Ray is shut down at the end.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from preft.common.engine_contract import MULTIPLEX_HEADER, EngineChunk, EngineResponse
from preft.common.settings import RedisSettings, S3Settings
from preft.engine.ray_metrics import VLLM_METRICS
from preft.engine.residency import KEY_PREFIX
from preft.engine.settings import EngineSettings, ReplicaSettings
from preft.registry.blobstore import BlobStore
from preft.stack import free_port
from tests.adapter_specs import spec_for, upload
from tests.conftest import random_prompt
from tests.deploy.manifests import engine_metric_relabelings, relabel
from tests.reference import reference_generate

pytestmark = pytest.mark.engine

ENGINE_TOKEN = "engine-test-token"
AUTH = {"authorization": f"Bearer {ENGINE_TOKEN}"}  # (the client's default: every request is the gateway's)
APP = "preft-engine-test"


@pytest.fixture(scope="module")
def bucket(s3_server):
    name = f"test-{uuid.uuid4().hex[:24]}"
    s3_server.client().create_bucket(Bucket=name)
    return S3Settings(
        endpoint_url=s3_server.endpoint_url,
        bucket=name,
        access_key=s3_server.access_key,
        secret_key=SecretStr(s3_server.secret_key),
    )


@pytest.fixture(scope="module")
def specs(bucket, adapters):
    store = BlobStore(bucket)
    return {name: upload(store, path) for name, path in adapters["llama"].items()}


@pytest.fixture(scope="module")
def ray_metrics_port():
    """The Ray node's metrics port (what the PodMonitor scrapes on each Ray pod)."""
    return free_port()


@pytest.fixture(scope="module")
def serve_app(model_dirs, bucket, redis_server, tmp_path_factory, specs, ray_metrics_port):
    import ray
    from ray import serve

    from preft.engine.serve_app import build_app
    from preft.stack.ray_local import start_local_ray

    disk = tmp_path_factory.mktemp("adapter-cache")
    settings = EngineSettings(
        model_dir=model_dirs["llama"],
        dtype="float32",
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=16,
        max_num_batched_tokens=64,
        max_model_len=512,
        block_size=32,
        gpu_memory_utilization=0.1,
        cpu_num_threads=1,
        cpu_omp_threads_bind="1",  # vLLM's worker computes on core 1; core 0 is left to Ray and the replica
        disk_cache_dir=disk,
        s3=bucket,
        redis=RedisSettings(url=redis_server.url_for("engine")),
        residency_heartbeat_s=1.0,
        residency_ttl_s=5.0,
        replica=ReplicaSettings(
            num_replicas=1,
            num_cpus_per_replica=1,
            max_adapters_per_replica=4,
            graceful_shutdown_timeout_s=15,
            health_check_period_s=2,
            ray_metrics_interval_s=1.0,
        ),
        app_name=APP,
        api_token=SecretStr(ENGINE_TOKEN),
    )
    port = free_port()
    start_local_ray(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=ray_metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},  # (Ray's default: 10 s)
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        started = time.perf_counter()
        serve.run(build_app(settings), name=APP, route_prefix="/")
        deploy_s = time.perf_counter() - started
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=120) as client:
            health = client.get("/healthz").json()
            print(
                f"\nserve.run until ready: {deploy_s:.1f} s; engine start inside the replica: "
                f"{health['engine_start_s']:.1f} s"
            )
            yield client, settings
    finally:
        started = time.perf_counter()
        serve.shutdown()
        ray.shutdown()
        print(f"\nserve.shutdown + ray.shutdown: {time.perf_counter() - started:.1f} s")


def _post(client, body: dict, model_id: str) -> httpx.Response:
    return client.post("/generate", json=body, headers={MULTIPLEX_HEADER: model_id})


def _metric(client, name: str, **labels) -> float:
    """One sample from the replica's /metrics (one replica: the proxy always reaches it)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}}") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_base_request_non_streaming_and_streaming(serve_app):
    client, _ = serve_app
    body = {"request_id": "b1", "prompt_token_ids": [5, 9, 13, 17], "max_tokens": 6, "ignore_eos": True}
    r = _post(client, body, "base")
    assert r.status_code == 200, r.text
    resp = EngineResponse.model_validate(r.json())
    assert len(resp.token_ids) == 6 and resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 6

    with client.stream("POST", "/generate", json={**body, "stream": True}, headers={MULTIPLEX_HEADER: "base"}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("application/x-ndjson")
        chunks = [EngineChunk.model_validate_json(line) for line in s.iter_lines() if line]
    assert [t for c in chunks for t in c.token_ids] == resp.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage == resp.usage


def test_cold_adapter_is_downloaded_once_then_served_from_memory(serve_app, specs, model_dirs, adapters):
    client, settings = serve_app
    spec = specs["lora_a"]
    prompt = random_prompt(__import__("random").Random(3), 20)
    body = {
        "request_id": "a1",
        "prompt_token_ids": prompt,
        "max_tokens": 8,
        "ignore_eos": True,
        "adapter": spec.model_dump(),
        "mode": "prefill",
    }
    s3_before = _metric(client, "preft_paging_hits_total", tier="s3")
    host_hits_before = _metric(client, "preft_paging_hits_total", tier="host")

    started = time.perf_counter()
    first = _post(client, body, spec.digest)
    cold_s = time.perf_counter() - started
    assert first.status_code == 200, first.text
    started = time.perf_counter()
    second = _post(client, {**body, "request_id": "a2"}, spec.digest)
    warm_s = time.perf_counter() - started
    assert second.status_code == 200
    print(f"\ncold adapter request: {cold_s * 1000:.0f} ms; same adapter again: {warm_s * 1000:.0f} ms")

    assert first.json()["token_ids"] == second.json()["token_ids"]
    expected = reference_generate(model_dirs["llama"], prompt, adapters["llama"]["lora_a"], "prefill", 8)
    assert first.json()["token_ids"] == expected
    assert _metric(client, "preft_paging_hits_total", tier="s3") == s3_before + 1  # one fetch
    assert _metric(client, "preft_paging_hits_total", tier="host") >= host_hits_before + 1
    assert (settings.disk_cache_dir / "slot-0" / spec.digest / "adapter_model.safetensors").is_file()


def test_concurrent_requests_for_a_cold_adapter_share_one_download(serve_app, specs):
    client, _ = serve_app
    spec = specs["direft_a"]
    s3_before = _metric(client, "preft_paging_hits_total", tier="s3")
    body = {"prompt_token_ids": [7, 8, 9], "max_tokens": 4, "adapter": spec.model_dump(), "stream": True}

    import concurrent.futures

    def one(i: int) -> list[dict]:
        with client.stream(
            "POST", "/generate", json={**body, "request_id": f"d{i}"}, headers={MULTIPLEX_HEADER: spec.digest}
        ) as s:
            assert s.status_code == 200
            return [json.loads(line) for line in s.iter_lines() if line]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert all(r[-1]["finish_reason"] == "length" for r in results)
    assert len({tuple(t for c in r for t in c["token_ids"]) for r in results}) == 1
    assert _metric(client, "preft_paging_hits_total", tier="s3") == s3_before + 1


def test_bad_adapter_spec_is_refused_and_the_replica_keeps_serving(serve_app, specs, adapters):
    client, _ = serve_app
    good = specs["lora_b"]
    lying = spec_for(adapters["llama"]["lora_b"]).model_copy(update={"digest": specs["lora_c"].digest})
    body = {"request_id": "x1", "prompt_token_ids": [3, 4, 5], "max_tokens": 3, "adapter": lying.model_dump()}
    r = _post(client, body, lying.digest)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "invalid_request" and "digest" in r.json()["message"]

    r = _post(client, {**body, "adapter": good.model_dump()}, lying.digest)  # header disagrees with the body
    assert r.status_code == 400 and MULTIPLEX_HEADER in r.json()["message"]

    r = _post(client, {**body, "request_id": "x2", "adapter": good.model_dump()}, good.digest)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/healthz").json()["status"] == "ok"


def test_replica_publishes_its_adapters_to_redis(serve_app, specs, redis_server):
    r = redis.Redis.from_url(redis_server.admin_url)
    keys = []
    for _ in range(30):
        keys = list(r.scan_iter(f"{KEY_PREFIX}*"))
        if keys:
            break
        time.sleep(0.2)
    assert len(keys) == 1
    held = {m.decode() for m in r.smembers(keys[0])}
    assert specs["lora_a"].digest in held or specs["lora_b"].digest in held
    assert 0 < r.pttl(keys[0]) <= 5000


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a Prometheus text export, keyed by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_replica_metrics_reach_rays_metrics_port_under_their_own_names(serve_app, ray_metrics_port):
    """What a fleet's Prometheus reads of a replica: the Ray node's metrics port, relabeled as the engine's PodMonitor
    does (deploy/base/monitoring). After the requests above, every preft_* counter sample of the replica's /metrics
    that has risen (requests, tokens, latency histograms, paging) is there under its own name with the same value,
    and the gauges are there too (engine.ray_metrics copies them; Ray names them ray_*, the relabelings name them
    back). vLLM's own engine metrics (KV-cache usage, running/waiting requests, tokens, TTFT/e2e histograms, prefix
    cache) come the same way, as vllm:<name>."""
    client, _ = serve_app
    rules = engine_metric_relabelings()
    ray_own = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId"}

    def bridged(name: str) -> bool:  # preft's engine series and the vLLM families engine.ray_metrics copies
        if name.endswith("_created"):
            return False
        if name.startswith("vllm:"):
            return any(name.removeprefix(f) in ("", "_total", "_bucket", "_sum", "_count") for f in VLLM_METRICS)
        return name.startswith("preft_") and not name.startswith("preft_gateway_")

    replica = {key: value for key, value in _samples(client.get("/metrics").text).items() if bridged(key[0])}
    # (a counter sample still at 0, e.g. an empty low bucket, appears in Ray's export once it first rises)
    counters = {k: v for k, v in replica.items() if k[0].endswith(("_total", "_bucket", "_sum", "_count")) and v}
    assert any(k[0] == "preft_requests_total" for k in counters) and any(k[0].endswith("_bucket") for k in counters)
    # vLLM's own engine metrics (its Prometheus stat logger, in the replica's registry) after the requests above
    vllm_counters = {"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total"}
    vllm_counters |= {"vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count"}
    assert vllm_counters <= {k[0] for k in counters}
    scraped: dict = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{ray_metrics_port}/metrics", timeout=5).text
        scraped, unnamed = {}, set()
        for (name, labels), value in _samples(text).items():
            relabeled = relabel({"__name__": name, **dict(labels)}, rules)
            name = relabeled.pop("__name__")
            if name.startswith(("ray_preft_", "ray_vllm_")):
                unnamed.add(name)
            if name.startswith(("preft_", "vllm:")):
                own = {k: v for k, v in relabeled.items() if k not in ray_own and not k.startswith("otel_scope_")}
                scraped[(name, tuple(sorted(own.items())))] = value
        if all(scraped.get(k) == pytest.approx(v) for k, v in counters.items()):
            break
        time.sleep(1)
    missing = {k: v for k, v in counters.items() if scraped.get(k) != pytest.approx(v)}
    assert not missing, f"{len(missing)} of {len(counters)} counter samples differ or are missing: {missing}"
    gauges = {name for name, _ in scraped} - {name for name, _ in counters}
    assert {"preft_queue_depth", "preft_tokens_per_second"} <= gauges
    # the KV-cache pressure alert's series, and the scheduler's queue
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"} <= gauges
    assert not unnamed, f"samples the relabelings did not name back: {unnamed}"
    assert not {name for name, _ in scraped if name.startswith("preft_gateway_")}  # (the gateway's, not copied)


def test_deleting_the_app_drains_in_flight_requests_first(serve_app, redis_server):
    """Last in the module: it removes the application. A stream that is running when the app is deleted finishes
    whole; then the replica's drain ran (its residency key is removed)."""
    import threading

    from ray import serve

    client, _ = serve_app
    r = redis.Redis.from_url(redis_server.admin_url)
    assert list(r.scan_iter(f"{KEY_PREFIX}*")), "the replica publishes residency while it runs"
    body = {"request_id": "long", "prompt_token_ids": [4, 5, 6], "max_tokens": 300, "ignore_eos": True, "stream": True}
    lines: list[dict] = []
    first_line = threading.Event()

    def consume() -> None:
        with client.stream("POST", "/generate", json=body, headers={MULTIPLEX_HEADER: "base"}) as s:
            for line in s.iter_lines():
                if line:
                    lines.append(json.loads(line))
                    first_line.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert first_line.wait(60)
    started = time.perf_counter()
    serve.delete(APP)
    delete_s = time.perf_counter() - started
    reader.join(60)
    print(f"\nserve.delete with a stream in flight: {delete_s:.1f} s")
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["usage"]["completion_tokens"] == 300
    assert sum(len(line["token_ids"]) for line in lines) == 300
    assert not list(r.scan_iter(f"{KEY_PREFIX}*"))
