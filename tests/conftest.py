"""Shared fixtures: tiny generated models (Llama and Qwen2 architectures) and adapters for them, and one SeaweedFS S3
server for the session."""

from __future__ import annotations

import functools
import importlib
import os
import random
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from preft.devtools.tiny import TinyModelSpec, build_direft, build_lora, build_model
from preft.stack import SeaweedS3, free_port
from preft.vllm_plugin import settings
from preft.vllm_plugin.kernels import act, common, expand, fused, policy, shrink

# torch.cuda.is_available() asks the CUDA runtime, which initializes the driver and so poisons fork, while
# torch.cuda.is_initialized() stays False: vLLM then forks its engine core, which cannot use CUDA (as
# test_exactness's engines did after its module-level check). Asked through NVML, the check leaves fork usable.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

ARCHS = ("llama", "qwen2")
MARKER_BY_DIRECTORY = {
    "integration": "integration",
    "e2e": "e2e",
    "testbed": "testbed",
}  # tests/<dir>/... get the marker


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(here).parts if item.path.is_relative_to(here) else ()
        if parts and parts[0] in MARKER_BY_DIRECTORY:
            item.add_marker(getattr(pytest.mark, MARKER_BY_DIRECTORY[parts[0]]))


@functools.cache
def _interpreter_refusal() -> str | None:
    """Why Triton's interpreter cannot run a loop bounded by an integer argument, or None when it can.

    Some releases' interpreters (the H200 image's, with its numpy) turn such a bound into an index through a
    one-element array, which numpy 2 refuses; there the kernels run compiled, checked by the exactness tests
    and by loadtest/engine/bench_lora_tiles against the torch path."""
    import triton
    import triton.language as tl

    @triton.jit
    def count(out_ptr, n):
        total = 0
        for _ in range(0, n, 1):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 3)
    except Exception as error:  # whatever the interpreter raises is the reason to skip
        return repr(error)
    return None if out.item() == 3 else f"a loop of 3 counted {out.item()}"


@pytest.fixture(params=["expand,shrink,act,fold,gluon,down", "expand,shrink,act", "fused,expand"])
def lora_kernels_interpreted(monkeypatch, request):
    """The GPU LoRA kernels, run by Triton's interpreter on CPU tensors in place of the torch path.

    Each test runs with each choice that serves a LoRA linear or the MLP's activation differently: the shrink
    and expand kernels with the activation's, its gate/up LoRA folded in or added by the expand, and the fused
    kernel (the expand kernel still serves vLLM's separate expands)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if (refusal := _interpreter_refusal()) is not None:
        pytest.skip(f"this Triton's interpreter cannot run the kernels' loops: {refusal}")
    monkeypatch.setenv("PREFT_LORA_KERNELS", request.param)
    _reload_kernels()  # (triton.jit interprets only what it decorates while TRITON_INTERPRET is set)
    settings.load()
    monkeypatch.setattr(policy, "supported", lambda y: True)  # CPU tensors too
    yield
    monkeypatch.undo()
    _reload_kernels()
    settings.load()


def _reload_kernels() -> None:
    """The kernel modules again, the jit helpers first (the kernels take them from their module's globals)."""
    for module in (common, shrink, expand, fused, act):
        importlib.reload(module)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(
        tmp_path_factory.mktemp("s3"),
        free_port(),
        access_key="preft-test",
        secret_key=secrets.token_urlsafe(24),
        volume_size_limit_mb=64,
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(root / arch, TinyModelSpec(arch=arch, seed=7)) for arch in ARCHS}


@pytest.fixture(scope="session")
def adapters(model_dirs, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per architecture: three LoRAs (different ranks/targets) and two DiReFTs (different ranks/layers)."""
    root = tmp_path_factory.mktemp("adapters")
    out: dict[str, dict[str, Path]] = {}
    for arch, model in model_dirs.items():
        d = root / arch
        out[arch] = {
            "lora_a": build_lora(d / "lora_a", model, rank=8, seed=11),
            "lora_b": build_lora(d / "lora_b", model, rank=4, targets=("q_proj", "v_proj", "down_proj"), seed=12),
            "lora_c": build_lora(d / "lora_c", model, rank=8, targets=("o_proj", "up_proj"), seed=13),
            "direft_a": build_direft(d / "direft_a", model, rank=4, layers=(0, 2), seed=21),
            "direft_b": build_direft(d / "direft_b", model, rank=8, layers=(1,), seed=22),
        }
    return out


def random_prompt(rng: random.Random, length: int, vocab: int = 384) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]
