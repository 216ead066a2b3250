"""preft.training's one-pass PreFT forward equals serving's two phases, trains only the adapter, and saves it
in the formats the registry serves.

The two-phase computation here is written independently of preft.training (peft's ``disable_adapter`` for
LoRA, plain forward hooks for DiReFT, one KV cache): the prompt with the adapter on, then the completion fed
token by token with it off (prefill) or on (all).
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from preft.adapters import ModelShape, check_adapter
from preft.devtools.tiny import build_direft, build_lora
from preft.training import DireftConfig, PreftModel, PromptSplitError, UnsupportedAdapterError
from tests.conftest import ARCHS, random_prompt

ADAPTERS = ("lora_a", "lora_b", "direft_a", "direft_b")
MODES = ("prefill", "all")
ATOL = 2e-5  # float32: one pass vs token-by-token over a cache add in other orders


def _base(model_dir):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.no_grad()
def two_phase_logprobs(model_dir, adapter_dir, mode: str, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[i] | prompt, completion[:i]) by serving's two phases, independent of preft.training."""
    model = _base(model_dir)
    off = contextlib.nullcontext
    if adapter_dir is not None and (adapter_dir / "preft_config.json").exists():
        cfg = json.loads((adapter_dir / "preft_config.json").read_text())
        w = load_file(str(adapter_dir / "adapter_model.safetensors"))
        enabled = [True]

        def hook_for(a, b, bias):
            def hook(module, args, output):
                if not enabled[0]:
                    return output
                h = output[0] if isinstance(output, tuple) else output
                h = h + ((h.double() @ a.T + bias) @ b).to(h.dtype)
                return (h, *output[1:]) if isinstance(output, tuple) else h

            return hook

        for layer in cfg["layers"]:
            a, b, bias = (w[f"layers.{layer}.{p}"].double() for p in ("A", "B", "b"))
            model.model.layers[layer].register_forward_hook(hook_for(a, b, bias))

        @contextlib.contextmanager
        def off():
            enabled[0] = False
            yield
            enabled[0] = True

    elif adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
        off = model.disable_adapter
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, logits = out.cache, [out.logits[0, -1]]
    for token in completion[:-1]:
        with off() if mode == "prefill" else contextlib.nullcontext():
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0, -1])
    logps = torch.stack(logits).log_softmax(-1)
    return logps.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def trl_batch(pairs: list[tuple[list[int], list[int]]], pad: int = 2) -> dict[str, torch.Tensor]:
    """GRPOTrainer's layout: prompts left-padded, completions right-padded, labels -100 but on completions."""
    p_len = max(len(p) for p, _ in pairs)
    c_len = max(len(c) for _, c in pairs)
    ids, mask, labels = [], [], []
    for p, c in pairs:
        row = [pad] * (p_len - len(p)) + p + c + [pad] * (c_len - len(c))
        ids.append(row)
        mask.append([0] * (p_len - len(p)) + [1] * (len(p) + len(c)) + [0] * (c_len - len(c)))
        labels.append([-100] * p_len + c + [-100] * (c_len - len(c)))
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}


def _pairs(seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [(random_prompt(rng, n), random_prompt(rng, m)) for n, m in ((7, 9), (3, 5), (12, 1))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_one_pass_equals_two_phases(model_dirs, adapters, arch, name, mode):
    model_dir, adapter_dir = model_dirs[arch], adapters[arch][name]
    policy = PreftModel.from_model_dir(model_dir, adapter_dir, mode=mode)
    pairs = _pairs(seed=len(name) + 10 * ARCHS.index(arch))
    batch = trl_batch(pairs)
    p_len = max(len(p) for p, _ in pairs)
    with torch.no_grad():
        by_lengths = policy.completion_logprobs(
            batch["input_ids"], batch["attention_mask"], prompt_lengths=[p_len] * len(pairs)
        )
        # as TRL calls it: the prompt read from the labels
        logits = policy.model(**batch).logits
    by_labels = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    for row, (prompt, completion) in enumerate(pairs):
        want = two_phase_logprobs(model_dir, adapter_dir, mode, prompt, completion)
        got = by_lengths[row, p_len - 1 : p_len - 1 + len(completion)]
        torch.testing.assert_close(got, want.float(), atol=ATOL, rtol=0)
        torch.testing.assert_close(
            by_labels[row, p_len - 1 : p_len - 1 + len(completion)], want.float(), atol=ATOL, rtol=0
        )
    # the generation reference agrees with the teacher-forced pass: its greedy tokens are each step's argmax
    prompt = pairs[0][0]
    tokens = policy.generate_greedy(prompt, 6)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        step = policy(ids, prompt_lengths=[len(prompt)]).logits[0, len(prompt) - 1 : -1]
    assert step.argmax(-1).tolist() == tokens


def test_modes_differ(model_dirs, adapters):
    """The comparisons above can fail: prefill and all give other completion log-probs (beyond the first)."""
    prompt, completion = _pairs(0)[0]
    for name in ADAPTERS:
        pre, full = (
            two_phase_logprobs(model_dirs["llama"], adapters["llama"][name], m, prompt, completion) for m in MODES
        )
        assert pre[0] == pytest.approx(float(full[0]), abs=1e-6)
        assert (pre[1:] - full[1:]).abs().max() > 1e-3, name


def _last_layer_adapter(kind: str, model_dir, tmp_path):
    last = ModelShape.from_model_dir(model_dir).num_layers - 1
    if kind == "direft":
        return build_direft(tmp_path / kind, model_dir, rank=4, layers=(last,), seed=5)
    target = {"lora_down": "down_proj", "lora_v": "v_proj"}[kind]
    d = build_lora(tmp_path / kind, model_dir, rank=4, targets=(target,), seed=5)
    weights = load_file(str(d / "adapter_model.safetensors"))  # keep only the last layer's
    from safetensors.torch import save_file

    save_file({k: v for k, v in weights.items() if f".layers.{last}." in k}, str(d / "adapter_model.safetensors"))
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, "layers_to_transform": [last]}))
    return d


@pytest.mark.parametrize("kind", ["direft", "lora_down", "lora_v"])
def test_prefill_adapter_reaches_completion_only_through_prompt_kv(model_dirs, tmp_path, kind):
    """An adapter on the last layer's output (DiReFT; LoRA on down_proj) writes no key or value: in prefill mode it
    changes the first completion token's log-prob (read at the last prompt position) and no later one — exactly,
    gradients included. The same layer's v_proj LoRA writes the prompt's values, and so reaches every token."""
    model_dir = model_dirs["qwen2"]
    adapter_dir = _last_layer_adapter(kind, model_dir, tmp_path)
    prompt, completion = _pairs(1)[0]
    ids = torch.tensor([prompt + completion])
    first, later = slice(len(prompt) - 1, len(prompt)), slice(len(prompt), None)
    base = _base(model_dir)
    with torch.no_grad():
        base_lp = base(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    for mode in MODES:
        policy = PreftModel.from_pretrained(_base(model_dir), adapter_dir, mode=mode, is_trainable=True)
        lp = policy.completion_logprobs(ids, prompt_lengths=[len(prompt)])[0]
        assert (lp[first] - base_lp[first]).abs().max() > 1e-4
        writes_kv = kind == "lora_v" or mode == "all"
        if writes_kv:
            assert (lp[later] - base_lp[later]).abs().max() > 1e-4, mode
        else:
            torch.testing.assert_close(lp[later], base_lp[later], atol=1e-6, rtol=0)
        params = list(policy.trainable_parameters().values())
        grads = torch.autograd.grad(lp[later].sum(), params, allow_unused=True, retain_graph=True)
        later_reaches = any(g is not None and g.abs().max() > 0 for g in grads)
        assert later_reaches == writes_kv, mode
        grads = torch.autograd.grad(lp[first].sum(), params, allow_unused=True)
        assert any(g is not None and g.abs().max() > 0 for g in grads)


@pytest.mark.parametrize("method", ["lora", "direft"])
def test_gradients_reach_only_the_adapter(model_dirs, adapters, method):
    name = "lora_b" if method == "lora" else "direft_a"
    policy = PreftModel.from_pretrained(
        _base(model_dirs["llama"]), adapters["llama"][name], mode="prefill", is_trainable=True
    )
    policy.train()
    batch = trl_batch(_pairs(2))
    out = policy.model(**batch)  # labels: the model's own loss over the completion tokens
    out.loss.backward()
    adapter = policy.trainable_parameters()
    assert adapter and all(p.grad is not None and p.grad.abs().max() > 0 for p in adapter.values())
    frozen = [n for n, p in policy.model.named_parameters() if n not in adapter]
    assert frozen and all(policy.model.get_parameter(n).grad is None for n in frozen)
    assert all(("lora_" in n) if method == "lora" else n.startswith("preft_direft.") for n in adapter)


def test_the_prompt_must_be_known(model_dirs, adapters):
    policy = PreftModel.from_model_dir(model_dirs["llama"], adapters["llama"]["direft_a"], mode="prefill")
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(PromptSplitError, match="no prompt"):
        policy.model(input_ids=ids, labels=ids)  # a language-modeling row: every token scored
    packed = {
        "input_ids": ids,
        "labels": torch.tensor([[-100, 6, -100, 8]]),
        "position_ids": torch.tensor([[0, 1, 0, 1]]),
    }
    with pytest.raises(PromptSplitError, match="packed"):
        policy.model(**packed)
    with pytest.raises(PromptSplitError, match="shape"):
        policy(ids, prompt_mask=torch.ones(1, 3, dtype=torch.bool))


def test_merged_lora_is_refused(model_dirs, adapters):
    policy = PreftModel.from_model_dir(model_dirs["llama"], adapters["llama"]["lora_b"], mode="prefill")
    policy.model.merge_adapter()
    with pytest.raises(UnsupportedAdapterError, match="merged"):
        policy(torch.tensor([[5, 6, 7]]), prompt_lengths=[2])


def _perturb(policy: PreftModel, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters().values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["lora", "direft"])
def test_new_adapter_saves_in_the_registry_format_and_loads_back(model_dirs, tmp_path, arch, method):
    model_dir = model_dirs[arch]
    if method == "lora":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
        policy = PreftModel.for_lora(_base(model_dir), config, mode="prefill")
    else:
        policy = PreftModel.for_direft(_base(model_dir), DireftConfig(rank=4, layers=(0, 2), seed=0), mode="prefill")
    _perturb(policy, seed=3)  # (new adapters start as no-ops: B = 0)
    saved = policy.save_pretrained(tmp_path / "adapter")
    check = check_adapter(saved, ModelShape.from_model_dir(model_dir), max_rank=64)
    assert check.method.value == method and check.rank == 4
    reloaded = PreftModel.from_model_dir(model_dir, saved, mode="prefill")
    ids = torch.tensor([random_prompt(random.Random(4), 10)])
    with torch.no_grad():
        want = policy.eval().completion_logprobs(ids, prompt_lengths=[4])
        got = reloaded.completion_logprobs(ids, prompt_lengths=[4])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    base = _base(model_dir)
    with torch.no_grad():
        base_lp = base(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert (got[0, 3:] - base_lp[3:]).abs().max() > 1e-4  # the saved adapter is not a no-op


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_keeps_the_gate(model_dirs, adapters, reentrant):
    """Layers recomputed in backward (TRL turns checkpointing on by default) apply the gate of their forward."""
    grads = []
    for checkpointing in (False, True):
        policy = PreftModel.from_pretrained(
            _base(model_dirs["llama"]), adapters["llama"]["direft_a"], mode="prefill", is_trainable=True
        )
        if checkpointing:
            policy.hf_model.gradient_checkpointing_enable({"use_reentrant": reentrant})
            policy.hf_model.enable_input_require_grads()
        policy.train()
        policy.model(**trl_batch(_pairs(5))).loss.backward()
        grads.append({n: p.grad for n, p in policy.trainable_parameters().items()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)
