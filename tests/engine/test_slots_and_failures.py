"""One adapter slot: prefill-mode requests free it when their prompt is done; bad adapters fail alone."""

from __future__ import annotations

import itertools
import random

import pytest

from preft.devtools.tiny import build_lora
from preft.engine.requests import GenerationRequest
from tests.bad_adapters import make_bad_adapters
from tests.conftest import random_prompt
from tests.reference import reference_generate

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(model_dirs, engine_factory):
    return engine_factory(model_dirs["llama"], max_loras=1, max_lora_rank=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def four_loras(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    return [build_lora(root / f"l{i}", model_dirs["llama"], rank=4, seed=100 + i) for i in range(4)]


def _intervals(engine, reqs):
    """(first token, last token) engine timestamps of each request, run together through vLLM."""
    prompts, params, loras = zip(*(engine._prepare(r) for r in reqs), strict=True)
    outs = engine.llm.generate(list(prompts), list(params), lora_request=list(loras), use_tqdm=False)
    return [(o.metrics.first_token_ts, o.metrics.last_token_ts) for o in outs]


def test_prefill_mode_needs_one_slot_for_many_adapters(engine, four_loras):
    rng = random.Random(5)
    reqs = [
        GenerationRequest(
            f"r{i}", prompt_ids=tuple(random_prompt(rng, 8)), adapter=str(d), mode="prefill", max_tokens=48
        )
        for i, d in enumerate(four_loras)
    ]
    spans = _intervals(engine, reqs)
    assert max(first for first, _ in spans) < min(last for _, last in spans), (
        f"with one slot, four prefill-mode adapters should all be decoding at once: {spans}"
    )


def test_all_mode_holds_its_slot_until_done(engine, four_loras):
    """The contrast that shows the previous test can fail: `all` mode serializes on one slot."""
    rng = random.Random(6)
    reqs = [
        GenerationRequest(f"a{i}", prompt_ids=tuple(random_prompt(rng, 8)), adapter=str(d), mode="all", max_tokens=16)
        for i, d in enumerate(four_loras)
    ]
    spans = sorted(_intervals(engine, reqs))
    for (_, prev_last), (next_first, _) in itertools.pairwise(spans):
        assert next_first >= prev_last, f"`all`-mode requests overlapped on a single slot: {spans}"


def test_bad_adapters_fail_alone_and_the_engine_keeps_serving(engine, model_dirs, adapters, tmp_path_factory):
    model, ads = model_dirs["llama"], adapters["llama"]
    bad = make_bad_adapters(ads["lora_a"], ads["direft_a"], tmp_path_factory.mktemp("bad"))
    rng = random.Random(7)
    prompt = random_prompt(rng, 20)
    good = [
        GenerationRequest("good-lora", prompt_ids=tuple(prompt), adapter=str(ads["lora_a"]), max_tokens=8),
        GenerationRequest("good-direft", prompt_ids=tuple(prompt), adapter=str(ads["direft_b"]), max_tokens=8),
        GenerationRequest("good-base", prompt_ids=tuple(prompt), max_tokens=8),
    ]
    broken = [
        GenerationRequest(name, prompt_ids=tuple(prompt), adapter=str(p), max_tokens=8) for name, (p, _) in bad.items()
    ]
    too_long = GenerationRequest("too-long", prompt_ids=tuple(prompt * 30), max_tokens=8)
    out_of_vocab = GenerationRequest("out-of-vocab", prompt_ids=(1, 2, 10_000), max_tokens=8)
    results = {r.id: r for r in engine.generate([*broken[:10], *good, *broken[10:], too_long, out_of_vocab])}
    for name, (_, expected) in bad.items():
        err = results[name].error or ""
        assert all(word in err for word in expected), f"{name}: {err!r} lacks {expected}"
    assert "exceeds the context" in (results["too-long"].error or "")
    assert "outside the vocabulary" in (results["out-of-vocab"].error or "")
    for req in good:
        assert results[req.id].error is None
        ref = reference_generate(model, list(req.prompt_ids), req.adapter, "prefill", 8)
        assert list(results[req.id].token_ids) == ref, req.id
    again = engine.generate(good)
    assert [list(r.token_ids) for r in again] == [list(results[g.id].token_ids) for g in good]
