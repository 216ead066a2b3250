"""The Files API's wiring: the file store on the settings' bucket and its sweeper of expired files (`start`, only
with a bucket), and its routes (`wire`)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from preft.gateway.core.collaborators import Core
from preft.gateway.files import routes
from preft.gateway.files.deps import FilesApi
from preft.gateway.files.object_store import ObjectStore
from preft.gateway.files.settings import FilesSettings
from preft.gateway.files.store import FileStore
from preft.gateway.files.sweeper import FileSweeper


def wire(app: FastAPI) -> None:
    """/v1/files."""
    app.include_router(routes.router)


def start(
    stack: contextlib.AsyncExitStack, settings: FilesSettings, core: Core, *, max_batch_requests: int
) -> FilesApi | None:
    """The Files API on the settings' bucket, its sweeper running until the lifespan ends; None without a bucket."""
    if settings.s3 is None:
        return None
    objects = ObjectStore(settings.s3)
    store = FileStore(
        core.redis, objects, timeout_s=core.settings.redis_timeout_s, max_per_tenant=settings.files_max_per_tenant
    )
    sweeper = FileSweeper(store, period_s=settings.files_sweep_period_s)
    sweeper.start()
    stack.push_async_callback(sweeper.close)
    return FilesApi(settings, store, objects, max_batch_requests)
