"""The engine's greedy tokens are the HF/peft reference's, in mixed batches, in float32.

One engine per architecture (Llama, Qwen2) with 2 adapter slots, 32-token steps (so longer prompts are
prefilled in chunks) and 32-token KV blocks (so prompts span several prefix-cache blocks). Beside the shared
adapters (ranks 4 and 8) the mixed batch has a LoRA of rank 40 on every module: steps that hold it run rank 40
(on CUDA the gate/up LoRA folded into the activation in two rank chunks, the last one partial).

The reference is fed the engine's tokens and must rank each of them first. On CPU that means the same tokens.
On CUDA the engine's float32 kernels (Triton attention, cuBLAS) add in other orders than torch on the CPU, so
where the reference's two best tokens are nearly tied either may come out: there an engine token within
``LOGIT_TIE`` of the reference's best logit counts as the reference's (an adapter applied where it should not
be, or missed, moves logits by ~0.1-1: see test_modes_differ_so_the_test_can_fail). Such near ties are recorded
as the test's ``near_ties`` property (``--junitxml`` shows them).
"""

from __future__ import annotations

import random

import pytest

from preft.devtools.tiny import build_lora
from preft.engine.requests import GenerationRequest
from tests.conftest import random_prompt
from tests.engine.conftest import LOGIT_TIE, MAX_LORAS, MAX_NUM_BATCHED_TOKENS
from tests.reference import reference_logits

pytestmark = pytest.mark.engine

ADAPTERS = ("lora_a", "lora_b", "lora_c", "lora_wide", "direft_a", "direft_b")
WIDE_RANK = 40  # above lora_act.RANK_CHUNK, not a multiple of it
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


def _divergences(model_dir, req: GenerationRequest, tokens: list[int]) -> list[dict]:
    """Steps where the reference, fed the engine's tokens, ranks another token first: its margin over the engine's."""
    assert len(tokens) == req.max_tokens, (req.id, tokens)
    logits = reference_logits(model_dir, list(req.prompt_ids), req.adapter, req.mode.value, tokens)
    out = []
    for step, (token, scores) in enumerate(zip(tokens, logits, strict=True)):
        best = int(scores.argmax())
        if best != token:
            out.append({"request": req.id, "step": step, "engine": token, "reference": best,
                        "margin": round(float(scores[best] - scores[token]), 6)})  # fmt: skip
    return out


def _check(model_dir, reqs: list[GenerationRequest], results, record_property) -> None:
    """Every result error-free and every token the reference's, near ties (CUDA) recorded."""
    assert all(res.error is None for res in results), [res.error for res in results if res.error]
    by_id = {res.id: list(res.token_ids) for res in results}
    found = [d for req in reqs for d in _divergences(model_dir, req, by_id[req.id])]
    record_property("near_ties", found)
    wrong = [d for d in found if d["margin"] > LOGIT_TIE]
    assert not wrong, f"engine != reference (logit margin > {LOGIT_TIE}) in {len(wrong)} steps: {wrong}"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def engine(arch, model_dirs, engine_factory):
    return engine_factory(model_dirs[arch], max_lora_rank=64)


@pytest.fixture(scope="module")
def batch_adapters(arch, model_dirs, adapters, tmp_path_factory) -> dict:
    """The shared adapters and a LoRA of rank WIDE_RANK on every module."""
    wide = tmp_path_factory.mktemp(f"wide-{arch}") / "lora_wide"
    return {**adapters[arch], "lora_wide": build_lora(wide, model_dirs[arch], rank=WIDE_RANK, seed=14)}


@pytest.fixture(scope="module")
def batch_run(arch, engine, batch_adapters):
    """One mixed batch through the engine."""
    rng = random.Random(f"prompts-{arch}")
    prompts = [random_prompt(rng, n) for n in PROMPT_LENGTHS]
    reqs = _mixed_batch(batch_adapters, prompts)
    return reqs, engine.generate(reqs)


def test_mixed_batch_matches_reference(arch, batch_run, model_dirs, record_property):
    reqs, results = batch_run
    distinct = {r.adapter for r in reqs if r.adapter}
    assert len(distinct) > MAX_LORAS, "the batch must need more adapters than there are slots"
    assert any(len(r.prompt_ids) > MAX_NUM_BATCHED_TOKENS for r in reqs), "some prompts must be chunked"
    _check(model_dirs[arch], reqs, results, record_property)


def test_modes_differ_so_the_test_can_fail(batch_run):
    """prefill output != all output != base output for every adapter (the same first token is expected)."""
    _, results = batch_run
    by_id = {r.id: list(r.token_ids) for r in results}
    for k, name in enumerate(ADAPTERS):
        j = k % len(PROMPT_LENGTHS)
        prefill, all_, base = by_id[f"{name}-prefill-{j}"], by_id[f"{name}-all-{j}"], by_id[f"base-{j}"]
        assert prefill != all_, name
        assert prefill != base, name
        assert prefill[0] == all_[0], f"{name}: both modes compute the prompt with the adapter"


def test_prefix_cache_reuse_is_exact(arch, engine, model_dirs, adapters, record_property):
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
    _check(model, second, results, record_property)


def _prefix_cache_hits(engine) -> float:
    return sum(getattr(m, "value", 0) for m in engine.llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
