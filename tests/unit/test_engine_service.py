"""A replica's request path and HTTP contract with a test engine injected (no vLLM, no Ray): errors as statuses,
NDJSON streaming, the adapter hook, draining, a dead engine, aborts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from preft.common.engine_contract import (
    LIVE_PRIORITY,
    MULTIPLEX_HEADER,
    OFFLINE_PRIORITY,
    EngineChunk,
    EngineRequest,
    EngineResponse,
    Usage,
)
from preft.engine.http import create_app
from preft.engine.service import EngineService
from preft.engine.settings import EngineSettings
from tests.adapter_specs import service_over, spec_for
from tests.fake_engine import ScriptedEngine

TOKEN = "unit-test-engine-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def _engine_token(monkeypatch):
    """Settings outside dev refuse the placeholder engine token."""
    monkeypatch.setenv("PREFT_ENGINE__API_TOKEN", TOKEN)


@pytest.fixture
def replica(model_dirs, adapters, tmp_path):
    engine = ScriptedEngine(model_dir=model_dirs["llama"])
    service = service_over(engine, adapters["llama"].values(), tmp_path / "disk", host_max_adapters=4)
    hook_calls: list[tuple[str, str | None]] = []

    async def on_adapter(model_id, spec):
        hook_calls.append((model_id, spec.digest if spec else None))

    app = create_app(service, token=TOKEN, on_adapter=on_adapter)
    specs = {name: spec_for(path, ref=f"t/{name}@v1") for name, path in adapters["llama"].items()}
    return service, engine, app, specs, hook_calls


def body(**kw) -> dict:
    data = {"request_id": "r1", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}
    data.update(kw)
    return data


async def post(app, data: dict, headers: dict | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        return await client.post("/generate", json=data, headers={**AUTH, **(headers or {})})


def test_non_streaming_and_streaming_answers_follow_the_contract(replica):
    service, engine, app, specs, hooks = replica

    async def scenario():
        await service.start()
        r = await post(app, body(), {MULTIPLEX_HEADER: "base"})
        assert r.status_code == 200, r.text
        resp = EngineResponse.model_validate(r.json())
        assert resp.token_ids == [18, 19, 20, 21] and resp.text == "<18><19><20><21>"
        assert resp.finish_reason == "length" and resp.usage == Usage(prompt_tokens=3, completion_tokens=4)

        spec = specs["lora_a"]
        r = await post(app, body(stream=True, adapter=spec.model_dump()), {MULTIPLEX_HEADER: spec.digest})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        chunks = [EngineChunk.model_validate_json(line) for line in r.text.splitlines()]
        assert [c.token_ids for c in chunks] == [[18], [19], [20], [21]]
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 4
        assert hooks == [("base", None), (spec.digest, spec.digest)]
        assert engine.seen_adapters[-1].name == spec.digest and spec.digest in engine.loaded
        assert service.in_flight == 0

    asyncio.run(scenario())


def test_errors_become_contract_statuses(replica):
    service, _, app, specs, _ = replica
    spec = specs["lora_a"]
    lying = spec.model_copy(update={"digest": specs["lora_b"].digest})

    async def scenario():
        await service.start()
        cases = [
            (body(), {MULTIPLEX_HEADER: spec.digest}, 400, "invalid_request", "header"),
            (body(prompt_token_ids=[]), {}, 400, "invalid_request", "prompt_token_ids"),
            (body(max_tokens=0), {}, 400, "invalid_request", "max_tokens"),
            (body(prompt_token_ids=[10**6]), {}, 400, "invalid_request", "vocabulary"),
            (body(adapter=lying.model_dump()), {MULTIPLEX_HEADER: lying.digest}, 400, "invalid_request", "digest"),
            (body(stream=True, prompt_token_ids=[10**6]), {}, 400, "invalid_request", "vocabulary"),
            (body(priority=LIVE_PRIORITY - 1), {}, 400, "invalid_request", "priority"),  # (ahead of live requests)
            (body(priority=OFFLINE_PRIORITY + 1), {}, 400, "invalid_request", "priority"),
        ]
        for data, headers, status, kind, words in cases:
            r = await post(app, data, headers)
            assert r.status_code == status, (data, r.text)
            assert r.json()["type"] == kind and words in r.json()["message"], r.json()
        assert service.in_flight == 0

    asyncio.run(scenario())


def test_header_with_dashes_is_accepted(replica):
    service, _, app, _, _ = replica

    async def scenario():
        await service.start()
        r = await post(app, body(), {"serve-multiplexed-model-id": "base"})
        assert r.status_code == 200
        r = await post(app, body(), {"serve-multiplexed-model-id": "0" * 64})
        assert r.status_code == 400

    asyncio.run(scenario())


def test_drain_refuses_new_requests_and_lets_running_ones_finish(replica):
    service, engine, app, _, _ = replica
    engine.delay_s = 0.05

    async def scenario():
        await service.start()
        running = await service.stream(EngineRequest.model_validate(body(max_tokens=10)))
        drain = asyncio.create_task(service.drain(timeout_s=10))
        await asyncio.sleep(0.01)
        r = await post(app, body())
        assert r.status_code == 503 and r.json()["type"] == "unavailable"
        tokens = [t async for c in running for t in c.token_ids]
        assert len(tokens) == 10  # the running request finished
        assert await drain is True and engine.stopped

        h = await httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r").get("/healthz")
        assert h.status_code == 503

    asyncio.run(scenario())


def test_drain_gives_up_after_the_timeout(replica):
    service, engine, _, _, _ = replica
    engine.delay_s = 0.5

    async def scenario():
        await service.start()
        running = await service.stream(EngineRequest.model_validate(body(max_tokens=100)))
        assert await service.drain(timeout_s=0.2) is False
        assert engine.stopped
        await running.aclose()

    asyncio.run(scenario())


def test_a_dead_engine_answers_503_and_fails_health(replica):
    service, engine, app, _, _ = replica

    async def scenario():
        await service.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            assert (await client.get("/healthz")).json()["status"] == "ok"
            engine.dead = True
            h = await client.get("/healthz")
            assert h.status_code == 503 and "died" in h.json()["message"]
            r = await client.post("/generate", json=body(), headers=AUTH)
            assert r.status_code == 503 and r.json()["type"] == "unavailable"

    asyncio.run(scenario())


def test_closing_a_stream_early_aborts_it_and_releases_the_adapter(replica):
    service, engine, _, specs, _ = replica
    engine.delay_s = 0.01
    spec = specs["direft_a"]

    async def scenario():
        await service.start()
        stream = await service.stream(EngineRequest.model_validate(body(max_tokens=50, adapter=spec.model_dump())))
        assert service.pager._host.pins(spec.digest) == 1
        first = await anext(stream)
        assert first.token_ids
        await stream.aclose()  # the client went away
        assert engine.aborted == ["r1"]
        assert service.in_flight == 0 and service.pager._host.pins(spec.digest) == 0

    asyncio.run(scenario())


def test_metrics_endpoint_exposes_preft_metrics(replica):
    service, _, app, _, _ = replica

    async def scenario():
        await service.start()
        await post(app, body())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            text = (await client.get("/metrics")).text
        assert "preft_queue_depth" in text and "preft_paging_hits_total" in text

    asyncio.run(scenario())


def test_generate_answers_only_the_gateway_token_while_health_and_metrics_stay_open(replica):
    service, engine, app, _, hooks = replica

    async def scenario():
        await service.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}, {"x-token": TOKEN}):
                r = await client.post("/generate", json=body(), headers=headers)
                assert r.status_code == 401 and r.json()["type"] == "unauthenticated", headers
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
        assert engine.seen_adapters == [] and hooks == []  # refused before anything ran

    asyncio.run(scenario())


def test_engine_token_placeholder_is_refused_outside_dev(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFT_ENGINE__API_TOKEN")
    with pytest.raises(ValueError, match="set PREFT_ENGINE__API_TOKEN"):
        EngineSettings(model_dir=tmp_path)
    assert EngineSettings(model_dir=tmp_path, environment="dev").api_token.get_secret_value() == "dev-engine-token"
    with pytest.raises(ValueError, match="non-empty"):
        create_app(None, token="")  # type: ignore[arg-type]


def test_settings_read_nested_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFT_ENGINE__MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("PREFT_ENGINE__MAX_CPU_LORAS", "8")
    monkeypatch.setenv("PREFT_ENGINE__REPLICA__NUM_REPLICAS", "3")
    monkeypatch.setenv("PREFT_ENGINE__S3__BUCKET", "adapters")
    monkeypatch.setenv("PREFT_ENGINE__CPU_OMP_THREADS_BIND", "0-1")
    s = EngineSettings()
    assert s.model_dir == tmp_path and s.max_cpu_loras == 8 and s.replica.num_replicas == 3
    assert s.s3.bucket == "adapters"
    assert s.process_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert s.process_env()["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert s.engine_options().max_cpu_loras == 8
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineSettings(model_dir=tmp_path, max_loras=8, max_cpu_loras=4)
    with pytest.raises(ValueError, match="residency_ttl_s"):
        EngineSettings(model_dir=tmp_path, residency_heartbeat_s=10, residency_ttl_s=5)


def test_lora_kernels_setting_reaches_the_replica_environment(tmp_path):
    from preft.vllm_plugin import settings

    default = EngineSettings(model_dir=tmp_path).lora_kernels  # the plugin reads it as the six names
    assert settings.parse_kernels(default) == {"expand", "shrink", "act", "fold", "gluon", "down"}
    assert EngineSettings(model_dir=tmp_path).process_env()["PREFT_LORA_KERNELS"] == "expand,shrink,act,fold,gluon,down"
    choices = ((" fused, expand", "fused,expand"), ("none", "none"), ("expand,shrink,act", "expand,shrink,act"))
    for value, env in choices:
        assert EngineSettings(model_dir=tmp_path, lora_kernels=value).process_env()["PREFT_LORA_KERNELS"] == env
    for bad in ("", "expnd", "none,expand"):
        with pytest.raises(ValueError, match="lora_kernels must be"):
            EngineSettings(model_dir=tmp_path, lora_kernels=bad)
    # fold folds into act, from the shrink's z; gluon is a fold's kernel; down is gluon's
    for bad in ("expand,fold", "expand,act,fold", "shrink,fold", "expand,shrink,act,gluon", "act,shrink,fold,down"):
        with pytest.raises(ValueError, match=r"must name 'act' and 'shrink' beside 'fold'.*'gluon' beside 'down'"):
            EngineSettings(model_dir=tmp_path, lora_kernels=bad)


def test_lora_tiles_setting_is_checked_and_reaches_the_replica_environment(tmp_path):
    assert "PREFT_LORA_TILES" not in EngineSettings(model_dir=tmp_path).process_env()
    tiles = "shrink=32x64 w4 s4,expand=64x128 w8 s3"
    assert EngineSettings(model_dir=tmp_path, lora_tiles=tiles).process_env()["PREFT_LORA_TILES"] == tiles
    with pytest.raises(ValueError, match="rows must be a power of two"):
        EngineSettings(model_dir=tmp_path, lora_tiles="expand=48x64")


def test_gc_freeze_setting_reaches_the_replica_environment(tmp_path, monkeypatch):
    from preft.vllm_plugin.patches import gc_freeze

    assert EngineSettings(model_dir=tmp_path).process_env()["PREFT_GC_FREEZE"] == "1"
    off = EngineSettings(model_dir=tmp_path, gc_freeze=False).process_env()["PREFT_GC_FREEZE"]
    assert off == "0"
    for value, enabled in ((off, False), ("1", True), ("false", False), ("off", False), (None, True)):
        if value is None:
            monkeypatch.delenv("PREFT_GC_FREEZE", raising=False)
        else:
            monkeypatch.setenv("PREFT_GC_FREEZE", value)
        assert gc_freeze.enabled() is enabled, value
    with pytest.raises(ValueError, match="gc_freeze"):
        EngineSettings(model_dir=tmp_path, gc_freeze="sometimes")


def test_scheduling_policy_setting_reaches_the_engine_arguments(tmp_path, monkeypatch):
    from preft.engine.vllm_engine import EngineOptions, engine_kwargs

    served = EngineSettings(model_dir=tmp_path).engine_options()
    assert served.scheduling_policy == "priority"  # (a batch's lines wait behind live requests)
    assert engine_kwargs(served)["scheduling_policy"] == "priority"
    assert engine_kwargs(EngineOptions(model=str(tmp_path)))["scheduling_policy"] == "fcfs"  # (the offline engine)
    monkeypatch.setenv("PREFT_ENGINE__SCHEDULING_POLICY", "fcfs")
    assert EngineSettings(model_dir=tmp_path).engine_options().scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineSettings(model_dir=tmp_path, scheduling_policy="lifo")


def test_every_settings_field_is_described():
    from preft.engine.settings import ReplicaSettings

    for model in (EngineSettings, ReplicaSettings):
        for name, field in model.model_fields.items():
            if name in ("s3", "redis", "replica"):
                continue
            assert field.description, f"{model.__name__}.{name} has no description"


def test_ndjson_line_format_is_one_json_object_per_line(replica):
    service, _, app, _, _ = replica

    async def scenario():
        await service.start()
        r = await post(app, body(stream=True, max_tokens=2))
        lines = r.text.split("\n")
        assert lines[-1] == "" and all(json.loads(line) for line in lines[:-1])

    asyncio.run(scenario())


@pytest.mark.parametrize(("tenant_label", "seen"), [(False, ""), (True, "acme")])
def test_the_tenant_id_reaches_the_engine_only_with_tenant_labels(replica, tenant_label, seen):
    """The engine labels its metrics with the request's tenant: served on Serve's and Ray's metrics ports, so only
    where those are confined (ReplicaSettings.metrics_tenant_label)."""
    _, engine, _, _, _ = replica
    service = EngineService(engine=engine, pager=replica[0].pager, tenant_label=tenant_label)

    async def scenario():
        await service.start()
        await service.complete(EngineRequest.model_validate(body(tenant="acme")))
        await service.drain(1)

    asyncio.run(scenario())
    assert engine.seen_tenants == [seen]
