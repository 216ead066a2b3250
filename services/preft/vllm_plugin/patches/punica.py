"""Our subclass of the platform's punica wrapper: per-step metadata from host arrays, LoRA ops over groups.

``update_metadata`` runs when the step's adapter mapping changes. It converts the mapping to slots with
numpy (vLLM's ``convert_mapping`` loops over tokens in Python), fills the index tensors vLLM's LoRA layers
read (with DiReFT-only slots turned into "no adapter"), and hands the slot maps to the plugin state, which
groups the adapted tokens by slot. No step-time device synchronization: everything is known on the host.

Every LoRA op (linear, logits, embedding, shrink, expand) then goes through our custom ops (``step.ops``), which
run over the grouped rows only. This replaces both vLLM's Triton kernels on GPU (whose launch grid spans every
slot and every token, so their cost grows with ``max_loras``) and the CPU torch ops (which read slot -1,
"no adapter", as the last slot).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from preft.vllm_plugin import compat
from preft.vllm_plugin.kernels.staging import staged
from preft.vllm_plugin.patches.worker import mapping_ids
from preft.vllm_plugin.step import ops  # noqa: F401  (ops registers the torch.ops.preft namespace)


def _ids_to_slots(ids: Any, lora_index_to_id: list[int | None]) -> np.ndarray:
    """LoRA id per row -> slot per row (-1 for id 0, "no adapter"); an id without a slot is an error, as in vLLM.

    Rows come in runs of one id (a request's tokens), so only each run's id is looked up: a step of 16,384
    tokens costs a few passes over its ids, not a sort of them."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return np.full(0, -1, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    run_ids = ids[starts]
    known, known_slots = _slot_table(tuple(lora_index_to_id))
    at = np.minimum(np.searchsorted(known, run_ids), known.size - 1)
    if (missing := (run_ids > 0) & (known[at] != run_ids)).any():
        raise RuntimeError(f"preft: LoRA id {int(run_ids[missing][0])} has tokens in the step but no slot")
    run_slots = np.where(run_ids > 0, known_slots[at], -1)
    return np.repeat(run_slots, np.diff(np.append(starts, ids.size)))


@functools.lru_cache(maxsize=4)
def _slot_table(lora_index_to_id: tuple[int | None, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The ids in slots, sorted, and the slot of each (kept while the slots hold the same adapters); id 0, "no
    adapter", is always there with slot -1, so the table is never empty."""
    pairs = sorted(
        [(0, -1)] + [(lora_id, slot) for slot, lora_id in enumerate(lora_index_to_id) if lora_id is not None]
    )
    ids = np.array([lora_id for lora_id, _ in pairs], dtype=np.int64)
    return ids, np.array([slot for _, slot in pairs], dtype=np.int64)


def _write_base_metadata(wrapper, token_slots: np.ndarray, sampled_slots: np.ndarray, max_loras: int, vocab: int):
    """What vLLM's convert_mapping + _update_base_metadata write, from slot arrays (extra vocab is always 0)."""
    n, m = token_slots.shape[0], sampled_slots.shape[0]
    embeddings = np.zeros((2, n), dtype=np.int64)
    embeddings[1] = np.where(token_slots >= 0, token_slots, 0) * vocab
    padded = np.where(sampled_slots >= 0, sampled_slots, max_loras - 1)
    padded = np.arange(m, dtype=np.int64) + padded * m

    # One host buffer for the four (pinned on CUDA, so the copies do not wait for the step in flight).
    host = staged((token_slots, sampled_slots, padded, embeddings), pinned=wrapper._token_lora_indices.is_cuda)
    tokens, sampled, sampled_padded, embedding = torch.split(host, [n, m, m, 2 * n])
    wrapper._token_lora_indices[:n].copy_(tokens, non_blocking=True)
    wrapper._sampler_indices[:m].copy_(sampled, non_blocking=True)
    wrapper._sampler_indices_padded[:m].copy_(sampled_padded, non_blocking=True)
    wrapper._embeddings_indices[:, :n].copy_(embedding.view(2, n), non_blocking=True)
    wrapper.indices_len[:] = [n, m, m, n]


class _PreftOps:
    """Mixed into the platform's punica wrapper (CPU or GPU); `preft_state` is set when the manager is built."""

    preft_state = None

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs: Any) -> None:
        self.is_prefill = mapping.is_prefill
        token_ids, sampled_ids = mapping_ids(mapping)
        token_slots = _ids_to_slots(token_ids, lora_index_to_id)
        sampled_slots = _ids_to_slots(sampled_ids, lora_index_to_id)
        lora_tokens, lora_sampled = self.preft_state.set_step(token_slots, sampled_slots)
        _write_base_metadata(self, lora_tokens, lora_sampled, max_loras, vocab_size)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kw):
        # add_inputs=False (vLLM's dual-stream path) hands a zeroed y: adding into it is the same.
        torch.ops.preft.lora_linear(
            y,
            x,
            list(lora_a_stacked),
            list(lora_b_stacked),
            list(output_slices),
            float(scale),
            self.preft_state.id,
            False,
        )
        return None

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        torch.ops.preft.lora_linear(
            y,
            x,
            [lora_a_stacked],
            [lora_b_stacked],
            [lora_b_stacked.shape[-2]],
            float(scale),
            self.preft_state.id,
            True,
        )
        return None

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        torch.ops.preft.lora_shrink(y, x, list(lora_a_stacked), float(scale), self.preft_state.id)
        return None

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
        buffer = x if isinstance(x, torch.Tensor) else torch.stack(tuple(x))
        torch.ops.preft.lora_expand(
            y,
            buffer,
            list(lora_b_stacked),
            list(output_slices),
            int(offset_start),
            bool(add_inputs),
            self.preft_state.id,
        )
        return None

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        torch.ops.preft.lora_expand(
            y, x.unsqueeze(0), [lora_b_stacked], [lora_b_stacked.shape[-2]], 0, bool(add_inputs), self.preft_state.id
        )
        return None


_CLASSES: dict[type, type] = {}


def preft_wrapper_class(base: type) -> type:
    """Our subclass of the platform's punica wrapper class."""
    if base not in _CLASSES:
        if not (issubclass(base, compat.punica_cpu_cls()) or issubclass(base, compat.punica_gpu_cls())):
            raise compat.UnsupportedVllmError(f"PreFT does not support the punica wrapper {base.__name__}")
        _CLASSES[base] = type(f"Preft{base.__name__}", (_PreftOps, base), {})
    return _CLASSES[base]


def get_punica_wrapper(*args: Any, **kwargs: Any):
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    base = resolve_obj_by_qualname(current_platform.get_punica_wrapper())
    return preft_wrapper_class(base)(*args, **kwargs)


def install() -> None:
    module = compat.lora_model_manager_module()
    if module.get_punica_wrapper is not get_punica_wrapper:
        module.get_punica_wrapper = get_punica_wrapper
