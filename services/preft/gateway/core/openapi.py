"""The gateway's /openapi.json: FastAPI's, completed with what FastAPI cannot see.

- Request bodies: routes read JSON bodies through ``deps.JsonBody`` (its size limit and 400s), not as FastAPI body
  parameters, so each such dependency's model is added here as the operation's requestBody (multipart uploads
  declare theirs with `multipart_body`).
- Errors: every error answer is the error envelope (``errors``) and validation errors are 400s, not FastAPI's 422
  (dropped here). Routes declare the errors of their own work with `errors(...)`; added here are those of the
  Bearer scheme (a tenant's API key, on every operation but the probes: 401, 403 for a disabled tenant, 503 while
  Redis or the registry is down; the auth itself reads the Authorization header, ``core.auth``) and of a JSON body
  (400, 413).
- Success answers: each route declares its model (`response_model=`, documentation only: routes answer
  JSONResponse themselves) and, where it streams, `event_stream`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from preft.gateway.core.deps import JsonBody
from preft.gateway.core.registry import MANAGEMENT_ERRORS
from preft.gateway.core.response_models import ErrorResponse

BEARER = "TenantApiKey"
# The operations that take no API key.
UNAUTHENTICATED_PATHS = frozenset({"/healthz", "/readyz", "/healthz/deps"})
REF = "#/components/schemas/{model}"

ERROR_DESCRIPTIONS = {
    400: "The request is invalid: the message names the field",
    401: "No API key, or one that is unknown, revoked or expired",
    403: "The key's tenant is disabled",
    404: "No such object (or one of another tenant's: answered alike)",
    409: "The request conflicts with the object's state (a taken name, an alias on the version)",
    411: "An upload without a Content-Length",
    413: "The body, the prompt or the upload is larger than the server takes",
    429: "A rate limit, the monthly quota or a per-tenant limit is reached (Retry-After where waiting helps)",
    500: "The engine failed the generation",
    503: "A dependency (Redis, the registry, the engine, S3) is unavailable; retry (Retry-After)",
}
AUTH_ERRORS = (401, 403, 503)
JSON_BODY_ERRORS = (400, 413)
# A generation's own (beside its body's): no such model, a rate limit or the quota, the engine failing
GENERATION_ERRORS = (404, 429, 500)
# A registry management call's: its refusals pass through (``core.registry``)
REGISTRY_ERRORS = tuple(sorted({e.http_status for e in MANAGEMENT_ERRORS}))


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries: the error envelope for each status a route answers of its own work."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


def event_stream(what: str) -> dict[int | str, dict[str, Any]]:
    """A `responses=` entry: the 200 streamed as server-sent events (where the request asks for a stream). The
    schema is one event's, as OpenAPI 3.1 reads a text/event-stream schema: its `data` (JSON, or OpenAI's closing
    [DONE]; a stream that fails after its first byte ends with the error envelope) and the Responses events' name."""
    properties = {
        "event": {"type": "string", "description": "The Responses events' type"},
        "data": {"type": "string", "description": what},
    }
    schema = {"type": "object", "properties": properties, "required": ["data"], "additionalProperties": False}
    return {200: {"content": {"text/event-stream": {"schema": schema}}}}


def multipart_body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An `openapi_extra` with a multipart/form-data requestBody of these fields (uploads read their form
    themselves, after checking its size)."""
    schema = {"type": "object", "properties": properties, "required": required}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def _json_body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model of the route's JsonBody dependency, if it has one."""
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        if isinstance(dependant.call, JsonBody):
            return dependant.call.model
        pending.extend(dependant.dependencies)
    return None


def _add_schemas(schema: dict[str, Any], models: list[type[BaseModel]]) -> dict[type[BaseModel], dict[str, Any]]:
    """The models' request schemas added to the components (with those they use); a $ref to each."""
    refs, definitions = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    known = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.get("$defs", {}).items():
        if known.setdefault(name, definition) != definition:
            raise RuntimeError(f"two schemas named {name!r} in /openapi.json: rename one of the models")
    return {model: ref for (model, _), ref in refs.items()}


def _with_error(operation: dict[str, Any], status: int) -> None:
    schema = {"$ref": REF.format(model=ErrorResponse.__name__)}
    answer = {"description": ERROR_DESCRIPTIONS[status], "content": {"application/json": {"schema": schema}}}
    operation["responses"].setdefault(str(status), answer)


def completed(schema: dict[str, Any], routes: list[Any]) -> dict[str, Any]:
    """`schema` (FastAPI's) with the JSON request bodies, the Bearer scheme and the errors FastAPI cannot see, and
    without its 422s (see the module's docstring)."""
    api_routes = [r for r in routes if isinstance(r, APIRoute) and r.include_in_schema]
    bodies = [_json_body_model(route) for route in api_routes]
    refs = _add_schemas(schema, [ErrorResponse, *dict.fromkeys(m for m in bodies if m is not None)])
    components = schema["components"]
    for name in ("HTTPValidationError", "ValidationError"):
        components["schemas"].pop(name, None)
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key, sent as `Authorization: Bearer <key>`",
    }
    for route, body in zip(api_routes, bodies, strict=True):
        for method in route.methods:
            operation = schema["paths"][route.path_format][method.lower()]
            operation["responses"].pop("422", None)
            if body is not None:
                content = {"application/json": {"schema": refs[body]}}
                operation["requestBody"] = {"required": True, "content": content}
                for status in JSON_BODY_ERRORS:
                    _with_error(operation, status)
            if route.path_format not in UNAUTHENTICATED_PATHS:
                operation["security"] = [{BEARER: []}]
                for status in AUTH_ERRORS:
                    _with_error(operation, status)
            operation["responses"] = dict(sorted(operation["responses"].items()))
    return schema


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (and so /openapi.json) the completed schema, built once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes, tags=app.openapi_tags
            )
            app.openapi_schema = completed(schema, app.routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
