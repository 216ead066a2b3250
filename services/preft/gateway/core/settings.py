"""The core's settings: where the gateway listens, its collaborators (Redis, registry, engine), the model, the
caches, rate limits and metering. One part of `preft.gateway.settings.GatewaySettings` (flat `PREFT_GATEWAY__*`
names, as every part's)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

from preft.common.settings import DEV_ENGINE_TOKEN, DEV_TOKEN, RedisSettings, refuse_placeholder, unauthenticated_redis

# The `model` value that means the base model whatever its served name (what it was listed as before it had one).
BASE_ALIAS = "base"


class CoreSettings(BaseModel):
    """The core: where it listens, its collaborators (Redis, registry, engine), the model, caches and limits."""

    environment: Literal["dev", "prod"] = Field("prod", description="dev allows the placeholder registry token")
    host: str = Field("127.0.0.1", description="Address uvicorn binds")
    port: int = Field(8080, ge=0, le=65535, description="TCP port uvicorn binds")
    metrics_address: str = Field(
        "127.0.0.1:9101",
        description="host:port serving Prometheus metrics at /metrics, apart from the API's port (which never serves "
        "them: an Ingress in front of it cannot expose tenant labels); port 0 = any free one, empty = none. Loopback "
        "by default: the chart and kustomize bind 0.0.0.0 for the ServiceMonitor",
    )
    access_log: bool = Field(
        True, description="uvicorn access log (method, path, status; no query secrets; never headers or bodies)"
    )

    redis: RedisSettings = Field(default_factory=RedisSettings, description="Redis holding keys, tenants, buckets")
    redis_timeout_s: float = Field(
        0.5, gt=0, description="Deadline for one gateway Redis operation, connecting included (Redis down -> 503)"
    )

    registry_address: str = Field("127.0.0.1:50051", description="host:port of the registry's gRPC endpoint")
    registry_token: SecretStr = Field(
        SecretStr(DEV_TOKEN), description="The registry's gateway token (its gateway_token; the admin token works too)"
    )
    registry_timeout_s: float = Field(2.0, gt=0, description="Deadline for each registry call")

    engine_url: str = Field("http://127.0.0.1:8000", description="Base URL of the engine app (the Ray Serve proxy)")
    engine_connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout to the engine")
    engine_read_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the engine's answer (non-streaming) or its next streamed chunk"
    )
    engine_unresponsive_s: float = Field(
        2.0,
        gt=0,
        description="Longest wait for the engine's response headers while the engine shows no sign of life (no answer "
        "to any request, no health check answer, since half of it): then 503 with Retry-After, not a wait for a new "
        "replica. While it shows life (a busy replica queueing requests, a long non-streaming answer, whose headers "
        "come with its last token) requests wait on, up to engine_read_timeout_s",
    )
    engine_token: SecretStr = Field(
        SecretStr(DEV_ENGINE_TOKEN), description="The secret the engine requires on /generate (its api_token)"
    )
    engine_max_connections: int = Field(1024, ge=1, description="Connection pool size towards the engine")

    model_dir: Path | None = Field(None, description="Base model directory; its tokenizer is used unless tokenizer_dir")
    tokenizer_dir: Path | None = Field(None, description="Tokenizer directory (Hugging Face format, chat template)")
    served_model_name: str = Field(
        BASE_ALIAS,
        min_length=1,
        description=f"The base model's name: the `model` value /v1/models lists for it (`{BASE_ALIAS}` is accepted "
        "for it too)",
    )
    max_model_len: int = Field(8192, ge=2, description="Prompt + generated tokens the engine can hold per request")
    max_prompt_tokens: int = Field(8191, ge=1, description="Longest prompt accepted, in tokens (longer: 413)")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request sets none (capped by length)")
    prompt_max_bytes_per_token: int = Field(
        32,
        ge=1,
        description="Bound on a prompt's average UTF-8 bytes per token (real text: 3-6): a prompt text (or rendered "
        "conversation) over max_prompt_tokens × this many bytes is refused (413) before it is tokenized, and the "
        "rate limit is charged bytes / this many tokens for it before tokenizing, settled with the real count after",
    )
    tokenize_workers: int = Field(
        1,
        ge=1,
        description="Threads tokenizing long prompts off the event loop (keep it below the replica's cores: the event "
        "loop needs one)",
    )
    tokenize_per_tenant: int = Field(
        2,
        ge=1,
        description="Long prompts of one tenant in the tokenizing threads (running or queued) at once per replica, so "
        "another tenant's waits behind a few of them at most; more wait for a slot",
    )
    tokenize_wait_s: float = Field(
        2.0,
        ge=0,
        description="How long a long prompt waits for one of its tenant's tokenizing slots before it is refused with "
        "429 and Retry-After",
    )
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body (larger: 413)")
    max_adapter_upload_bytes: int = Field(
        512 * 1024 * 1024, ge=1024, description="Largest adapter upload through POST /v1/adapters (larger: 413)"
    )
    registry_upload_timeout_s: float = Field(600.0, gt=0, description="Deadline for an adapter upload to the registry")

    key_cache_ttl_s: float = Field(
        2.0, ge=0, description="How long an API key lookup is reused; revocation takes effect within this time"
    )
    key_cache_max_entries: int = Field(100_000, ge=1, description="API key lookups kept in memory")
    resolve_cache_ttl_s: float = Field(
        10.0, ge=0, description="How long an adapter resolution is reused (also while the registry is down)"
    )
    resolve_cache_max_entries: int = Field(100_000, ge=1, description="Adapter resolutions kept in memory")
    allow_mode_override: bool = Field(
        False, description="Let requests pick the position mode (`preft_mode` in the body); else 400 when they try"
    )
    cache_salt_key: SecretStr | None = Field(
        None,
        description="Key of the tenants' prefix-cache salts (`cache_salt`), the same on every replica; unset: derived "
        "from registry_token",
    )
    cache_groups: dict[str, Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=dict,
        description="Tenant → prefix-cache group: the tenants of one group share cached prompt blocks (opt-in; any "
        'other tenant shares them with no one), e.g. PREFT_GATEWAY__CACHE_GROUPS=\'{"acme": "a", "acme-eu": "a"}\'',
    )
    usage_flush_interval_s: float = Field(
        1.0, gt=0, description="How often adapter uses are sent to the registry (RecordUse, batched)"
    )
    metering_flush_interval_s: float = Field(
        1.0, gt=0, description="How often the token usage of answered requests is added to Redis (batched)"
    )
    quota_reservation_lapse_s: float = Field(
        3600.0,
        gt=0,
        description="How long a request's reservation against its tenant's monthly token quota stands at most: one "
        "left by a gateway that crashed lapses then (keep it above the longest a request runs: a streamed answer "
        "running longer loses its reservation, and may take the tenant over its quota by what it uses)",
    )
    metering_max_pending: int = Field(
        100_000,
        ge=1,
        description="Token usage entries (tenant, minute, model) held while Redis is unreachable (each minute of an "
        "outage adds one per tenant and model in use); reaching it, the outage's usage is kept by hour, not minute, "
        "and past it by hour too, new usage is dropped",
    )

    @model_validator(mode="after")
    def _check_core(self) -> CoreSettings:
        if self.environment != "dev" and self.registry_token.get_secret_value() == DEV_TOKEN:
            raise ValueError("set PREFT_GATEWAY__REGISTRY_TOKEN: the placeholder token is only allowed in dev")
        if self.environment != "dev" and (refusal := unauthenticated_redis("gateway", self.redis)):
            raise ValueError(refusal)
        refuse_placeholder(self.environment, self.engine_token, DEV_ENGINE_TOKEN, "PREFT_GATEWAY__ENGINE_TOKEN")
        if self.quota_reservation_lapse_s <= self.engine_read_timeout_s:
            raise ValueError("quota_reservation_lapse_s must be above engine_read_timeout_s (a request runs as long)")
        if self.max_prompt_tokens >= self.max_model_len:
            raise ValueError("max_prompt_tokens must be below max_model_len (one token is left to generate)")
        return self

    @property
    def max_prompt_bytes(self) -> int:
        """Longest prompt text accepted, in UTF-8 bytes (longer: 413 before tokenizing)."""
        return self.max_prompt_tokens * self.prompt_max_bytes_per_token

    def is_base_model(self, model: str) -> bool:
        """Whether the `model` of a request means the base model: its served name, or the alias `base`."""
        return model in (self.served_model_name, BASE_ALIAS)

    @property
    def tokenizer_path(self) -> Path | None:
        return self.tokenizer_dir or self.model_dir
