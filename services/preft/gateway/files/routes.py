"""OpenAI's Files API: each tenant's own files (``files.store``), the inputs and outputs of its batches.

    POST   /v1/files               multipart: file, purpose (batch or user_data), and optionally
                                   expires_after[anchor] (created_at) with expires_after[seconds] (3600-2592000)
    GET    /v1/files               purpose, limit (1-10000), after (a file id), order (desc unless asc)
    GET    /v1/files/{id}
    GET    /v1/files/{id}/content  the file's bytes
    DELETE /v1/files/{id}

An upload is checked before anything is stored: its size (`files_max_bytes`: 413 past it; a Content-Length is
required), its purpose, its expires_after, and for `batch` every line (a 400 naming the first bad one). A file
expires `expires_after[seconds]` after its creation (its `expires_at`); without expires_after, as OpenAI's,
`batch` files after 30 days and `user_data` files never. An expired file answers 404 at once, and the replicas'
sweepers remove it (``files.sweeper``). Batches write their outputs as files of purpose `batch_output`. Another
tenant's file answers 404, as one that does not exist.
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse, Response, StreamingResponse

from preft.common.errors import InvalidArgument
from preft.gateway.core.deps import CallerDep, check_multipart_upload
from preft.gateway.core.errors import PayloadTooLarge
from preft.gateway.core.openapi import errors, multipart_body
from preft.gateway.core.pages import item_list
from preft.gateway.files.batch_input import check_lines
from preft.gateway.files.deps import FilesDep, FileStoreDep
from preft.gateway.files.response_models import FileDeleted, FileList, FileObject
from preft.gateway.files.store import DEFAULT_EXPIRES_AFTER_S, EXPIRES_AFTER_S, UPLOAD_PURPOSES

router = APIRouter(tags=["files"])

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # what the form's other fields and boundaries may add to the file's bytes
MAX_FILENAME_CHARS = 255
MAX_LIST = 10_000
ANCHOR, SECONDS = "expires_after[anchor]", "expires_after[seconds]"
FIELDS = ("file", "purpose", ANCHOR, SECONDS)
DIGITS = re.compile(r"^[0-9]{1,9}$")
UPLOAD_FORM = multipart_body(
    {
        "file": {"type": "string", "format": "binary", "description": "The file (a name of 1-255 characters)"},
        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
        ANCHOR: {"type": "string", "enum": ["created_at"], "description": f"With {SECONDS}"},
        SECONDS: {
            "type": "integer",
            "minimum": EXPIRES_AFTER_S[0],
            "maximum": EXPIRES_AFTER_S[1],
            "description": f"With {ANCHOR}: the file expires this long after its creation",
        },
    },
    required=["file", "purpose"],
)
# Every Files route answers 400 where the gateway has no bucket for files (``files.deps``).


def _file_part(form: Any) -> UploadFile:
    parts = form.getlist("file")
    if len(parts) != 1 or not isinstance(parts[0], UploadFile):
        raise InvalidArgument("file: send one file, as the form's file part")
    upload: UploadFile = parts[0]
    name = upload.filename or ""
    if not name or len(name) > MAX_FILENAME_CHARS or any(ord(c) < 32 for c in name):
        raise InvalidArgument(f"file: the part needs a file name (1-{MAX_FILENAME_CHARS} printable characters)")
    return upload


def _purpose(form: Any) -> str:
    purpose = form.get("purpose")
    if not isinstance(purpose, str) or not purpose:
        raise InvalidArgument("purpose: give the file's purpose (batch or user_data)")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidArgument(f"purpose: this server takes files for {' or '.join(UPLOAD_PURPOSES)}, not {purpose!r}")
    return purpose


def _one(form: Any, name: str) -> str | None:
    values = form.getlist(name)
    if not values:
        return None
    if len(values) > 1 or not isinstance(values[0], str):
        raise InvalidArgument(f"{name}: give it once, as a form field")
    return values[0]


def _expires_after_s(form: Any, purpose: str) -> int | None:
    """The seconds after its creation that the file expires (OpenAI's default for the purpose where not given)."""
    anchor, seconds = _one(form, ANCHOR), _one(form, SECONDS)
    if anchor is None and seconds is None:
        return DEFAULT_EXPIRES_AFTER_S.get(purpose)
    if anchor is None or seconds is None:
        missing = ANCHOR if anchor is None else SECONDS
        raise InvalidArgument(f"{missing}: give both {ANCHOR} and {SECONDS}, or neither")
    if anchor != "created_at":
        raise InvalidArgument(f"{ANCHOR}: the only anchor is created_at, not {anchor!r}")
    low, high = EXPIRES_AFTER_S
    if not DIGITS.match(seconds) or not low <= int(seconds) <= high:
        raise InvalidArgument(f"{SECONDS}: an integer number of seconds from {low} to {high}, not {seconds!r}")
    return int(seconds)


@router.post("/v1/files", response_model=FileObject, responses=errors(400, 411, 413, 429), openapi_extra=UPLOAD_FORM)
async def upload_file(request: Request, caller: CallerDep, api: FilesDep) -> JSONResponse:
    files, limit = api.store, api.settings.files_max_bytes
    check_multipart_upload(
        request,
        max_bytes=limit + MULTIPART_OVERHEAD_BYTES,
        too_large=f"The file is larger than {limit} bytes.",
        not_multipart="send the file as multipart/form-data: fields file and purpose",
    )
    async with request.form(max_files=1, max_fields=8) as form:
        extra = sorted({k for k in form if k not in FIELDS})
        if "expires_after" in extra:
            raise InvalidArgument(f"expires_after: send it as the fields {ANCHOR} and {SECONDS}")
        if extra:
            raise InvalidArgument(f"{extra[0]} is not supported by this server")
        purpose, upload = _purpose(form), _file_part(form)
        expires_after_s = _expires_after_s(form, purpose)
        size = upload.size or 0
        if size > limit:
            raise PayloadTooLarge(f"The file is larger than {limit} bytes.")
        if not size:
            raise InvalidArgument("file: the file is empty")
        source = upload.file
        if purpose == "batch":
            source.seek(0)
            await asyncio.to_thread(check_lines, source, api.max_batch_requests)
        source.seek(0)
        created = await files.create(
            caller.tenant,
            source,
            size=size,
            filename=upload.filename or "",
            purpose=purpose,
            expires_after_s=expires_after_s,
        )
    return JSONResponse(created)


@router.get("/v1/files", response_model=FileList, responses=errors(400))
async def list_files(
    caller: CallerDep,
    files: FileStoreDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = MAX_LIST,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    page = await files.page(caller.tenant, purpose=purpose, after=after, limit=limit, order=order)
    return JSONResponse(item_list(page.files, has_more=page.has_more))


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=errors(400, 404))
async def retrieve_file(file_id: str, caller: CallerDep, files: FileStoreDep) -> JSONResponse:
    return JSONResponse(await files.get(caller.tenant, file_id))


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        **errors(400, 404),
    },
)
async def file_content(file_id: str, caller: CallerDep, files: FileStoreDep) -> Response:
    obj, chunks = await files.content(caller.tenant, file_id)
    headers = {"content-length": str(obj["bytes"])}
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=errors(400, 404))
async def delete_file(file_id: str, caller: CallerDep, files: FileStoreDep) -> JSONResponse:
    await files.delete(caller.tenant, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
