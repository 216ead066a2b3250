"""An in-place update is checked against the adapter's manifest (its safetensors header): names, shapes, dtypes, finite
values, each refusal naming the tensor."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from preft.adapters.updates import TensorSpec, WeightUpdateError, check_weight_update, weight_manifest


@pytest.fixture
def lora(adapters):
    path = adapters["llama"]["lora_b"]
    return weight_manifest(path), load_file(str(path / "adapter_model.safetensors"))


def test_the_manifest_is_the_files_tensors(lora):
    manifest, tensors = lora
    assert set(manifest) == set(tensors)
    name = next(iter(tensors))
    assert manifest[name] == TensorSpec(tuple(tensors[name].shape), "F32")


def test_the_adapters_own_tensors_pass_whole_or_in_part(lora):
    manifest, tensors = lora
    check_weight_update(manifest, tensors)
    check_weight_update(manifest, dict(list(tensors.items())[:2]))


def test_each_mismatch_is_refused_naming_the_tensor(lora):
    manifest, tensors = lora
    name = next(iter(tensors))
    nan = tensors[name].clone()
    nan[0, 0] = math.nan
    cases = {
        "unknown tensor names 'x.lora_A.weight'": {"x.lora_A.weight": tensors[name]},
        "has shape": {name: tensors[name].T.contiguous()},
        "has dtype F16, the adapter's is F32": {name: tensors[name].half()},
        "is a list": {name: [1.0]},
        "NaN or infinite": {name: nan},
        "holds no tensors": {},
    }
    for says, update in cases.items():
        with pytest.raises(WeightUpdateError, match=says) as caught:
            check_weight_update(manifest, update)
        if update and "unknown" not in says:
            assert name in str(caught.value)
    check_weight_update(manifest, {name: nan}, finite=False)  # (values read once, where they are applied)
