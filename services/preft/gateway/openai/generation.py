"""One generation's path around its prompt's tokenizing: the rate limit charged an estimate before (``precharged``),
then lengths, the rate limits and quota settled with the real count, adapter resolution, the engine call, and
releasing what was reserved. Completions and chat differ only in how they build the prompt and format the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from preft.common.engine_contract import MAX_SEED, EngineRequest, EngineResponse, Usage, check_min_tokens
from preft.common.errors import InvalidArgument, Unavailable
from preft.common.metrics import GATEWAY_OVERHEAD, QUEUE_DEPTH
from preft.gateway.core.auth import Caller
from preft.gateway.core.cache_salt import CacheSalts, salt_key
from preft.gateway.core.engine_client import EngineClient, EngineStream
from preft.gateway.core.errors import PayloadTooLarge
from preft.gateway.core.limits import Admission, RateLimiter
from preft.gateway.core.metering import Metered, TokenMeter
from preft.gateway.core.prompt_guard import PromptGuard
from preft.gateway.core.resolution import AdapterResolver, Resolution
from preft.gateway.core.settings import CoreSettings
from preft.gateway.openai.schemas import GenerationBody
from preft.gateway.openai.settings import OpenAISettings

IN_FLIGHT = QUEUE_DEPTH.labels(service="gateway")
T = TypeVar("T")


@dataclass
class HeldMetering:
    """The tokens of generations kept from the meter for their caller, which meters them where it records their
    answer: a batch line's go with its part (``batches.store``), so a line answered again after a crash is metered
    once. `later_s`: how much later than the meter they may count (the quota reservation holds them that much
    longer)."""

    later_s: float
    entries: list[Metered] = field(default_factory=list)


@dataclass
class Precharge:
    """What a request took from its tenant's buckets before its prompt was tokenized (an estimate; None: offline
    work, which takes from no bucket), until `admit` settles it with the real count."""

    admission: Admission | None
    settled: bool = False


@dataclass
class Job:
    """An admitted generation: its engine requests (per prompt, one per sample: `n`, or `best_of`), adapter and mode,
    and the tokens it reserved."""

    requests: list[EngineRequest]  # prompt by prompt, each prompt's samples in turn
    resolution: Resolution
    admission: Admission
    samples: int = 1  # engine requests per prompt
    held: HeldMetering | None = None  # where its tokens go instead of the meter
    generated_tokens: int = 0  # what the engine produced so far: the part of the reservation that stays charged
    answered: bool = False  # the engine answered every request (their first tokens): the job's tokens are metered
    finished: bool = field(default=False)

    @property
    def prompt_tokens(self) -> int:
        """The prompts' tokens, each prompt once (as `total_usage` counts them)."""
        return sum(len(r.prompt_token_ids) for r in self.requests[:: self.samples])

    @property
    def reserved_generation(self) -> int:
        """The generated tokens reserved: each sample's max_tokens (every choice, and best_of's extra samples)."""
        return sum(r.max_tokens for r in self.requests)


def total_usage(usages: list[Usage], samples: int = 1) -> Usage:
    """A request's usage over its engine requests (prompt by prompt, `samples` each): each prompt once, every
    sample's generated tokens."""
    prompt_tokens = sum(u.prompt_tokens for u in usages[::samples])
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages))


async def _all(calls: list[Awaitable[T]]) -> list[T]:
    """Every call's result, in order; the first failure cancels the others (closing their engine connections, which
    stops their generations) and is raised as it is. One call is awaited in place (no task: a stream whose engine
    broke off right after its first chunks keeps them: aiohttp raises the break before what it had buffered)."""
    if len(calls) == 1:
        return [await calls[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]  # type: ignore[arg-type]
    except* Exception as failures:
        raise failures.exceptions[0] from None
    return [t.result() for t in tasks]


def _samples(
    request: EngineRequest, prompts: list[list[int]], budgets: list[int], n: int, seed: int | None
) -> list[EngineRequest]:
    """Each prompt's samples as engine requests of their own (the engine batches them); with a seed, seed + j, as vLLM
    seeds its own, wrapped to stay a seed the engine takes."""
    return [
        request.model_copy(
            update={
                "request_id": f"{request.request_id}-{i * n + j}" if i or j else request.request_id,
                "prompt_token_ids": prompt,
                "max_tokens": budget,
                "seed": None if seed is None else (seed + j) % (MAX_SEED + 1),
            }
        )
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True))
        for j in range(n)
    ]


class GenerationService:
    """Owns the order of checks for a generation and the bookkeeping around the engine call."""

    def __init__(
        self,
        settings: CoreSettings,
        *,
        formats: OpenAISettings,
        limiter: RateLimiter,
        resolver: AdapterResolver,
        engine: EngineClient,
        meter: TokenMeter | None = None,
        guard: PromptGuard,
    ) -> None:
        self.settings = settings
        self.formats = formats
        self.guard = guard
        self.tokenizer = guard.tokenizer
        self.limiter = limiter
        self.resolver = resolver
        self.engine = engine
        self.meter = meter
        self._background: set[asyncio.Task] = set()
        key = settings.cache_salt_key or settings.registry_token
        self.cache_salts = CacheSalts(salt_key(key.get_secret_value()), settings.cache_groups)

    def max_tokens_for(self, prompt_tokens: int, requested: int | None) -> int:
        """The generation budget: 413 for a prompt over the limit, 400 when prompt + max_tokens cannot fit."""
        s = self.settings
        if prompt_tokens == 0:
            raise InvalidArgument("the prompt is empty")
        if prompt_tokens > s.max_prompt_tokens:
            raise PayloadTooLarge(
                f"The prompt has {prompt_tokens} tokens; this server accepts at most {s.max_prompt_tokens}."
            )
        room = s.max_model_len - prompt_tokens
        if requested is None:
            return min(s.default_max_tokens, room)
        if requested > room:
            raise InvalidArgument(
                f"This model's maximum context length is {s.max_model_len} tokens; the prompt has {prompt_tokens} "
                f"and max_tokens asks for {requested}. Lower max_tokens or shorten the prompt."
            )
        return requested

    @contextlib.asynccontextmanager
    async def precharged(
        self, caller: Caller, body: GenerationBody, fewest: list[int], *, max_tokens: int | None, request_id: str
    ) -> AsyncIterator[Precharge]:
        """Take the request and an estimate of its tokens (`fewest` per prompt, ``prompt_guard``, and max_tokens per
        sample) from the tenant's buckets before its prompts are tokenized, so an empty bucket refuses (429) without
        the tokenizer's work; `admit` inside settles it with the real count. Given back where the block fails
        before."""
        if caller.offline:  # (a batch's line: reserved against the quota only, when admitted)
            yield Precharge(None)
            return
        s = self.settings
        keep = body.truncate_prompt_tokens
        if keep is not None:
            fewest = [min(tokens, s.max_prompt_tokens if keep == -1 else keep) for tokens in fewest]
        # (the fewest generated tokens: max_tokens where given, else the default as capped by the longest prompt)
        budget = (
            max_tokens if max_tokens is not None else min(s.default_max_tokens, s.max_model_len - s.max_prompt_tokens)
        )
        estimate = sum(fewest) + len(fewest) * body.samples() * budget
        pre = Precharge(await self.limiter.admit(caller.tenant, estimate, request_id=request_id))
        try:
            yield pre
        except BaseException:
            if not pre.settled and pre.admission is not None:
                self._release(pre.admission, unused=pre.admission.tokens_reserved, used=0)
            raise

    async def admit(
        self,
        caller: Caller,
        body: GenerationBody,
        prompts: list[list[int]],
        *,
        max_tokens: int | None,
        request_id: str,
        vocab_size: int,
        precharge: Precharge | None = None,
        held: HeldMetering | None = None,
    ) -> Job:
        """Check lengths, take from the tenant's buckets and reserve against its monthly quota (each prompt, and
        max_tokens per sample: `n`, or `best_of`), or settle the `precharge` with that, then resolve the model
        (404/503 give the tokens back). The job's tokens go to `held` where given, else to the meter."""
        budgets = [self.max_tokens_for(len(prompt), max_tokens) for prompt in prompts]
        stop, logprobs = body.stop_list(), body.engine_logprobs()  # (400s before anything is reserved)
        logit_bias, constraint, n = body.token_biases(vocab_size), body.constraint(), body.samples()
        stop_token_ids, min_tokens = body.token_ids("stop_token_ids", vocab_size), body.min_tokens or 0
        allowed_token_ids = body.token_ids("allowed_token_ids", vocab_size)
        try:
            check_min_tokens(min_tokens, min(budgets))
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        reserved = sum(len(prompt) + n * budget for prompt, budget in zip(prompts, budgets, strict=True))
        admission = await self._reserve(caller, reserved, precharge, request_id)
        try:
            resolution = await self.resolver.resolve(caller.tenant, body.model, body.preft_mode)
        except BaseException:
            self._release(admission, unused=admission.tokens_reserved, used=0)
            raise
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompts[0],
            max_tokens=budgets[0],
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            top_k=max(body.top_k or 0, 0),  # (-1: all, as vLLM takes it)
            min_p=body.min_p or 0.0,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            allowed_token_ids=allowed_token_ids,
            bad_words=body.bad_words or [],
            logprobs=logprobs,
            prompt_logprobs=body.engine_prompt_logprobs(),
            logit_bias=logit_bias,
            constraint=constraint,
            seed=body.seed,
            stop=stop,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            ignore_eos=body.ignore_eos,
            stream=bool(body.stream),
            adapter=resolution.adapter,
            mode=resolution.mode,
            tenant=caller.tenant,
            cache_salt=self.cache_salts.salt(caller.tenant),
            priority=body.engine_priority(offline=caller.offline),
        )
        requests = _samples(request, prompts, budgets, n, body.seed)
        IN_FLIGHT.inc()
        return Job(requests, resolution, admission, samples=n, held=held)

    async def _reserve(self, caller: Caller, reserved: int, precharge: Precharge | None, request_id: str) -> Admission:
        """Take `reserved` tokens: a batch's line from the quota alone (offline work takes from no per-minute bucket),
        a precharged request by settling its precharge, any other from the tenant's buckets."""
        if caller.offline:
            return await self.limiter.admit_offline(caller.tenant, reserved, request_id=request_id)
        if precharge is not None and precharge.admission is not None:
            admission = await self.limiter.settle(precharge.admission, reserved, request_id=request_id)
            precharge.settled = True
            return admission
        return await self.limiter.admit(caller.tenant, reserved, request_id=request_id)

    async def complete(self, job: Job, *, started_s: float) -> list[EngineResponse]:
        """The whole answer (non-streaming): one engine response per choice."""
        GATEWAY_OVERHEAD.observe(time.perf_counter() - started_s)
        try:
            model_id = job.resolution.model_id
            outs = await _all([self.engine.generate(r, model_id) for r in job.requests])
            job.generated_tokens = sum(out.usage.completion_tokens for out in outs)
            if any(out.finish_reason == "abort" for out in outs):
                raise Unavailable("the engine aborted the generation; retry later")
            job.answered = True
            return outs
        finally:
            self.finish(job)

    async def open_streams(self, job: Job, *, started_s: float) -> list[EngineStream]:
        """One engine stream per choice, each with its first chunk arrived; the caller must `finish` the job when
        they end."""
        GATEWAY_OVERHEAD.observe(time.perf_counter() - started_s)
        opened: list[EngineStream] = []

        async def open_one(request: EngineRequest) -> EngineStream:
            stream = await self.engine.stream(request, job.resolution.model_id)
            opened.append(stream)
            return stream

        try:
            streams = await _all([open_one(r) for r in job.requests])
            job.answered = True
            return streams
        except BaseException:
            for stream in opened:
                await stream.aclose()
            self.finish(job)
            raise

    def finish(self, job: Job) -> None:
        """Meter an answered job's tokens, and release its reservations (in the background): the bucket's tokens
        that were not generated go back, the monthly quota's shrink to what is metered (``limits``). Idempotent."""
        if job.finished:
            return
        job.finished = True
        IN_FLIGHT.dec()
        used = 0  # (the tokens metered: the monthly quota's reservation holds them until the meter has added them)
        held = job.held
        if job.answered and self.meter is not None:
            adapter = job.resolution.adapter
            model = adapter.ref if adapter is not None else self.settings.served_model_name
            if held is None:
                self.meter.record(job.admission.tenant, model, job.prompt_tokens, job.generated_tokens)
            else:
                held.entries.append(Metered(model, job.prompt_tokens, job.generated_tokens))
            used = job.prompt_tokens + job.generated_tokens
        unused = job.reserved_generation - job.generated_tokens if job.admission.tokens_reserved else 0
        self._release(job.admission, unused=unused, used=used, later_s=held.later_s if held is not None else 0.0)

    def _release(self, admission: Admission, *, unused: int, used: int, later_s: float = 0.0) -> None:
        """Release what the admission reserved, in the background (nothing to do: no task)."""
        if unused > 0 or admission.reservation is not None:
            task = asyncio.create_task(self.limiter.release(admission, unused=unused, used=used, later_s=later_s))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
