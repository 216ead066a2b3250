"""FastAPI dependencies of every sub-package: the core's collaborators, the caller, and JSON bodies read with a size
limit.

Routes declare the caller before the body, so a request without a valid key gets 401 before its body is read.
Every dependency is `async def`: FastAPI runs plain functions in a thread pool, a thread hop per call.
"""

from __future__ import annotations

from typing import Annotated, Generic, TypeVar

import redis.asyncio as aioredis
from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from preft.common.errors import InvalidArgument
from preft.gateway.core.auth import Caller
from preft.gateway.core.collaborators import Core
from preft.gateway.core.errors import LengthRequired, PayloadTooLarge, validation_message
from preft.gateway.core.limits import RateLimiter
from preft.gateway.core.prompt_guard import PromptGuard
from preft.gateway.core.registry import AsyncRegistry
from preft.gateway.core.resolution import AdapterResolver
from preft.gateway.core.settings import CoreSettings
from preft.gateway.core.tokenization import PromptTokenizer

M = TypeVar("M", bound=BaseModel)


async def get_core(request: Request) -> Core:
    return request.app.state.core


CoreDep = Annotated[Core, Depends(get_core)]


async def get_settings(core: CoreDep) -> CoreSettings:
    return core.settings


async def get_tokenizer(core: CoreDep) -> PromptTokenizer:
    return core.tokenizer


async def get_registry(core: CoreDep) -> AsyncRegistry:
    return core.registry


async def get_resolver(core: CoreDep) -> AdapterResolver:
    return core.resolver


async def get_redis(core: CoreDep) -> aioredis.Redis:
    return core.redis


async def get_limiter(core: CoreDep) -> RateLimiter:
    return core.limiter


async def get_guard(core: CoreDep) -> PromptGuard:
    return core.guard


async def get_caller(request: Request, core: CoreDep) -> Caller:
    return await core.authenticator.authenticate(request.headers.get("authorization"))


class JsonBody(Generic[M]):
    """A dependency reading the body (at most `max_request_bytes`, else 413) and validating it as `model` (else 400).

    It reads the body itself, so FastAPI does not see a body parameter: ``core.openapi`` finds these dependencies
    and documents `model` as the operation's request body.
    """

    def __init__(self, model: type[M]) -> None:
        self.model = model

    async def __call__(self, request: Request, core: CoreDep) -> M:
        limit = core.settings.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
            parts.append(part)
        if not size:
            raise InvalidArgument("the request has no body; send a JSON object")
        return parsed_body(self.model, b"".join(parts))


def json_body(model: type[M]) -> JsonBody[M]:
    """The dependency that reads a route's JSON body as `model` (``JsonBody``)."""
    return JsonBody(model)


def check_multipart_upload(request: Request, *, max_bytes: int, too_large: str, not_multipart: str) -> None:
    """Refuse an upload before its body is read: 411 without a Content-Length, 413 (`too_large`) past `max_bytes`,
    400 (`not_multipart`) where it is not multipart/form-data."""
    declared = request.headers.get("content-length", "")
    if not declared.isdigit():
        raise LengthRequired("send the upload with a Content-Length header")
    if int(declared) > max_bytes:
        raise PayloadTooLarge(too_large)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidArgument(not_multipart)


def parsed_body(model: type[M], data: bytes | str) -> M:
    """A JSON body validated as `model` (else 400 naming the fields): as json_body reads a request's, and a batch a
    line's."""
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        raise InvalidArgument(validation_message(e.errors(include_input=False))) from None


SettingsDep = Annotated[CoreSettings, Depends(get_settings)]
CallerDep = Annotated[Caller, Depends(get_caller)]
TokenizerDep = Annotated[PromptTokenizer, Depends(get_tokenizer)]
RegistryDep = Annotated[AsyncRegistry, Depends(get_registry)]
ResolverDep = Annotated[AdapterResolver, Depends(get_resolver)]
RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]
LimiterDep = Annotated[RateLimiter, Depends(get_limiter)]
GuardDep = Annotated[PromptGuard, Depends(get_guard)]
