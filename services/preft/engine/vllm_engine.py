"""The offline PreFT engine: one vLLM engine with the PreFT plugin serving mixed-adapter, mixed-mode batches.

This module and `async_engine` (the serving engine) are the only ones of ours that use vLLM's engine API (the plugin
package is the only one that touches vLLM internals); both build vLLM's arguments with `engine_kwargs`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from preft.adapters import AdapterError, ModelShape
from preft.common.engine_contract import SamplingOptions, TokenLogprob, TopLogprob
from preft.common.modes import PositionMode, mode_extra_args
from preft.engine.catalog import AdapterCatalog, CatalogEntry
from preft.engine.paging.pager import ADDS_IN_FLIGHT
from preft.engine.requests import GenerationRequest, GenerationResult

# Adapters vLLM's host cache holds beyond the pager's tier: the adds and the removals the pager may have on their way
# to the engine at once, so that vLLM never evicts an adapter on its own.
CPU_CACHE_HEADROOM = 2 * ADDS_IN_FLIGHT


@dataclass(frozen=True)
class EngineOptions:
    """How the engine is built; None means "vLLM's default for this machine"."""

    model: str
    dtype: str = "auto"
    enable_lora: bool = True  # False: a plain base-model engine (the benchmark's ceiling); adapters refused
    max_loras: int = 4  # adapter slots: adapters with prompt tokens in one step (prefill mode) or running (all)
    max_lora_rank: int = 16  # largest LoRA or DiReFT rank accepted
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory (LRU), >= max_loras
    max_num_batched_tokens: int | None = None  # tokens per step; longer prompts are prefilled in chunks
    max_num_seqs: int = 64
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None  # on CPU: fraction of one NUMA node's memory for the KV cache
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    block_size: int | None = None  # KV-cache block (prefix-cache granularity); vLLM's CPU default is 128
    log_stats: bool = True  # per-request timestamps (time to first token) and Prometheus counters
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    tensor_parallel_size: int = 1  # GPUs one engine shards the model over
    tokenizer: bool = True  # False: token-id prompts only, no detokenized text
    seed: int = 0
    # "priority": vLLM admits waiting requests by their priority (EngineRequest.priority), then arrival; "fcfs"
    # (vLLM's default, the offline engine's): by arrival alone. The serving engine's settings choose "priority".
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # What returned logprobs are: None is vLLM's default ("raw_logprobs", before any sampling parameter applies);
    # the rollout server asks for "processed_logprobs" (after temperature and the other processors), as TRL's does
    logprobs_mode: str | None = None


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def use_v1_model_runner() -> None:
    """The plugin needs vLLM's V1 model runner (see preft.vllm_plugin.compat); set before vLLM reads its envs."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def engine_kwargs(options: EngineOptions) -> dict[str, Any]:
    """vLLM engine arguments for these options: the keyword arguments of `vllm.LLM` and of `AsyncEngineArgs`.

    vLLM's own host-memory LoRA cache is sized at least 64 so that it never evicts on its own below that: the
    serving pager keeps at most `max_cpu_loras` adapters loaded and removes them itself.
    """
    o = options
    on_cpu = _is_cpu()
    kwargs: dict[str, Any] = dict(
        model=o.model,
        dtype=o.dtype,
        enable_lora=o.enable_lora,
        max_num_seqs=min(o.max_num_seqs, o.max_num_batched_tokens or o.max_num_seqs),
        enable_prefix_caching=o.enable_prefix_caching,
        enable_chunked_prefill=True,
        gpu_memory_utilization=o.gpu_memory_utilization or (0.3 if on_cpu else 0.9),
        enforce_eager=o.enforce_eager if o.enforce_eager is not None else on_cpu,
        load_format=o.load_format,
        skip_tokenizer_init=not o.tokenizer,
        seed=o.seed,
        scheduling_policy=o.scheduling_policy,
    )
    if o.enable_lora:
        kwargs.update(
            max_loras=o.max_loras,
            max_lora_rank=o.max_lora_rank,
            max_cpu_loras=max(o.max_cpu_loras or 0, o.max_loras, 64) + CPU_CACHE_HEADROOM,
        )
    if o.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = o.tensor_parallel_size
    if o.block_size is not None:
        kwargs["block_size"] = o.block_size
    kwargs["disable_log_stats"] = not o.log_stats
    if o.logprobs_mode is not None:
        kwargs["logprobs_mode"] = o.logprobs_mode
    if o.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = o.max_num_batched_tokens
    if o.max_model_len is not None:
        kwargs["max_model_len"] = o.max_model_len
    return kwargs


def check_prompt(prompt_ids: Sequence[int], max_tokens: int, *, vocab_size: int, max_model_len: int) -> None:
    """Refuse (ValueError) token ids outside the vocabulary and, when max_model_len > 0, a too long request."""
    check_token_ids(prompt_ids, vocab_size, "prompt")
    if max_model_len > 0:
        check_length(len(prompt_ids), max_tokens, max_model_len)


def check_token_ids(token_ids: Iterable[int], vocab_size: int, what: str) -> None:
    """Refuse (ValueError) a token id outside the vocabulary, naming `what` holds it."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def check_length(n_prompt: int, max_tokens: int, max_model_len: int) -> None:
    if n_prompt + max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of {max_model_len} tokens"
        )


def check_sampling(options: SamplingOptions, vocab_size: int) -> None:
    """Refuse (ValueError) token ids outside the vocabulary in the options' logit_bias, stop_token_ids and
    allowed_token_ids."""
    check_token_ids(options.logit_bias, vocab_size, "logit_bias")
    check_token_ids(options.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(options.allowed_token_ids, vocab_size, "allowed_token_ids")


def sampling_params(
    options: SamplingOptions, *, max_tokens: int, mode: PositionMode, tokenizer: bool, delta: bool = False
) -> Any:
    """vLLM's SamplingParams for one generation (`delta`: each output holds only what is new); ValueError for what
    needs the tokenizer (constraints, bad words) where the engine runs without one."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    for field, asked in (("constraint", options.constraint is not None), ("bad_words", bool(options.bad_words))):
        if asked and not tokenizer:
            raise ValueError(f"{field}: this engine runs without a tokenizer, which {field} needs")
    structured = None
    if options.constraint is not None:
        structured = StructuredOutputsParams(**options.constraint.vllm_fields())
    return SamplingParams(
        n=1,
        temperature=options.temperature,
        top_p=options.top_p,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        top_k=options.top_k,
        min_p=options.min_p,
        min_tokens=options.min_tokens,
        stop_token_ids=list(options.stop_token_ids) or None,
        allowed_token_ids=list(options.allowed_token_ids) or None,
        bad_words=list(options.bad_words) or None,
        include_stop_str_in_output=options.include_stop_str_in_output,
        skip_special_tokens=options.skip_special_tokens,
        spaces_between_special_tokens=options.spaces_between_special_tokens,
        logprobs=options.logprobs,
        prompt_logprobs=options.prompt_logprobs,
        logit_bias=options.logit_bias or None,
        structured_outputs=structured,
        seed=options.seed,
        stop=list(options.stop) or None,
        ignore_eos=options.ignore_eos,
        max_tokens=max_tokens,
        detokenize=tokenizer,
        extra_args=mode_extra_args(mode),
        **({"output_kind": RequestOutputKind.DELTA} if delta else {}),
    )


def client_error() -> type[Exception]:
    """The class of vLLM's errors for a request the client got wrong, as it raises them when a request is added:
    VLLMClientError from 0.28 on; in 0.26 (no such class) a ValueError, VLLMValidationError's base there."""
    import vllm.exceptions

    return getattr(vllm.exceptions, "VLLMClientError", ValueError)


def token_logprobs(token_ids: list[int], positions: Sequence[Mapping[int, Any]], k: int) -> list[TokenLogprob]:
    """Each token's logprob and the `k` most likely tokens at its position, from vLLM's {token id: Logprob} per
    position (the chosen token and the top k, each with its rank)."""
    out = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = position[token_id]
        ranked = sorted((lp.rank, t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k)
        top = [TopLogprob(token_id=t, token=lp.decoded_token or "", logprob=lp.logprob) for _, t, lp in ranked]
        out.append(TokenLogprob(token_id=token_id, token=chosen.decoded_token or "", logprob=chosen.logprob, top=top))
    return out


def _result(req: GenerationRequest, out: Any) -> GenerationResult:
    """A request's result from vLLM's RequestOutput (its final one)."""
    completion, metrics, asked = out.outputs[0], getattr(out, "metrics", None), req.sampling
    tokens = list(completion.token_ids)
    logprobs = prompt_logprobs = None
    if asked.logprobs is not None:
        logprobs = token_logprobs(tokens, completion.logprobs or (), asked.logprobs)
    if asked.prompt_logprobs is not None and out.prompt_logprobs:  # ([None, ...]: the first token has none)
        prompt_logprobs = token_logprobs(out.prompt_token_ids[1:], out.prompt_logprobs[1:], asked.prompt_logprobs)
    return GenerationResult(
        id=req.id,
        token_ids=tuple(tokens),
        text=completion.text or "",
        finish_reason=completion.finish_reason,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        first_token_latency_s=getattr(metrics, "first_token_latency", None),
    )


def lora_request(entry: CatalogEntry) -> Any:
    """The vLLM LoRARequest of a catalog entry (DiReFT adapters ride the same request type; the plugin sorts them)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(entry.lora_name, entry.lora_int_id, str(entry.info.path))


class PreftEngine:
    """Runs generation requests, each with its own adapter (LoRA or DiReFT) and position mode, in one engine.

    Requests are checked first (adapter validated against the model, prompt within vocabulary and context);
    a bad request gets an error result and never reaches vLLM, so the others keep being served.
    """

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.shape = ModelShape.from_model_dir(options.model)
        self.catalog = AdapterCatalog(self.shape, max_rank=options.max_lora_rank)
        use_v1_model_runner()
        from vllm import LLM

        self.llm = LLM(**engine_kwargs(options))
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def _prepare(self, req: GenerationRequest) -> tuple[Any, Any, Any]:
        from vllm.inputs import TokensPrompt

        if req.prompt_ids is not None:
            check_prompt(req.prompt_ids, req.max_tokens, vocab_size=self.shape.vocab_size, max_model_len=0)
            prompt: Any = TokensPrompt(prompt_token_ids=list(req.prompt_ids))
            n_prompt = len(req.prompt_ids)
        elif not self.options.tokenizer:
            raise ValueError("this engine runs without a tokenizer: give prompt_ids, not a text prompt")
        else:
            prompt = req.prompt
            n_prompt = len(self.llm.get_tokenizer().encode(req.prompt))
        check_length(n_prompt, req.max_tokens, self.max_model_len)
        lora = None
        if req.adapter is not None:
            if not self.options.enable_lora:
                raise ValueError("this engine was started without adapter support")
            lora = lora_request(self.catalog.resolve(req.adapter))
        check_sampling(req.sampling, self.shape.vocab_size)
        params = sampling_params(
            req.sampling, max_tokens=req.max_tokens, mode=req.mode, tokenizer=self.options.tokenizer
        )
        return prompt, params, lora

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generation for all requests in one engine run (mixed batches); results in request order."""
        results: dict[int, GenerationResult] = {}
        runnable: list[tuple[int, Any, Any, Any]] = []
        for i, req in enumerate(requests):
            try:
                runnable.append((i, *self._prepare(req)))
            except (AdapterError, ValueError, OSError, client_error()) as e:
                adapter = f"adapter {req.adapter}: " if isinstance(e, AdapterError) else ""
                results[i] = GenerationResult(id=req.id, error=f"{adapter}{e}")
        self._run(requests, runnable, results)
        return [results[i] for i in range(len(requests))]

    def _run(
        self,
        requests: list[GenerationRequest],
        runnable: list[tuple[int, Any, Any, Any]],
        results: dict[int, GenerationResult],
    ) -> None:
        """Run the prepared requests in one batch. vLLM refuses the whole batch for one request it will not take (a
        constraint it cannot compile): the batch is then run in halves, down to the refused request, an error
        result."""
        if not runnable:
            return
        try:
            outputs = self.llm.generate(
                [p for _, p, _, _ in runnable],
                [s for _, _, s, _ in runnable],
                lora_request=[lr for _, _, _, lr in runnable],
                use_tqdm=False,
            )
        except (ValueError, client_error()) as e:
            if len(runnable) == 1:
                i = runnable[0][0]
                results[i] = GenerationResult(id=requests[i].id, error=f"the engine refused the request: {e}")
                return
            half = len(runnable) // 2
            self._run(requests, runnable[:half], results)
            self._run(requests, runnable[half:], results)
            return
        for (i, *_), out in zip(runnable, outputs, strict=True):
            results[i] = _result(requests[i], out)

    def close(self) -> None:
        """Stop vLLM's engine processes (an engine is also stopped when the process exits)."""
        self.llm.llm_engine.engine_core.shutdown()
