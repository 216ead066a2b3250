"""FastAPI dependencies: the app's collaborators, the caller, and JSON bodies read with a size limit.

Routes declare the caller before the body, so a request without a valid key gets 401 before its body is read.
Every dependency is `async def`: FastAPI runs plain functions in a thread pool, a thread hop per call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import redis.asyncio as aioredis
from fastapi import Depends, Query, Request
from pydantic import BaseModel, ValidationError

from preft.common.errors import InvalidArgument
from preft.gateway.auth import Caller, KeyAuthenticator
from preft.gateway.background import BackgroundRuns
from preft.gateway.batch_store import BatchStore
from preft.gateway.conversation_store import ConversationStore
from preft.gateway.errors import LengthRequired, PayloadTooLarge, validation_message
from preft.gateway.files import FileStore
from preft.gateway.generation import GenerationService
from preft.gateway.registry import AsyncRegistry
from preft.gateway.resolution import AdapterResolver
from preft.gateway.response_store import ResponseStore
from preft.gateway.responses import ResponsesBody, check_include
from preft.gateway.schemas import ChatBody, CompletionBody
from preft.gateway.settings import GatewaySettings
from preft.gateway.tokenization import PromptTokenizer

M = TypeVar("M", bound=BaseModel)


async def get_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


async def get_generation(request: Request) -> GenerationService:
    return request.app.state.generation


async def get_tokenizer(request: Request) -> PromptTokenizer:
    return request.app.state.tokenizer


async def get_registry(request: Request) -> AsyncRegistry:
    return request.app.state.registry


async def get_resolver(request: Request) -> AdapterResolver:
    return request.app.state.resolver


async def get_response_store(request: Request) -> ResponseStore:
    return request.app.state.response_store


async def get_background_runs(request: Request) -> BackgroundRuns:
    return request.app.state.background_runs


async def get_conversation_store(request: Request) -> ConversationStore:
    return request.app.state.conversation_store


def files_on(request: Request) -> None:
    """400 where the server has no bucket for files (and so runs no batches)."""
    if request.app.state.file_store is None:
        raise InvalidArgument("this server does not store files (no S3 bucket is configured for the gateway)")


async def get_file_store(request: Request) -> FileStore:
    files_on(request)
    return request.app.state.file_store


async def get_batch_store(request: Request) -> BatchStore:
    files_on(request)
    return request.app.state.batch_store


async def get_redis(request: Request) -> aioredis.Redis:
    return request.app.state.redis


async def get_caller(request: Request) -> Caller:
    authenticator: KeyAuthenticator = request.app.state.authenticator
    return await authenticator.authenticate(request.headers.get("authorization"))


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency reading the body (at most `max_request_bytes`, else 413) and validating it (else 400)."""

    async def read(request: Request) -> M:
        limit = request.app.state.settings.max_request_bytes
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
        return parsed_body(model, b"".join(parts))

    return read


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


@dataclass
class ItemPaging:
    """A page of a list of items: `limit` of them after the item `after`, newest first unless order=asc."""

    after: str | None = None
    limit: Annotated[int, Query(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"


async def check_included(request: Request) -> None:
    """`include` (as `include=` or, as the `openai` client sends it, `include[]=`) of a route listing Responses items:
    checked as a response's; the items are kept whole, so there is nothing more to add."""
    check_include(request.query_params.getlist("include") + request.query_params.getlist("include[]"))


SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
CallerDep = Annotated[Caller, Depends(get_caller)]
GenerationDep = Annotated[GenerationService, Depends(get_generation)]
TokenizerDep = Annotated[PromptTokenizer, Depends(get_tokenizer)]
RegistryDep = Annotated[AsyncRegistry, Depends(get_registry)]
ResolverDep = Annotated[AdapterResolver, Depends(get_resolver)]
RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]
CompletionBodyDep = Annotated[CompletionBody, Depends(json_body(CompletionBody))]
ChatBodyDep = Annotated[ChatBody, Depends(json_body(ChatBody))]
ResponseStoreDep = Annotated[ResponseStore, Depends(get_response_store)]
BackgroundRunsDep = Annotated[BackgroundRuns, Depends(get_background_runs)]
ConversationStoreDep = Annotated[ConversationStore, Depends(get_conversation_store)]
ResponsesBodyDep = Annotated[ResponsesBody, Depends(json_body(ResponsesBody))]
ItemPagingDep = Annotated[ItemPaging, Depends()]
FileStoreDep = Annotated[FileStore, Depends(get_file_store)]
BatchStoreDep = Annotated[BatchStore, Depends(get_batch_store)]
IncludeChecked = Depends(check_included)
