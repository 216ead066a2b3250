"""Compacting a running batch's recorded parts: a run of them merged into one part, swapped into their place.

Which parts merge, and when, is ``batches.tiers``'s. A compaction downloads the parts it picked, merges them by index
(``batches.parts.merge_parts``: each index once, as the part recorded first has it), uploads the merge as a new part,
and swaps it in (``BatchStore.swap_parts``: checked against the lease, and only where the list still holds those
parts at that place). The parts replaced are then deleted from S3 (left, and logged, where S3 fails: the batch's
end deletes them). Counts and the done lines do not change: no line moves in or out.

Each run has one compactor, a task beside its answering: compactions of a batch happen one at a time, never hold up
an answer, and stop with the run. Every object the list names is in S3 throughout: the replaced parts are deleted
only once the swap is known to be done, and the merged one only once it is known to be refused (the lease lost, or
the list changed); one a stop leaves behind (cut short between upload and swap) is named by no list, and is deleted
with the batch's objects when it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import tempfile
import uuid
from pathlib import Path

from preft.common.errors import PreftError
from preft.gateway.batches import parts as batch_parts
from preft.gateway.batches.parts import part_key
from preft.gateway.batches.store import BatchRecord, BatchStore, LeaseLost
from preft.gateway.batches.tiers import Pick, Tiers, merged_name
from preft.gateway.files.object_store import ObjectStore

log = logging.getLogger(__name__)


class Compactor:
    """Owns one run's compactions of its batch's recorded parts: when one is due, doing it, one at a time."""

    def __init__(
        self, store: BatchStore, objects: ObjectStore, batch: BatchRecord, token: str, *, tiers: Tiers
    ) -> None:
        self._store, self._objects = store, objects
        self._batch, self._token = batch, token
        self.tiers = tiers
        self._run = uuid.uuid4().hex[:16]  # (merged parts' names: unique, as written parts' are)
        self._numbers = itertools.count()
        self._known = 0  # (recorded parts: as last read, and one more for each part recorded since)
        self._due = asyncio.Event()
        self._due.set()  # (a run taken on may find many parts: look once at the start)

    def recorded(self) -> None:
        """A part was recorded: look at the parts where there may be enough for a compaction."""
        self._known += 1
        if self._known >= self.tiers.compact_at > 0:
            self._due.set()

    async def run(self) -> None:
        """Compact whenever due, until cancelled. LeaseLost where the lease is no longer this runner's; an outage
        of Redis or S3 is logged and tried again at the next part recorded."""
        while True:
            await self._due.wait()
            self._due.clear()
            try:
                while await self.compact_once():
                    pass
            except LeaseLost:
                raise
            except PreftError as e:
                log.warning("batch %s: its parts were not compacted: %s", self._batch.id, e.message)
            except Exception:  # (the batch goes on without compaction: finalizing merges whatever parts it finds)
                log.exception(
                    "batch %s: compacting its parts failed; not compacted any more in this run", self._batch.id
                )
                return

    async def compact_once(self) -> bool:
        """One compaction, where one is due; whether it was done (another may be due)."""
        names = await self._store.parts(self._batch.tenant, self._batch.id)
        self._known = len(names)
        pick = self.tiers.pick(names)
        if pick is None:
            return False
        name = merged_name(f"{self._run}-{next(self._numbers):06d}", pick.tier)
        # (cleanup errors ignored: a stop leaves its download and merge threads writing here for a moment)
        with tempfile.TemporaryDirectory(prefix="preft-compact-", ignore_cleanup_errors=True) as work:
            merged = Path(work) / "merged.part"
            paths = await batch_parts.download(self._objects, self._batch, pick.names, Path(work))
            lines = await asyncio.to_thread(self._merge, paths, merged)
            with merged.open("rb") as f:
                await self._objects.put(part_key(self._batch, name), f)
        if not await self._swap(pick, name):
            return False
        log.debug("batch %s: %d parts compacted into %s (%d lines)", self._batch.id, len(pick.names), name, lines)
        await self._delete([part_key(self._batch, n) for n in pick.names], "the parts compacted")
        return True

    @staticmethod
    def _merge(paths: list[Path], into: Path) -> int:
        with into.open("wb") as f:
            return batch_parts.merge_parts(paths, f)

    async def _swap(self, pick: Pick, name: str) -> bool:
        """Swap the merged part in; where refused, delete it (it is named by no list)."""
        try:
            swapped = await self._store.swap_parts(self._batch, self._token, pick.start, pick.names, name)
        except LeaseLost:
            await self._delete([part_key(self._batch, name)], "a merged part its runner could not record")
            raise
        if not swapped:
            log.warning("batch %s: its parts changed during a compaction; not swapped", self._batch.id)
            await self._delete([part_key(self._batch, name)], "a merged part not swapped in")
        return swapped

    async def _delete(self, keys: list[str], what: str) -> None:
        """Delete objects no list names (best effort: the batch's end deletes what is left)."""
        try:
            await self._objects.delete_many(keys)
        except PreftError as e:
            log.warning("batch %s: %s left in S3 until it ends: %s", self._batch.id, what, e.message)
