"""Typed settings for every service, read from `PREFT_*` environment variables (`__` separates nesting).

Example: `PREFT_REGISTRY__REDIS__URL=redis://10.0.0.5:6379/0`, `PREFT_REGISTRY__ADMIN_TOKEN=...`.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEV_TOKEN = "dev-admin-token"  # the placeholder `preft up` uses; refused outside environment=dev
DEV_ENGINE_TOKEN = "dev-engine-token"  # the engine token's placeholder; refused outside environment=dev


def refuse_placeholder(environment: str, secret: SecretStr | None, placeholder: str, variable: str) -> None:
    """Raise unless `secret` was set to something other than its dev placeholder (in environment=dev, anything goes)."""
    if environment != "dev" and secret is not None and secret.get_secret_value() == placeholder:
        raise ValueError(f"set {variable}: the placeholder value is only allowed in dev")


class RedisSettings(BaseModel):
    """Where Redis is, who this service is there (its ACL user, `common.redis_acl`), and how long to wait for it."""

    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL (db index included)")
    username: str | None = Field(None, description="ACL user (gateway, registry or engine); None: `default`")
    password: SecretStr | None = Field(None, description="The user's password; None: no AUTH (dev only)")
    socket_timeout_s: float = Field(1.0, description="Per-command timeout; a down Redis fails fast, never hangs")
    max_connections: int = Field(64, description="Connection pool size")

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_url(cls, data: Any) -> Any:
        """Credentials written into the URL move to `username`/`password`, so the URL (logged, shown in reprs)
        never holds the password."""
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        parts = urlsplit(data["url"])
        if parts.password is None and parts.username is None:
            return data
        host = parts.netloc.rpartition("@")[2]
        data = {**data, "url": urlunsplit(parts._replace(netloc=host))}
        if parts.username and data.get("username") is None:
            data["username"] = unquote(parts.username)
        if parts.password is not None and data.get("password") is None:
            data["password"] = unquote(parts.password)
        return data

    def client_options(self) -> dict[str, Any]:
        """redis-py's connection arguments besides the URL: the credentials and timeouts."""
        return {
            "username": self.username,
            "password": None if self.password is None else self.password.get_secret_value(),
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.socket_timeout_s,
            "max_connections": self.max_connections,
        }


def unauthenticated_redis(service: str, redis: RedisSettings) -> str | None:
    """Why `redis` is refused outside dev (None when it is not): every service authenticates as its own ACL user."""
    if redis.password is None or not redis.username:
        upper = service.upper()
        return (
            f"set PREFT_{upper}__REDIS__USERNAME and PREFT_{upper}__REDIS__PASSWORD (its Redis ACL user): "
            "an unauthenticated Redis is only allowed in dev"
        )
    return None


class S3Settings(BaseModel):
    """An S3-compatible bucket (AWS, MinIO, SeaweedFS) holding adapter blobs."""

    endpoint_url: str | None = Field(None, description="None = AWS; e.g. http://127.0.0.1:8333 for SeaweedFS")
    bucket: str = Field("preft-adapters", description="Bucket for blobs/sha256/<digest>")
    region: str = Field("us-east-1", description="Signing region")
    access_key: str | None = Field(None, description="Access key id; None = the default AWS credential chain")
    secret_key: SecretStr | None = Field(None, description="Secret access key")
    connect_timeout_s: float = Field(2.0, description="TCP connect timeout")
    read_timeout_s: float = Field(30.0, description="Read timeout per request")
    multipart_part_bytes: int = Field(8 * 1024 * 1024, ge=5 * 1024 * 1024, description="Multipart part size")


class RegistrySettings(BaseSettings):
    """The registry service: storage, limits and its gRPC endpoint."""

    model_config = SettingsConfigDict(env_prefix="PREFT_REGISTRY__", env_nested_delimiter="__", extra="ignore")

    environment: Literal["dev", "prod"] = Field("prod", description="dev allows the placeholder admin token")
    listen_address: str = Field("127.0.0.1:50051", description="host:port the gRPC server binds")
    metrics_address: str = Field(
        "127.0.0.1:9102",
        description="host:port serving Prometheus metrics at /metrics (RPCs, blob bytes, store errors, index size); "
        "empty = none. Loopback by default: the chart and kustomize bind 0.0.0.0 for the ServiceMonitor",
    )
    admin_token: SecretStr = Field(SecretStr(DEV_TOKEN), description="Bearer token allowed every RPC (operators)")
    gateway_token: SecretStr | None = Field(
        None,
        description="Bearer token allowed the RPCs the gateway makes for tenants (resolve, list, publish, share, "
        "delete adapters; record uses) but not tenant, key, limit, base model or gc administration; None: no such role",
    )
    reader_token: SecretStr | None = Field(
        None, description="Read-only bearer token of engine replicas (the Hot ranking alone); None: no such role"
    )
    worker_threads: int = Field(16, ge=1, description="gRPC server threads (one per in-flight call)")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    max_rank: int = Field(256, ge=1, description="Largest adapter rank accepted at publish")
    max_adapter_bytes: int = Field(4 * 1024**3, ge=1, description="Largest adapter version (all files)")
    max_config_bytes: int = Field(1024 * 1024, ge=1, description="Largest JSON or README file")
    default_requests_per_min: int = Field(600, ge=1, description="Tenant limit when not set")
    default_tokens_per_min: int = Field(200_000, ge=1, description="Tenant limit when not set")
    default_max_adapters: int = Field(1000, ge=1, description="Tenant limit when not set")
    default_max_bytes: int = Field(50 * 1024**3, ge=1, description="Tenant limit when not set")
    hot_half_life_s: float = Field(3600.0, gt=0, description="A use's weight in hotness halves every half-life")
    gc_grace_s: float = Field(3600.0, ge=0, description="gc leaves blobs and uploads younger than this alone")

    @model_validator(mode="after")
    def _no_placeholder_secret_outside_dev(self) -> RegistrySettings:
        if self.environment != "dev" and self.admin_token.get_secret_value() == DEV_TOKEN:
            raise ValueError("set PREFT_REGISTRY__ADMIN_TOKEN: the placeholder token is only allowed in dev")
        if self.environment != "dev" and (refusal := unauthenticated_redis("registry", self.redis)):
            raise ValueError(refusal)
        tokens = [
            t.get_secret_value() for t in (self.admin_token, self.gateway_token, self.reader_token) if t is not None
        ]
        if len(set(tokens)) < len(tokens) or not all(tokens):
            raise ValueError("the registry's admin, gateway and reader tokens must be non-empty and differ")
        return self


class AdminSettings(BaseSettings):
    """Where `preft-admin` finds the registry (flags override these)."""

    model_config = SettingsConfigDict(env_prefix="PREFT_ADMIN__", extra="ignore")

    registry: str = Field("127.0.0.1:50051", description="host:port of the registry's gRPC endpoint")
    token: SecretStr = Field(SecretStr(DEV_TOKEN), description="The registry admin token")
    timeout_s: float = Field(10.0, gt=0, description="Deadline for each call except uploads")
    stack_dir: str = Field(
        ".preft/stack", description="`preft up`'s state directory: its registry and token are the defaults"
    )
