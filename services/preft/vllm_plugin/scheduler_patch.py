"""Scheduler side of PreFT: a prefill-mode request stops holding an adapter slot once its prompt is done.

vLLM's scheduler bounds the distinct adapters of the scheduled requests by ``max_loras``, counting every
running request that has a LoRA. During ``schedule()`` we hide the adapter of running requests whose prompt
is fully computed and whose mode is ``prefill``: their decode tokens run on the base model, so they need no
slot. The adapter is restored before anything else reads it (block hashing happens after ``schedule()``).
Preempted requests restart from position 0 and count again, as their prompt is recomputed with the adapter.
"""

from __future__ import annotations

from preft.vllm_plugin import compat
from preft.vllm_plugin.modes import is_prefill_only
from preft.vllm_plugin.patching import wrap_method


def past_prompt_in_prefill_mode(request) -> bool:
    return (
        request.lora_request is not None
        and request.num_computed_tokens >= request.num_prompt_tokens
        and is_prefill_only(request.sampling_params)
    )


def _schedule(original):
    def schedule(self, *args, **kwargs):
        if not self.lora_config:
            return original(self, *args, **kwargs)
        hidden = [(r, r.lora_request) for r in self.running if past_prompt_in_prefill_mode(r)]
        for request, _ in hidden:
            request.lora_request = None
        try:
            return original(self, *args, **kwargs)
        finally:
            for request, lora_request in hidden:
                request.lora_request = lora_request

    return schedule


def install() -> None:
    wrap_method(compat.scheduler_cls(), "schedule", _schedule)
