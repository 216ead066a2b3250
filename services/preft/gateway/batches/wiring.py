"""The Batch API's wiring: the batch store, the fleet's slots and this replica's runner, whose lines the generation
and Responses services answer (`start`, only with the Files API's bucket), and its routes (`wire`)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from preft.gateway.batches import routes
from preft.gateway.batches.deps import BatchesApi
from preft.gateway.batches.lines import LineAnswerer
from preft.gateway.batches.offline_slots import OfflineSlots
from preft.gateway.batches.runner import BatchRunner
from preft.gateway.batches.settings import BatchesSettings
from preft.gateway.batches.store import BatchStore
from preft.gateway.core.collaborators import Core
from preft.gateway.files.deps import FilesApi
from preft.gateway.openai.generation import GenerationService
from preft.gateway.responses.service import ResponsesService


def wire(app: FastAPI) -> None:
    """/v1/batches."""
    app.include_router(routes.router)


def start(
    stack: contextlib.AsyncExitStack,
    settings: BatchesSettings,
    core: Core,
    files: FilesApi | None,
    generation: GenerationService,
    responses: ResponsesService,
) -> BatchesApi | None:
    """The Batch API, its runner started and stopped first when the lifespan ends (its lines use the rest); None
    without the Files API."""
    if files is None:
        return None
    timeout_s = core.settings.redis_timeout_s
    store = BatchStore(
        core.redis,
        timeout_s=timeout_s,
        keep_s=settings.batches_keep_s,
        max_open_per_tenant=settings.batches_max_open_per_tenant,
    )
    slots = OfflineSlots(
        core.redis,
        cap=settings.batches_max_lines_in_flight,
        lease_s=settings.batches_lease_s,
        poll_s=settings.batches_poll_s,
        timeout_s=timeout_s,
    )
    answerer = LineAnswerer(
        generation=generation,
        responses=responses,
        slots=slots,
        max_request_bytes=core.settings.max_request_bytes,
        metering_later_s=settings.batches_part_s,
    )
    runner = BatchRunner(
        store,
        files.store,
        files.objects,
        answerer,
        slots,
        max_running=settings.batches_max_running,
        max_running_per_tenant=settings.batches_max_running_per_tenant,
        line_concurrency=settings.batches_line_concurrency,
        lease_s=settings.batches_lease_s,
        poll_s=settings.batches_poll_s,
        max_requests=settings.batches_max_requests,
        part_lines=settings.batches_part_lines,
        part_s=settings.batches_part_s,
        compact_parts=settings.batches_compact_parts,
    )
    runner.start()
    stack.push_async_callback(runner.close)
    return BatchesApi(settings, store, runner)
