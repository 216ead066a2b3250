"""The engine replica's HTTP API (see `contract`): POST /generate (the gateway's token required), GET /healthz,
GET /metrics.

This is the engine's one boundary where domain errors become HTTP statuses (EngineError bodies): 400 invalid, 503
unavailable or draining (the gateway may retry elsewhere), 500 a bug.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from preft.common.engine_contract import (
    AUTH_HEADER,
    BASE_MODEL_ID,
    MULTIPLEX_HEADER,
    AdapterSpec,
    EngineChunk,
    EngineError,
    EngineRequest,
    bearer,
)
from preft.common.errors import InvalidArgument, PreftError, ResourceExhausted, Unauthenticated, Unavailable
from preft.engine.service import EngineService

logger = logging.getLogger(__name__)

# Called with the multiplexed model id and the adapter before a request runs: the Serve deployment registers the id
# with Serve's multiplexing (routing affinity) and pages the adapter in there.
AdapterHook = Callable[[str, AdapterSpec | None], Awaitable[None]]
NDJSON = "application/x-ndjson"


def get_service(request: Request) -> EngineService:
    return request.app.state.service


ServiceDep = Annotated[EngineService, Depends(get_service)]


def require_token(token: str) -> Callable[[Request], None]:
    """A dependency that refuses (401) a request whose authorization header does not carry `token`."""
    expected = bearer(token).encode()

    def check(request: Request) -> None:
        sent = request.headers.get(AUTH_HEADER, "").encode()
        if not hmac.compare_digest(sent, expected):  # (constant time: the comparison must not leak a prefix)
            raise Unauthenticated("missing or wrong engine token")

    return check


def error_body(e: BaseException) -> tuple[int, EngineError]:
    """The HTTP status and body of an error (the contract's three kinds, and 401 for a caller without the token)."""
    if isinstance(e, Unauthenticated):
        return 401, EngineError(type="unauthenticated", message=e.message)
    if isinstance(e, Unavailable | ResourceExhausted):
        return 503, EngineError(type="unavailable", message=e.message)
    if isinstance(e, PreftError) and 400 <= e.http_status < 500:
        return 400, EngineError(type="invalid_request", message=e.message)
    return 500, EngineError(type="internal", message="internal error in the engine replica")


def _error_response(e: BaseException) -> JSONResponse:
    status, body = error_body(e)
    if status == 500:
        logger.error("engine request failed", exc_info=e)
    return JSONResponse(body.model_dump(), status_code=status)


def create_app(service: EngineService, *, token: str, on_adapter: AdapterHook | None = None) -> FastAPI:
    """The HTTP app of one replica, over its EngineService; /generate answers only callers sending `token`."""
    if not token:
        raise ValueError("the engine token must be non-empty")
    app = FastAPI(title="preft engine replica", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(PreftError)
    async def _domain_error(_: Request, e: PreftError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))
        return JSONResponse(EngineError(type="invalid_request", message=message).model_dump(), status_code=400)

    @app.post("/generate", dependencies=[Depends(require_token(token))])
    async def generate(body: EngineRequest, request: Request, svc: ServiceDep) -> Response:
        expected = body.adapter.digest if body.adapter is not None else BASE_MODEL_ID
        model_id = request.headers.get(MULTIPLEX_HEADER) or request.headers.get(MULTIPLEX_HEADER.replace("_", "-"))
        if model_id is not None and model_id != expected:
            raise InvalidArgument(f"header {MULTIPLEX_HEADER} is {model_id!r} but the body asks for {expected!r}")
        if svc.draining:
            raise Unavailable("this replica is shutting down; retry on another")
        try:
            if on_adapter is not None:
                await on_adapter(expected, body.adapter)
            if not body.stream:
                return JSONResponse((await svc.complete(body)).model_dump())
            chunks = await svc.stream(body)  # errors before the first chunk still become a status
        except Exception as e:  # answered here: an exception escaping the app would be re-raised to the server
            return _error_response(e)
        return StreamingResponse(_ndjson(chunks), media_type=NDJSON)

    @app.get("/healthz")
    async def healthz(svc: ServiceDep) -> JSONResponse:
        if svc.draining:
            raise Unavailable("draining")
        await svc.check_health()
        return JSONResponse(
            {
                "status": "ok",
                "in_flight": svc.in_flight,
                "engine_start_s": svc.start_seconds,
                "host_adapters": len(svc.pager.resident("host")),
                "disk_adapters": len(svc.pager.resident("disk")),
            }
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


async def _ndjson(chunks: AsyncIterator[EngineChunk]) -> AsyncIterator[bytes]:
    """Chunks as JSON lines. An error after the first line can no longer change the status: it is sent as a last
    line holding an EngineError (no finish_reason), and the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk.model_dump_json().encode() + b"\n"
    except PreftError as e:
        _, body = error_body(e)
        yield body.model_dump_json().encode() + b"\n"
    except Exception as e:
        logger.error("engine stream failed", exc_info=e)
        _, body = error_body(e)
        yield body.model_dump_json().encode() + b"\n"
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
