"""The pager's mechanism against an in-memory blob source and a recording engine (no S3, no vLLM).

The same behaviours against a real S3 server are in tests/integration/engine/test_pager.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from preft.common.errors import InvalidArgument, Unavailable
from preft.engine.paging.pager import Pager
from tests.adapter_specs import CountingBlobs, MemoryBlobs, RecordingHost, make_pager, spec_for

ADAPTERS = ("lora_a", "lora_b", "lora_c", "direft_a", "direft_b")


@pytest.fixture
def setup(model_dirs, adapters, tmp_path):
    blobs = MemoryBlobs()
    for d in adapters["llama"].values():
        blobs.add_dir(d)
    specs = {name: spec_for(adapters["llama"][name], ref=f"t/{name}@v1") for name in ADAPTERS}
    counting = CountingBlobs(blobs)
    host = RecordingHost(model_dirs["llama"])

    def make(**kw) -> Pager:
        return make_pager(**{"host": host, "blobs": counting, "disk_dir": tmp_path / "disk", **kw})

    return make, specs, counting, host, blobs


def run(coro):
    return asyncio.run(coro)


def test_cold_adapter_goes_through_every_tier_once(setup):
    make, specs, counting, host, _ = setup

    async def scenario():
        pager = make()
        await pager.start()
        path = await pager.ensure(specs["lora_a"])
        assert path.name == specs["lora_a"].digest and (path / "adapter_model.safetensors").is_file()
        assert not (path / "README.md").exists()
        assert host.loaded == {specs["lora_a"].digest}
        assert counting.total == 2  # config + weights
        again = await pager.ensure(specs["lora_a"])
        assert again == path and counting.total == 2 and len(host.calls) == 1
        assert pager.resident("host") == [specs["lora_a"].digest] == pager.resident("disk")

    run(scenario())


def test_host_tier_is_authoritative_lru(setup):
    make, specs, counting, host, _ = setup
    a, b, c = (specs[n].digest for n in ("lora_a", "lora_b", "direft_a"))

    async def scenario():
        pager = make(host_max_adapters=2)
        await pager.start()
        await pager.ensure(specs["lora_a"])
        await pager.ensure(specs["lora_b"])
        await pager.ensure(specs["lora_a"])  # touch: b is now least recently used
        await pager.ensure(specs["direft_a"])
        # (sent together, in either order: vLLM's host cache has room beyond the tier for what is on its way)
        assert sorted(host.calls[-2:]) == [("add", c), ("remove", b)]
        assert host.loaded == {a, c}
        assert set(pager.resident("disk")) == {a, b, c}  # still on disk
        downloads = counting.total
        await pager.ensure(specs["lora_b"])  # back from disk, no download
        assert counting.total == downloads
        assert host.loaded == {c, b}

    run(scenario())


def test_adapters_in_use_are_not_evicted(setup):
    make, specs, _, host, _ = setup

    async def scenario():
        pager = make(host_max_adapters=2)
        await pager.start()
        async with pager.use(specs["lora_a"]), pager.use(specs["lora_b"]):
            with pytest.raises(Unavailable, match="host memory is full"):
                await pager.ensure(specs["lora_c"])
            assert not pager.holds(specs["lora_c"].digest)
        await pager.ensure(specs["lora_c"])  # once released, the least recently used goes
        assert host.loaded == {specs["lora_b"].digest, specs["lora_c"].digest}

    run(scenario())


def test_concurrent_requests_share_one_load_and_a_failure_reaches_all(setup):
    make, specs, counting, host, blobs = setup

    async def scenario():
        pager = make()
        await pager.start()
        counting.gate.clear()
        waiters = [asyncio.create_task(pager.ensure(specs["lora_a"])) for _ in range(8)]
        await asyncio.to_thread(counting.started.wait, 10)
        counting.gate.set()
        paths = await asyncio.gather(*waiters)
        assert len(set(paths)) == 1
        assert counting.total == 2 and len(host.calls) == 1  # one download of each file, one add

        # a failing load: every waiter gets the error, and it is not remembered
        weights = next(f for f in specs["lora_b"].files if f.path == "adapter_model.safetensors")
        saved = blobs.data.pop(weights.sha256)
        counting.gate.clear()
        counting.started.clear()
        waiters = [asyncio.create_task(pager.ensure(specs["lora_b"])) for _ in range(8)]
        await asyncio.to_thread(counting.started.wait, 10)
        counting.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, Unavailable) and "missing from the blob store" in r.message for r in results)
        assert counting.calls[weights.sha256] == 1
        blobs.data[weights.sha256] = saved
        await pager.ensure(specs["lora_b"])  # tried again, now works
        assert counting.calls[weights.sha256] == 2

    run(scenario())


def test_a_waiter_going_away_does_not_cancel_the_shared_load(setup):
    make, specs, counting, host, _ = setup

    async def scenario():
        pager = make()
        await pager.start()
        counting.gate.clear()
        first = asyncio.create_task(pager.ensure(specs["lora_a"]))
        second = asyncio.create_task(pager.ensure(specs["lora_a"]))
        await asyncio.to_thread(counting.started.wait, 10)
        first.cancel()
        counting.gate.set()
        assert (await second).name == specs["lora_a"].digest
        assert first.cancelled() and host.loaded == {specs["lora_a"].digest}

    run(scenario())


def test_wrong_digest_is_invalid_and_leaves_nothing_on_disk(setup, tmp_path):
    make, specs, _, host, _ = setup
    lying = specs["lora_a"].model_copy(update={"digest": specs["lora_b"].digest})

    async def scenario():
        pager = make()
        await pager.start()
        with pytest.raises(InvalidArgument, match="content digest"):
            await pager.ensure(lying)
        assert pager.resident("disk") == [] and host.calls == []
        disk = tmp_path / "disk"
        assert [p.name for p in disk.iterdir() if not p.name.startswith(".")] == []
        assert list((disk / ".staging").iterdir()) == []

    run(scenario())


def test_method_mismatch_is_invalid(setup):
    make, specs, _, host, _ = setup
    wrong = specs["lora_a"].model_copy(update={"method": "direft"})

    async def scenario():
        pager = make()
        await pager.start()
        with pytest.raises(InvalidArgument, match="is a lora adapter, not direft"):
            await pager.ensure(wrong)
        assert not pager.holds(wrong.digest) and host.loaded == set()

    run(scenario())


def test_failed_loads_are_counted_once_by_reason(setup):
    """preft_adapter_load_failures_total (the PreftAdapterLoadFailures alert): one count per failed load, however
    many requests waited for it, labelled by the error's status."""
    make, specs, _, _, blobs = setup

    def failures(reason: str) -> float:
        return REGISTRY.get_sample_value("preft_adapter_load_failures_total", {"reason": reason}) or 0.0

    async def scenario():
        pager = make()
        await pager.start()
        before = {r: failures(r) for r in ("unavailable", "invalid_argument")}
        weights = next(f for f in specs["lora_b"].files if f.path == "adapter_model.safetensors")
        saved = blobs.data.pop(weights.sha256)
        results = await asyncio.gather(*(pager.ensure(specs["lora_b"]) for _ in range(4)), return_exceptions=True)
        assert all(isinstance(r, Unavailable) for r in results)
        assert failures("unavailable") == before["unavailable"] + 1
        blobs.data[weights.sha256] = saved
        with pytest.raises(InvalidArgument):
            await pager.ensure(specs["lora_a"].model_copy(update={"method": "direft"}))
        assert failures("invalid_argument") == before["invalid_argument"] + 1
        await pager.ensure(specs["lora_b"])  # a load that works counts nothing
        assert failures("unavailable") == before["unavailable"] + 1

    run(scenario())


def test_disk_tier_evicts_by_bytes_and_keeps_host_resident_adapters(setup, tmp_path):
    make, specs, _, _, _ = setup
    sizes = {n: sum(f.size_bytes for f in specs[n].files) for n in ("lora_a", "lora_b", "lora_c")}

    async def scenario():
        # room for the two largest, not three; one host slot
        pager = make(host_max_adapters=1, disk_max_bytes=sum(sorted(sizes.values())[1:]) + 1)
        await pager.start()
        await pager.ensure(specs["lora_a"])
        await pager.ensure(specs["lora_b"])
        await pager.ensure(specs["lora_c"])  # lora_c in host; lora_a (oldest, not in host) leaves the disk
        disk = pager.resident("disk")
        assert specs["lora_a"].digest not in disk and specs["lora_c"].digest in disk
        assert not (tmp_path / "disk" / specs["lora_a"].digest).exists()

    run(scenario())


def test_restart_rebuilds_the_disk_index(setup):
    make, specs, counting, _, _ = setup

    async def scenario():
        pager = make()
        await pager.start()
        await pager.ensure(specs["lora_a"])
        await pager.ensure(specs["direft_a"])
        before = counting.total
        restarted = make()
        await restarted.start()
        assert set(restarted.resident("disk")) == {specs["lora_a"].digest, specs["direft_a"].digest}
        assert restarted.resident("host") == []  # a fresh engine holds nothing
        await restarted.ensure(specs["direft_a"])
        assert counting.total == before

    run(scenario())


def test_download_timeout_is_unavailable_and_cleans_up(setup, tmp_path):
    make, specs, counting, _, _ = setup

    async def scenario():
        pager = make(download_timeout_s=0.2)
        await pager.start()
        counting.gate.clear()
        started = time.perf_counter()
        with pytest.raises(Unavailable, match=r"took over 0\.2 s"):
            await pager.ensure(specs["lora_a"])
        assert time.perf_counter() - started < 5
        counting.gate.set()
        for _ in range(100):  # the abandoned thread finishes, then its staging directory goes
            if not list((tmp_path / "disk" / ".staging").iterdir()):
                break
            await asyncio.sleep(0.05)
        assert list((tmp_path / "disk" / ".staging").iterdir()) == []
        assert pager.resident("disk") == []

    run(scenario())


def test_prefetch_loads_hottest_last_and_skips_failures(setup):
    make, specs, _, _, _ = setup
    broken = specs["lora_c"].model_copy(update={"digest": specs["direft_b"].digest})

    async def scenario():
        pager = make(host_max_adapters=2)
        await pager.start()
        loaded = await pager.prefetch([specs["lora_a"], broken, specs["lora_b"]])
        assert loaded == [specs["lora_a"].digest]  # capacity 2: lora_b is past it; the broken one is skipped
        assert pager.resident("host") == [specs["lora_a"].digest]

        loaded = await pager.prefetch([specs["direft_a"], specs["lora_b"]])
        assert loaded == [specs["direft_a"].digest, specs["lora_b"].digest]
        assert pager.resident("host") == [specs["lora_b"].digest, specs["direft_a"].digest]  # hottest is newest

    run(scenario())


def test_not_started_is_unavailable(setup):
    make, specs, _, _, _ = setup
    with pytest.raises(Unavailable, match="not started"):
        run(make().ensure(specs["lora_a"]))


def test_replicas_on_one_node_claim_separate_disk_slots(tmp_path):
    from preft.engine.paging.disk import claim_slot

    first, lock0 = claim_slot(tmp_path)
    second, lock1 = claim_slot(tmp_path)
    assert (first.name, second.name) == ("slot-0", "slot-1")
    lock0.close()  # the replica holding slot-0 died: a new one takes over its cache
    again, lock2 = claim_slot(tmp_path)
    assert again == first
    lock1.close()
    lock2.close()


class GatedHost(RecordingHost):
    """A recording engine whose add_lora and remove_lora wait at their gates: shows which calls are out at once."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.adds_gate, self.removes_gate = asyncio.Event(), asyncio.Event()
        self.out = 0

    async def _gated(self, gate: asyncio.Event) -> None:
        self.out += 1
        try:
            await gate.wait()
        finally:
            self.out -= 1

    async def add_lora(self, adapter_dir: Path):
        await self._gated(self.adds_gate)
        return await super().add_lora(adapter_dir)

    async def remove_lora(self, digest: str) -> None:
        await self._gated(self.removes_gate)
        await super().remove_lora(digest)


async def _until(condition, what: str) -> None:
    for _ in range(500):  # (downloads run in threads)
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached: {what}")


def test_loads_of_several_adapters_send_their_adds_together_after_reading_them_ahead(setup, model_dirs):
    make, specs, _, _, _ = setup
    host = GatedHost(model_dirs["llama"])
    names = ("lora_a", "lora_b", "direft_a")

    async def scenario():
        pager = make(host=host, host_max_adapters=3)
        await pager.start()
        loads = [asyncio.create_task(pager.ensure(specs[n])) for n in names]
        # every add out at once: the engine runs them between two of its steps
        await _until(lambda: host.out == len(names), "three adds out")
        host.adds_gate.set()
        await asyncio.gather(*loads)
        assert host.loaded == {specs[n].digest for n in names}
        assert sorted(p.name for p in host.prepared) == sorted(specs[n].digest for n in names)  # each read ahead

    run(scenario())


def test_an_adapter_asked_for_while_its_removal_is_on_its_way_is_added_after_it(setup, model_dirs):
    make, specs, _, _, _ = setup
    host = GatedHost(model_dirs["llama"])
    a, b, c = specs["lora_a"], specs["lora_b"], specs["direft_a"]

    def calls_of(spec) -> list[str]:
        return [kind for kind, digest in host.calls if digest == spec.digest]

    async def scenario():
        pager = make(host=host, host_max_adapters=2)
        await pager.start()
        host.adds_gate.set()
        await pager.ensure(a)
        await pager.ensure(b)
        load_c = asyncio.create_task(pager.ensure(c))  # evicts a: its removal waits at its gate
        await _until(lambda: host.out == 1 and c.digest in host.loaded, "c added, a's removal out")
        load_a = asyncio.create_task(pager.ensure(a))  # evicts b; a's add must wait for a's removal
        await _until(lambda: host.out == 2, "b's removal out too")
        await asyncio.sleep(0.05)
        assert calls_of(a) == ["add"], "a added again before its removal reached the engine"
        host.removes_gate.set()
        await asyncio.gather(load_c, load_a)
        assert calls_of(a) == ["add", "remove", "add"]
        assert host.loaded == {a.digest, c.digest}

    run(scenario())
