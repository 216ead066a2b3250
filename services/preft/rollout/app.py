"""The rollout server's HTTP app: TRL's vLLM server protocol (`preft.common.rollout_contract`) over a
RolloutService.

The one boundary where domain errors become statuses, as vLLM's server answers them: 400 for a bad request or bad
weights, 404 for another model or adapter, 409 for a call out of order (a finish without a start, NCCL calls on a
server that takes HTTP updates), 503 when the engine is down. TRL's client retries 500/502/503 only, so a refused
update fails at once with the server's message.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from preft.common.errors import InvalidArgument, PreftError
from preft.common.rollout_contract import (
    HTTP_UPDATE_PATH,
    SAFETENSORS_MEDIA_TYPE,
    CompletionsRequest,
    ErrorBody,
    InitRequest,
    UpdateAnswer,
    UpdateRequest,
)
from preft.rollout.service import RolloutService
from preft.rollout.staging import read_safetensors

logger = logging.getLogger(__name__)


def get_service(request: Request) -> RolloutService:
    return request.app.state.service


ServiceDep = Annotated[RolloutService, Depends(get_service)]


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(ErrorBody(message=message, type=kind, code=status).model_dump(), status_code=status)


def create_app(service: RolloutService, *, manage_lifespan: bool = True) -> FastAPI:
    """The app over `service`; with `manage_lifespan` it starts the service (engine, adapter) on startup and shuts
    it down on exit."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifespan:
            await service.start()
        try:
            yield
        finally:
            if manage_lifespan:
                await service.shutdown()

    app = FastAPI(title="preft rollout server", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(PreftError)
    async def _domain_error(_: Request, e: PreftError) -> JSONResponse:
        if e.http_status >= 500:
            logger.warning("rollout server: %s", e.message)
        return _error(e.http_status, type(e).__name__, e.message)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))
        return _error(400, "BadRequestError", message)

    @app.get("/health")
    async def health(svc: ServiceDep) -> JSONResponse:
        await svc.check_health()
        return JSONResponse({})

    @app.get("/v1/models")
    async def models(svc: ServiceDep) -> dict[str, Any]:
        card = {"id": svc.adapter.name, "object": "model", "owned_by": "preft", "root": svc.adapter.name}
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    async def server_info(svc: ServiceDep) -> dict[str, Any]:
        return {"vllm_config": svc.server_info()}

    @app.get("/get_world_size")
    async def world_size() -> dict[str, int]:
        return {"world_size": 1}  # (the one process that receives updates; the trainer is rank 0 beside it)

    @app.post("/v1/completions")
    async def completions(body: CompletionsRequest, svc: ServiceDep) -> dict[str, Any]:
        return await svc.complete(body)

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer(body: InitRequest, svc: ServiceDep) -> dict[str, Any]:
        await svc.init_nccl(body.init_info)
        return {}

    @app.post("/start_weight_update")
    async def start_weight_update(svc: ServiceDep) -> dict[str, Any]:
        svc.start_update()
        return {}

    @app.post("/update_weights")
    async def update_weights(body: UpdateRequest, svc: ServiceDep) -> dict[str, Any]:
        await svc.receive_nccl(body.update_info)
        return {}

    @app.post(HTTP_UPDATE_PATH)
    async def update_weights_http(request: Request, svc: ServiceDep, adapter: str | None = None) -> JSONResponse:
        svc.require_http()
        svc.check_adapter(adapter)
        kind = request.headers.get("content-type", "")
        if kind.split(";")[0].strip() not in (SAFETENSORS_MEDIA_TYPE, "application/octet-stream"):
            raise InvalidArgument(f"the body must be a safetensors file ({SAFETENSORS_MEDIA_TYPE}), not {kind!r}")
        try:
            body = await request.body()
        except ClientDisconnect:  # (the trainer went away mid-body: nothing of this update is staged)
            svc.staging.abandon("the trainer disconnected while sending tensors")
            logger.warning("a trainer disconnected while sending a weight update; the served weights are unchanged")
            return _error(400, "ClientDisconnect", "disconnected")
        try:
            tensors = read_safetensors(body)
        except InvalidArgument as e:
            svc.staging.abandon(e.message)
            raise
        svc.stage(tensors)
        return JSONResponse({"staged": len(tensors)})

    @app.post("/finish_weight_update")
    async def finish_weight_update(svc: ServiceDep) -> UpdateAnswer:
        return await svc.finish_update()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        # Nothing to drop: the engine keys cached prompt KV by the adapter's weight version, which every update bumps.
        return {"success": True}

    return app
