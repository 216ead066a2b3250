"""Reference PreFT generation with Hugging Face transformers + peft, written independently of the plugin.

Greedy decoding over one KV cache: the prompt is run with the adapter on; in ``prefill`` mode every
generated token is then run with the adapter off (attending to the adapter-computed prompt KV), in ``all``
mode with it on. LoRA goes through peft (``disable_adapter()`` turns it off); DiReFT through forward hooks
on the decoder layers that add Bᵀ(A·h + b) to the layer's output h.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


class _DireftHooks:
    def __init__(self, model, adapter_dir: Path) -> None:
        cfg = json.loads((adapter_dir / "preft_config.json").read_text())
        weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
        self.enabled = True
        self.handles = []
        for layer in cfg["layers"]:
            a, b, bias = (weights[f"layers.{layer}.{p}"].double() for p in ("A", "B", "b"))
            self.handles.append(model.model.layers[layer].register_forward_hook(self._hook(a, b, bias)))

    def _hook(self, a, b, bias):
        def hook(module, args, output):
            if not self.enabled:
                return output
            h = output[0] if isinstance(output, tuple) else output
            delta = ((h.double() @ a.T + bias) @ b).to(h.dtype)
            h = h + delta
            return (h, *output[1:]) if isinstance(output, tuple) else h

        return hook


def _method(adapter_dir: Path) -> str:
    return "direft" if (adapter_dir / "preft_config.json").exists() else "lora"


def reference_model(model_dir: str | Path, adapter_dir: str | Path | None):
    """The float32 reference model with the adapter on, and a context manager that turns it off: load it once and
    pass it as `loaded=` to reference_generate for many prompts on one adapter (not from two threads at once: turning
    the adapter off is the model's state)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    adapter_off = contextlib.nullcontext
    if adapter_dir is not None:
        adapter_dir = Path(adapter_dir)
        if _method(adapter_dir) == "lora":
            model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
            adapter_off = model.disable_adapter
        else:
            hooks = _DireftHooks(model, adapter_dir)

            @contextlib.contextmanager
            def adapter_off():
                hooks.enabled = False
                try:
                    yield
                finally:
                    hooks.enabled = True

    return model, adapter_off


@torch.no_grad()
def _step_logits(model_dir, prompt_ids, adapter_dir, mode: str, steps: int, feed, loaded=None) -> list[torch.Tensor]:
    """Next-token logits of `steps` decoding steps; `feed(i, logits)` is the token fed after step i."""
    model, adapter_off = loaded or reference_model(model_dir, adapter_dir)
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    cache, logits = out.past_key_values, [out.logits[0, -1]]
    decode_ctx = adapter_off if mode == "prefill" else contextlib.nullcontext
    for i in range(steps - 1):
        with decode_ctx():
            out = model(input_ids=torch.tensor([[feed(i, logits[-1])]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[0, -1])
    return logits


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
    `loaded`: reference_model(model_dir, adapter_dir), loaded once for many prompts."""
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
    model, _ = reference_model(model_dir, adapter_dir)
    return model(input_ids=torch.tensor([prompt_ids])).logits[0, :-1]
