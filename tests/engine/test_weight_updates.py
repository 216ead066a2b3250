"""Adapter weights replaced in place in a running engine (vLLM AsyncLLM + plugin): requests after an update get the
HF + peft reference's tokens with the new weights, before it with the old ones, in LoRAP, LoRA `all` and DiReFTP;
the prefix cache never hands a request KV of other weights; a prompt being prefilled when an update arrives finishes
on the weights it started with; bad updates change nothing; an updated adapter stays in host memory (never paged back
in from its blob) until its published weights are restored."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from preft.common.engine_contract import EngineRequest
from preft.common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from preft.devtools.tiny import build_direft, build_lora
from preft.engine.async_engine import AsyncPreftEngine
from tests.adapter_specs import service_over, spec_for
from tests.conftest import random_prompt
from tests.engine.conftest import BLOCK_SIZE, engine_options
from tests.reference import reference_generate

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
WEIGHTS = "adapter_model.safetensors"
# (name, mode, builder): each adapter is built twice, the "old" weights served first and the "new" pushed in place
CASES = (
    ("lora", "prefill", lambda out, model, seed: build_lora(out, model, rank=8, seed=seed)),
    ("lora-qv-down", "all", lambda out, model, seed: build_lora(out, model, rank=4, targets=QV_DOWN, seed=seed)),
    ("direft", "prefill", lambda out, model, seed: build_direft(out, model, rank=4, layers=(0, 2), seed=seed)),
)
QV_DOWN = ("q_proj", "v_proj", "down_proj")  # (q and v are slices of vLLM's packed qkv_proj, k has no LoRA)


@pytest.fixture(scope="module")
def engine(model_dirs, loop):
    engine = AsyncPreftEngine(engine_options(model_dirs["llama"], scheduling_policy="priority"))
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.shutdown())


@pytest.fixture(scope="module")
def pairs(model_dirs, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per case: (old, new) adapter directories, same configuration, other weights (several seeds per case)."""
    root, model = tmp_path_factory.mktemp("updates"), model_dirs["llama"]
    out = {}
    for k, (name, _, build) in enumerate(CASES):
        for variant in range(4):
            key = f"{name}-{variant}"
            seed = 1000 + 10 * k + 2 * variant
            out[key] = (build(root / key / "old", model, seed), build(root / key / "new", model, seed + 1))
    return out


def weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(adapter_dir / WEIGHTS))


async def generate(engine, prompt, adapter_dir, mode, *, rid: str, max_tokens: int = MAX_TOKENS):
    """Greedy tokens and the prompt tokens found in the prefix cache."""
    req = EngineRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, mode=mode)
    chunks = [c async for c in engine.generate(req, adapter_dir)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage.cached_tokens


@pytest.mark.parametrize("name,mode", [(name, mode) for name, mode, _ in CASES])
def test_requests_after_an_update_get_the_new_weights_tokens(engine, model_dirs, pairs, loop, name, mode):
    """Old weights, then new (in place, no reload), then the old again (a third version): each request equals the
    reference for the weights it was served, and a repeated prompt hits the prefix cache only within one version."""
    model = model_dirs["llama"]
    old, new = pairs[f"{name}-0"]
    prompt = random_prompt(random.Random(f"upd-{name}"), 2 * BLOCK_SIZE + 5)
    expected = {d: reference_generate(model, prompt, d, mode, MAX_TOKENS) for d in (old, new)}
    assert expected[old] != expected[new], "the test needs weights that change the greedy tokens"

    async def scenario():
        info = await engine.add_lora(old)
        served = [("v0", old, await generate(engine, prompt, old, mode, rid=f"{name}-a"))]
        served.append(("v0 again", old, await generate(engine, prompt, old, mode, rid=f"{name}-b")))
        update = await engine.update_adapter_weights(info.digest, weights(new))
        assert update.version == 1 and update.waited_for == 0
        print(f"{name}: update visible after {update.seconds * 1000:.1f} ms")
        served.append(("v1", new, await generate(engine, prompt, old, mode, rid=f"{name}-c")))
        served.append(("v1 again", new, await generate(engine, prompt, old, mode, rid=f"{name}-d")))
        assert (await engine.update_adapter_weights(info.digest, weights(old))).version == 2
        served.append(("v2", old, await generate(engine, prompt, old, mode, rid=f"{name}-e")))
        return served

    served = loop.run_until_complete(scenario())
    for label, weights_dir, (tokens, _) in served:
        assert tokens == expected[weights_dir], f"{label}: tokens are not the reference's for the weights served"
    cached = {label: hits for label, _, (_, hits) in served}
    full_blocks = 2 * BLOCK_SIZE
    assert cached == {"v0": 0, "v0 again": full_blocks, "v1": 0, "v1 again": full_blocks, "v2": 0}, (
        "a prompt's cached KV was reused across weight versions (or not within one)"
    )


def test_a_partial_update_replaces_only_the_named_tensors(engine, model_dirs, pairs, loop, tmp_path):
    """Only the LoRA B tensors pushed (vLLM scales B: the pushed B is scaled as a loaded one): the reference with the
    old A and the new B."""
    old, new = pairs["lora-qv-down-1"]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    tensors = {**weights(old), **{k: v for k, v in weights(new).items() if ".lora_B." in k}}
    save_file(tensors, str(mixed / WEIGHTS))
    (mixed / "adapter_config.json").write_text((old / "adapter_config.json").read_text())
    prompt = random_prompt(random.Random("partial"), 21)
    expected = reference_generate(model_dirs["llama"], prompt, mixed, "all", MAX_TOKENS)

    async def scenario():
        info = await engine.add_lora(old)
        b_only = {k: v for k, v in weights(new).items() if ".lora_B." in k}
        await engine.update_adapter_weights(info.digest, b_only)
        return await generate(engine, prompt, old, "all", rid="partial")

    tokens, _ = loop.run_until_complete(scenario())
    assert tokens == expected


def test_a_prompt_being_prefilled_finishes_on_the_weights_it_started_with(engine, model_dirs, pairs, loop):
    """A long prompt is being prefilled in chunks (one per step: a base request decodes beside it, one token a step)
    when the update arrives: the update waits for it, so it is the old weights' from its first chunk to its output; a
    request sent while the update waits is held, then served on the new weights; the update is answered after."""
    model = model_dirs["llama"]
    old, new = pairs["lora-2"]
    long_prompt = random_prompt(random.Random("long"), 500)  # 17 steps of 31 tokens beside the sentinel's one
    short_prompt = random_prompt(random.Random("short"), 20)
    expected_long = {d: reference_generate(model, long_prompt, d, "prefill", 4) for d in (old, new)}
    expected_short = {d: reference_generate(model, short_prompt, d, "prefill", 4) for d in (old, new)}
    assert expected_long[old] != expected_long[new] and expected_short[old] != expected_short[new]

    async def scenario():
        info = await engine.add_lora(old)
        sentinel = engine.generate(
            EngineRequest(request_id="sentinel", prompt_token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True), None
        )
        seen = len((await anext(sentinel)).token_ids)
        long_task = asyncio.ensure_future(generate(engine, long_prompt, old, "prefill", rid="long", max_tokens=4))
        start = seen
        while seen < start + 2:  # (two steps since: the long prompt is part-way through its 17)
            seen += len((await anext(sentinel)).token_ids)
        update_task = asyncio.ensure_future(engine.update_adapter_weights(info.digest, weights(new)))
        await asyncio.sleep(0.3)  # (the update has reached the engine core, and waits)
        short = await generate(engine, short_prompt, old, "prefill", rid="short", max_tokens=4)
        update = await update_task
        long = await long_task
        await sentinel.aclose()
        return update, long, short

    update, (long, _), (short, _) = loop.run_until_complete(scenario())
    print(f"the update waited {update.waited_steps} steps, {update.seconds * 1000:.0f} ms")
    assert long == expected_long[old], "the prompt in flight was not served entirely on the old weights"
    assert short == expected_short[new], "a request sent while the update waited was not served on the new weights"
    assert update.waited_for == 1 and update.waited_steps >= 1, f"the update did not wait for the prompt: {update}"


def test_bad_updates_are_refused_and_change_nothing(engine, model_dirs, pairs, loop):
    model = model_dirs["llama"]
    old, new = pairs["lora-1"]
    other, _ = pairs["direft-1"]  # (never loaded)
    prompt = random_prompt(random.Random("bad"), 2 * BLOCK_SIZE + 3)
    expected = reference_generate(model, prompt, old, "prefill", MAX_TOKENS)
    good = weights(new)
    name = next(iter(good))

    def changed(**edits) -> dict[str, torch.Tensor]:
        return {**good, **edits}

    nan, inf = good[name].clone(), good[name].clone()
    nan[0, 0], inf[-1, -1] = math.nan, math.inf
    bad = {
        "unknown name": ({**good, "base_model.model.lm_head.lora_A.weight": good[name]}, InvalidArgument, "unknown"),
        "shape": (changed(**{name: good[name].T.contiguous()}), InvalidArgument, "has shape"),
        "dtype": (changed(**{name: good[name].to(torch.bfloat16)}), InvalidArgument, "dtype BF16"),
        "NaN": (changed(**{name: nan}), InvalidArgument, "NaN or infinite"),
        "infinity": (changed(**{name: inf}), InvalidArgument, "NaN or infinite"),
        "nothing": ({}, InvalidArgument, "no tensors"),
    }

    async def scenario():
        info = await engine.add_lora(old)
        first = await generate(engine, prompt, old, "prefill", rid="bad-0")
        errors = {}
        for label, (tensors, error, _) in bad.items():
            with pytest.raises(error) as caught:
                await engine.update_adapter_weights(info.digest, tensors)
            errors[label] = caught.value.message
        with pytest.raises(NotFound):
            await engine.update_adapter_weights(spec_for(other).digest, weights(other))
        return first, errors, await generate(engine, prompt, old, "prefill", rid="bad-1")

    first, errors, after = loop.run_until_complete(scenario())
    for label, (_, _, says) in bad.items():
        assert says in errors[label], f"{label}: {errors[label]}"
    assert first[0] == after[0] == expected
    assert after[1] == 2 * BLOCK_SIZE, "a refused update changed the adapter's version (its cached KV is gone)"


def test_an_updated_adapter_stays_in_host_memory_until_restored(engine, model_dirs, pairs, loop, tmp_path):
    """Through the replica's service and pager (a host tier of 2): the updated adapter is never evicted while others
    come and go, and serves its new weights; only its owner may update or restore it, and only its owner's requests
    use it; restored, it serves its published weights and is evicted and paged back in like any other."""
    model = model_dirs["llama"]
    (live_old, live_new), (other_a, _), (other_b, _) = pairs["direft-2"], pairs["lora-qv-down-2"], pairs["direft-3"]
    service = service_over(engine, (live_old, other_a, other_b), tmp_path / "disk", max_live_adapters=1)
    pager = service.pager
    live, a, b = spec_for(live_old, ref="t/live@v1"), spec_for(other_a, ref="t/a@v1"), spec_for(other_b, ref="t/b@v1")
    prompt = random_prompt(random.Random("tiers"), 30)
    expected = {d: reference_generate(model, prompt, d, "prefill", MAX_TOKENS) for d in (live_old, live_new)}

    def request(spec, rid: str) -> EngineRequest:
        return EngineRequest(
            request_id=rid, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, adapter=spec
        )

    async def tokens(spec, rid: str) -> list[int]:
        return (await service.complete(request(spec, rid))).token_ids

    async def scenario():
        await pager.start()
        out = {"published": await tokens(live, "t-0")}
        with pytest.raises(NotFound):  # (not resident yet)
            await service.update_adapter_weights(a.digest, weights(other_a), owner="t")
        await service.update_adapter_weights(live.digest, weights(live_new), owner="t")
        with pytest.raises(PermissionDenied):
            await service.update_adapter_weights(live.digest, weights(live_new), owner="u")
        with pytest.raises(FailedPrecondition):  # (another tenant's adapter with the same content)
            await tokens(live.model_copy(update={"ref": "u/copy@v1"}), "t-u")
        for k, spec in enumerate((a, b, a, b)):  # (a host tier of 2, one slot pinned: a and b evict each other)
            await tokens(spec, f"t-churn-{k}")
        out["churned"] = pager.holds(live.digest), pager.holds(a.digest), pager.holds(b.digest)
        out["live"] = await tokens(live, "t-1")
        await service.restore_adapter(live.digest, owner="t")
        out["restored"] = await tokens(live, "t-2")
        for k, spec in enumerate((a, b)):
            await tokens(spec, f"t-evict-{k}")
        out["evicted"] = not pager.holds(live.digest)
        started = time.perf_counter()
        out["paged in again"] = await tokens(live, "t-3")
        out["page-in s"] = time.perf_counter() - started
        await pager.close()
        return out

    out = loop.run_until_complete(scenario())
    assert out["published"] == expected[live_old]
    assert out["churned"] == (True, False, True), "the updated adapter was evicted (or the churn did not evict)"
    assert out["live"] == expected[live_new], "the updated adapter did not keep serving its new weights"
    assert out["restored"] == expected[live_old]
    assert out["evicted"], "a restored adapter should be evictable again"
    assert out["paged in again"] == expected[live_old]
