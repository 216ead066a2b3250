"""The gateway application: `create_app(settings)` wires collaborators, routers, error handlers and metrics.

Collaborators (Redis client, registry client, engine client, tokenizer) are built in the lifespan from the
settings unless passed in; passed-in ones are used as they are and left open (their owner closes them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI

from preft.gateway import redis_client
from preft.gateway.auth import KeyAuthenticator
from preft.gateway.background import BackgroundRuns
from preft.gateway.batch_lines import LineAnswerer
from preft.gateway.batch_store import BatchStore
from preft.gateway.batches import BatchRunner
from preft.gateway.conversation_store import ConversationLimits, ConversationStore
from preft.gateway.engine_client import EngineClient
from preft.gateway.errors import install_error_handlers
from preft.gateway.file_sweeper import FileSweeper
from preft.gateway.files import FileStore
from preft.gateway.generation import GenerationService
from preft.gateway.limits import RateLimiter
from preft.gateway.metering import TokenMeter
from preft.gateway.object_store import ObjectStore
from preft.gateway.observability import RequestMetricsMiddleware, install_access_log_redaction
from preft.gateway.offline_slots import OfflineSlots
from preft.gateway.prompt_guard import PromptGuard
from preft.gateway.registry import AsyncRegistry
from preft.gateway.resolution import AdapterResolver
from preft.gateway.response_store import ResponseStore
from preft.gateway.routes import (
    adapters,
    batches,
    chat,
    completions,
    conversations,
    files,
    health,
    metrics,
    models,
    responses,
    shares,
    token_usage,
    tokenize,
)
from preft.gateway.settings import GatewaySettings
from preft.gateway.tokenization import PromptTokenizer
from preft.gateway.usage import UsageRecorder


def create_app(
    settings: GatewaySettings,
    *,
    engine_client: EngineClient | None = None,
    registry: AsyncRegistry | None = None,
    redis: aioredis.Redis | None = None,
    tokenizer: PromptTokenizer | None = None,
) -> FastAPI:
    """The gateway app; keyword arguments replace the collaborators the lifespan would build from `settings`."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
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
            usage_task = asyncio.create_task(usage.run(), name="preft-usage-recorder")
            stack.push_async_callback(_cancel, usage_task)
            meter = TokenMeter(
                r,
                interval_s=settings.metering_flush_interval_s,
                timeout_s=settings.redis_timeout_s,
                max_pending=settings.metering_max_pending,
            )
            meter_task = asyncio.create_task(meter.run(), name="preft-token-meter")
            stack.push_async_callback(_cancel, meter_task)
            resolver = AdapterResolver(
                reg,
                usage,
                base_model_name=settings.served_model_name,
                ttl_s=settings.resolve_cache_ttl_s,
                max_entries=settings.resolve_cache_max_entries,
                allow_mode_override=settings.allow_mode_override,
            )
            app.state.redis = r
            app.state.response_store = ResponseStore(
                r, ttl_s=settings.responses_store_ttl_s, timeout_s=settings.redis_timeout_s
            )
            app.state.conversation_store = ConversationStore(
                r,
                ttl_s=settings.responses_store_ttl_s,
                timeout_s=settings.redis_timeout_s,
                limits=ConversationLimits(
                    items=settings.conversations_max_items,
                    bytes=settings.conversations_max_bytes,
                    per_tenant=settings.conversations_max_per_tenant,
                ),
            )
            app.state.background_runs = BackgroundRuns(
                app.state.response_store, max_runs=settings.responses_background_max
            )
            stack.push_async_callback(app.state.background_runs.close)
            app.state.registry = reg
            app.state.tokenizer = tok
            app.state.resolver = resolver
            app.state.authenticator = KeyAuthenticator(
                r,
                ttl_s=settings.key_cache_ttl_s,
                max_entries=settings.key_cache_max_entries,
                redis_timeout_s=settings.redis_timeout_s,
            )
            guard = PromptGuard(tok, settings)
            stack.callback(guard.close)
            app.state.generation = GenerationService(
                settings,
                guard=guard,
                limiter=RateLimiter(
                    r,
                    redis_timeout_s=settings.redis_timeout_s,
                    reservation_lapse_s=settings.quota_reservation_lapse_s,
                    meter_interval_s=settings.metering_flush_interval_s,
                ),
                resolver=resolver,
                engine=engine,
                meter=meter,
            )
            app.state.file_store = app.state.batch_store = app.state.batch_runner = app.state.file_sweeper = None
            if settings.s3 is not None:
                _start_batches(app, settings, r, tok)
                stack.push_async_callback(app.state.file_sweeper.close)
                stack.push_async_callback(app.state.batch_runner.close)  # (first to close: its lines use the rest)
            yield

    app = FastAPI(
        title="preft-serve gateway",
        summary="OpenAI-compatible API over per-tenant adapters",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(RequestMetricsMiddleware)  # outermost: also counts the 500s of the error middleware
    install_access_log_redaction()  # (here, not in the server's main: whatever server runs the app logs no secrets)
    routers = (
        completions,
        chat,
        responses,
        conversations,
        files,
        batches,
        tokenize,
        models,
        adapters,
        shares,
        token_usage,
        health,
        metrics,
    )
    for module in routers:
        app.include_router(module.router)
    return app


def _start_batches(app: FastAPI, settings: GatewaySettings, redis: aioredis.Redis, tokenizer: PromptTokenizer) -> None:
    """The Files API's store, its sweeper of expired files and the batch runner, on the settings' S3 bucket."""
    assert settings.s3 is not None
    objects = ObjectStore(settings.s3)
    files = FileStore(redis, objects, timeout_s=settings.redis_timeout_s, max_per_tenant=settings.files_max_per_tenant)
    store = BatchStore(
        redis,
        timeout_s=settings.redis_timeout_s,
        keep_s=settings.batches_keep_s,
        max_open_per_tenant=settings.batches_max_open_per_tenant,
    )
    slots = OfflineSlots(
        redis,
        cap=settings.batches_max_lines_in_flight,
        lease_s=settings.batches_lease_s,
        poll_s=settings.batches_poll_s,
        timeout_s=settings.redis_timeout_s,
    )
    answerer = LineAnswerer(
        generation=app.state.generation,
        tokenizer=tokenizer,
        response_store=app.state.response_store,
        background_runs=app.state.background_runs,
        conversation_store=app.state.conversation_store,
        slots=slots,
    )
    runner = BatchRunner(
        store,
        files,
        objects,
        answerer,
        slots,
        max_running=settings.batches_max_running,
        max_running_per_tenant=settings.batches_max_running_per_tenant,
        line_concurrency=settings.batches_line_concurrency,
        lease_s=settings.batches_lease_s,
        poll_s=settings.batches_poll_s,
        max_requests=settings.batches_max_requests,
        part_lines=settings.batches_part_lines,
        part_s=settings.batches_part_s,
        compact_parts=settings.batches_compact_parts,
    )
    app.state.file_store, app.state.batch_store, app.state.batch_runner = files, store, runner
    app.state.file_sweeper = FileSweeper(files, period_s=settings.files_sweep_period_s)
    runner.start()
    app.state.file_sweeper.start()


def _load_tokenizer(settings: GatewaySettings) -> PromptTokenizer:
    path = settings.tokenizer_path
    if path is None:
        raise RuntimeError("set PREFT_GATEWAY__MODEL_DIR or PREFT_GATEWAY__TOKENIZER_DIR (the base model's tokenizer)")
    return PromptTokenizer.load(path)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
