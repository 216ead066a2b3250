"""FastAPI dependencies of the Files routes (and of the batches', which read files): the Files API's collaborators,
present only where the gateway has a bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from preft.common.errors import InvalidArgument
from preft.gateway.files.object_store import ObjectStore
from preft.gateway.files.settings import FilesSettings
from preft.gateway.files.store import FileStore


@dataclass(frozen=True)
class FilesApi:
    """The Files API's collaborators: its settings, the file store and the bucket, and how many requests a batch
    input file may hold (checked at upload)."""

    settings: FilesSettings
    store: FileStore
    objects: ObjectStore
    max_batch_requests: int


async def get_files(request: Request) -> FilesApi:
    """The Files API; 400 where the server has no bucket for files (and so runs no batches)."""
    files: FilesApi | None = request.app.state.files
    if files is None:
        raise InvalidArgument("this server does not store files (no S3 bucket is configured for the gateway)")
    return files


FilesDep = Annotated[FilesApi, Depends(get_files)]


async def get_file_store(files: FilesDep) -> FileStore:
    return files.store


FileStoreDep = Annotated[FileStore, Depends(get_file_store)]
