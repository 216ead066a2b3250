"""The core's wiring: the collaborators every sub-package uses, built in the app's lifespan (`start`), and what the
core adds to the app (`wire`: error handlers, request metrics, health routes); /metrics is served on a listener of
its own (`metrics_address`), never on the API's port.

Collaborators passed in (Redis client, registry client, engine client, tokenizer) are used as they are and left
open (their owner closes them); those built here close with the lifespan's exit stack.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI

from preft.common.metrics_http import MetricsListener, serve_metrics
from preft.gateway.core import redis_client, routes
from preft.gateway.core.auth import KeyAuthenticator
from preft.gateway.core.collaborators import Core
from preft.gateway.core.engine_client import EngineClient
from preft.gateway.core.errors import install_error_handlers
from preft.gateway.core.limits import RateLimiter
from preft.gateway.core.metering import TokenMeter
from preft.gateway.core.observability import RequestMetricsMiddleware, install_access_log_redaction
from preft.gateway.core.openapi import install_openapi
from preft.gateway.core.prompt_guard import PromptGuard
from preft.gateway.core.registry import AsyncRegistry
from preft.gateway.core.resolution import AdapterResolver
from preft.gateway.core.settings import CoreSettings
from preft.gateway.core.tokenization import PromptTokenizer
from preft.gateway.core.usage import UsageRecorder


def wire(app: FastAPI) -> None:
    """Error handlers, request metrics (outermost: they also count the error middleware's 500s), secrets kept out
    of the access log (here, not in the server's main: whatever server runs the app logs none), the health probes
    (the metrics have a listener of their own: `start`)."""
    install_error_handlers(app)
    app.add_middleware(RequestMetricsMiddleware)
    install_access_log_redaction()
    app.include_router(routes.router)
    install_openapi(app)


async def start(
    stack: contextlib.AsyncExitStack,
    settings: CoreSettings,
    *,
    engine_client: EngineClient | None = None,
    registry: AsyncRegistry | None = None,
    redis: aioredis.Redis | None = None,
    tokenizer: PromptTokenizer | None = None,
) -> Core:
    """The core's collaborators, those not passed in built from `settings`; the background flushes started."""
    tok = tokenizer or _load_tokenizer(settings)
    r = redis
    if r is None:
        r = redis_client.connect(settings.redis, settings.redis_timeout_s)
        stack.push_async_callback(r.aclose)
    reg = registry
    if reg is None:
        reg = AsyncRegistry(
            settings.registry_address,
            settings.registry_token.get_secret_value(),
            timeout_s=settings.registry_timeout_s,
            upload_timeout_s=settings.registry_upload_timeout_s,
        )
        stack.push_async_callback(reg.close)
    engine = engine_client
    if engine is None:
        engine = EngineClient(
            settings.engine_url,
            token=settings.engine_token.get_secret_value(),
            connect_timeout_s=settings.engine_connect_timeout_s,
            read_timeout_s=settings.engine_read_timeout_s,
            max_connections=settings.engine_max_connections,
            unresponsive_s=settings.engine_unresponsive_s,
        )
        stack.push_async_callback(engine.aclose)
    usage = UsageRecorder(reg, interval_s=settings.usage_flush_interval_s)
    _run_in_background(stack, usage.run(), "preft-usage-recorder")
    meter = TokenMeter(
        r,
        interval_s=settings.metering_flush_interval_s,
        timeout_s=settings.redis_timeout_s,
        max_pending=settings.metering_max_pending,
    )
    _run_in_background(stack, meter.run(), "preft-token-meter")
    guard = PromptGuard(tok, settings)
    stack.callback(guard.close)
    metrics_listener = _serve_metrics(stack, settings.metrics_address)
    return Core(
        settings=settings,
        redis=r,
        registry=reg,
        engine=engine,
        tokenizer=tok,
        guard=guard,
        authenticator=KeyAuthenticator(
            r,
            ttl_s=settings.key_cache_ttl_s,
            max_entries=settings.key_cache_max_entries,
            redis_timeout_s=settings.redis_timeout_s,
        ),
        limiter=RateLimiter(
            r,
            redis_timeout_s=settings.redis_timeout_s,
            reservation_lapse_s=settings.quota_reservation_lapse_s,
            meter_interval_s=settings.metering_flush_interval_s,
        ),
        resolver=AdapterResolver(
            reg,
            usage,
            is_base_model=settings.is_base_model,
            ttl_s=settings.resolve_cache_ttl_s,
            max_entries=settings.resolve_cache_max_entries,
            allow_mode_override=settings.allow_mode_override,
        ),
        meter=meter,
        metrics_port=metrics_listener.port if metrics_listener else None,
    )


def _serve_metrics(stack: contextlib.AsyncExitStack, address: str) -> MetricsListener | None:
    """The /metrics listener at `address` (none where it is empty), closed with the lifespan."""
    if not address:
        return None
    listener = serve_metrics(address)
    stack.callback(listener.close)
    return listener


def _load_tokenizer(settings: CoreSettings) -> PromptTokenizer:
    path = settings.tokenizer_path
    if path is None:
        raise RuntimeError("set PREFT_GATEWAY__MODEL_DIR or PREFT_GATEWAY__TOKENIZER_DIR (the base model's tokenizer)")
    return PromptTokenizer.load(path)


def _run_in_background(stack: contextlib.AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
    """Run `work` as a task until the lifespan ends (then cancelled: the flushers send what they hold once more)."""
    task = asyncio.create_task(work, name=name)

    async def cancel() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    stack.push_async_callback(cancel)
