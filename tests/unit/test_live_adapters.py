"""A replica's in-place updates with a test engine (no vLLM): an updated (live) adapter is pinned in host memory and
never evicted until restored; only its owner may update, restore or use it; a refused update leaves nothing pinned."""

from __future__ import annotations

import asyncio

import pytest
import torch

from preft.common.engine_contract import EngineRequest
from preft.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from preft.engine.service import EngineService
from tests.adapter_specs import service_over, spec_for
from tests.fake_engine import ScriptedEngine

TENSORS = {"layers.0.b": torch.zeros(4)}


@pytest.fixture
def replica(model_dirs, adapters, tmp_path):
    engine = ScriptedEngine(model_dir=model_dirs["llama"])
    service = service_over(engine, adapters["llama"].values(), tmp_path / "disk", max_live_adapters=1)
    specs = {name: spec_for(path, ref=f"t/{name}@v1") for name, path in adapters["llama"].items()}
    return service, engine, specs


async def _generate(service: EngineService, spec, rid: str = "r") -> None:
    await service.complete(EngineRequest(request_id=rid, prompt_token_ids=[5, 6], max_tokens=2, adapter=spec))


def test_a_live_adapter_is_never_evicted_until_restored(replica):
    service, engine, specs = replica
    live, a, b = specs["direft_a"], specs["lora_a"], specs["lora_b"]

    async def scenario():
        await service.pager.start()
        await _generate(service, live)
        update = await service.update_adapter_weights(live.digest, TENSORS, owner="t")
        assert (update.owner, update.version) == ("t", 1) and live.digest in service.live
        for k, spec in enumerate((a, b, a)):  # (a host tier of 2, one pinned: a and b take turns)
            await _generate(service, spec, f"churn-{k}")
        assert service.pager.holds(live.digest) and live.digest in engine.loaded
        await service.restore_adapter(live.digest, owner="t")
        assert live.digest not in service.live
        assert engine.updates[-1][0] == live.digest  # (the published weights, written back in place)
        assert engine.updates[-1][1] == sorted(["layers.0.A", "layers.0.B", "layers.0.b", *_layer(2)])
        await _generate(service, b, "after")  # (live is now the least recently used)
        assert not service.pager.holds(live.digest)

    asyncio.run(scenario())


def _layer(layer: int) -> list[str]:
    return [f"layers.{layer}.{part}" for part in ("A", "B", "b")]


def test_only_the_owner_updates_restores_and_uses_a_live_adapter(replica):
    service, _, specs = replica
    live = specs["direft_a"]
    copy = live.model_copy(update={"ref": "u/same-content@v1"})  # (another tenant's upload of the same files)

    async def scenario():
        await service.pager.start()
        with pytest.raises(NotFound):
            await service.update_adapter_weights(live.digest, TENSORS, owner="t")  # (not resident)
        await _generate(service, live)
        await service.update_adapter_weights(live.digest, TENSORS, owner="t")
        with pytest.raises(PermissionDenied):
            await service.update_adapter_weights(live.digest, TENSORS, owner="u")
        with pytest.raises(PermissionDenied):
            await service.restore_adapter(live.digest, owner="u")
        with pytest.raises(FailedPrecondition):
            await _generate(service, copy)
        await _generate(service, live, "owner")  # (the owner's own requests are served)
        await _generate(service, specs["lora_a"])
        with pytest.raises(ResourceExhausted):  # (max_live_adapters=1)
            await service.update_adapter_weights(specs["lora_a"].digest, TENSORS, owner="t")
        with pytest.raises(NotFound):
            await service.restore_adapter(specs["lora_a"].digest, owner="t")  # (not live)

    asyncio.run(scenario())


def test_a_first_update_waits_for_no_other_tenants_request_on_the_same_content(replica):
    service, engine, specs = replica
    live = specs["direft_a"]
    copy = live.model_copy(update={"ref": "u/same-content@v1"})
    engine.delay_s = 0.05

    async def scenario():
        await service.pager.start()
        other = asyncio.ensure_future(_generate(service, copy, "other"))
        await asyncio.sleep(0.02)
        with pytest.raises(FailedPrecondition):
            await service.update_adapter_weights(live.digest, TENSORS, owner="t")
        await other
        await service.update_adapter_weights(live.digest, TENSORS, owner="t")

    asyncio.run(scenario())


def test_a_refused_update_leaves_the_adapter_unpinned(replica):
    service, engine, specs = replica
    spec = specs["direft_a"]
    engine.refuse_updates = True

    async def scenario():
        await service.pager.start()
        await _generate(service, spec)
        with pytest.raises(InvalidArgument):
            await service.update_adapter_weights(spec.digest, TENSORS, owner="t")
        assert spec.digest not in service.live
        for k, other in enumerate((specs["lora_a"], specs["lora_b"])):
            await _generate(service, other, f"o-{k}")
        assert not service.pager.holds(spec.digest)

    asyncio.run(scenario())


def test_updates_are_refused_while_draining(replica):
    service, _, specs = replica

    async def scenario():
        await service.pager.start()
        await _generate(service, specs["lora_a"])
        await service.drain(1.0)
        with pytest.raises(Unavailable):
            await service.update_adapter_weights(specs["lora_a"].digest, TENSORS, owner="t")

    asyncio.run(scenario())
