"""What the Files routes answer, for /openapi.json (``core.response_models`` says why models only document answers
the routes build as dicts)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from preft.gateway.core.response_models import Documented, ItemList


class FileObject(Documented):
    """OpenAI's file object (``files.store``)."""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "user_data", "batch_output"]
    status: Literal["processed"]
    status_details: None
    expires_at: int | None = Field(description="Unix seconds (null: never)")


class FileList(ItemList[FileObject]):
    pass


class FileDeleted(Documented):
    id: str
    object: Literal["file"]
    deleted: Literal[True]
