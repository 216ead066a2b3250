"""Scheduler side of PreFT: a prefill-mode request stops holding an adapter slot once its prompt is done, and
waiting live requests preempt running offline ones (``priority_preemption``) before each step is scheduled; adapter
weight updates that waited for prompts to finish are applied then, and meanwhile hold their adapter's waiting
requests (``weight_updates``).

vLLM's scheduler bounds the distinct adapters of the scheduled requests by ``max_loras``, counting every
running request that has a LoRA. During ``schedule()`` we hide the adapter of running requests whose prompt
is fully computed and whose mode is ``prefill``: their decode tokens run on the base model, so they need no
slot. The adapter is restored before anything else reads it (block hashing happens after ``schedule()``).
Preempted requests restart from position 0 and count again, as their prompt is recomputed with the adapter.

This runs on every step, so it costs one attribute test per running request: whether a request is
prefill-only is decided once, when the scheduler receives it, and nothing is hidden when the bound cannot
bind (no request waits to be admitted and the running ones have at most ``max_loras`` adapters).
"""

from __future__ import annotations

from preft.common.modes import is_prefill_only
from preft.vllm_plugin import compat
from preft.vllm_plugin.patches import prefix_cache, priority_preemption, weight_updates
from preft.vllm_plugin.patches.patching import wrap_method

PREFILL_ONLY = "_preft_prefill_only"  # set on each vLLM Request by the scheduler's add_request


def _add_request(original):
    def add_request(self, request, *args, **kwargs):
        setattr(request, PREFILL_ONLY, request.lora_request is not None and is_prefill_only(request.sampling_params))
        priority_preemption.note_arrival(self, request)
        if prefix_cache.VERSIONS in self.__dict__:  # (some adapter was updated: hashed under its current version)
            prefix_cache.restamp(self, request)
        return original(self, request, *args, **kwargs)

    return add_request


def _bound_can_bind(scheduler) -> bool:
    """Whether hiding adapters can change this step: something may be admitted, or the running outnumber slots."""
    return (
        len(scheduler.running) > scheduler.lora_config.max_loras
        or bool(scheduler.waiting)
        or bool(getattr(scheduler, "skipped_waiting", None))
    )


def _schedule(original):
    def schedule(self, *args, **kwargs):
        weight_updates.before_schedule(self)
        updating = weight_updates.hold_waiting(self)  # (adapters whose update waits: no new prompt starts)
        held = priority_preemption.make_room(self)  # (this step's victims, out of the waiting queue until it is built)
        try:
            return hiding_adapters(self, *args, **kwargs)
        finally:
            if held:
                priority_preemption.requeue(self, held)
            if updating:
                weight_updates.release_waiting(updating)

    def hiding_adapters(self, *args, **kwargs):
        if not self.lora_config or not _bound_can_bind(self):
            return original(self, *args, **kwargs)
        hidden = [  # prefill-mode requests past their prompt (inlined: this runs over every request, every step)
            (r, r.lora_request)
            for r in self.running
            if getattr(r, PREFILL_ONLY, False) and r.num_computed_tokens >= r.num_prompt_tokens
        ]
        for request, _ in hidden:
            request.lora_request = None
        try:
            return original(self, *args, **kwargs)
        finally:
            for request, lora_request in hidden:
                request.lora_request = lora_request

    return schedule


def install() -> None:
    scheduler = compat.scheduler_cls()
    wrap_method(scheduler, "add_request", _add_request)
    wrap_method(scheduler, "schedule", _schedule)
