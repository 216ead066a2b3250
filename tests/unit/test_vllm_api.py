"""Every vLLM symbol the engine modules and the rollout server's NCCL receiver use exists in the installed vLLM."""

from __future__ import annotations

import importlib

import pytest

from preft.engine.async_engine import VLLM_API
from preft.rollout import nccl


@pytest.mark.parametrize("symbol", VLLM_API + nccl.VLLM_API)
def test_vllm_symbol_exists(symbol):
    module_name, attr_path = symbol.split(":")
    obj = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    assert obj is not None
