"""Where errors become HTTP, and the gateway's own members of the domain error tree.

Every error answer has OpenAI's shape, `{"error": {"message", "type", "code"}}`, so the official clients raise
their usual exceptions. Domain errors (PreftError) take their `http_status`; request validation errors become 400
(not FastAPI's 422); routing errors keep their status; anything unexpected becomes a generic 500, logged here once
with its traceback and never shown to the caller. Messages never contain API keys or prompt text.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from preft.common.errors import (
    InvalidArgument,
    NotFound,
    PreftError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from preft.common.metrics import GATEWAY_ERRORS

log = logging.getLogger(__name__)

# OpenAI's error `type`s, as its API answers them: a client error of any status (a wrong key, an unknown model, a
# missing file included) is an `invalid_request_error` (its `code` says which: invalid_api_key, model_not_found, ...);
# a rate limit's type names the bucket that ran out (`requests` or `tokens`), a used-up quota's is
# `insufficient_quota`; anything on our side is a `server_error`. Our own `code`s stay as they are.
CLIENT_ERROR_TYPE = "invalid_request_error"
RATE_LIMIT_TYPE = "requests"
SERVER_ERROR_TYPE = "server_error"


def error_type_of(status: int) -> str:
    """OpenAI's `type` for an error answered with `status` (where the error itself names none)."""
    if status == 429:
        return RATE_LIMIT_TYPE
    return SERVER_ERROR_TYPE if status >= 500 else CLIENT_ERROR_TYPE


# -- the gateway's members of the error tree ---------------------------------------------------------------------


class ModelNotFound(NotFound):
    """The `model` names nothing this tenant may use. The body is the same whether or not it exists elsewhere."""

    code: ClassVar[str] = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model {model!r} does not exist or you do not have access to it.")


class InvalidApiKey(Unauthenticated):
    code: ClassVar[str] = "invalid_api_key"


class LengthRequired(InvalidArgument):
    """An upload without a Content-Length (its size is checked before it is read)."""

    http_status = 411
    code: ClassVar[str] = "length_required"


class PayloadTooLarge(InvalidArgument):
    """The prompt or the request body is longer than the gateway accepts."""

    http_status = 413
    code: ClassVar[str] = "payload_too_large"


class RateLimited(ResourceExhausted):
    """A tenant's requests/min or tokens/min bucket is empty; `retry_after_s` is None when waiting cannot help."""

    code: ClassVar[str] = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float | None, bucket: str = RATE_LIMIT_TYPE) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.error_type = bucket  # OpenAI's type for it: the bucket that ran out, "requests" or "tokens"


class QuotaExceeded(ResourceExhausted):
    """A tenant has used its monthly token quota: waiting for the next minute does not help (no Retry-After)."""

    code: ClassVar[str] = "insufficient_quota"
    error_type: ClassVar[str] = "insufficient_quota"  # (OpenAI's type for it; a rate limit's is its bucket)


def error_code(exc: PreftError) -> str:
    """A short, bounded reason: the class's `code`, else its name in snake case (also the metrics label)."""
    code = getattr(exc, "code", None)
    return code or re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()


def error_body(status: int, message: str, code: str, error_type: str | None = None) -> dict[str, Any]:
    kind = error_type or error_type_of(status)
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def error_response(
    status: int, message: str, code: str, headers: dict[str, str] | None = None, error_type: str | None = None
) -> JSONResponse:
    GATEWAY_ERRORS.labels(status=str(status), reason=code).inc()
    return JSONResponse(error_body(status, message, code, error_type), status_code=status, headers=headers)


def preft_error_response(exc: PreftError) -> JSONResponse:
    """The HTTP answer for a domain error (also used for errors that happen inside a stream, see sse_error)."""
    status, code = exc.http_status, error_code(exc)
    if status >= 500:
        cause = exc.__cause__
        log.warning("answering %d %s: %s%s", status, code, exc.message, f" (cause: {cause!r})" if cause else "")
    headers = None
    if isinstance(exc, RateLimited) and exc.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    elif isinstance(exc, Unavailable):
        headers = {"Retry-After": "1"}  # outages here are retried or recovered from within about a second
    return error_response(status, exc.message, code, headers, getattr(exc, "error_type", None))


def sse_error(exc: BaseException) -> bytes:
    """The SSE event that ends a stream which failed after its first byte (OpenAI clients raise APIError on it)."""
    if isinstance(exc, PreftError):
        status, message, code = exc.http_status, exc.message, error_code(exc)
        if status >= 500:
            log.warning("stream ended by %d %s: %s (cause: %r)", status, code, message, exc.__cause__)
    else:
        log.error("stream failed", exc_info=exc)
        status, message, code = 500, "internal gateway error", "internal_error"
    GATEWAY_ERRORS.labels(status=str(status), reason=code).inc()
    return f"data: {json.dumps(error_body(status, message, code, getattr(exc, 'error_type', None)))}\n\n".encode()


def validation_message(errors: list[Any]) -> str:
    """One line from pydantic/FastAPI validation errors, naming the fields (body values are not echoed)."""
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "invalid request: " + "; ".join(parts)


# -- handlers ----------------------------------------------------------------------------------------------------


async def _on_preft_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PreftError)
    return preft_error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(400, validation_message(list(exc.errors())), "invalid_request")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail), f"http_{exc.status_code}", exc.headers)


class UnhandledErrorMiddleware:
    """Turns any exception that escaped the handlers into a generic 500 and logs it once (the traceback stays here).

    It does not re-raise (as Starlette's ServerErrorMiddleware does), so the server does not log it a second time.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(500, "internal gateway error", "internal_error")(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(PreftError, _on_preft_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_middleware(UnhandledErrorMiddleware)
