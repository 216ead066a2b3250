"""The plugin writes the same LoRA index metadata as vLLM's convert_mapping, from numpy, without DiReFT slots."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from preft.vllm_plugin.patches.punica import _ids_to_slots, _write_base_metadata
from preft.vllm_plugin.patches.worker import array_mapping, mapping_ids


def _wrapper():
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    return PunicaWrapperCPU(64, 16, "cpu")


def _written(w):
    n, m = w.indices_len[0], w.indices_len[1]
    return (
        w._token_lora_indices[:n].tolist(),
        w._sampler_indices[:m].tolist(),
        w._sampler_indices_padded[:m].tolist(),
        w._embeddings_indices[:, :n].tolist(),
        list(w.indices_len),
    )


@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_metadata_equals_vllm_convert_mapping(seed, runs):
    """Tokens drawn one by one, and in runs of one id as a step's requests give them."""
    from vllm.lora.layers import LoRAMapping

    rng = random.Random(seed)
    slots = [None, 17, 3, None, 42, 8]  # lora_index_to_id: slot -> LoRA id
    ids = [0, 17, 3, 42, 8]
    draws, run_length = (8, 8) if runs else (40, 1)  # (at most 64 tokens: the wrapper's size)
    tokens = tuple(t for _ in range(rng.randint(1, draws)) for t in [rng.choice(ids)] * rng.randint(1, run_length))
    sampled = tuple(rng.choice(ids) for _ in range(rng.randint(1, 10)))
    mapping = LoRAMapping(tokens, sampled, is_prefill=True)
    max_loras, vocab = len(slots) + 1, 1000

    stock = _wrapper()
    stock._update_base_metadata(mapping, slots, max_loras, vocab)
    ours = _wrapper()
    _write_base_metadata(ours, _ids_to_slots(tokens, slots), _ids_to_slots(sampled, slots), max_loras, vocab)
    assert _written(ours) == _written(stock)


def test_unknown_id_is_an_error():
    with pytest.raises(RuntimeError, match="no slot"):
        _ids_to_slots((0, 5), [None, 3])
    assert _ids_to_slots((), [None]).tolist() == []
    assert _ids_to_slots((0, 3, 3), [None, 3]).tolist() == [-1, 1, 1]
    assert _ids_to_slots((0, 0), [None, None]).tolist() == [-1, -1]
    with pytest.raises(RuntimeError, match="LoRA id 4 "):
        _ids_to_slots((3, 3, 0, 4, 4), [None, 3])
    with pytest.raises(RuntimeError, match="no slot"):
        _ids_to_slots((0, 2), [None, None])
    assert isinstance(_ids_to_slots(np.zeros(0, dtype=np.int64), [1]), np.ndarray)
    assert torch.tensor(_ids_to_slots((3,), [3])).item() == 0


@pytest.mark.parametrize("seed", range(3))
def test_array_mapping_stands_in_for_vllms_mapping(seed):
    """vLLM's own metadata code reads our numpy-backed mapping as its tuple mapping; we read its arrays as they are."""
    from vllm.lora.layers import LoRAMapping

    rng = np.random.default_rng(seed)
    slots, max_loras, vocab = [None, 17, 3, None, 42, 8], 7, 1000
    tokens, sampled = rng.choice([0, 17, 3, 42, 8], 40), rng.choice([0, 17, 3, 42, 8], 6)
    ours, theirs = array_mapping(tokens, sampled), LoRAMapping(tuple(tokens), tuple(sampled), is_prefill=True)
    written = []
    for mapping in (ours, theirs):
        w = _wrapper()
        w._update_base_metadata(mapping, slots, max_loras, vocab)
        written.append(_written(w))
    assert written[0] == written[1]
    assert all(a is b for a, b in zip(mapping_ids(ours), (tokens, sampled), strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(mapping_ids(theirs), (tokens, sampled), strict=True))
    assert ours.is_prefill and ours.type == theirs.type


def test_array_mapping_compares_by_value_as_vllms_manager_needs():
    """LoRAModelManager.set_adapter_mapping updates the metadata only when `_last_mapping != mapping`."""
    from vllm.lora.layers import LoRAMapping

    first = array_mapping(np.array([0, 3, 3]), np.array([3]))
    assert first == array_mapping(np.array([0, 3, 3]), np.array([3]))
    assert first != array_mapping(np.array([0, 3, 4]), np.array([3]))
    assert first != array_mapping(np.array([0, 3]), np.array([3]))
    assert first != array_mapping(np.array([0, 3, 3]), np.array([0]))
    last_mapping = None  # the manager's first step
    assert last_mapping != first
    assert first != LoRAMapping((0, 3, 3), (3,), is_prefill=True)  # vLLM's own (dummy-LoRA warm-up): updated
