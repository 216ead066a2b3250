"""Background responses (`background: true`): answered by a task on this gateway replica, not within the request.

The request is admitted as any other (limits, adapter, 4xx before anything runs) and answered at once with the
response `queued`. The task then streams the answer from the engine as a streamed response would, stores it
`in_progress`, then `completed` or `incomplete` (or `failed`, `cancelled`); GET /v1/responses/{id} reads it. While
it runs the task holds the response's run lease in Redis (renewed every `poll_s`); a cancel asked on any replica
marks the lease and the owning replica stops the run within `poll_s`. A stored response still in progress whose
lease is gone reads as failed (its replica stopped). Stopping the gateway lets runs finish for `drain_s`, then fails
the rest. A run created with `stream: true` keeps its events in Redis as it makes them; `replay` streams them (to
that request's client, and again to GET ?stream=true from any event), following the run to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from preft.common.errors import PreftError, Unavailable
from preft.common.metrics import BACKGROUND_ENDED, BACKGROUND_RUNNING
from preft.gateway.responses.protocol import ANSWERED
from preft.gateway.responses.store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)

IN_PROGRESS = ("queued", "in_progress")
ANSWER_EVENTS = tuple(f"response.{status}" for status in ANSWERED)  # (each carries the answered response)
STOPPED_ERROR = {"code": "server_error", "message": "the gateway running this response stopped before it finished"}

# Opens the engine streams and gives the answer's events (the Responses stream's, ending with the final response).
Answer = Callable[[], Awaitable[AsyncIterator[dict[str, Any]]]]


@dataclasses.dataclass
class Run:
    """One background response: where it is stored, how to answer it, its output so far, and what to do at its end."""

    tenant: str
    stored: StoredResponse  # as queued: the response, the conversation up to its input, its input items
    answer: Answer
    output_so_far: Callable[[], list[dict[str, Any]]]
    finish: Callable[[], None]  # gives back what the request reserved (idempotent)
    ended: Callable[[dict[str, Any]], Awaitable[None]] | None = None  # sees the response once it is stored at its end

    @property
    def response_id(self) -> str:
        return self.stored.response["id"]


class BackgroundRuns:
    """Owns this replica's background responses: their tasks, leases and cancels."""

    def __init__(
        self, store: ResponseStore, *, max_runs: int, lease_s: float = 30.0, poll_s: float = 1.0, drain_s: float = 10.0
    ) -> None:
        self._store = store
        self.max_runs = max_runs
        self.lease_s, self.poll_s, self.drain_s = lease_s, poll_s, drain_s
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._ending: set[tuple[str, str]] = set()  # (runs storing their end: no longer cancelled)
        self._stopping = False
        self._watcher: asyncio.Task[None] | None = None

    async def start(self, run: Run) -> None:
        """Store the response queued, take its lease and start its task; Unavailable (nothing started) where this
        replica runs `max_runs` already or Redis is down."""
        if len(self._tasks) >= self.max_runs or self._stopping:
            raise Unavailable("this gateway runs as many background responses as it may; retry later")
        await self._store.save(run.tenant, run.stored)
        await self._store.hold(run.tenant, run.response_id, self.lease_s)
        key = (run.tenant, run.response_id)
        self._tasks[key] = asyncio.create_task(self._run(run), name=f"preft-background-{run.response_id}")
        self._tasks[key].add_done_callback(lambda _: self._forget(key))
        BACKGROUND_RUNNING.set(len(self._tasks))
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="preft-background-leases")

    def _forget(self, key: tuple[str, str]) -> None:
        self._tasks.pop(key, None)
        BACKGROUND_RUNNING.set(len(self._tasks))

    async def cancel(self, tenant: str, response_id: str) -> None:
        """Stop the run: here where this replica has it, else through its lease (its replica stops it within
        `poll_s`); nothing where no replica runs it."""
        if not self._cancel_here(tenant, response_id):
            await self._store.ask_cancel(tenant, response_id)

    def _cancel_here(self, tenant: str, response_id: str) -> bool:
        """Cancel the run where this replica has it; False where it has not."""
        task = self._tasks.get((tenant, response_id))
        if task is None:
            return False
        if (tenant, response_id) not in self._ending:
            task.cancel()
        return True

    async def close(self) -> None:
        """Let the runs finish for `drain_s`, then stop the rest (stored as failed)."""
        self._stopping = True
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=self.drain_s)
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)

    async def _run(self, run: Run) -> None:
        response, kept = run.stored.response, _KeptEvents(self._store, run) if run.stored.events else None
        try:
            events = await run.answer()
            response = {**response, "status": "in_progress"}
            await self._update(run, response)
            async with contextlib.aclosing(events) as answer:
                async for event in answer:
                    if kept is not None:
                        await kept.add(event)
                    if event["type"] in ANSWER_EVENTS:
                        response = event["response"]
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  (stored below, then the task ends)
            status, error = ("failed", STOPPED_ERROR) if self._stopping else ("cancelled", None)
            response = {**response, "status": status, "error": error, "output": _cut(run.output_so_far())}
        except Exception as e:  # the run's end is stored whatever failed; the error's message goes with it
            if not isinstance(e, PreftError):
                log.exception("background response %s failed", run.response_id)
            message = e.message if isinstance(e, PreftError) else "the generation failed"
            error = {"code": "server_error", "message": message}
            response = {**response, "status": "failed", "error": error, "output": _cut(run.output_so_far())}
        finally:
            run.finish()
        key = (run.tenant, run.response_id)
        self._ending.add(key)
        BACKGROUND_ENDED.labels(status=response["status"]).inc()
        try:
            if kept is not None and response["status"] == "failed":  # (a cancelled stream just ends)
                await kept.add({"type": "response.failed", "sequence_number": kept.next, "response": response})
            await self._update(run, response)
            if run.ended is not None:
                await run.ended(response)
            with contextlib.suppress(Unavailable):
                await self._store.release(*key)
        finally:
            self._ending.discard(key)

    async def _update(self, run: Run, response: dict[str, Any]) -> None:
        """Store the response as it now stands (not where it was deleted meanwhile)."""
        try:
            await self._store.save(run.tenant, run.stored.at(response), only_existing=True)
        except Unavailable as e:
            log.warning("background response %s not stored as %s: %s", run.response_id, response["status"], e.message)

    async def _watch(self) -> None:
        """Every `poll_s`: renew the leases of the runs on this replica, and stop those whose cancel was asked."""
        while True:
            await asyncio.sleep(self.poll_s)
            keys = list(self._tasks)
            if not keys:
                continue
            try:
                states = await self._store.renew(keys, self.lease_s)
            except Unavailable as e:
                log.warning("background response leases not renewed: %s", e.message)
                continue
            for key, state in zip(keys, states, strict=True):
                if state == "cancel":
                    self._cancel_here(*key)
                elif state is None and key in self._tasks:  # (lost, as after a Redis restart: taken again)
                    with contextlib.suppress(Unavailable):
                        await self._store.hold(*key, self.lease_s)


class _KeptEvents:
    """A background run's stream events, kept in Redis as they come (for streams that read them, from any event);
    a Redis outage stops the keeping, not the run."""

    def __init__(self, store: ResponseStore, run: Run) -> None:
        self._store, self._run, self.next, self._on = store, run, 0, True

    async def add(self, event: dict[str, Any]) -> None:
        self.next = event["sequence_number"] + 1
        if not self._on:
            return
        try:
            await self._store.add_events(self._run.tenant, self._run.response_id, [event])
        except Unavailable as e:
            self._on = False
            log.warning("background response %s: its events no longer kept: %s", self._run.response_id, e.message)


def _cut(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output of a run stopped midway: the item being written is incomplete."""
    return [{**item, "status": "incomplete"} if item["status"] == "in_progress" else item for item in output]


ENDING_EVENTS = (*ANSWER_EVENTS, "response.failed")


async def replay(
    store: ResponseStore, tenant: str, response_id: str, after: int, poll_s: float = 0.05
) -> AsyncGenerator[dict[str, Any], None]:
    """A background response's kept stream events numbered after `after`, then those still to come as they come, to
    its end (a cancelled run's, or a stopped replica's, ends without an ending event)."""
    entry, ended = "0", False
    while True:
        events = await store.events_after(tenant, response_id, entry)
        entry = events[-1][0] if events else entry
        for _, event in events:
            if event["sequence_number"] > after:
                yield event
            if event["type"] in ENDING_EVENTS:
                return
        if events:
            continue
        if ended:
            return
        ended = not await store.running(tenant, response_id)  # (a run stores its end, then lets go of its lease)
        await asyncio.sleep(0 if ended else poll_s)  # (once its run has ended, one more read: events kept meanwhile)


async def current(store: ResponseStore, tenant: str, response_id: str) -> StoredResponse:
    """A stored response as it stands: one left in progress by a replica that stopped reads as failed."""
    stored = await store.get(tenant, response_id)
    if stored.response["status"] not in IN_PROGRESS or await store.running(tenant, response_id):
        return stored
    stored = await store.get(tenant, response_id)  # (read again: a run ends by storing its end, then releasing)
    if stored.response["status"] not in IN_PROGRESS:
        return stored
    return dataclasses.replace(stored, response={**stored.response, "status": "failed", "error": STOPPED_ERROR})
