"""Exact prefix caching under PreFT.

vLLM keys a block by its tokens, its parent block and extra keys, one of which is the LoRA name (our LoRA
names are content digests, so two different adapters never share blocks). That is exact when the adapter
applies at every position. For a prefill-mode request the KV of positions at or after the prompt's end is
computed by the base model, so a block reaching past the prompt gets one more key, the prompt length: only
a computation with the same tokens, adapter and boundary (the same request, recomputed after preemption)
can reuse it. Blocks inside the prompt keep the plain adapter key and are shared by both modes, which
compute them identically.

vLLM's own keys come first and are kept as they are, among them the request's cache_salt on its first block (so,
through the parent chain, on all): the gateway sets one per tenant (or per cache group of tenants).
"""

from __future__ import annotations

from preft.common.modes import is_prefill_only
from preft.vllm_plugin import compat
from preft.vllm_plugin.patches.patching import wrap_method

BOUNDARY_KEY = "preft-prefill-boundary"


def boundary_extra_key(request, end_token_idx: int) -> tuple[str, int] | None:
    if request.lora_request is None or end_token_idx <= request.num_prompt_tokens:
        return None
    if not is_prefill_only(request.sampling_params):
        return None
    return (BOUNDARY_KEY, request.num_prompt_tokens)


def _extra_keys(original):
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, *args, **kwargs):
        keys, next_mm = original(request, start_token_idx, end_token_idx, *args, **kwargs)
        extra = boundary_extra_key(request, end_token_idx)
        if extra is not None:
            keys = (*(keys or ()), extra)
        return keys, next_mm

    return generate_block_hash_extra_keys


def install() -> None:
    for module in compat.block_hash_modules():
        wrap_method(module, "generate_block_hash_extra_keys", _extra_keys)
