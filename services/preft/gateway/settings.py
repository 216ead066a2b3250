"""Typed settings of the gateway, read from `PREFT_GATEWAY__*` environment variables (`__` separates nesting).

Each sub-package declares its own part (`core.settings`, `openai.settings`, `responses.settings`, `files.settings`,
`batches.settings`); `GatewaySettings` joins them, so every name stays flat: `PREFT_GATEWAY__REDIS__URL=redis://
10.0.0.5:6379/0`, `PREFT_GATEWAY__REGISTRY_TOKEN=...`, `PREFT_GATEWAY__ENGINE_URL=http://ray-head:8000`,
`PREFT_GATEWAY__MODEL_DIR=/models/llama-3-8b`, `PREFT_GATEWAY__S3__BUCKET=preft-adapters` (with the other `S3__*`
fields: the Files and Batch APIs are on).
"""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

from preft.gateway.batches.settings import BatchesSettings
from preft.gateway.core.settings import CoreSettings
from preft.gateway.files.settings import FilesSettings
from preft.gateway.openai.settings import OpenAISettings
from preft.gateway.responses.settings import ResponsesSettings


class GatewaySettings(CoreSettings, OpenAISettings, ResponsesSettings, FilesSettings, BatchesSettings, BaseSettings):
    """The gateway's settings: every sub-package's part, under one flat `PREFT_GATEWAY__` prefix."""

    model_config = SettingsConfigDict(env_prefix="PREFT_GATEWAY__", env_nested_delimiter="__", extra="ignore")
