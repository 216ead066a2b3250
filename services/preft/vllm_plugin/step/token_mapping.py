"""Per-step adapter mapping from per-request state, vectorized (no Python loop over tokens or requests).

A request's LoRA id is stored negated when it is prefill-only. For request i with ``computed[i]`` tokens
already computed and ``scheduled[i]`` tokens in this step, positions ``computed[i] + k`` for
``k < scheduled[i]`` are adapter positions when ``lora[i] > 0`` (``all`` mode) or when the position is
before the prompt's end (``prefill`` mode). Everything else maps to 0, vLLM's "no adapter".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_LIMIT = np.iinfo(np.int64).max


@dataclass(frozen=True)
class StepMapping:
    """Adapter ids for one step: per scheduled token, per sampled token, and the distinct ids in use."""

    token_ids: np.ndarray  # int64 [sum(scheduled)]
    sampled_ids: np.ndarray  # int64 [sum(sampled)]
    active_ids: np.ndarray  # int64, sorted unique ids > 0 that have at least one token in the step


def adapted_token_counts(
    signed_lora_ids: np.ndarray, num_prompt: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray
) -> np.ndarray:
    """How many of each request's scheduled tokens (a prefix of them) run with its adapter."""
    limit = np.where(signed_lora_ids < 0, num_prompt.astype(np.int64), NO_LIMIT)
    limit = np.where(signed_lora_ids == 0, 0, limit)
    remaining = np.clip(limit - num_computed.astype(np.int64), 0, None)
    return np.minimum(remaining, num_scheduled.astype(np.int64))


def build_step_mapping(
    signed_lora_ids: np.ndarray,
    num_prompt: np.ndarray,
    num_computed: np.ndarray,
    num_scheduled: np.ndarray,
    num_sampled: np.ndarray,
) -> StepMapping:
    scheduled = num_scheduled.astype(np.int64)
    adapted = adapted_token_counts(signed_lora_ids, num_prompt, num_computed, scheduled)
    total = int(scheduled.sum())
    if not adapted.any():  # base requests, and prefill-mode requests past their prompt: most decode steps
        none = np.zeros(0, dtype=np.int64)
        return StepMapping(np.zeros(total, dtype=np.int64), np.zeros(int(num_sampled.sum()), dtype=np.int64), none)
    lora_ids = np.abs(signed_lora_ids).astype(np.int64)
    starts = np.cumsum(scheduled) - scheduled
    offset_in_request = np.arange(total, dtype=np.int64) - np.repeat(starts, scheduled)
    token_ids = np.repeat(lora_ids, scheduled)
    token_ids[offset_in_request >= np.repeat(adapted, scheduled)] = 0
    # A request samples from its last scheduled position: adapted only if every scheduled token was.
    sampled_ids = np.repeat(np.where((adapted == scheduled) & (scheduled > 0), lora_ids, 0), num_sampled)
    active_ids = np.unique(lora_ids[(adapted > 0) & (lora_ids > 0)])
    return StepMapping(token_ids=token_ids, sampled_ids=sampled_ids, active_ids=active_ids)
