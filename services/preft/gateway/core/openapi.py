"""The gateway's /openapi.json: FastAPI's, plus the Bearer scheme (a tenant's API key) on every operation that takes
one, that is all but the probes (the auth itself reads the Authorization header: see core.auth)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

BEARER = "TenantApiKey"
# The operations that take no API key.
UNAUTHENTICATED_PATHS = frozenset({"/healthz", "/readyz", "/healthz/deps"})


def with_bearer_scheme(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with the Bearer security scheme declared and required by every operation outside the probes."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key, sent as `Authorization: Bearer <key>`",
    }
    for path, operations in schema.get("paths", {}).items():
        if path in UNAUTHENTICATED_PATHS:
            continue
        for operation in operations.values():
            if isinstance(operation, dict):
                operation["security"] = [{BEARER: []}]
    return schema


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (and so /openapi.json) the schema with the Bearer scheme, built once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes, tags=app.openapi_tags
            )
            app.openapi_schema = with_bearer_scheme(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
