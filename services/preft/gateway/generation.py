"""One generation's path once its prompt is tokenized: lengths, rate limits, adapter resolution, the engine call,
and giving unused tokens back. Completions and chat differ only in how they build the prompt and format the answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from preft.common.errors import InvalidArgument, Unavailable
from preft.common.metrics import GATEWAY_OVERHEAD, QUEUE_DEPTH
from preft.engine.contract import EngineRequest, EngineResponse
from preft.gateway.auth import Caller
from preft.gateway.engine_client import EngineClient, EngineStream
from preft.gateway.errors import PayloadTooLarge
from preft.gateway.limits import Admission, RateLimiter
from preft.gateway.resolution import AdapterResolver, Resolution
from preft.gateway.schemas import GenerationBody
from preft.gateway.settings import GatewaySettings

IN_FLIGHT = QUEUE_DEPTH.labels(service="gateway")


@dataclass
class Job:
    """An admitted generation: the engine request, its adapter and mode, and the tokens it reserved."""

    request: EngineRequest
    resolution: Resolution
    admission: Admission
    generated_tokens: int = 0  # what the engine produced so far: the part of the reservation that stays charged
    finished: bool = field(default=False)


class GenerationService:
    """Owns the order of checks for a generation and the bookkeeping around the engine call."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        limiter: RateLimiter,
        resolver: AdapterResolver,
        engine: EngineClient,
    ) -> None:
        self.settings = settings
        self.limiter = limiter
        self.resolver = resolver
        self.engine = engine
        self._background: set[asyncio.Task] = set()

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

    async def admit(
        self,
        caller: Caller,
        body: GenerationBody,
        prompt_ids: list[int],
        *,
        max_tokens: int | None,
        request_id: str,
        vocab_size: int,
    ) -> Job:
        """Check lengths, take from the tenant's buckets, then resolve the model (404/503 give the tokens back)."""
        budget = self.max_tokens_for(len(prompt_ids), max_tokens)
        stop, logprobs = body.stop_list(), body.engine_logprobs()  # (400s before anything is reserved)
        logit_bias = body.token_biases(vocab_size)
        admission = await self.limiter.admit(caller.tenant, len(prompt_ids) + budget)
        try:
            resolution = await self.resolver.resolve(caller.tenant, body.model, body.preft_mode)
        except BaseException:
            self._refund(caller.tenant, admission.tokens_reserved)
            raise
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=budget,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=logprobs,
            logit_bias=logit_bias,
            seed=body.seed,
            stop=stop,
            ignore_eos=body.ignore_eos,
            stream=bool(body.stream),
            adapter=resolution.adapter,
            mode=resolution.mode,
            tenant=caller.tenant,
        )
        IN_FLIGHT.inc()
        return Job(request, resolution, admission)

    async def complete(self, job: Job, *, started_s: float) -> EngineResponse:
        """The whole answer (non-streaming)."""
        GATEWAY_OVERHEAD.observe(time.perf_counter() - started_s)
        try:
            out = await self.engine.generate(job.request, job.resolution.model_id)
            job.generated_tokens = out.usage.completion_tokens
            if out.finish_reason == "abort":
                raise Unavailable("the engine aborted the generation; retry later")
            return out
        finally:
            self.finish(job)

    async def open_stream(self, job: Job, *, started_s: float) -> EngineStream:
        """An engine stream whose first chunk has arrived; the caller must `finish` the job when it ends."""
        GATEWAY_OVERHEAD.observe(time.perf_counter() - started_s)
        try:
            return await self.engine.stream(job.request, job.resolution.model_id)
        except BaseException:
            self.finish(job)
            raise

    def finish(self, job: Job) -> None:
        """Give back the reserved tokens that were not generated (in the background). Idempotent."""
        if job.finished:
            return
        job.finished = True
        IN_FLIGHT.dec()
        self._refund(job.admission.tenant, job.request.max_tokens - job.generated_tokens)

    def _refund(self, tenant: str, tokens: int) -> None:
        if tokens > 0:
            task = asyncio.create_task(self.limiter.refund(tenant, tokens))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
