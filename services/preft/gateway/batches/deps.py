"""FastAPI dependencies of the Batch routes: the Batch API's collaborators, present only where the gateway has a
bucket (as the Files API's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from preft.gateway.batches.runner import BatchRunner
from preft.gateway.batches.settings import BatchesSettings
from preft.gateway.batches.store import BatchStore
from preft.gateway.files.deps import FilesDep


@dataclass(frozen=True)
class BatchesApi:
    """The Batch API's collaborators: its settings, the batch store, and this replica's runner."""

    settings: BatchesSettings
    store: BatchStore
    runner: BatchRunner


async def get_batches(request: Request, _: FilesDep) -> BatchesApi:
    """The Batch API (400 without a bucket, as files: a batch's input and output are files)."""
    return request.app.state.batches


BatchesDep = Annotated[BatchesApi, Depends(get_batches)]


async def get_batch_store(batches: BatchesDep) -> BatchStore:
    return batches.store


async def get_batch_runner(batches: BatchesDep) -> BatchRunner:
    return batches.runner


BatchStoreDep = Annotated[BatchStore, Depends(get_batch_store)]
BatchRunnerDep = Annotated[BatchRunner, Depends(get_batch_runner)]
