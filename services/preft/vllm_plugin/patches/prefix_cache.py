"""Exact prefix caching under PreFT.

vLLM keys a block by its tokens, its parent block and extra keys, one of which is the LoRA name (our LoRA
names are content digests, so two different adapters never share blocks). That is exact when the adapter
applies at every position. For a prefill-mode request the KV of positions at or after the prompt's end is
computed by the base model, so a block reaching past the prompt gets one more key, the prompt length: only
a computation with the same tokens, adapter and boundary (the same request, recomputed after preemption)
can reuse it. Blocks inside the prompt keep the plain adapter key and are shared by both modes, which
compute them identically.

An adapter whose weights were updated in place (``weight_updates``) is no longer its digest's: each applied update
(and each removal of an updated adapter, which a reload from its blob would otherwise meet) bumps the adapter's
version in its scheduler, and the blocks of a request stamped with version v > 0 carry it as one more key. A request
is stamped when the scheduler receives it and again, its blocks re-hashed, whenever the version changes while it has
computed nothing (waiting, or preempted back to position 0), so it computes and caches under the weights it runs on;
no request meets blocks computed with other weights. Versions only grow: a key is never reused for other weights.

vLLM's own keys come first and are kept as they are, among them the request's cache_salt on its first block (so,
through the parent chain, on all): the gateway sets one per tenant (or per cache group of tenants).
"""

from __future__ import annotations

from typing import Any

from preft.common.modes import is_prefill_only
from preft.vllm_plugin import compat
from preft.vllm_plugin.patches.patching import wrap_method

BOUNDARY_KEY = "preft-prefill-boundary"
VERSION_KEY = "preft-adapter-version"
STAMP = "_preft_adapter_version"  # on a vLLM Request: the adapter version its block hashes carry (absent: 0)
VERSIONS = "_preft_adapter_versions"  # on vLLM's Scheduler: LoRA id -> current version (absent: 0, as loaded)


def boundary_extra_key(request, end_token_idx: int) -> tuple[str, int] | None:
    if request.lora_request is None or end_token_idx <= request.num_prompt_tokens:
        return None
    if not is_prefill_only(request.sampling_params):
        return None
    return (BOUNDARY_KEY, request.num_prompt_tokens)


def version_extra_key(request) -> tuple[str, int] | None:
    version = getattr(request, STAMP, 0)
    return (VERSION_KEY, version) if version and request.lora_request is not None else None


def _extra_keys(original):
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, *args, **kwargs):
        keys, next_mm = original(request, start_token_idx, end_token_idx, *args, **kwargs)
        version, boundary = version_extra_key(request), boundary_extra_key(request, end_token_idx)
        if version is not None or boundary is not None:
            keys = (*(keys or ()), *(k for k in (version, boundary) if k is not None))
        return keys, next_mm

    return generate_block_hash_extra_keys


def adapter_version(scheduler: Any, lora_id: int) -> int:
    return scheduler.__dict__.get(VERSIONS, {}).get(lora_id, 0)


def bump_version(scheduler: Any, lora_id: int) -> int:
    """The adapter's weights changed: its next version (a key no block has been cached under)."""
    versions = scheduler.__dict__.setdefault(VERSIONS, {})
    versions[lora_id] = versions.get(lora_id, 0) + 1
    return versions[lora_id]


def restamp(scheduler: Any, request: Any) -> None:
    """Stamp a request that has computed nothing with its adapter's current version, re-hashing its blocks (vLLM
    hashed them when it built the request, possibly under an older version)."""
    lora = request.lora_request
    version = adapter_version(scheduler, lora.lora_int_id) if lora is not None else 0
    if getattr(request, STAMP, 0) != version:
        setattr(request, STAMP, version)
        request.block_hashes.clear()
        request.update_block_hashes()


def install() -> None:
    for module in compat.block_hash_modules():
        wrap_method(module, "generate_block_hash_extra_keys", _extra_keys)
