"""Greedy decoding over one KV cache, the way PreFT serves: the reference that the engine's tests compare with.

The prompt is one pass (the adapter on, in both modes); each generated token is then one pass over the cache,
with the adapter off in ``prefill`` mode (the gate of ``preft.training.model`` turns it off once the cache holds
tokens) and on in ``all`` mode. `model` is ``PreftModel.model`` (or a plain causal LM: the base model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


@torch.no_grad()
def step_logits(
    model: nn.Module, prompt_ids: Sequence[int], steps: int, feed: Callable[[int, torch.Tensor], int]
) -> list[torch.Tensor]:
    """Next-token logits of `steps` decoding steps (step 0: after the prompt); ``feed(i, logits_i)`` is the token
    fed after step i (the last step's token is not fed)."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([list(prompt_ids)], device=device), use_cache=True)
    cache, logits = out.cache, [out.logits[0, -1]]
    for i in range(steps - 1):
        token = torch.tensor([[feed(i, logits[-1])]], device=device)
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0, -1])
    return logits


def greedy_generate(model: nn.Module, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The `max_tokens` greedy tokens after the prompt."""
    tokens: list[int] = []

    def pick(i: int, logits: torch.Tensor) -> int:
        tokens.append(int(logits.argmax()))
        return tokens[-1]

    last = step_logits(model, prompt_ids, max_tokens, pick)[-1]
    pick(max_tokens - 1, last)
    return tokens
