"""The offline PreFT engine: one vLLM engine with the PreFT plugin serving mixed-adapter, mixed-mode batches.

This module and `async_engine` (the serving engine) are the only ones of ours that use vLLM's engine API (the plugin
package is the only one that touches vLLM internals); both build vLLM's arguments with `engine_kwargs`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from preft.adapters import AdapterError, ModelShape
from preft.engine.catalog import AdapterCatalog, CatalogEntry
from preft.engine.requests import GenerationRequest, GenerationResult
from preft.vllm_plugin.modes import mode_extra_args


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
    tokenizer: bool = True  # False: token-id prompts only, no detokenized text
    seed: int = 0


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
    )
    if o.enable_lora:
        kwargs.update(
            max_loras=o.max_loras,
            max_lora_rank=o.max_lora_rank,
            max_cpu_loras=max(o.max_cpu_loras or 0, o.max_loras, 64),
        )
    if o.block_size is not None:
        kwargs["block_size"] = o.block_size
    kwargs["disable_log_stats"] = not o.log_stats
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
        from vllm import SamplingParams
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
        params = SamplingParams(
            temperature=0.0,
            max_tokens=req.max_tokens,
            ignore_eos=True,
            detokenize=self.options.tokenizer,
            extra_args=mode_extra_args(req.mode),
        )
        return prompt, params, lora

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Greedy generation for all requests in one engine run (mixed batches); results in request order."""
        results: dict[int, GenerationResult] = {}
        runnable: list[tuple[int, Any, Any, Any]] = []
        for i, req in enumerate(requests):
            try:
                runnable.append((i, *self._prepare(req)))
            except (AdapterError, ValueError, OSError) as e:
                adapter = f"adapter {req.adapter}: " if isinstance(e, AdapterError) else ""
                results[i] = GenerationResult(id=req.id, error=f"{adapter}{e}")
        if runnable:
            outputs = self.llm.generate(
                [p for _, p, _, _ in runnable],
                [s for _, _, s, _ in runnable],
                lora_request=[lr for _, _, _, lr in runnable],
                use_tqdm=False,
            )
            for (i, *_), out in zip(runnable, outputs, strict=True):
                completion, metrics = out.outputs[0], getattr(out, "metrics", None)
                results[i] = GenerationResult(
                    id=requests[i].id,
                    token_ids=tuple(completion.token_ids),
                    text=completion.text or "",
                    first_token_latency_s=getattr(metrics, "first_token_latency", None),
                )
        return [results[i] for i in range(len(requests))]

    def close(self) -> None:
        """Stop vLLM's engine processes (an engine is also stopped when the process exits)."""
        self.llm.llm_engine.engine_core.shutdown()
