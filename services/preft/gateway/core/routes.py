"""GET /healthz (the process answers), GET /readyz (the process is up and wired: it depends on nothing outside it),
and GET /healthz/deps (Redis, the registry and the engine answer). The Prometheus metrics are not here: they have a
listener of their own (`CoreSettings.metrics_address`).

/readyz leaves dependencies out on purpose: every gateway pod shares them, so a Redis or registry blip would take all
pods out of their Service at once (no pod left to answer even the requests that need neither, as the base model's
without a quota); the requests that need one answer 503 with Retry-After while it is down. Dependency health is for
dashboards and operators, on /healthz/deps."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse

from preft.common.errors import PreftError, Unavailable
from preft.gateway.core.deps import CoreDep, RedisDep, RegistryDep, SettingsDep
from preft.gateway.core.redis_client import guarded
from preft.gateway.core.response_models import DependencyHealth, Liveness, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Liveness)
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz", response_model=Readiness)
async def readyz(core: CoreDep) -> JSONResponse:
    """200 once the process is wired (its collaborators made: resolving them is the check), whatever its
    dependencies' state (see the module's docstring)."""
    return JSONResponse({"status": "ready"})


async def _engine_check(core: Any, timeout_s: float) -> None:
    health = getattr(core.engine, "health", None)  # (a test's fake engine may have none)
    if health is not None and not await health.check(timeout_s):
        raise Unavailable(f"no answer to its health check within {timeout_s:g} s")


@router.get(
    "/healthz/deps",
    response_model=DependencyHealth,
    responses={503: {"model": DependencyHealth, "description": "Some dependency does not answer"}},
)
async def healthz_deps(core: CoreDep, redis: RedisDep, registry: RegistryDep, settings: SettingsDep) -> JSONResponse:
    """200 when Redis, the registry and the engine all answer; 503 naming the ones that do not (not an API error)."""
    checks = {
        "redis": guarded(redis.ping(), settings.redis_timeout_s),
        "registry": registry.check(),
        "engine": _engine_check(core, settings.engine_unresponsive_s),
    }
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
