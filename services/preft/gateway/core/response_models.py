"""The shapes the core answers, for /openapi.json: the error envelope every route answers its errors in, the probes'
bodies, and a page of a list. Routes build their answers as dicts (the hot path validates nothing twice); these
models only document them, and the conformance test (tests/e2e/test_openapi_conformance.py) holds the two together.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


class Documented(BaseModel):
    """An answer's shape: closed (a key the code adds and the model lacks fails the conformance test)."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(Documented):
    message: str = Field(description="What went wrong, safe to show (never a key or prompt text)")
    type: str = Field(
        description="OpenAI's error type: invalid_request_error (any client error), requests or tokens (the rate "
        "limit bucket that ran out), insufficient_quota, server_error"
    )
    code: str = Field(description="A short, stable reason: invalid_api_key, model_not_found, ...")
    param: None = Field(description="Always null here: the message names the field")


class ErrorResponse(Documented):
    """OpenAI's error envelope: every 4xx and 5xx answer of the API routes."""

    error: ErrorDetail


class Liveness(Documented):
    status: Literal["ok"]


class Readiness(Documented):
    status: Literal["ready"]


class DependencyHealth(Documented):
    """/healthz/deps: each dependency "ok" or "unavailable: <why>" (a 503 names the ones down)."""

    status: Literal["ready", "unavailable"]
    checks: dict[str, str] = Field(description="redis, registry, engine: ok or why not")


class ItemList(Documented, Generic[T]):
    """A page of a list (``core.pages.item_list``): `first_id`/`last_id` are null on an empty page."""

    object: Literal["list"]
    data: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool
