"""GET /healthz (the process answers), GET /readyz (Redis and the registry answer too) and GET /metrics (the
process's Prometheus metrics, declared in preft.common.metrics, in the text exposition format)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.responses import JSONResponse, Response

from preft.common.errors import PreftError
from preft.gateway.core.deps import RedisDep, RegistryDep, SettingsDep
from preft.gateway.core.redis_client import guarded

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(redis: RedisDep, registry: RegistryDep, settings: SettingsDep) -> JSONResponse:
    """200 when Redis and the registry both answer; 503 naming the ones that do not (a probe, not an API error)."""
    checks = {"redis": guarded(redis.ping(), settings.redis_timeout_s), "registry": registry.check()}
    results = await asyncio.gather(*checks.values(), return_exceptions=True)
    report = {}
    for name, result in zip(checks, results, strict=True):
        if isinstance(result, PreftError):
            report[name] = f"unavailable: {result.message}"
        elif isinstance(result, BaseException):
            raise result
        else:
            report[name] = "ok"
    ready = all(v == "ok" for v in report.values())
    return JSONResponse({"status": "ready" if ready else "unavailable", "checks": report}, 200 if ready else 503)


@router.get("/metrics", tags=["metrics"])
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
