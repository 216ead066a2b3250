"""Adapter validation: good adapters pass, each broken one fails naming its file and tensor."""

from __future__ import annotations

import pytest

from preft.adapters import AdapterError, AdapterMethod, ModelShape, adapter_digest, inspect_adapter
from tests.bad_adapters import make_bad_adapters


@pytest.fixture(scope="module")
def shape(model_dirs) -> ModelShape:
    return ModelShape.from_model_dir(model_dirs["llama"])


@pytest.fixture(scope="module")
def bad_cases(adapters, tmp_path_factory):
    ads = adapters["llama"]
    return make_bad_adapters(ads["lora_a"], ads["direft_a"], tmp_path_factory.mktemp("bad"))


def test_good_adapters_pass(adapters, shape):
    lora = inspect_adapter(adapters["llama"]["lora_b"], shape, max_rank=8)
    assert lora.method is AdapterMethod.LORA and lora.rank == 4
    assert set(lora.targets) == {"q_proj", "v_proj", "down_proj"}
    direft = inspect_adapter(adapters["llama"]["direft_a"], shape, max_rank=8)
    assert direft.method is AdapterMethod.DIREFT and direft.layers == (0, 2) and direft.rank == 4


def test_at_least_twenty_bad_cases(bad_cases):
    assert len(bad_cases) >= 20


def test_each_bad_adapter_fails_with_a_clear_message(bad_cases, shape):
    for name, (path, expected) in bad_cases.items():
        with pytest.raises(AdapterError) as info:
            inspect_adapter(path, shape, max_rank=16)
        message = str(info.value)
        missing = [word for word in expected if word not in message]
        assert not missing, f"{name}: message {message!r} lacks {missing}"


def test_digest_is_content_identity(adapters, tmp_path):
    import shutil

    src = adapters["llama"]["lora_a"]
    copy = shutil.copytree(src, tmp_path / "copy")
    assert adapter_digest(src) == adapter_digest(copy)
    assert adapter_digest(src) != adapter_digest(adapters["llama"]["lora_c"])
