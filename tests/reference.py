"""Reference PreFT generation: preft.training's model (Hugging Face transformers + peft), written independently of
the plugin — the same code that trains adapters, so what the engine is checked against is what is trained.

Greedy decoding over one KV cache (``preft.training.step_logits``): the prompt is run with the adapter on; in
``prefill`` mode every generated token is then run with the adapter off (attending to the adapter-computed
prompt KV), in ``all`` mode with it on. DiReFT's Bᵀ(A·h + b) is computed in float64 (as this reference always
did); tests/training checks preft.training itself against a separate two-phase computation.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from preft.training import PreftModel, step_logits


def reference_model(model_dir: str | Path, adapter_dir: str | Path | None, mode: str = "prefill") -> torch.nn.Module:
    """The float32 reference model, its adapter gated per position as `mode` says: load it once and pass it as
    `loaded=` to reference_generate for many prompts on one adapter and mode."""
    if adapter_dir is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return PreftModel.from_model_dir(model_dir, adapter_dir, mode=mode, direft_dtype=torch.float64).model


@torch.no_grad()
def _step_logits(model_dir, prompt_ids, adapter_dir, mode: str, steps: int, feed, loaded=None) -> list[torch.Tensor]:
    """Next-token logits of `steps` decoding steps; `feed(i, logits)` is the token fed after step i."""
    return step_logits(loaded or reference_model(model_dir, adapter_dir, mode), prompt_ids, steps, feed)


def reference_generate(
    model_dir: str | Path,
    prompt_ids: list[int],
    adapter_dir: str | Path | None,
    mode: str,
    max_tokens: int,
    *,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    allowed: Callable[[list[int]], Collection[int]] | None = None,
    min_tokens: int = 0,
    stop_token_ids: Collection[int] = (),
    loaded=None,
) -> list[int]:
    """Greedy tokens of the reference; the penalties as OpenAI defines them, over the tokens generated so far: each
    token's logit less frequency_penalty × its count and presence_penalty once it has appeared; repetition_penalty
    as vLLM (and HF) define it, over the prompt and the tokens so far: a positive logit divided by it, a negative
    one multiplied; logit_bias added to its tokens' logits; `allowed(tokens so far)`: the only tokens it may pick
    next (a constraint); stop_token_ids left out of the first min_tokens, and the answer ends with the first one.
    `loaded`: reference_model(model_dir, adapter_dir, mode), loaded once for many prompts."""
    counts: dict[int, int] = {}
    tokens: list[int] = []

    def pick(step: torch.Tensor) -> int:
        penalized = step.clone()
        for token, bias in (logit_bias or {}).items():
            penalized[token] += bias
        if repetition_penalty != 1.0:
            seen = sorted({*prompt_ids, *tokens})
            logits = penalized[seen]
            penalized[seen] = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        for token, count in counts.items():
            penalized[token] -= frequency_penalty * count + presence_penalty
        if len(tokens) < min_tokens and stop_token_ids:
            penalized[list(stop_token_ids)] = float("-inf")
        if allowed is not None:
            mask = torch.full_like(penalized, float("-inf"))
            mask[list(allowed(tokens))] = 0.0
            penalized += mask
        token = int(penalized.argmax())
        counts[token] = counts.get(token, 0) + 1
        tokens.append(token)
        return token

    logits = _step_logits(model_dir, prompt_ids, adapter_dir, mode, max_tokens, lambda i, step: pick(step), loaded)
    pick(logits[-1])  # (the last step's token is not fed back)
    stops = [i for i, t in enumerate(tokens) if t in stop_token_ids]
    return tokens[: stops[0] + 1] if stops else tokens


def reference_logits(
    model_dir: str | Path, prompt_ids: list[int], adapter_dir: str | Path | None, mode: str, tokens: list[int]
) -> list[torch.Tensor]:
    """The reference's logits before each of `tokens` (another engine's output), fed those tokens in turn."""
    return _step_logits(model_dir, prompt_ids, adapter_dir, mode, len(tokens), lambda i, step: tokens[i])


@torch.no_grad()
def reference_prompt_logits(
    model_dir: str | Path, prompt_ids: list[int], adapter_dir: str | Path | None
) -> torch.Tensor:
    """The reference's logits at each prompt position but the last (row i: before prompt token i + 1), adapter on:
    the prompt pass is the same in both modes."""
    return reference_model(model_dir, adapter_dir)(input_ids=torch.tensor([prompt_ids])).logits[0, :-1]
