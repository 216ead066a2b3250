"""The per-step token -> adapter mapping (pure numpy)."""

from __future__ import annotations

import numpy as np

from preft.vllm_plugin.step.token_mapping import build_step_mapping


def _map(lora, prompt, computed, scheduled, sampled=None):
    a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    sampled = np.ones(len(lora), dtype=np.int64) if sampled is None else a(sampled)
    return build_step_mapping(a(lora), a(prompt), a(computed), a(scheduled), sampled)


def test_prefill_mode_maps_only_prompt_positions():
    # One prefill-mode request (id 3, stored negated): prompt 5 tokens, 3 computed, 4 scheduled
    # -> positions 3,4 are prompt (adapter), 5,6 would be generated (base).
    m = _map([-3], [5], [3], [4])
    assert m.token_ids.tolist() == [3, 3, 0, 0]
    assert m.sampled_ids.tolist() == [0]
    assert m.active_ids.tolist() == [3]


def test_decode_step_of_prefill_mode_has_no_active_adapter():
    m = _map([-3, -4], [5, 7], [9, 7], [1, 1])
    assert m.token_ids.tolist() == [0, 0]
    assert m.active_ids.size == 0


def test_last_prompt_chunk_samples_with_adapter():
    m = _map([-3], [8], [4], [4])
    assert m.token_ids.tolist() == [3, 3, 3, 3]
    assert m.sampled_ids.tolist() == [3]


def test_all_mode_and_base_mixed():
    m = _map([2, 0, -5, 2], [4, 4, 4, 4], [0, 4, 4, 9], [4, 1, 1, 1])
    assert m.token_ids.tolist() == [2, 2, 2, 2, 0, 0, 2]
    assert m.sampled_ids.tolist() == [2, 0, 0, 2]
    assert m.active_ids.tolist() == [2]


def test_spec_decode_sampled_counts():
    m = _map([-1, 6], [2, 2], [0, 5], [2, 3], sampled=[1, 3])
    assert m.token_ids.tolist() == [1, 1, 6, 6, 6]
    assert m.sampled_ids.tolist() == [1, 6, 6, 6]
