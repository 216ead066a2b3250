"""OpenAI's Batch API: a file of requests answered offline, within a completion window (``batches.runner`` runs them).

    POST /v1/batches               {"input_file_id", "endpoint", "completion_window": "24h", "metadata",
                                    "output_expires_after": {"anchor": "created_at", "seconds": 3600-2592000}}
    GET  /v1/batches               after (a batch id), limit (1-100, default 20): newest first
    GET  /v1/batches/{id}
    POST /v1/batches/{id}/cancel   the batch, cancelling (cancelled once its runner stopped it)

The endpoint is /v1/chat/completions, /v1/completions or /v1/responses; the input file must be one of the tenant's
of purpose `batch`. `output_expires_after` makes the batch's output and error files expire that long after they
are written (without it they stay until deleted). A tenant with `batches_max_open_per_tenant` batches not ended yet
is answered 429 (nothing stored). Another tenant's batch (or file) answers 404, as one that does not exist.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.responses import JSONResponse

from preft.common.errors import InvalidArgument
from preft.common.metrics import BATCHES_CREATED
from preft.gateway.batches.deps import BatchesDep, BatchRunnerDep, BatchStoreDep
from preft.gateway.batches.response_models import Batch, BatchList
from preft.gateway.core.deps import CallerDep, json_body
from preft.gateway.core.openapi import errors
from preft.gateway.core.pages import Metadata, item_list
from preft.gateway.files.deps import FileStoreDep
from preft.gateway.files.store import EXPIRES_AFTER_S

router = APIRouter(tags=["batches"])


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = Field(description="The file's creation (the only anchor)")
    seconds: StrictInt = Field(ge=EXPIRES_AFTER_S[0], le=EXPIRES_AFTER_S[1])


class NewBatch(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"input_file_id": "file-abc123", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            ]
        },
    )

    input_file_id: str = Field(min_length=1, max_length=128, description="A file of purpose batch")
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None


# Every Batch route answers 400 where the gateway has no bucket for files (as the Files routes).
@router.post("/v1/batches", response_model=Batch, responses=errors(404, 429))
async def create_batch(
    caller: CallerDep,
    body: Annotated[NewBatch, Depends(json_body(NewBatch))],
    files: FileStoreDep,
    batches: BatchesDep,
) -> JSONResponse:
    input_file = await files.get(caller.tenant, body.input_file_id)
    if input_file["purpose"] != "batch":
        raise InvalidArgument(
            f"input_file_id: {body.input_file_id} has purpose {input_file['purpose']!r}; upload the requests with "
            "purpose batch"
        )
    now = time.time()
    deadline_s = now + batches.settings.batches_completion_window_s
    spec = {
        "id": f"batch_{uuid.uuid4().hex}",
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "created_at": int(now),
        "expires_at": int(deadline_s),
        "deadline_s": deadline_s,
        "metadata": body.metadata or {},
        "output_expires_after_s": body.output_expires_after.seconds if body.output_expires_after else None,
        "key_id": caller.key_id,
    }
    batch = await batches.store.create(caller.tenant, spec)
    BATCHES_CREATED.inc()
    batches.runner.wake()
    return JSONResponse(batch.as_object())


@router.get("/v1/batches", response_model=BatchList, responses=errors(400))
async def list_batches(
    caller: CallerDep,
    store: BatchStoreDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JSONResponse:
    page = await store.page(caller.tenant, after=after, limit=limit)
    return JSONResponse(item_list([batch.as_object() for batch in page.batches], has_more=page.has_more))


@router.get("/v1/batches/{batch_id}", response_model=Batch, responses=errors(400, 404))
async def retrieve_batch(batch_id: str, caller: CallerDep, store: BatchStoreDep) -> JSONResponse:
    return JSONResponse((await store.get(caller.tenant, batch_id)).as_object())


@router.post("/v1/batches/{batch_id}/cancel", response_model=Batch, responses=errors(400, 404))
async def cancel_batch(batch_id: str, caller: CallerDep, store: BatchStoreDep, runner: BatchRunnerDep) -> JSONResponse:
    """Ask for the batch to stop (whichever replica runs it stops it within its poll); the batch as it then
    stands: cancelling (an ended one, as it ended)."""
    await store.cancel(caller.tenant, batch_id)
    runner.wake()
    return JSONResponse((await store.get(caller.tenant, batch_id)).as_object())
