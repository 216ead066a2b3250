"""The engine's greedy tokens are identical to the HF/peft reference, in mixed batches, in float32.

One engine per architecture (Llama, Qwen2) with 2 adapter slots, 32-token steps (so longer prompts are
prefilled in chunks) and 32-token KV blocks (so prompts span several prefix-cache blocks).
"""

from __future__ import annotations

import random

import pytest

from preft.engine.requests import GenerationRequest
from tests.conftest import random_prompt
from tests.engine.conftest import MAX_LORAS, MAX_NUM_BATCHED_TOKENS
from tests.reference import reference_generate

pytestmark = pytest.mark.engine

ADAPTERS = ("lora_a", "lora_b", "lora_c", "direft_a", "direft_b")
PROMPT_LENGTHS = (5, 13, 47, 90)  # 47 and 90 exceed the 32-token step: chunked prefill
MAX_TOKENS = 12


def _request(rid, prompt, adapter_dir, mode, max_tokens=MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(
        id=rid,
        prompt_ids=tuple(prompt),
        adapter=str(adapter_dir) if adapter_dir else None,
        mode=mode,
        max_tokens=max_tokens,
    )


def _mixed_batch(adapters: dict, prompts: list[list[int]]) -> list[GenerationRequest]:
    """Base requests interleaved with every adapter in both modes, each on two of the prompts."""
    reqs = [_request(f"base-{i}", p, None, "prefill") for i, p in enumerate(prompts)]
    for k, name in enumerate(ADAPTERS):
        for mode in ("prefill", "all"):
            for j in (k % len(prompts), (k + 2) % len(prompts)):
                reqs.append(_request(f"{name}-{mode}-{j}", prompts[j], adapters[name], mode))
    random.Random(3).shuffle(reqs)
    return reqs


def _reference(model_dir, req: GenerationRequest) -> list[int]:
    return reference_generate(model_dir, list(req.prompt_ids), req.adapter, req.mode.value, req.max_tokens)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def engine(arch, model_dirs, engine_factory):
    return engine_factory(model_dirs[arch])


@pytest.fixture(scope="module")
def batch_run(arch, engine, model_dirs, adapters):
    """One mixed batch through the engine, and the reference for every request."""
    rng = random.Random(hash(arch) % 1000)
    prompts = [random_prompt(rng, n) for n in PROMPT_LENGTHS]
    reqs = _mixed_batch(adapters[arch], prompts)
    results = engine.generate(reqs)
    expected = {r.id: _reference(model_dirs[arch], r) for r in reqs}
    return reqs, results, expected


def test_mixed_batch_matches_reference(batch_run):
    reqs, results, expected = batch_run
    distinct = {r.adapter for r in reqs if r.adapter}
    assert len(distinct) > MAX_LORAS, "the batch must need more adapters than there are slots"
    assert any(len(r.prompt_ids) > MAX_NUM_BATCHED_TOKENS for r in reqs), "some prompts must be chunked"
    mismatches = {
        res.id: (list(res.token_ids), expected[res.id]) for res in results if list(res.token_ids) != expected[res.id]
    }
    assert all(res.error is None for res in results)
    assert not mismatches, f"engine != reference for {len(mismatches)}/{len(reqs)} requests: {mismatches}"


def test_modes_differ_so_the_test_can_fail(batch_run):
    """prefill output != all output != base output for every adapter (the same first token is expected)."""
    _, results, _ = batch_run
    by_id = {r.id: list(r.token_ids) for r in results}
    for k, name in enumerate(ADAPTERS):
        j = k % len(PROMPT_LENGTHS)
        prefill, all_, base = by_id[f"{name}-prefill-{j}"], by_id[f"{name}-all-{j}"], by_id[f"base-{j}"]
        assert prefill != all_, name
        assert prefill != base, name
        assert prefill[0] == all_[0], f"{name}: both modes compute the prompt with the adapter"


def test_prefix_cache_reuse_is_exact(arch, engine, model_dirs, adapters):
    """Repeated prompts (same adapter, other adapters, other mode) and prompts extending a prefill-mode
    request's own output (its decode-computed KV must not be reused as adapter-computed) match the reference."""
    model, ads = model_dirs[arch], adapters[arch]
    rng = random.Random(99)
    prompt = random_prompt(rng, 40)
    first = [
        _request("seed-prefill", prompt, ads["lora_a"], "prefill", max_tokens=40),
        _request("seed-all", prompt, ads["direft_a"], "all", max_tokens=40),
    ]
    seeded = {r.id: list(r.token_ids) for r in engine.generate(first)}
    hits_before = _prefix_cache_hits(engine)
    extended_p = prompt + seeded["seed-prefill"][:30]
    extended_a = prompt + seeded["seed-all"][:30]
    second = [
        _request("same-adapter-same-mode", prompt, ads["lora_a"], "prefill"),
        _request("same-adapter-other-mode", prompt, ads["lora_a"], "all"),
        _request("other-adapter", prompt, ads["lora_b"], "prefill"),
        _request("base", prompt, None, "prefill"),
        _request("extends-own-output-prefill", extended_p, ads["lora_a"], "prefill"),
        _request("extends-own-output-all-mode", extended_p, ads["lora_a"], "all"),
        _request("extends-all-mode-output", extended_a, ads["direft_a"], "prefill"),
    ]
    results = engine.generate(second)
    assert _prefix_cache_hits(engine) > hits_before, "the second batch should hit the prefix cache"
    mismatches = {
        r.id: (list(r.token_ids), exp)
        for r, req in zip(results, second, strict=True)
        if list(r.token_ids) != (exp := _reference(model, req))
    }
    assert not mismatches, mismatches


def _prefix_cache_hits(engine) -> float:
    return sum(getattr(m, "value", 0) for m in engine.llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
