"""Punica wrappers that know PreFT's slot kinds, and correct CPU LoRA ops.

``update_metadata`` runs once per step: after vLLM converts the step's LoRA-id mapping to slot indices, the
map is split by method (tokens of DiReFT-only slots are hidden from the LoRA kernels; the DiReFT op gets its
own map). On CPU the stock torch ops index the stacked weights with the slot index, so "no adapter" (-1)
silently picks the last slot; ours group the step's tokens by slot once and touch only adapted tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from preft.vllm_plugin import compat
from preft.vllm_plugin.groups import EMPTY_GROUPS, TokenGroups


def _split_step_slots(wrapper, mapping, lora_index_to_id, max_loras, vocab_size) -> None:
    wrapper.is_prefill = mapping.is_prefill
    wrapper._update_base_metadata(mapping, lora_index_to_id, max_loras, vocab_size)
    n_tokens, n_sampled = wrapper.indices_len[0], wrapper.indices_len[1]
    state = wrapper.preft_state
    tokens = wrapper._token_lora_indices[:n_tokens]
    tokens.copy_(state.split_slots(tokens))
    sampled = wrapper._sampler_indices[:n_sampled]
    sampled.copy_(state.lora_slots(sampled))


class _CpuOps:
    """LoRA ops on CPU over token groups: y[rows] += ((x[rows] @ A[slot]^T) * scale) @ B[slot]^T."""

    _token_groups: TokenGroups = EMPTY_GROUPS
    _sampler_groups: TokenGroups = EMPTY_GROUPS

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs: Any) -> None:
        _split_step_slots(self, mapping, lora_index_to_id, max_loras, vocab_size)
        self._token_groups = TokenGroups.from_slots(self.token_lora_indices)
        self._sampler_groups = TokenGroups.from_slots(self.sampler_indices)

    @staticmethod
    def _shrink(xs: torch.Tensor, a_stacked: torch.Tensor, groups: TokenGroups, scale: float) -> torch.Tensor:
        """[n_adapted, r] float32 (the precision of vLLM's shrink buffers)."""
        out = torch.empty(xs.shape[0], a_stacked.shape[-2], dtype=torch.float32)
        for slot, s, e in groups.segments:
            out[s:e] = (xs[s:e].float() @ a_stacked[slot, 0].float().T) * scale
        return out

    @staticmethod
    def _expand(zs: torch.Tensor, b_stacked: torch.Tensor, groups: TokenGroups, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(zs.shape[0], b_stacked.shape[-2], dtype=dtype)
        for slot, s, e in groups.segments:
            out[s:e] = zs[s:e].to(dtype) @ b_stacked[slot, 0].to(dtype).T
        return out

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kw):
        groups = self._token_groups
        if groups.empty:
            return None
        x = x.view(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        xs = x.index_select(0, groups.rows)
        offset = 0
        for a, b, size in zip(lora_a_stacked, lora_b_stacked, output_slices, strict=True):
            delta = self._expand(self._shrink(xs, a, groups, scale), b, groups, y2.dtype)
            y2[:, offset : offset + size].index_add_(0, groups.rows, delta[:, :size])
            offset += size
        return None

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        groups = self._token_groups
        if groups.empty:
            return None
        x = x.view(-1, x.shape[-1])
        xs = x.index_select(0, groups.rows)
        for i, a in enumerate(lora_a_stacked):
            yi = y[i].view(-1, y[i].shape[-1])
            yi.index_add_(0, groups.rows, self._shrink(xs, a, groups, scale).to(yi.dtype))
        return None

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
        groups = self._token_groups
        if groups.empty:
            return None
        y2 = y.view(-1, y.shape[-1])
        offset = offset_start
        for i, (b, size) in enumerate(zip(lora_b_stacked, output_slices, strict=True)):
            xi = x[i].view(-1, x[i].shape[-1]).index_select(0, groups.rows)
            delta = self._expand(xi, b, groups, y2.dtype)[:, :size]
            target = y2[:, offset : offset + size]
            if add_inputs:
                target.index_add_(0, groups.rows, delta)
            else:
                target.index_copy_(0, groups.rows, delta)
            offset += size
        return None

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        groups = self._token_groups
        if groups.empty:
            return None
        xs = x.view(-1, x.shape[-1]).index_select(0, groups.rows)
        delta = self._expand(xs, lora_b_stacked, groups, y.dtype)
        y2 = y.view(-1, y.shape[-1])[:, : delta.shape[1]]
        (y2.index_add_ if add_inputs else y2.index_copy_)(0, groups.rows, delta[:, : y2.shape[1]])
        return None

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        groups = self._sampler_groups
        if groups.empty:
            return None
        y2 = y.view(-1, y.shape[-1])
        xs = x.view(-1, x.shape[-1]).index_select(0, groups.rows)
        a = lora_a_stacked if lora_a_stacked.dim() == 4 else lora_a_stacked.unsqueeze(1)
        b = lora_b_stacked if lora_b_stacked.dim() == 4 else lora_b_stacked.unsqueeze(1)
        delta = self._expand(self._shrink(xs, a, groups, scale), b, groups, y2.dtype)
        width = min(delta.shape[1], y2.shape[1])
        y2[:, :width].index_add_(0, groups.rows, delta[:, :width])
        return None


class _GpuMetadata:
    """On GPU vLLM's Triton kernels already skip -1; only the per-method split is added."""

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs: Any) -> None:
        _split_step_slots(self, mapping, lora_index_to_id, max_loras, vocab_size)
        self.token_mapping_meta.prepare_tensors(self.token_lora_indices)
        self.prompt_mapping_meta.prepare_tensors(self.sampler_indices)


_CLASSES: dict[type, type] = {}


def preft_wrapper_class(base: type) -> type:
    """Our subclass of the platform's punica wrapper class."""
    if base not in _CLASSES:
        if issubclass(base, compat.punica_cpu_cls()):
            mixin = _CpuOps
        elif issubclass(base, compat.punica_gpu_cls()):
            mixin = _GpuMetadata
        else:
            raise compat.UnsupportedVllmError(f"PreFT does not support the punica wrapper {base.__name__}")
        _CLASSES[base] = type(f"Preft{base.__name__}", (mixin, base), {"preft_state": None})
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
