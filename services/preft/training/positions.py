"""Which positions of a forward pass the adapter applies to: the policy, apart from the hooks that apply it.

A forward pass runs with one of three gates: ``ON`` (every position: the ``all`` mode, and a prompt pass of
generation), ``OFF`` (no position: a decoding step of ``prefill`` mode, whose tokens are generated ones), or a
``[batch, seq]`` boolean mask (one teacher-forced pass over prompt + completion: True on prompt positions).

Because causal attention only looks backwards, one pass with the mask equals the two-phase computation that
serving does (prompt prefilled with the adapter, completion decoded without it, attending to the adapted
prompt's KV): a completion position's own hidden states are the base model's, and its attention reads the keys
and values that the adapted prompt positions computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from preft.common.modes import PositionMode

IGNORE_INDEX = -100  # the label of a position that is not scored (Hugging Face's and TRL's convention)


class _Everywhere:
    def __repr__(self) -> str:
        return "ON"


class _Nowhere:
    def __repr__(self) -> str:
        return "OFF"


ON = _Everywhere()
OFF = _Nowhere()
Gate = _Everywhere | _Nowhere | torch.Tensor


class PromptSplitError(ValueError):
    """A batch whose prompt positions cannot be told (or that has none where prefill mode needs them)."""


def mask_from_lengths(prompt_lengths: torch.Tensor | list[int], seq_len: int, device=None) -> torch.Tensor:
    """[batch, seq] True on positions [0, prompt_lengths[i]) of row i (left padding, if any, counts as prompt)."""
    lengths = torch.as_tensor(prompt_lengths, device=device).reshape(-1, 1)
    return torch.arange(seq_len, device=lengths.device).unsqueeze(0) < lengths


def mask_from_labels(labels: torch.Tensor) -> torch.Tensor:
    """The prompt of each row: the positions before its first scored label (label != -100).

    This is how TRL marks a completion: SFTTrainer's labels are -100 over the prompt (prompt-completion data,
    ``completion_only_loss``) and GRPOTrainer's over the prompt and padding. A row with no scored label keeps the
    adapter everywhere (nothing of it is scored). A row whose first token is scored has no prompt, which prefill
    mode cannot train: refused.
    """
    scored = labels != IGNORE_INDEX
    seq_len = labels.shape[1]
    first = torch.where(scored.any(dim=1), scored.int().argmax(dim=1), seq_len)
    if bool((first == 0).any()):
        rows = (first == 0).nonzero().flatten().tolist()
        raise PromptSplitError(
            f"rows {rows} score their first token, so they have no prompt for a prefill-only adapter: train on "
            "prompt-completion data (labels -100 over the prompt), or pass prompt_lengths / prompt_mask"
        )
    return mask_from_lengths(first, seq_len)


def check_unpacked(position_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    """Refuse packed rows (several sequences in one row, as TRL's padding_free/packing makes): one prompt per row."""
    restarts = position_ids is not None and position_ids.dim() == 2 and position_ids.shape[1] > 1
    restarts = restarts and bool((position_ids[:, 1:] < position_ids[:, :-1]).any())
    if restarts or any(k.startswith("cu_seq_lens") for k in kwargs):
        raise PromptSplitError(
            "packed sequences (padding_free / packing) put several prompts in one row; prefill-only training "
            "needs one prompt-completion pair per row"
        )


@dataclass
class PositionGate:
    """The gate of the forward in flight, shared by one model's adapter hooks.

    ``explicit`` is what the caller said for the pass about to run (a prompt mask, set from prompt_mask,
    prompt_lengths or labels around the top-level call). ``active`` is what the hooks apply; it is decided when
    the decoder stack starts and kept afterwards, so a gradient-checkpointed layer recomputed during backward
    sees the gate of its forward.
    """

    mode: PositionMode
    explicit: torch.Tensor | None = None
    active: Gate = ON

    def decide(self, batch: int, seq_len: int, cached_tokens: int) -> Gate:
        """The gate of a decoder-stack call over [batch, seq_len] new tokens after `cached_tokens` cached ones."""
        if self.mode is PositionMode.ALL:
            self.active = ON
        elif self.explicit is not None:
            if tuple(self.explicit.shape) != (batch, seq_len):
                raise PromptSplitError(
                    f"prompt mask of shape {tuple(self.explicit.shape)} for input of shape {(batch, seq_len)}"
                )
            self.active = self.explicit
        else:
            # generation: the first pass is the prompt, later passes decode generated tokens
            self.active = OFF if cached_tokens > 0 else ON
        return self.active


def gate_delta(delta: torch.Tensor, gate: Gate) -> torch.Tensor:
    """The adapter's contribution `delta` [batch, seq, …] kept where the gate is open, zero elsewhere."""
    if gate is ON:
        return delta
    if gate is OFF:
        return torch.zeros_like(delta)
    if tuple(delta.shape[:2]) != tuple(gate.shape):
        raise PromptSplitError(f"adapter output of shape {tuple(delta.shape)} for a prompt mask of {tuple(gate.shape)}")
    return delta * gate.to(delta.dtype).unsqueeze(-1)
