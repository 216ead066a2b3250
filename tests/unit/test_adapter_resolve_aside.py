"""AsyncPreftEngine validates and hashes an adapter new to its catalog off the event loop: the whole file is hashed
(84 MB for a rank-16 LoRA of Llama-3.1-8B), and the loop meanwhile streams every request of the replica."""

from __future__ import annotations

import asyncio
import threading

import pytest

from preft.common.errors import Unavailable
from preft.engine.async_engine import AsyncPreftEngine
from preft.engine.settings import EngineOptions


@pytest.mark.parametrize("call", ["prepare_lora", "add_lora"])
def test_an_adapter_new_to_the_catalog_is_resolved_outside_the_event_loop(model_dirs, adapters, monkeypatch, call):
    engine = AsyncPreftEngine(EngineOptions(model=str(model_dirs["llama"]), max_lora_rank=8))
    resolve, threads = engine.catalog.resolve, []

    def recording(adapter_dir):
        threads.append(threading.get_ident())
        return resolve(adapter_dir)

    monkeypatch.setattr(engine.catalog, "resolve", recording)

    async def load() -> int:
        with pytest.raises(Unavailable):  # (no vLLM started: the call stops once the adapter is resolved)
            await getattr(engine, call)(adapters["llama"]["lora_a"])
        return threading.get_ident()

    loop_thread = asyncio.run(load())
    assert threads and loop_thread not in threads
