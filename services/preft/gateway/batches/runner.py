"""Running batches (OpenAI's Batch API) on the gateway's replicas, any of which may run any batch.

A batch is created `validating` and open (``batches.store``; a tenant has up to `max_open_per_tenant` open). Each
replica's runner looks for open batches every `poll_s` (at once after a create or a cancel on its own replica) and
takes those no runner holds, up to `max_running`: taking one is taking its lease, which the runner renews every
`poll_s`. Tenants take turns (``fair_order``: fewest batches running over all replicas first, then whose batch
started longest ago), and no tenant runs more than `max_running_per_tenant` at once (counted in the lease's own
script). A replica that stops lets its leases go (a clean shutdown: at once) or lapse (a crash: after `lease_s`);
another replica, or the same one restarted, then takes the batch on where it was. Each phase can be taken on midway:

- validating: the input file is copied within S3 to the batch's own `batches/<tenant>/<id>/input.jsonl` (deleting
  the file later does not stop the batch) and checked whole (``batch_input.BatchPlan``): a bad line, a url that
  is not the batch's endpoint or a custom_id used twice fails the batch, with `errors` naming the lines.
- in_progress: the lines not yet answered are answered (``batches.lines``: as live requests of the endpoint are),
  `line_concurrency` at a time, each holding a slot of the fleet's cap on batch requests per engine request it makes
  while it is at the engine (``offline_slots``: live traffic keeps the rest of the engines' room). Answered lines are
  written to S3 a part at a time (``batches.parts``: a part is up to `part_lines` lines, written at least every
  `part_s`) and each part is then recorded in Redis, with its lines' counts (while it runs, runs of small parts are
  merged into one, ``batches.compaction``); a takeover answers only the lines no recorded part holds. So after a crash
  the lines in flight are answered again, and so are those answered but not yet in a recorded part: up to a part's
  worth (`part_lines`, or `part_s` of answers). The counts a batch shows move a part at a time, and so does the
  tenant's metered usage: a line's tokens go to it in the script that records the line (``batches.lines``), so a line
  answered twice is metered once, and a line stopped midway (cancel, expiry, a crash) not at all. A line refused with a
  5xx of an outage is tried up to `ATTEMPTS` times. The batch stops taking lines when it is cancelled (lines in flight
  are stopped) or when its completion window ends (lines in flight are stopped; every line not answered is recorded as
  `batch_expired`, in parts too); the lines answered by then are recorded first.
- finalizing, cancelling: the recorded parts are merged in request order into the output file (answers) and the
  error file (refusals, expired lines), files of purpose `batch_output` whose ids follow from the batch's (a
  takeover writes the same files again), and the batch ends: completed, expired or cancelled. Its objects in S3
  (the input copy, the parts) are then deleted (left behind, and logged, where S3 fails).

Stopping the gateway stops its runs at once and lets their leases go; what they answered is recorded where it can
be within the shutdown's wait (`CLOSE_WAIT_S`), and what they recorded stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Container, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from preft.common.errors import NotFound, PreftError, Unavailable
from preft.common.metrics import BATCH_LINES, BATCH_TAKEOVERS, BATCHES_ENDED, BATCHES_RUNNING
from preft.gateway.batches import parts as batch_parts
from preft.gateway.batches.compaction import Compactor
from preft.gateway.batches.lines import LineAnswerer
from preft.gateway.batches.offline_slots import OfflineSlots
from preft.gateway.batches.parts import PartWriter
from preft.gateway.batches.store import STATUSES_OPEN, BatchRecord, BatchStore, LeaseLost, LineRecord
from preft.gateway.batches.tiers import Tiers
from preft.gateway.core.auth import Caller
from preft.gateway.core.metering import Metered
from preft.gateway.files import batch_input
from preft.gateway.files.batch_input import BatchLine, BatchPlan
from preft.gateway.files.object_store import ObjectStore
from preft.gateway.files.store import OUTPUT_PURPOSE, FileStore

log = logging.getLogger(__name__)

ATTEMPTS = 3  # tries of a line refused for an outage (Redis, the engine): 0.5 s, then 1 s apart
RETRY_BACKOFF_S = 0.5
OPEN_SCAN = 1000  # open batches a runner looks through each round (oldest first)
READ_BLOCK = 64  # lines read from the input at a time
CLOSE_WAIT_S = 5.0  # longest a shutdown waits for its stopped runs to record what they answered, and let go
INTERNAL_ERROR = {
    "code": "server_error",
    "message": "the batch failed on the gateway before its requests were all answered",
    "param": None,
    "line": None,
}


def objects_prefix(batch: BatchRecord) -> str:
    """Where the batch keeps its objects in S3 (its input copy, its parts): all deleted once it ended."""
    return f"batches/{batch.tenant}/{batch.id}/"


def input_key(batch: BatchRecord) -> str:
    """Where the batch keeps its own copy of its input file."""
    return f"{objects_prefix(batch)}input.jsonl"


def result_file_id(batch: BatchRecord, name: str) -> str:
    """The id of the batch's output or error file: the same whichever runner writes it."""
    return "file-" + hashlib.sha256(f"{batch.tenant}/{batch.id}/{name}".encode()).hexdigest()[:32]


def expired_line(custom_id: str) -> dict[str, Any]:
    """A line the completion window ended before it was answered, as OpenAI writes it in the error file."""
    message = "This request could not be executed before the completion window expired."
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "batch_expired", "message": message},
    }


def _requests(path: Path) -> Iterator[BatchLine]:
    """The input's requests, read through a handle of their own (readers never share a file position)."""
    with path.open("rb") as f:
        yield from batch_input.requests(f)


def _next_block(lines: Iterator[BatchLine], done: Container[int], count: int) -> list[BatchLine]:
    """Up to `count` more lines not answered yet (blocking: reads the input file)."""
    block = []
    for line in lines:
        if line.index not in done:
            block.append(line)
            if len(block) >= count:
                break
    return block


def _now() -> int:
    return int(time.time())


def fair_order(
    waiting: list[tuple[str, str]], running: Counter[str], last_started: dict[str, int]
) -> list[tuple[str, str]]:
    """Waiting batches (tenant, id; oldest first) in the order to start them, so that tenants take turns: a
    tenant's k-th waiting batch ranks as if k + its running ones were ahead of it; on a tie, the tenant whose batch
    started longest ago goes first, then the oldest batch."""
    seen: Counter[str] = Counter()
    ranked = []
    for age, (tenant, batch_id) in enumerate(waiting):
        ranked.append((running[tenant] + seen[tenant], last_started.get(tenant, 0), age, tenant, batch_id))
        seen[tenant] += 1
    return [(tenant, batch_id) for *_, tenant, batch_id in sorted(ranked)]


@dataclass
class _Run:
    """One batch this runner runs: the batch as last read, and whether its cancel was asked."""

    batch: BatchRecord
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    ending: bool = False  # (its end is being stored: the lease goes with it, and the run is not stopped for that)

    @property
    def key(self) -> tuple[str, str]:
        return self.batch.tenant, self.batch.id


class BatchRunner:
    """Owns this replica's batch runs: finding open batches, their leases, their tasks."""

    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        objects: ObjectStore,
        answerer: LineAnswerer,
        slots: OfflineSlots,
        *,
        max_running: int,
        max_running_per_tenant: int,
        line_concurrency: int,
        lease_s: float,
        poll_s: float,
        max_requests: int,
        part_lines: int,
        part_s: float,
        compact_parts: int,
    ) -> None:
        self._store = store
        self._files = files
        self._objects = objects
        self._answerer = answerer
        self._slots = slots
        self.max_running = max_running
        self.max_running_per_tenant = max_running_per_tenant
        self.line_concurrency = line_concurrency
        self.lease_s, self.poll_s = lease_s, poll_s
        self.max_requests = max_requests
        self.part_lines, self.part_s = part_lines, part_s
        self.tiers = Tiers(compact_at=compact_parts)
        self.token = uuid.uuid4().hex  # (this runner's name on the leases it holds)
        self._runs: dict[tuple[str, str], _Run] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False
        self._scan_from = 0  # (where in the open batches, oldest first, the next round looks)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="preft-batches")

    def wake(self) -> None:
        """Look at the batches now (one was created or cancelled here), not at the next round."""
        self._wake.set()

    async def close(self) -> None:
        """Stop every run here (what they answered is recorded where it can be within `CLOSE_WAIT_S`, what they
        recorded stays; their leases go, for another replica to take them on)."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)

    # -- the rounds: leases, cancels, new work ---------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._renew()  # (first: a failure of what follows never costs a batch its lease)
                await self._slots.renew()
                await self._take()
            except PreftError as e:
                log.warning("batches: this round was cut short: %s", e.message)
            except Exception:
                log.exception("batches: this round failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            self._wake.clear()

    async def _renew(self) -> None:
        """Renew the leases of the runs here; stop those whose lease is lost, tell those cancelled."""
        keys = list(self._runs)
        if not keys:
            return
        states = await self._store.renew(keys, self.token, self.lease_s)
        for key, state in zip(keys, states, strict=True):
            run, task = self._runs.get(key), self._tasks.get(key)
            if run is None or task is None:
                continue
            if (state is None or state == "gone") and not run.ending:
                log.warning("batch %s: its lease is no longer this replica's; stopped here", key[1])
                task.cancel()
            elif state == "cancelling":
                run.cancel.set()

    async def _take(self) -> None:
        """Take open batches that no runner holds, in turn across tenants (`fair_order`), while this replica has
        room and each tenant fewer than `max_running_per_tenant` running; `OPEN_SCAN` open batches at a time, oldest
        first: where those give nothing to take (all running, or their tenants at their limit), the next round looks at
        the next `OPEN_SCAN`, so newer batches are not starved behind a long backlog."""
        room = self.max_running - len(self._tasks)
        if room <= 0 or self._closing:
            return
        entries = await self._store.open_batches(OPEN_SCAN, start=self._scan_from)
        self._scan_from = self._scan_from + OPEN_SCAN if len(entries) == OPEN_SCAN else 0
        held = await self._store.held(entries)
        running = Counter(tenant for (tenant, _), h in zip(entries, held, strict=True) if h)
        waiting = [k for k, h in zip(entries, held, strict=True) if not h and k not in self._tasks]
        last_started = await self._store.last_started(tenant for tenant, _ in waiting)
        busy: set[str] = set()
        for tenant, batch_id in fair_order(waiting, running, last_started):
            if tenant in busy:
                continue
            claim = await self._store.claim(
                tenant, batch_id, self.token, self.lease_s, max_running=self.max_running_per_tenant
            )
            if claim == "tenant_busy":
                busy.add(tenant)
            if claim != "taken":
                continue
            if await self._start(tenant, batch_id):
                self._scan_from = 0  # (something to take here: the oldest first again)
                room -= 1
                if room <= 0:
                    return

    async def _start(self, tenant: str, batch_id: str) -> bool:
        """Run a batch whose lease this runner just took; False where there is nothing to run."""
        batch = await self._store.find(tenant, batch_id)
        if batch is None or batch.status not in STATUSES_OPEN:  # (its record went: nothing to run)
            await self._store.forget_open(tenant, batch_id)
            await self._store.release(tenant, batch_id, self.token)
            return False
        if batch.fields.get("in_progress_at"):
            BATCH_TAKEOVERS.inc()
            log.info("batch %s: taken on (%s)", batch_id, batch.status)
        run = _Run(batch)
        if batch.status == "cancelling":
            run.cancel.set()
        self._runs[run.key] = run
        self._tasks[run.key] = asyncio.create_task(self._run(run), name=f"preft-batch-{batch_id}")
        self._tasks[run.key].add_done_callback(lambda _: self._forget(run.key))
        BATCHES_RUNNING.set(len(self._tasks))
        return True

    def _forget(self, key: tuple[str, str]) -> None:
        self._runs.pop(key, None)
        self._tasks.pop(key, None)
        BATCHES_RUNNING.set(len(self._tasks))

    # -- one batch -------------------------------------------------------------------------------------------------

    async def _run(self, run: _Run) -> None:
        batch_id = run.batch.id
        try:
            await self._drive(run)
        except asyncio.CancelledError:
            pass  # (shutdown, or a lost lease: what was recorded stays for the next runner)
        except LeaseLost:
            log.warning("batch %s: its lease went to another replica; stopped here", batch_id)
        except Unavailable as e:
            log.warning("batch %s: paused, to be taken on again: %s", batch_id, e.message)
        except Exception as e:
            if isinstance(e, PreftError):
                log.error("batch %s failed: %s", batch_id, e.message)
            else:
                log.exception("batch %s failed", batch_id)
            await self._fail(run, [INTERNAL_ERROR], from_statuses=STATUSES_OPEN)
        finally:
            with contextlib.suppress(Exception):
                await self._store.release(*run.key, self.token)

    async def _drive(self, run: _Run) -> None:
        """The batch's phases from where it stands (its input read from a local copy)."""
        with tempfile.NamedTemporaryFile(prefix="preft-batch-", suffix=".jsonl") as source:
            path, batch, loaded = Path(source.name), run.batch, False
            if batch.status == "validating":
                batch, loaded = await self._validate(run, source, path), True
            if batch.status == "in_progress":
                if not loaded:
                    await self._load(batch, source)
                batch = await self._answer_lines(run, path)
            if batch.status in ("finalizing", "cancelling"):
                await self._finish(run)

    async def _load(self, batch: BatchRecord, source: IO[bytes]) -> None:
        await self._objects.download(input_key(batch), source)
        source.flush()

    async def _reread(self, run: _Run) -> BatchRecord:
        run.batch = await self._store.get(*run.key)
        return run.batch

    async def _move(self, run: _Run, from_statuses: tuple[str, ...], to: str, **fields: Any) -> BatchRecord:
        """Move the batch (where its status is still one of `from_statuses`); the batch as it then stands."""
        await self._store.move(run.batch, self.token, from_statuses=from_statuses, to=to, **fields)
        return await self._reread(run)

    async def _validate(self, run: _Run, source: IO[bytes], path: Path) -> BatchRecord:
        batch = run.batch
        file_id = batch.spec["input_file_id"]
        try:
            await self._files.get(batch.tenant, file_id)
            await self._objects.copy(self._files.object_key(batch.tenant, file_id), input_key(batch))
        except NotFound:
            message = f"the input file {file_id} was deleted before the batch began"
            error = {"code": "input_file_not_found", "message": message, "param": "input_file_id", "line": None}
            return await self._fail(run, [error], from_statuses=("validating",))
        await self._load(batch, source)

        def plan_of() -> BatchPlan:
            with path.open("rb") as f:
                return BatchPlan.of(f, batch.endpoint, self.max_requests)

        plan = await asyncio.to_thread(plan_of)
        if plan.errors:
            return await self._fail(run, plan.errors, from_statuses=("validating",))
        return await self._move(run, ("validating",), "in_progress", total=plan.total, in_progress_at=_now())

    async def _fail(self, run: _Run, errors: list[dict[str, Any]], *, from_statuses: tuple[str, ...]) -> BatchRecord:
        """End the batch as failed, with `errors` (best effort where it fails for the gateway's own reasons)."""
        run.ending = True
        try:
            batch = await self._move(
                run, from_statuses, "failed", ends=True, failed_at=_now(), errors=json.dumps(errors)
            )
        except (PreftError, LeaseLost) as e:
            log.warning("batch %s: not stored as failed: %s", run.batch.id, e)
            return run.batch
        if batch.status == "failed":
            BATCHES_ENDED.labels(status="failed").inc()
            await self._drop_objects(batch)
        return batch

    async def _answer_lines(self, run: _Run, path: Path) -> BatchRecord:
        """Answer the lines not answered yet, until they are all answered, the batch is cancelled, or its window
        ends; the batch as it then stands (finalizing, or cancelling)."""
        batch = run.batch
        done = await self._store.done_lines(*run.key)
        caller = Caller(batch.tenant, batch.spec["key_id"], offline=True)
        compactor = Compactor(self._store, self._objects, batch, self.token, tiers=self.tiers)
        parts = PartWriter(
            self._store,
            self._objects,
            batch,
            self.token,
            part_lines=self.part_lines,
            part_s=self.part_s,
            on_recorded=compactor.recorded,
        )
        lines = _requests(path)
        workers = max(1, self.line_concurrency)
        queue: asyncio.Queue[BatchLine | None] = asyncio.Queue(maxsize=2 * workers)

        async def feed() -> None:
            while block := await asyncio.to_thread(_next_block, lines, done, READ_BLOCK):
                for line in block:
                    await queue.put(line)
            for _ in range(workers):
                await queue.put(None)

        async def work() -> None:
            while (line := await queue.get()) is not None:
                record = await self._answer(caller, line)
                await parts.add([record])
                BATCH_LINES.labels(outcome=record.counts_as).inc()

        async def answer_all() -> None:
            try:
                async with asyncio.TaskGroup() as group:
                    timers = [group.create_task(parts.flush_every())]
                    if self.tiers.compact_at > 0:
                        timers.append(group.create_task(compactor.run()))
                    group.create_task(feed())
                    await asyncio.wait([group.create_task(work()) for _ in range(workers)])
                    for timer in timers:  # (compaction too: finalizing merges whatever parts it finds)
                        timer.cancel()
            except* Exception as failures:
                raise failures.exceptions[0] from None

        try:
            ending = await self._until_stopped(run, answer_all(), batch.spec["deadline_s"] - time.time())
        except asyncio.CancelledError:
            if self._closing:  # (a clean stop: what was answered is recorded, where it can be within the wait)
                await self._flush_on_stop(parts)
            raise
        await parts.flush()  # (before the batch moves on: every line answered is recorded)
        if ending == "cancelled":
            return await self._reread(run)  # (cancelling: the cancel moved it)
        if ending == "expired":
            await self._record_expired(run, path, parts)
        return await self._move(run, ("in_progress",), "finalizing", finalizing_at=_now(), ending=ending)

    async def _flush_on_stop(self, parts: PartWriter) -> None:
        """Record what the run answered, at a clean stop (logged where it cannot be: answered again later)."""
        held = parts.held
        try:
            await parts.flush()
        except (PreftError, LeaseLost) as e:
            log.warning("batch %s: %d lines answered were not recorded at the stop: %s", parts.batch_id, held, e)

    async def _until_stopped(self, run: _Run, answering: Coroutine[Any, Any, None], remaining_s: float) -> str:
        """Run `answering` until it ends (completed), the batch is cancelled (cancelled), or `remaining_s` pass
        (expired); lines still in flight then are stopped."""
        lines_task = asyncio.ensure_future(answering)
        cancel_task = asyncio.ensure_future(run.cancel.wait())
        try:
            done, _ = await asyncio.wait(
                {lines_task, cancel_task}, timeout=max(remaining_s, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (lines_task, cancel_task):
                task.cancel()
            await asyncio.gather(lines_task, cancel_task, return_exceptions=True)
        if lines_task in done:
            lines_task.result()  # (raises what stopped it: a lost lease, an outage)
            return "completed"
        return "cancelled" if cancel_task in done else "expired"

    async def _answer(self, caller: Caller, line: BatchLine) -> LineRecord:
        """The line answered by its endpoint (tried again where an outage refused it), as it is recorded."""
        metered: tuple[Metered, ...] = ()  # (every attempt's: one refused midway may have generated)
        for attempt in range(ATTEMPTS):
            answer = await self._answerer.answer(caller, line.url, line.body)
            metered += answer.metered
            if not answer.retryable or attempt == ATTEMPTS - 1:
                break
            await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
        response = {"status_code": answer.status_code, "request_id": answer.request_id, "body": answer.body}
        entry = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response}
        return LineRecord(
            line.index,
            "output" if answer.ok else "error",
            {**entry, "error": None},
            answer.input_tokens,
            answer.output_tokens,
            metered,
        )

    async def _record_expired(self, run: _Run, path: Path, parts: PartWriter) -> None:
        """Record every line not answered as expired (in parts, as answers are)."""
        done = await self._store.done_lines(*run.key)

        def unanswered() -> list[tuple[int, str]]:
            return [(line.index, line.custom_id) for line in _requests(path) if line.index not in done]

        missing = await asyncio.to_thread(unanswered)
        for index, custom_id in missing:
            await parts.add([LineRecord(index, "error", expired_line(custom_id))])
        await parts.flush()
        BATCH_LINES.labels(outcome="expired").inc(len(missing))

    async def _finish(self, run: _Run) -> None:
        """Write the output and error files, and end the batch (completed, expired or cancelled)."""
        batch = run.batch
        final = "cancelled" if batch.status == "cancelling" else batch.fields.get("ending") or "completed"
        ids = await self._write_files(batch)
        run.ending = True
        ended = await self._move(run, (batch.status,), final, ends=True, **{f"{final}_at": _now()}, **ids)
        if ended.status == final:
            BATCHES_ENDED.labels(status=final).inc()
            await self._drop_objects(ended)

    async def _write_files(self, batch: BatchRecord) -> dict[str, str]:
        """The recorded parts merged in request order (each line once) as the batch's output and error files; their
        ids (a file only where it has lines)."""
        ids = {}
        names = await self._store.parts(batch.tenant, batch.id)
        with (
            tempfile.TemporaryDirectory(prefix="preft-batch-") as work,
            tempfile.TemporaryFile() as output,
            tempfile.TemporaryFile() as errors,
        ):
            paths = await batch_parts.download(self._objects, batch, names, Path(work))
            await asyncio.to_thread(batch_parts.merge, paths, output, errors, work_dir=Path(work))
            for name, written in (("output", output), ("error", errors)):
                size = written.tell()
                if not size:
                    continue
                written.seek(0)
                created = await self._files.create(
                    batch.tenant,
                    written,
                    size=size,
                    filename=f"{batch.id}_{name}.jsonl",
                    purpose=OUTPUT_PURPOSE,
                    file_id=result_file_id(batch, name),
                    limited=False,
                    expires_after_s=batch.spec.get("output_expires_after_s"),
                )
                ids[f"{name}_file_id"] = created["id"]
        return ids

    async def _drop_objects(self, batch: BatchRecord) -> None:
        """Delete the batch's objects in S3 (once it ended: its input copy, its parts, recorded or not); left behind,
        and logged, where S3 fails."""
        try:
            await self._objects.delete_many(await self._objects.list_keys(objects_prefix(batch)))
        except PreftError as e:
            log.warning(
                "batch %s: its objects were left in S3 (under %s): %s", batch.id, objects_prefix(batch), e.message
            )
