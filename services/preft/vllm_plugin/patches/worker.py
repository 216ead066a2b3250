"""Model-runner side of PreFT: which tokens of a step run with which adapter, and graph dispatch.

- The input batch stores a prefill-only request's LoRA id negated (patch #2 in compat), so the flag moves
  with the request through vLLM's own swap/condense bookkeeping of that array.
- ``set_active_loras`` (patch #1) maps each scheduled token from its position: prompt positions of a
  prefill-mode request carry the adapter, generated positions map to "no adapter", and only adapters with
  tokens in the step are activated. The step's mapping reaches vLLM's LoRA manager as numpy arrays
  (``ArrayLoRAMapping``), which our punica wrapper reads as they are.
- Only adapters not already in a slot go through vLLM's adapter loading; resident ones are only touched in
  the LRU caches (vLLM's own path rebuilds the set of loaded adapters once per request per step).
- CUDA-graph dispatch (patch #3): a step with adapted tokens runs eagerly (our ops group its tokens by slot
  at run time); every other step replays the no-LoRA graph, the only graphs captured (patch #4), so
  adapters loaded in slots never slow a step without adapted tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from preft.common.modes import is_prefill_only
from preft.vllm_plugin import compat
from preft.vllm_plugin.patches.patching import wrap_method
from preft.vllm_plugin.step.token_mapping import build_step_mapping


def _add_request(original):
    def add_request(self, request, *args: Any, **kwargs: Any):
        index = original(self, request, *args, **kwargs)
        if request.lora_request is not None and is_prefill_only(request.sampling_params):
            self.request_lora_mapping[index] = -abs(self.request_lora_mapping[index])
        return index

    return add_request


def _remove_request(original):
    def remove_request(self, req_id: str, *args: Any, **kwargs: Any):
        index = self.req_id_to_index.get(req_id)
        if index is not None:
            self.request_lora_mapping[index] = abs(self.request_lora_mapping[index])
        return original(self, req_id, *args, **kwargs)

    return remove_request


def _set_active_loras(original):
    def set_active_loras(self, input_batch, num_scheduled_tokens, num_sampled_tokens=None, mapping_type=None):
        if num_sampled_tokens is None:
            num_sampled_tokens = np.ones_like(num_scheduled_tokens, dtype=np.int32)
        n = len(num_scheduled_tokens)
        step = build_step_mapping(
            input_batch.request_lora_mapping[:n],
            input_batch.num_prompt_tokens[:n],
            input_batch.num_computed_tokens_cpu[:n],
            num_scheduled_tokens,
            num_sampled_tokens,
        )
        requests = [input_batch.lora_id_to_lora_request[int(i)] for i in step.active_ids]
        self._ensure_lora_enabled()
        mapping = array_mapping(step.token_ids, step.sampled_ids, mapping_type)
        self.lora_manager.set_active_adapters(not_resident(self.lora_manager, requests), mapping)

    return set_active_loras


@functools.cache
def _array_mapping_cls() -> type:
    """vLLM's LoRAMapping over numpy arrays (see compat's LoRAMapping touch point)."""
    base, types = compat.lora_mapping_classes()

    class ArrayLoRAMapping(base):
        """A step's LoRA ids per token and per sampled row; is_prefill, as vLLM's model runner always sets it."""

        __hash__ = None  # as the dataclass it derives from (mutable, compared by value)

        def __init__(self, token_ids: np.ndarray, sampled_ids: np.ndarray, mapping_type=None) -> None:
            self.token_ids, self.sampled_ids = token_ids, sampled_ids
            self.is_prefill, self.type = True, mapping_type or types.LANGUAGE

        @property
        def index_mapping(self) -> tuple[int, ...]:
            return tuple(self.token_ids.tolist())

        @property
        def prompt_mapping(self) -> tuple[int, ...]:
            return tuple(self.sampled_ids.tolist())

        def __eq__(self, other: object) -> bool:
            if not isinstance(other, ArrayLoRAMapping):
                return NotImplemented
            return (
                (self.is_prefill, self.type) == (other.is_prefill, other.type)
                and np.array_equal(self.token_ids, other.token_ids)
                and np.array_equal(self.sampled_ids, other.sampled_ids)
            )

    return ArrayLoRAMapping


def array_mapping(token_ids: np.ndarray, sampled_ids: np.ndarray, mapping_type=None):
    """A vLLM LoRAMapping of these ids that keeps them as numpy arrays: no per-token tuple is built or compared."""
    return _array_mapping_cls()(token_ids, sampled_ids, mapping_type)


def mapping_ids(mapping) -> tuple[np.ndarray, np.ndarray]:
    """(per-token, per-sampled-row) LoRA ids of a mapping: ours as they are, vLLM's (its dummy-LoRA warm-up
    builds its own) from their tuples."""
    if isinstance(mapping, _array_mapping_cls()):
        return mapping.token_ids, mapping.sampled_ids
    return np.asarray(mapping.index_mapping, dtype=np.int64), np.asarray(mapping.prompt_mapping, dtype=np.int64)


def not_resident(worker_manager, requests: list) -> set:
    """The requests whose adapter is not in a slot; the resident ones are touched as vLLM's add_adapter would.

    Touching them first keeps them from being the LRU victims when the others take slots.
    """
    manager = worker_manager._adapter_manager
    active, registered = manager._active_adapters, manager._registered_adapters
    missing = set()
    for request in requests:
        lora_id = request.lora_int_id
        if lora_id in active and lora_id in registered:
            registered.touch(lora_id)
            active.touch(lora_id)
        else:
            missing.add(request)
    return missing


def _determine_batch_execution_and_padding(original):
    def determine(self, *args: Any, **kwargs: Any):
        state = getattr(getattr(self, "lora_manager", None), "preft_state", None)
        if state is not None and kwargs.get("force_has_lora") is None and kwargs.get("force_num_active_loras") is None:
            kwargs["force_num_active_loras"] = 0
            kwargs["force_has_lora"] = False
            if state.step.has_adapter_tokens:
                kwargs["force_eager"] = True
        return original(self, *args, **kwargs)

    return determine


def _get_lora_cases(original):
    def get_lora_cases(self) -> list[int]:
        if self.vllm_config.lora_config is None:
            return original(self)
        return [0]  # steps with adapted tokens never replay a graph (see _determine_batch_execution_and_padding)

    return get_lora_cases


def install() -> None:
    batch = compat.input_batch_cls()
    wrap_method(batch, "add_request", _add_request)
    wrap_method(batch, "remove_request", _remove_request)
    wrap_method(compat.lora_mixin(), "set_active_loras", _set_active_loras)
    runner = compat.gpu_model_runner_cls()
    wrap_method(runner, "_determine_batch_execution_and_padding", _determine_batch_execution_and_padding)
    wrap_method(compat.cudagraph_dispatcher_cls(), "_get_lora_cases", _get_lora_cases)
