"""A running batch's answered lines in S3, a part at a time, and their merge into its output and error files.

A part is an object `batches/<tenant>/<id>/parts/<run>-<n>.part` (`<run>`: the id of the run that wrote it, `<n>`:
its number in that run) of lines `<request index> <output|error> <the file's line, JSON>\\n`, sorted by index. A run
buffers the lines it answers and writes them as a part once it holds `part_lines` of them, or `PART_MAX_BYTES`, or
every `part_s`; it then records the part (``BatchStore.record_part``: checked against the lease, each index counted
once). A part in S3 that was never recorded (its runner stopped or lost its lease in between) is ignored, and its
lines are answered again by whoever takes the batch on.

Finalizing merges the recorded parts by index (`merge`: a k-way merge of files on disk, `MERGE_FAN_IN` at a time,
so memory does not grow with the batch); an index in two parts is written once, as the part recorded first has it
(the one its counts came from). While the batch runs, ``batches.compaction`` merges runs of its recorded parts
(``merge_parts``) into one in their place, so that finalizing has few to download.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import io
import itertools
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator
from operator import itemgetter
from pathlib import Path
from typing import IO

from preft.common.errors import PreftError
from preft.gateway.batches.store import BatchRecord, BatchStore, LeaseLost, LineRecord
from preft.gateway.files.object_store import ObjectStore

log = logging.getLogger(__name__)

PART_MAX_BYTES = 8 * 1024 * 1024  # a part's lines held in memory at most, before it is written
MERGE_FAN_IN = 64  # parts merged at once (files open together); more are merged in rounds
DOWNLOADS = 8  # parts downloaded at once while finalizing


def parts_prefix(batch: BatchRecord) -> str:
    return f"batches/{batch.tenant}/{batch.id}/parts/"


def part_key(batch: BatchRecord, name: str) -> str:
    return f"{parts_prefix(batch)}{name}.part"


def encode(record: LineRecord) -> bytes:
    """The record as a part's line."""
    line = json.dumps(record.line, separators=(",", ":"))  # (ASCII: no raw newline or separator inside)
    return f"{record.index} {record.file} {line}\n".encode()


class PartWriter:
    """Owns one run's answered lines not recorded yet: holding them, and writing them to S3 as recorded parts."""

    def __init__(
        self,
        store: BatchStore,
        objects: ObjectStore,
        batch: BatchRecord,
        token: str,
        *,
        part_lines: int,
        part_s: float,
        on_recorded: Callable[[], None] | None = None,
    ) -> None:
        self._store, self._objects = store, objects
        self._on_recorded = on_recorded  # (told after each part it records: compaction may be due)
        self._batch, self._token = batch, token
        self.part_lines, self.part_s = part_lines, part_s
        self._run = uuid.uuid4().hex[:16]  # (parts of two runs of one runner never share a name)
        self._numbers = itertools.count()
        self._held: list[tuple[LineRecord, bytes]] = []
        self._bytes = 0
        self._lock = asyncio.Lock()

    @property
    def batch_id(self) -> str:
        return self._batch.id

    @property
    def held(self) -> int:
        """Lines answered and not recorded yet."""
        return len(self._held)

    async def add(self, records: Iterable[LineRecord]) -> None:
        """Hold answered lines; write them as a part where they fill one."""
        for record in records:
            data = encode(record)
            self._held.append((record, data))
            self._bytes += len(data)
        if len(self._held) >= self.part_lines or self._bytes >= PART_MAX_BYTES:
            await self.flush()

    async def flush(self) -> None:
        """Write the lines held as a part, and record it (nothing where none are held). LeaseLost where the lease
        is no longer this runner's."""
        async with self._lock:
            held, self._held, self._bytes = self._held, [], 0
            if not held:
                return
            try:
                await self._write(held)
            except BaseException:
                # (not recorded, or not known to be: written again by the next flush; an index recorded twice counts
                # once, and the merge keeps one)
                self._held[:0] = held
                self._bytes += sum(len(data) for _, data in held)
                raise

    async def flush_every(self) -> None:
        """Flush every `part_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.part_s)
            await self.flush()

    async def _write(self, held: list[tuple[LineRecord, bytes]]) -> None:
        held.sort(key=lambda pair: pair[0].index)
        name = f"{self._run}-{next(self._numbers):06d}"
        key = part_key(self._batch, name)
        await self._objects.put(key, io.BytesIO(b"".join(data for _, data in held)))
        try:
            await self._store.record_part(self._batch, self._token, name, [record for record, _ in held])
        except LeaseLost:
            with contextlib.suppress(PreftError):  # (never recorded: not left behind, where S3 lets it go)
                await self._objects.delete(key)
            raise
        if self._on_recorded is not None:
            self._on_recorded()


async def download(objects: ObjectStore, batch: BatchRecord, names: list[str], into: Path) -> list[Path]:
    """The parts `names` downloaded into the folder `into`, `DOWNLOADS` at a time; their paths, in order."""
    paths = [into / f"{n:06d}.part" for n in range(len(names))]
    limit = asyncio.Semaphore(DOWNLOADS)

    async def fetch(name: str, path: Path) -> None:
        async with limit:
            with path.open("wb") as f:
                await objects.download(part_key(batch, name), f)

    try:
        async with asyncio.TaskGroup() as group:
            for name, path in zip(names, paths, strict=True):
                group.create_task(fetch(name, path))
    except* Exception as failures:
        raise failures.exceptions[0] from None
    return paths


def _read(path: Path) -> Iterator[tuple[int, bytes]]:
    """A part's lines as (index, the rest of the line)."""
    with path.open("rb") as f:
        for raw in f:
            index, _, rest = raw.partition(b" ")
            yield int(index), rest


def _merged(paths: list[Path]) -> Iterator[tuple[int, bytes]]:
    """The parts' lines by index, each index once: the earliest part's (heapq.merge keeps the parts' order on a
    tie)."""
    last = -1
    for index, rest in heapq.merge(*(_read(p) for p in paths), key=itemgetter(0)):
        if index != last:
            last = index
            yield index, rest


def merge_parts(paths: list[Path], into: IO[bytes]) -> int:
    """Write the parts' lines (in the order they were recorded) by request index, each index once, as one part to
    `into`; the lines written."""
    written = 0
    for index, rest in _merged(paths):
        into.write(b"%d %s" % (index, rest))
        written += 1
    return written


def merge(
    paths: list[Path], output: IO[bytes], errors: IO[bytes], *, work_dir: Path, fan_in: int = MERGE_FAN_IN
) -> None:
    """Write the parts' lines (in the order they were recorded) by request index, each index once, to `output`
    and `errors`; more than `fan_in` parts are merged in rounds through files in `work_dir` (the parts are
    deleted as they are merged)."""
    for round_ in itertools.count():
        if len(paths) <= fan_in:
            break
        merged = []
        for first in range(0, len(paths), fan_in):
            group = paths[first : first + fan_in]
            path = work_dir / f"merged-{round_}-{first:06d}.part"
            with path.open("wb") as f:
                merge_parts(group, f)
            for done in group:
                done.unlink()
            merged.append(path)
        paths = merged
    for _, rest in _merged(paths):
        file, _, line = rest.partition(b" ")
        (output if file == b"output" else errors).write(line)
