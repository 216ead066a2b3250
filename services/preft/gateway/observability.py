"""Per-request bookkeeping around the whole app: when a request arrived, and the request counter by route."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from preft.common.metrics import GATEWAY_REQUESTS

STARTED_KEY = "preft_started_s"


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
