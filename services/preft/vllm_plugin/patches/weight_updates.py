"""In-place adapter weight updates, the engine core's side: when new weights take effect, and what the scheduler and
the prefix cache do about it. The workers' side (the tensors themselves) is ``adapter_weights``.

``EngineCore.preft_update_adapter_weights(lora_id, path)`` is an engine-core utility method (the client calls it
with ``call_utility_async``, as vLLM's own utilities): the workers replace the adapter's tensors with those of the
safetensors file at ``path`` (``adapter_weights.apply_update``, through the executor's ``collective_rpc``), and the
adapter's prefix-cache version is bumped (``prefix_cache``). Its answer is a dict: ``{"error": message}`` for weights
that do not fit (nothing changed), else ``{"version", "waited_steps", "waited_for"}``.

When. Utility calls run in the engine core's loop between two steps, so a step never sees half an update; vLLM
runs everything it scheduled before (with asynchronous scheduling, too: the workers take the update after the steps
already sent to them, on the same stream). A request must also run its whole prompt on one set of weights, so an
update waits while a request of that adapter is part-way through its prompt (chunked prefill, or a prefix-cache hit
followed by the rest): it is kept here, the adapter's waiting requests are held out of the scheduler's queues (so no
new prompt starts and the wait ends once the running prompts are done, a few steps), and it is applied before the
first step that finds none; the utility answers then (it returns a Future, which vLLM's utility path awaits).

Who sees which weights. A request that has computed nothing when the update is applied (waiting, or preempted back
to position 0) runs on the new weights and is re-stamped with the new version (its blocks re-hashed). A request
decoding keeps its prompt's KV: in prefill mode it decodes on the base model, so its output is the old weights'
entirely; in ``all`` mode it decodes on with the new weights from the next step. Should such a request be preempted
later, it is re-stamped when it is back at position 0: its recomputed prompt is the new weights', in one piece.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from preft.vllm_plugin import compat
from preft.vllm_plugin.patches import adapter_weights, prefix_cache
from preft.vllm_plugin.patches.patching import wrap_method

UTILITY = "preft_update_adapter_weights"  # the EngineCore method a client calls
PENDING = "_preft_pending_updates"  # on vLLM's Scheduler: LoRA id -> _Pending, updates waiting for prompts to finish
DECODING = "_preft_decoding_stale"  # on vLLM's Scheduler: requests that kept an older version's KV (decoding)
Result = dict[str, Any]


@dataclass
class _Pending:
    """The updates of one adapter that wait for its running prompts to finish, in arrival order."""

    run: Callable[[str], str | None]  # applies one file's tensors in the workers; the error, if any
    updates: list[tuple[str, Future]] = field(default_factory=list)
    waited_for: int = 0  # the adapter's requests part-way through their prompt when the first update arrived
    waited_steps: int = 0


def _in_prompt(scheduler: Any, lora_id: int) -> int:
    """Running requests of the adapter that are part-way through their prompt."""
    return sum(
        1
        for r in scheduler.running
        if r.lora_request is not None
        and r.lora_request.lora_int_id == lora_id
        and 0 < r.num_computed_tokens < r.num_prompt_tokens
    )


def _run_in_workers(executor: Any, lora_id: int, path: str) -> str | None:
    errors = [e for e in executor.collective_rpc(adapter_weights.apply_update, args=(lora_id, path)) if e]
    return errors[0] if errors else None


def update_adapter_weights(core: Any, lora_id: int, path: str) -> Result | Future:
    """The utility method (installed on vLLM's EngineCore)."""
    scheduler = core.scheduler
    run = functools.partial(_run_in_workers, core.model_executor, lora_id)
    pending: dict[int, _Pending] = scheduler.__dict__.setdefault(PENDING, {})
    if lora_id not in pending:
        waiting_for = _in_prompt(scheduler, lora_id)
        if not waiting_for:
            return _apply(scheduler, lora_id, run, path, _Pending(run))
        pending[lora_id] = _Pending(run, waited_for=waiting_for)
    future: Future = Future()
    pending[lora_id].updates.append((path, future))
    return future


def _apply(scheduler: Any, lora_id: int, run: Callable[[str], str | None], path: str, entry: _Pending) -> Result:
    error = run(path)
    if error is not None:
        return {"error": error}
    version = prefix_cache.bump_version(scheduler, lora_id)
    decoding = scheduler.__dict__.setdefault(DECODING, set())
    for request in scheduler.running:
        if request.lora_request is not None and request.lora_request.lora_int_id == lora_id:
            decoding.add(request)
    for queue in _queues(scheduler):
        for request in queue:
            if request.lora_request is not None and request.lora_request.lora_int_id == lora_id:
                prefix_cache.restamp(scheduler, request)
    return {"version": version, "waited_steps": entry.waited_steps, "waited_for": entry.waited_for}


def _queues(scheduler: Any) -> tuple[Any, ...]:
    skipped = getattr(scheduler, "skipped_waiting", None)  # (vLLM's second waiting queue)
    return (scheduler.waiting,) if skipped is None else (scheduler.waiting, skipped)


def before_schedule(scheduler: Any) -> None:
    """Before each step: apply the updates no prompt waits for any longer; re-stamp requests that kept an older
    version's KV once they are back at position 0."""
    decoding = scheduler.__dict__.get(DECODING)
    if decoding:
        for request in list(decoding):
            if request.is_finished():
                decoding.discard(request)
            elif request.num_computed_tokens == 0 and request not in scheduler.running:
                prefix_cache.restamp(scheduler, request)
                decoding.discard(request)
    pending: dict[int, _Pending] | None = scheduler.__dict__.get(PENDING)
    for lora_id, entry in list((pending or {}).items()):
        if _in_prompt(scheduler, lora_id):
            entry.waited_steps += 1
            continue
        del pending[lora_id]
        for path, future in entry.updates:
            try:
                future.set_result(_apply(scheduler, lora_id, entry.run, path, entry))
            except Exception as e:  # (a worker failed: the caller hears it, as from any utility)
                future.set_exception(e)


def hold_waiting(scheduler: Any) -> list[tuple[Any, Any]]:
    """Take the waiting requests of adapters with a pending update out of the queues for one step."""
    pending = scheduler.__dict__.get(PENDING)
    if not pending:
        return []
    held = []
    for queue in _queues(scheduler):
        ours = [r for r in queue if r.lora_request is not None and r.lora_request.lora_int_id in pending]
        if ours:
            queue.remove_requests(ours)
            held += [(queue, r) for r in ours]
    return held


def release_waiting(held: list[tuple[Any, Any]]) -> None:
    for queue, request in held:
        queue.add_request(request)


def _remove_lora(original):
    def remove_lora(self, lora_id: int, *args: Any, **kwargs: Any):
        # Loaded again, the adapter would be its blob's weights: not those cached under the updated version.
        if prefix_cache.adapter_version(self.scheduler, lora_id):
            prefix_cache.bump_version(self.scheduler, lora_id)
        return original(self, lora_id, *args, **kwargs)

    return remove_lora


def install() -> None:
    core = compat.engine_core_cls()
    if not hasattr(core, UTILITY):
        setattr(core, UTILITY, update_adapter_weights)
    wrap_method(core, "remove_lora", _remove_lora)
