"""The serving engine (vLLM AsyncLLM + plugin) streams the same greedy tokens as the offline engine, in one concurrent
mixed batch of adapters read ahead of add_lora, counts usage right, frees an aborted request, shares cached prompt
blocks only among requests of one cache salt, admits a live request ahead of queued offline ones and preempts a
running one for it (the priority scheduling policy, as the serving settings choose)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path

import psutil
import pytest
import torch

from preft.common.engine_contract import LIVE_PRIORITY, OFFLINE_PRIORITY, EngineRequest, OutputConstraint
from preft.common.errors import InvalidArgument, Unavailable
from preft.engine.async_engine import AsyncPreftEngine
from preft.engine.requests import GenerationRequest
from preft.engine.vllm_engine import engine_kwargs
from tests.conftest import random_prompt
from tests.engine.conftest import BLOCK_SIZE, LOGIT_TIE, LOGPROB_ABS, engine_options
from tests.reference import reference_generate, reference_logits, reference_prompt_logits

pytestmark = pytest.mark.engine

MAX_TOKENS = 10
# (adapter, mode): base, LoRA prefill, LoRA all, DiReFT prefill, DiReFT all
CASES = ((None, "prefill"), ("lora_a", "prefill"), ("lora_b", "all"), ("direft_a", "prefill"), ("direft_b", "all"))


@pytest.fixture(scope="module")
def async_engine(model_dirs, loop):
    engine = AsyncPreftEngine(engine_options(model_dirs["llama"], scheduling_policy="priority"))  # (as served)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    started = time.perf_counter()
    loop.run_until_complete(engine.start())
    print(f"async engine start: {time.perf_counter() - started:.1f} s")
    engine.test_processes = [c for c in psutil.Process().children() if c.pid not in before]  # its engine core
    yield engine
    loop.run_until_complete(engine.shutdown())


async def _collect(engine: AsyncPreftEngine, request: EngineRequest, adapter_dir):
    chunks = [c async for c in engine.generate(request, adapter_dir)]
    return chunks


def test_streamed_mixed_batch_equals_the_offline_engine(async_engine, engine_factory, model_dirs, adapters, loop):
    ads = adapters["llama"]
    rng = random.Random(11)
    prompts = [random_prompt(rng, n) for n in (6, 21, 45)]  # 45 > the 32-token step: chunked prefill
    jobs = []
    for k, (name, mode) in enumerate(CASES):
        for j, prompt in enumerate(prompts):
            rid = f"{name or 'base'}-{mode}-{j}"
            req = EngineRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                max_tokens=MAX_TOKENS + k,
                temperature=0.0,
                ignore_eos=True,
                stream=True,
                mode=mode,
            )
            jobs.append((req, ads[name] if name else None))

    async def run_all():
        # as the pager loads them: read ahead by the engine's workers (all at once), then added; the offline engine
        # below reads its adapters inside add_lora, so the outputs also compare the two ways of loading
        dirs = {d for _, d in jobs if d is not None}
        await asyncio.gather(*(async_engine.prepare_lora(d) for d in dirs))
        for adapter_dir in dirs:
            await async_engine.add_lora(adapter_dir)
        return await asyncio.gather(*(_collect(async_engine, req, d) for req, d in jobs))

    streamed = loop.run_until_complete(run_all())

    offline = engine_factory(model_dirs["llama"])
    expected = offline.generate(
        [
            GenerationRequest(
                req.request_id,
                prompt_ids=tuple(req.prompt_token_ids),
                adapter=str(d) if d else None,
                mode=req.mode,
                max_tokens=req.max_tokens,
            )
            for req, d in jobs
        ]
    )
    mismatches = {}
    for (req, _), chunks, exp in zip(jobs, streamed, expected, strict=True):
        assert exp.error is None
        tokens = [t for c in chunks for t in c.token_ids]
        if tokens != list(exp.token_ids):
            mismatches[req.request_id] = (tokens, list(exp.token_ids))
        assert len(chunks) >= 2, "a stream of several tokens must arrive in several chunks"
        assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
        last = chunks[-1]
        assert last.finish_reason == "length"
        assert last.usage.prompt_tokens == len(req.prompt_token_ids)
        assert last.usage.completion_tokens == req.max_tokens == len(tokens)
        assert "".join(c.text for c in chunks) == exp.text
    assert not mismatches, f"async != offline for {len(mismatches)}/{len(jobs)}: {mismatches}"
    assert async_engine.num_unfinished_requests() == 0


def test_an_aborted_stream_frees_the_request(async_engine, adapters, loop):
    req = EngineRequest(request_id="long", prompt_token_ids=[5, 6, 7, 8], max_tokens=400, ignore_eos=True)

    async def scenario():
        stream = async_engine.generate(req, adapters["llama"]["lora_a"])
        first = await anext(stream)
        assert first.token_ids and first.finish_reason is None
        assert async_engine.num_unfinished_requests() == 1
        await stream.aclose()  # the consumer went away
        for _ in range(100):
            if async_engine.num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.05)
        assert async_engine.num_unfinished_requests() == 0
        # the engine keeps serving
        short = req.model_copy(update={"request_id": "after", "max_tokens": 3})
        chunks = [c async for c in async_engine.generate(short, None)]
        assert chunks[-1].usage.completion_tokens == 3

    loop.run_until_complete(scenario())


def test_add_and_remove_lora_move_adapters_in_and_out_of_host_memory(async_engine, adapters, loop):
    lora_c = adapters["llama"]["lora_c"]

    async def scenario():
        info = await async_engine.add_lora(lora_c)
        lora_id = async_engine.catalog.resolve(lora_c).lora_int_id
        assert lora_id in await async_engine.loaded_lora_ids()
        await async_engine.remove_lora(info.digest)
        assert lora_id not in await async_engine.loaded_lora_ids()

    loop.run_until_complete(scenario())


@pytest.mark.parametrize("adapter", [None, "lora_a"])
def test_the_prefix_cache_is_shared_only_within_a_cache_salt(async_engine, adapters, loop, adapter):
    """Tenant B (its own salt) gets no prefix-cache hit on the prompt tenant A just sent, A's repeat gets every full
    block of it, as vLLM counts them (the scheduler's hits: RequestOutput.num_cached_tokens), base model or adapter."""
    blocks = 6
    prompt = random_prompt(random.Random(f"salt-{adapter}"), blocks * BLOCK_SIZE + 5)  # (this test's own tokens)
    adapter_dir = adapters["llama"][adapter] if adapter else None

    def cached(salt: str | None, n: int) -> int:
        req = EngineRequest(request_id=f"salt-{adapter}-{n}", prompt_token_ids=prompt, max_tokens=2, cache_salt=salt)
        chunks = loop.run_until_complete(_collect(async_engine, req, adapter_dir))
        return chunks[-1].usage.cached_tokens

    salt_a, salt_b = "a" * 64, "b" * 64
    assert cached(salt_a, 0) == 0  # (a prompt never sent before)
    assert cached(salt_b, 1) == 0, "tenant B hit tenant A's cached prompt"
    assert cached(salt_a, 2) == blocks * BLOCK_SIZE, "tenant A's own repeat should hit every full block"
    assert cached(salt_b, 3) == blocks * BLOCK_SIZE  # (B's own blocks now)
    assert cached(None, 4) == 0  # (no salt shares with no salted request)


LOGPROB_CASES = ((None, "prefill"), ("lora_a", "prefill"), ("lora_b", "all"), ("direft_a", "prefill"))


def _cases(ads, prefix: str, **fields) -> list[tuple[EngineRequest, Path | None]]:
    """One streamed request per case of LOGPROB_CASES (base, LoRAP, LoRA all, DiReFTP), with its adapter dir."""
    return [
        (EngineRequest(request_id=f"{prefix}-{name}-{mode}", stream=True, mode=mode, **fields), ads.get(name))
        for name, mode in LOGPROB_CASES
    ]


def _run_all(engine: AsyncPreftEngine, loop, jobs) -> list[list]:
    """Every job's chunks, the jobs run concurrently (mixed batches)."""

    async def run_all():
        return await asyncio.gather(*(_collect(engine, req, d) for req, d in jobs))

    return loop.run_until_complete(run_all())


def test_logprobs_are_the_models_at_each_position_in_its_mode(async_engine, model_dirs, adapters, loop):
    """Each generated token's logprob and the top 3 at its position are the log-softmax of the reference's logits
    there: the first token's from the prompt's last position with the adapter, the later ones' with it off in
    `prefill` mode and on in `all` mode (float32)."""
    prompt = random_prompt(random.Random(5), 37)  # (longer than a step: chunked prefill)
    cases = _cases(adapters["llama"], "lp", prompt_token_ids=prompt, max_tokens=6, logprobs=3, ignore_eos=True)
    for (req, adapter_dir), chunks in zip(cases, _run_all(async_engine, loop, cases), strict=True):
        tokens = [t for c in chunks for t in c.token_ids]
        logprobs = [lp for c in chunks for lp in c.logprobs or []]
        assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in chunks)
        assert [lp.token_id for lp in logprobs] == tokens and len(tokens) == 6
        assert any(t.token for lp in logprobs for t in lp.top)  # (the tokens' text, where they decode alone)
        reference = reference_logits(model_dirs["llama"], prompt, adapter_dir, req.mode.value, tokens)
        for position, (lp, logits) in enumerate(zip(logprobs, reference, strict=True)):
            want = torch.log_softmax(logits.double(), dim=-1)
            where = f"{req.request_id} position {position}"
            assert lp.logprob == pytest.approx(float(want[lp.token_id]), abs=LOGPROB_ABS), where
            assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id, where  # (greedy: the chosen is the top)
            top = torch.topk(want, 3)
            assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=LOGPROB_ABS), where


def test_prompt_logprobs_are_the_adapted_models_over_the_prompt(async_engine, model_dirs, adapters, loop):
    """Each prompt token's logprob (all but the first) and the top 2 at its position are the log-softmax of the
    reference's logits over the prompt with the adapter on, in both modes (the prompt pass is the same), all in the
    first chunk, across a prompt prefilled in several steps (float32)."""
    prompt = random_prompt(random.Random(17), 45)  # (longer than a step: chunked prefill)
    cases = _cases(adapters["llama"], "plp", prompt_token_ids=prompt, max_tokens=3, prompt_logprobs=2)
    for (req, adapter_dir), chunks in zip(cases, _run_all(async_engine, loop, cases), strict=True):
        scored = chunks[0].prompt_logprobs
        assert all(c.prompt_logprobs is None for c in chunks[1:]) and chunks[0].logprobs is None
        assert [lp.token_id for lp in scored] == prompt[1:], req.request_id
        want = torch.log_softmax(reference_prompt_logits(model_dirs["llama"], prompt, adapter_dir).double(), dim=-1)
        for position, (lp, row) in enumerate(zip(scored, want, strict=True)):
            where = f"{req.request_id} prompt position {position + 1}"
            assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=LOGPROB_ABS), where
            # the top 2 as the reference scores them, and its two best values: its top 2, up to a near tie's order
            scores = [float(row[t.token_id]) for t in lp.top]
            assert [t.logprob for t in lp.top] == pytest.approx(scores, abs=LOGPROB_ABS), where
            assert scores == pytest.approx(torch.topk(row, 2).values.tolist(), abs=LOGPROB_ABS), where


def test_penalties_follow_their_definition(async_engine, model_dirs, adapters, loop):
    """presence_penalty and frequency_penalty change greedy decoding as OpenAI defines them over the generated
    tokens (the reference applies that definition by itself), for a base request and a LoRAP one."""
    prompt = random_prompt(random.Random(9), 12)
    for adapter_dir, mode in ((None, "prefill"), (adapters["llama"]["lora_a"], "prefill")):
        plain = EngineRequest(request_id="plain", prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, mode=mode)
        penalized = plain.model_copy(
            update={"request_id": "penalized", "presence_penalty": 0.5, "frequency_penalty": 1.5}
        )
        got = {}
        for req in (plain, penalized):
            chunks = loop.run_until_complete(_collect(async_engine, req, adapter_dir))
            got[req.request_id] = [t for c in chunks for t in c.token_ids]
        model = model_dirs["llama"]
        assert not _off_the_reference(model, prompt, adapter_dir, mode, got["penalized"], presence=0.5, frequency=1.5)
        assert not _off_the_reference(model, prompt, adapter_dir, mode, got["plain"], presence=0.0, frequency=0.0)
        assert got["penalized"] != got["plain"]  # (the penalties changed this greedy run: the test can tell)
        if LOGIT_TIE == 0.0:  # (on the CPU, exactly the reference's own penalized run)
            want = reference_generate(model, prompt, adapter_dir, mode, 24, presence_penalty=0.5, frequency_penalty=1.5)
            assert got["penalized"] == want


def _off_the_reference(model, prompt, adapter_dir, mode, tokens, *, presence: float, frequency: float) -> list[dict]:
    """The steps where the engine's greedy token is not the reference's best after the same penalties (OpenAI's,
    over the tokens generated so far), by more than LOGIT_TIE; the reference is fed the engine's tokens."""
    counts: dict[int, int] = {}
    off = []
    reference = reference_logits(model, prompt, adapter_dir, mode, tokens)
    for step, (token, logits) in enumerate(zip(tokens, reference, strict=True)):
        penalized = logits.double().clone()
        for seen, n in counts.items():
            penalized[seen] -= frequency * n + presence
        margin = float(penalized.max() - penalized[token])
        if margin > LOGIT_TIE:
            off.append({"step": step, "token": token, "margin": margin})
        counts[token] = counts.get(token, 0) + 1
    return off


def test_vllms_sampling_extensions_follow_their_definitions(async_engine, model_dirs, adapters, loop):
    """vLLM's repetition_penalty (over the prompt and the answer), stop_token_ids with min_tokens, allowed_token_ids,
    and top_k / min_p at temperature 1 narrowed to the most likely token (so sampling picks what greedy does), as the
    reference applies them, for a LoRAP request; include_stop_str_in_output keeps a stop string in the text."""
    prompt, model = random_prompt(random.Random(21), 12), model_dirs["llama"]
    adapter_dir, mode = adapters["llama"]["lora_a"], "prefill"
    req = EngineRequest(request_id="extensions", prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, mode=mode)

    def run(**update) -> tuple[list[int], str | None]:
        return run_with_text(**update)[:2]

    def run_with_text(**update) -> tuple[list[int], str | None, str]:
        chunks = loop.run_until_complete(_collect(async_engine, req.model_copy(update=update), adapter_dir))
        return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason, "".join(c.text for c in chunks)

    def reference(**options) -> list[int]:
        return reference_generate(model, prompt, adapter_dir, mode, 16, **options)

    greedy = reference()
    repeated = run(repetition_penalty=1.8)[0]
    assert repeated == reference(repetition_penalty=1.8) and repeated != greedy
    stop = [greedy[2]]
    assert run(stop_token_ids=stop) == (reference(stop_token_ids=stop), "stop")
    held = run(stop_token_ids=stop, min_tokens=4)[0]
    assert held == reference(stop_token_ids=stop, min_tokens=4) and len(held) > 4 > greedy.index(stop[0])
    for narrowed in ({"top_k": 1}, {"min_p": 1.0}):
        assert run(temperature=1.0, seed=3, **narrowed)[0] == greedy, narrowed
    allowed = sorted({greedy[1], greedy[3], 7})
    only = run(allowed_token_ids=allowed)[0]
    assert only == reference(allowed=lambda _: allowed) and set(only) <= set(allowed)
    text = run_with_text()[2]
    stop = text[len(text) // 2 :][:3]
    cut = text.index(stop)
    assert run_with_text(stop=[stop])[2] == text[:cut]
    assert run_with_text(stop=[stop], include_stop_str_in_output=True)[2] == text[: cut + len(stop)]


def _bad_word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's tokens alone, and after a space where that is as many tokens and starts elsewhere (as vLLM
    defines bad_words)."""
    sequences = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return sequences


def test_bad_words_and_special_tokens_follow_their_definitions(async_engine, model_dirs, adapters, loop):
    """bad_words: the last token of a bad word's tokens is never picked right after the tokens before it, as the
    reference masking it does (for a LoRAP request); skip_special_tokens false keeps special tokens in the text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    prompt, model = random_prompt(random.Random(23), 12), model_dirs["llama"]
    adapter_dir, mode = adapters["llama"]["lora_a"], "prefill"
    req = EngineRequest(request_id="words", prompt_token_ids=prompt, max_tokens=12, ignore_eos=True, mode=mode)

    def run(**update) -> tuple[list[int], str]:
        chunks = loop.run_until_complete(_collect(async_engine, req.model_copy(update=update), adapter_dir))
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)

    greedy = reference_generate(model, prompt, adapter_dir, mode, 12)
    vocab = range(tokenizer.vocab_size)
    changed = []
    for words in ([tokenizer.decode(greedy[2:3])], [tokenizer.decode(greedy[4:6]), tokenizer.decode(greedy[8:9])]):
        banned = _bad_word_sequences(tokenizer, words)

        def allowed(tokens: list[int], banned=banned) -> list[int]:
            last = {
                seq[-1]
                for seq in banned
                if len(seq) <= len(tokens) + 1 and tokens[len(tokens) - len(seq) + 1 :] == seq[:-1]
            }
            return [t for t in vocab if t not in last]

        tokens = run(bad_words=words)[0]
        assert tokens == reference_generate(model, prompt, adapter_dir, mode, 12, allowed=allowed), words
        changed.append(tokens != greedy)
    assert any(changed)

    special = tokenizer.convert_tokens_to_ids("<|begin|>")
    text_prompt = tokenizer.encode("the cat sat on the mat")  # (a random prompt's last bytes may be text's first)
    forced = {"prompt_token_ids": text_prompt, "allowed_token_ids": [special], "max_tokens": 3}
    assert run(**forced) == ([special] * 3, "")
    for spaces in (True, False):  # (a fast tokenizer's text has no spaces between them either way)
        kept = run(**forced, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert kept == ([special] * 3, "<|begin|>" * 3)


def test_logit_bias_moves_the_tokens_it_names(async_engine, model_dirs, adapters, loop):
    """A bias of -100 on the unbiased run's tokens steers greedy decoding elsewhere, as the reference adding it
    does; +100 on one token makes it every token."""
    prompt = random_prompt(random.Random(13), 10)
    adapter_dir = adapters["llama"]["lora_a"]
    req = EngineRequest(request_id="plain", prompt_token_ids=prompt, max_tokens=8, ignore_eos=True)

    def tokens(**update) -> list[int]:
        chunks = loop.run_until_complete(_collect(async_engine, req.model_copy(update=update), adapter_dir))
        return [t for c in chunks for t in c.token_ids]

    plain = tokens()
    banned = {t: -100.0 for t in plain}
    steered = tokens(request_id="banned", logit_bias=banned)
    assert steered == reference_generate(model_dirs["llama"], prompt, adapter_dir, "prefill", 8, logit_bias=banned)
    assert not set(steered) & set(plain)
    assert tokens(request_id="forced", logit_bias={7: 100.0}) == [7] * 8


def test_bad_requests_are_invalid_before_reaching_vllm(async_engine, model_dirs, loop, tmp_path):
    async def first(req, adapter_dir=None):
        return await anext(async_engine.generate(req, adapter_dir))

    req = EngineRequest(request_id="bad", prompt_token_ids=[1, 10**6], max_tokens=2)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        loop.run_until_complete(first(req))
    too_long = EngineRequest(request_id="long", prompt_token_ids=[5] * 500, max_tokens=20)
    with pytest.raises(InvalidArgument, match="exceeds the context"):
        loop.run_until_complete(first(too_long))
    (tmp_path / "adapter_config.json").write_text("{}")
    ok = EngineRequest(request_id="ok", prompt_token_ids=[5, 6], max_tokens=2)
    with pytest.raises(InvalidArgument, match="adapter"):
        loop.run_until_complete(first(ok, tmp_path))
    biased = EngineRequest(request_id="bias", prompt_token_ids=[5, 6], max_tokens=2, logit_bias={10**6: 1.0})
    with pytest.raises(InvalidArgument, match="logit_bias token id 1000000 is outside the vocabulary"):
        loop.run_until_complete(first(biased))
    # constraints the structured-output backend cannot compile: refused before they run, the engine keeps serving
    for constraint in (
        OutputConstraint(regex="(unclosed"),
        OutputConstraint(json={"$ref": "#/$defs/missing"}),  # (valid JSON Schema: references are not followed)
        OutputConstraint(grammar="root ::= missing_rule"),
    ):
        constrained = ok.model_copy(update={"request_id": "constrained", "constraint": constraint})
        with pytest.raises(InvalidArgument, match="the engine refused the request"):
            loop.run_until_complete(first(constrained))
    assert loop.run_until_complete(first(ok)).token_ids


def _choice_constraint(model_dir, choices: list[str]):
    """The tokens a `choice` constraint allows next, worked out from the tokenizer alone: any token whose text
    extends the text so far towards one of the choices; the end-of-sequence token once the text is a choice. Also
    the end-of-sequence id and each ordinary token's text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    pieces = {t: tokenizer.decode([t]) for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids}

    def allowed(tokens: list[int]) -> list[int]:
        if tokens and tokens[-1] == eos:
            return [eos]  # (the reference keeps stepping after the end; the engine stops)
        text = tokenizer.decode(tokens)
        ok = [t for t, piece in pieces.items() if piece and any(c.startswith(text + piece) for c in choices)]
        return [*ok, eos] if text in choices else ok

    return allowed, eos, pieces


def test_constrained_text_matches_its_constraint_in_every_mode(async_engine, model_dirs, adapters, loop):
    """Structured outputs: a `choice` constraint gives the reference's greedy choice, worked out by masking its logits
    to the tokens that continue a choice, for base, LoRAP, LoRA all-token and DiReFTP requests (so the adapter's
    prompt pass decides it); a regex, a JSON schema and JSON-object mode give text that satisfies them and stop."""
    import jsonschema

    ads, model_dir = adapters["llama"], model_dirs["llama"]
    choices = ["red", "green", "blue sky", "black cat", "white"]
    allowed, eos, pieces = _choice_constraint(model_dir, choices)
    # JSON allows whitespace between any two tokens, which a random model may pick forever: biased away here
    compact = {t: -100.0 for t, piece in pieces.items() if piece and not piece.strip()}
    # and JSON-object mode's free keys and strings may never close: quotes and braces favoured
    closing = {**compact, **{t: 10.0 for t, piece in pieces.items() if '"' in piece or "}" in piece}}
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    prompt = random_prompt(random.Random(21), 37)
    constraints = {
        "choice": OutputConstraint(choice=choices),
        "regex": OutputConstraint(regex=r"(cat|dog)-[0-9]{2}"),
        "json": OutputConstraint(json=schema),
        "json_object": OutputConstraint(json_object=True),
    }
    jobs = [
        case
        for kind, constraint in constraints.items()
        for case in _cases(
            ads,
            f"so-{kind}",
            prompt_token_ids=prompt,
            max_tokens=80,
            constraint=constraint,
            logit_bias={"json": compact, "json_object": closing}.get(kind, {}),
        )
    ]
    picked = set()
    for (req, adapter_dir), chunks in zip(jobs, _run_all(async_engine, loop, jobs), strict=True):
        text, where = "".join(c.text for c in chunks), req.request_id
        assert chunks[-1].finish_reason == "stop", (where, text)
        if req.constraint.choice:
            want = reference_generate(model_dir, prompt, adapter_dir, req.mode.value, 12, allowed=allowed)
            want = want[: want.index(eos) + 1]  # (the engine's tokens end with the end-of-sequence token)
            assert [t for c in chunks for t in c.token_ids] == want, where
            assert text in choices, where
            picked.add(text)
        elif req.constraint.regex:
            assert re.fullmatch(req.constraint.regex, text), (where, text)
        else:
            value = json.loads(text)
            assert isinstance(value, dict), (where, text)
            if req.constraint.json_schema:
                jsonschema.validate(value, schema)
    print(f"choices picked: {sorted(picked)}")


def test_a_live_request_is_admitted_before_queued_offline_ones(async_engine, loop):
    """Offline (batch) requests take every sequence slot and more wait; a live request sent after them all gets the
    next free slot, so it finishes before most of the offline ones that were queued (under fcfs: after them all)."""
    slots, queued = engine_kwargs(async_engine.options)["max_num_seqs"], 8
    rng = random.Random(17)

    def request(request_id: str, priority: int) -> EngineRequest:
        fields = {"prompt_token_ids": random_prompt(rng, 4), "max_tokens": 48, "ignore_eos": True}
        return EngineRequest(request_id=request_id, priority=priority, **fields)

    offline = [request(f"offline-{i}", OFFLINE_PRIORITY) for i in range(slots + queued)]
    live = request("live", LIVE_PRIORITY)
    finished: list[str] = []

    async def run(req: EngineRequest) -> None:
        chunks = await _collect(async_engine, req, None)
        assert chunks[-1].usage.completion_tokens == req.max_tokens
        finished.append(req.request_id)

    async def scenario():
        before = async_engine.num_unfinished_requests()
        tasks = [asyncio.create_task(run(req)) for req in offline]
        while async_engine.num_unfinished_requests() < before + len(offline):  # (each sent to vLLM, in order)
            await asyncio.sleep(0.005)
        await asyncio.gather(run(live), *tasks)

    loop.run_until_complete(scenario())
    waited = {req.request_id for req in offline[slots:]}  # (the last to arrive: no slot was left for them)
    ahead = [rid for rid in finished[: finished.index("live")] if rid in waited]
    print(f"live finished {finished.index('live') + 1} of {len(finished)}, after {len(ahead)} of {queued} queued")
    assert len(ahead) < queued / 2, f"{len(ahead)} of {queued} queued offline requests finished first: {finished}"
    assert async_engine.num_unfinished_requests() == 0


def test_a_live_request_preempts_a_running_offline_one_whose_answer_stays_right(
    async_engine, model_dirs, adapters, loop
):
    """Offline LoRAP requests fill every sequence slot and are decoding; a live request sent then starts at once (one
    of them is preempted) and finishes first; the preempted one runs again from position 0 (its prompt with its
    adapter, its tokens so far without) and its greedy answer is still the reference's."""
    slots, adapter_dir = engine_kwargs(async_engine.options)["max_num_seqs"], adapters["llama"]["lora_a"]
    model = model_dirs["llama"]
    rng = random.Random(23)
    common = {"max_tokens": 40, "ignore_eos": True, "stream": True, "mode": "prefill"}
    offline = [
        EngineRequest(
            request_id=f"running-{i}", prompt_token_ids=random_prompt(rng, 6), priority=OFFLINE_PRIORITY, **common
        )
        for i in range(slots)
    ]
    live = EngineRequest(request_id="live", prompt_token_ids=random_prompt(rng, 5), max_tokens=3, ignore_eos=True)
    finished: list[str] = []
    tokens: dict[str, list[int]] = {}

    async def run(req: EngineRequest, adapter, started: asyncio.Event | None = None) -> None:
        async for chunk in async_engine.generate(req, adapter):
            tokens.setdefault(req.request_id, []).extend(chunk.token_ids)
            if started is not None:
                started.set()
        finished.append(req.request_id)

    async def scenario():
        await async_engine.add_lora(adapter_dir)
        started = [asyncio.Event() for _ in offline]
        tasks = [asyncio.create_task(run(req, adapter_dir, e)) for req, e in zip(offline, started, strict=True)]
        await asyncio.gather(*(e.wait() for e in started))  # (each has a token: all slots are taken)
        await asyncio.gather(run(live, None), *tasks)

    loop.run_until_complete(scenario())
    print(f"finished in order: {finished}")
    assert finished[0] == "live", f"the live request waited for a running offline one: {finished}"
    for req in offline:
        got = tokens[req.request_id]
        assert len(got) == req.max_tokens, req.request_id
        off = _off_the_reference(model, req.prompt_token_ids, adapter_dir, "prefill", got, presence=0.0, frequency=0.0)
        assert not off, (req.request_id, off)
    assert async_engine.num_unfinished_requests() == 0


def test_a_dead_engine_answers_unavailable_instead_of_hanging(async_engine, loop):
    """Last in the module (it kills the engine): the engine-core process dies; requests and health checks fail
    fast with Unavailable, which a replica answers as 503 while Ray Serve replaces it."""
    assert async_engine.test_processes, "the engine-core process of this engine was not found"
    for proc in async_engine.test_processes:
        proc.kill()

    async def scenario():
        for _ in range(100):  # vLLM notices the dead process and marks itself errored
            try:
                await async_engine.check_health()
            except Unavailable:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(Unavailable):
            await async_engine.check_health()
        req = EngineRequest(request_id="after-death", prompt_token_ids=[5, 6], max_tokens=3)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(anext(async_engine.generate(req, None)), 10)

    loop.run_until_complete(scenario())
