"""The core's collaborators, as the routes and services of every sub-package receive them."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from preft.gateway.core.auth import KeyAuthenticator
from preft.gateway.core.engine_client import EngineClient
from preft.gateway.core.limits import RateLimiter
from preft.gateway.core.metering import TokenMeter
from preft.gateway.core.prompt_guard import PromptGuard
from preft.gateway.core.registry import AsyncRegistry
from preft.gateway.core.resolution import AdapterResolver
from preft.gateway.core.settings import CoreSettings
from preft.gateway.core.tokenization import PromptTokenizer


@dataclass(frozen=True)
class Core:
    """The collaborators of every request: Redis, the registry and the engine, the tokenizer and its guard, the
    key authenticator, the rate limiter, adapter resolution and the token meter."""

    settings: CoreSettings
    redis: aioredis.Redis
    registry: AsyncRegistry
    engine: EngineClient
    tokenizer: PromptTokenizer
    guard: PromptGuard
    authenticator: KeyAuthenticator
    limiter: RateLimiter
    resolver: AdapterResolver
    meter: TokenMeter
    metrics_port: int | None = None  # where /metrics is served (apart from the API's port); None: nowhere
