"""Per-request bookkeeping around the whole app: when a request arrived, the request counter by route, and what the
access log may show of a request."""

from __future__ import annotations

import logging
import time
from urllib.parse import unquote_plus

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from preft.common.metrics import GATEWAY_REQUESTS

STARTED_KEY = "preft_started_s"
ACCESS_LOGGER = "uvicorn.access"
# Query parameters whose values the access log shows (the API's paging and listing ones). Clients put keys in the
# query string too (`?api_key=...`): the names below are shown with their values redacted, any other parameter is
# redacted whole (its name could be a bare secret).
LOGGED_QUERY_PARAMS = frozenset({"after", "before", "limit", "order", "include", "include[]"})
SECRET_QUERY_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "token", "access_token", "secret"})
REDACTED = "[redacted]"


class RequestMetricsMiddleware:
    """Stamps each request's arrival time (for the gateway-overhead histogram) and counts answers by route
    template and status class (bounded labels: unknown paths count as "unmatched")."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[STARTED_KEY] = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            GATEWAY_REQUESTS.labels(route=route, status_class=f"{status // 100}xx").inc()


def started_s(request: Request) -> float:
    """perf_counter() when the request reached the gateway (now, if the middleware did not see it)."""
    return request.scope.get("state", {}).get(STARTED_KEY) or time.perf_counter()


def redacted_target(target: str) -> str:
    """A request target (path and query string) as the access log may show it: see LOGGED_QUERY_PARAMS."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    shown = []
    for pair in query.split("&"):
        name = unquote_plus(pair.partition("=")[0])
        if name in LOGGED_QUERY_PARAMS:
            shown.append(pair)
        else:
            shown.append(f"{name}={REDACTED}" if name.lower() in SECRET_QUERY_PARAMS else REDACTED)
    return f"{path}?{'&'.join(shown)}"


class QueryRedaction(logging.Filter):
    """Redacts query strings in access log records (uvicorn logs the request target as one of the record's
    arguments; headers, Authorization included, are never logged there)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                redacted_target(a) if isinstance(a, str) and a.startswith("/") else a for a in record.args
            )
        return True


def install_access_log_redaction() -> None:
    """Put QueryRedaction on uvicorn's access logger, once: a logger's filters see each of its records before any
    handler does, whichever logging configuration the server applies (uvicorn's own keeps existing filters)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QueryRedaction) for f in logger.filters):
        logger.addFilter(QueryRedaction())
