"""The MLP forward that ``act`` (a default kernel) installs on CUDA (``patches.mlp``): the projection's base GEMM,
then ``preft::lora_silu_and_mul_down`` (the activation and down's shrink of it), down's base GEMM and
``preft::lora_expand``. Installed here on CPU in a running engine's worker, where the op adds the gate/up LoRA
into gate_up, runs torch's activation and shrinks it, it must give the tokens vLLM's own forward gave, with base
requests and adapters in both modes in one batch (vLLM 0.28's classes, as ``compat`` names them)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from preft.devtools.tiny import build_lora
from preft.engine.requests import GenerationRequest
from tests.conftest import ARCHS, random_prompt

pytestmark = pytest.mark.engine


def _patch(worker) -> tuple[int, int]:
    """In the worker: patch the model's MLPs as the plugin does on CUDA; how many were, and how many of them also
    take down_proj's LoRA."""
    from preft.vllm_plugin import compat
    from preft.vllm_plugin.patches import mlp as mlp_patch

    manager = worker.model_runner.lora_manager
    model = manager._adapter_manager.model
    patched = mlp_patch.patch(model, manager.preft_state.id)
    return patched, sum(getattr(layer.mlp, "preft_down", False) for layer in compat.decoder_layers(model))


def _batch(loras: dict, tag: str) -> list[GenerationRequest]:
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (5, 13, 47)]  # (47: prefilled in two steps)
    reqs = []
    for i, prompt in enumerate(prompts):
        for name, adapter in [("base", None), *loras.items()]:
            for mode in ("prefill", "all") if adapter else ("prefill",):
                rid = f"{tag}-{name}-{mode}-{i}"
                reqs.append(GenerationRequest(rid, prompt_ids=tuple(prompt), adapter=adapter, mode=mode, max_tokens=8))
    random.Random(6).shuffle(reqs)
    return reqs


def _tokens(engine, reqs: list[GenerationRequest]) -> dict[str, tuple[int, ...]]:
    results = engine.generate(reqs)
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return {r.id.split("-", 1)[1]: r.token_ids for r in results}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_patched_mlp_gives_the_tokens_of_vllms_forward(arch, model_dirs, adapters, engine_factory, tmp_path,
                                                           monkeypatch):  # fmt: skip
    if torch.cuda.is_available():  # (test_exactness covers it there)
        pytest.skip("on CUDA the engine already runs the patched forward: act is a default kernel")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # (the patch below is a function)
    model = model_dirs[arch]
    gate_up_only = build_lora(tmp_path / "gate_up", model, rank=8, targets=("gate_proj", "up_proj"), seed=31)
    down_only = build_lora(tmp_path / "down", model, rank=8, targets=("down_proj",), seed=37)
    loras = {
        "lora_a": str(adapters[arch]["lora_a"]),
        "lora_c": str(adapters[arch]["lora_c"]),
        "gu": str(gate_up_only),
        "down": str(down_only),
    }
    engine = engine_factory(model)
    before = _tokens(engine, _batch(loras, "before"))

    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert engine.llm.collective_rpc(_patch) == [(layers, layers)]
    after = _tokens(engine, _batch(loras, "after"))

    assert after == before
    for i in range(3):  # (so that a patched forward that lost the gate/up or the down LoRA would fail)
        for name in ("gu", "down"):
            assert (
                before[f"{name}-prefill-{i}"] != before[f"base-prefill-{i}"]
                or before[f"{name}-all-{i}"] != before[f"base-prefill-{i}"]
            ), f"the {name}-only LoRA changed no token of prompt {i}"
