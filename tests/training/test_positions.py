"""The prompt of a batch, as preft.training reads it from lengths and from TRL's labels, and the gate's choices."""

from __future__ import annotations

import pytest
import torch

from preft.common.modes import PositionMode
from preft.training.positions import (
    OFF,
    ON,
    PositionGate,
    PromptSplitError,
    check_unpacked,
    gate_delta,
    mask_from_labels,
    mask_from_lengths,
)


def test_lengths_and_labels_give_the_same_prompt():
    # GRPO's layout: left-padded prompts (5 columns), completions after, padding -100; a row with nothing scored
    labels = torch.tensor(
        [
            [-100, -100, -100, -100, -100, 7, 8, -100],
            [-100, -100, -100, -100, -100, 9, -100, -100],
            [-100] * 8,
        ]
    )
    mask = mask_from_labels(labels)
    assert mask[:2].equal(mask_from_lengths([5, 5], 8))
    assert mask[2].all()  # nothing scored: the adapter may stay on (nothing of the row counts)


def test_a_row_without_prompt_is_refused():
    with pytest.raises(PromptSplitError, match=r"rows \[1\]"):
        mask_from_labels(torch.tensor([[-100, 4, 5], [3, 4, 5]]))


def test_packed_rows_are_refused():
    check_unpacked(torch.tensor([[0, 1, 2, 3]]), {})
    check_unpacked(None, {})
    with pytest.raises(PromptSplitError):
        check_unpacked(torch.tensor([[0, 1, 0, 1]]), {})
    with pytest.raises(PromptSplitError):
        check_unpacked(None, {"cu_seq_lens_q": torch.tensor([0, 2, 4])})


def test_gate_decisions():
    gate = PositionGate(PositionMode.PREFILL)
    assert gate.decide(2, 5, cached_tokens=0) is ON  # a prompt pass
    assert gate.decide(2, 1, cached_tokens=5) is OFF  # a decoding step
    gate.explicit = mask_from_lengths([3, 4], 5)
    assert gate.decide(2, 5, cached_tokens=0).equal(gate.explicit)
    with pytest.raises(PromptSplitError, match="shape"):
        gate.decide(2, 6, cached_tokens=0)
    full = PositionGate(PositionMode.ALL, explicit=mask_from_lengths([3, 4], 5))
    assert full.decide(2, 5, cached_tokens=5) is ON


def test_gate_delta_masks_per_position():
    delta = torch.ones(2, 3, 4)
    assert gate_delta(delta, ON) is delta
    assert not gate_delta(delta, OFF).any()
    masked = gate_delta(delta, mask_from_lengths([1, 3], 3))
    assert masked.sum(-1).tolist() == [[4, 0, 0], [4, 4, 4]]
