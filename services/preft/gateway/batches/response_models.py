"""What the Batch routes answer, for /openapi.json (``core.response_models`` says why models only document answers
the routes build as dicts)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from preft.gateway.core.response_models import Documented, ItemList
from preft.gateway.responses.response_models import ResponseUsage


class BatchError(Documented):
    code: str
    message: str
    param: str | None
    line: int | None = Field(description="The input file's line (1-based), where one is to blame")


class BatchErrors(Documented):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(Documented):
    total: int
    completed: int
    failed: int


class Batch(Documented):
    """OpenAI's batch object (``batches.store``)."""

    id: str
    object: Literal["batch"]
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    errors: BatchErrors | None = Field(description="Why a failed batch failed")
    input_file_id: str
    completion_window: Literal["24h"]
    status: Literal[
        "validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired", "cancelled"
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: ResponseUsage
    metadata: dict[str, str] | None
    model: None


class BatchList(ItemList[Batch]):
    pass
