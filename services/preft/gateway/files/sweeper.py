"""Removing expired files: a sweeper on each gateway replica, any of which may remove any tenant's file.

Every `period_s` (first at start) the sweeper claims up to `round_max` files whose expiry has come (``files.store``: one
atomic claim, so replicas sharing one Redis never take the same file) and removes them, `concurrency` at a time:
record first, then bytes. A file it could not remove (S3 or Redis failed) is logged and left claimed; it is due
again `retry_s` later, on whichever replica claims it then. Files expired but not yet removed already answer 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from preft.common.errors import PreftError
from preft.gateway.files.store import Claimed, FileStore

log = logging.getLogger(__name__)

ROUND_MAX = 500  # files claimed per round (more wait for the next round)
CONCURRENCY = 8  # files removed at once
RETRY_S = 300.0  # a claimed file not removed (S3 failed, the replica stopped) is claimed again this long after (past
# the longest S3 delete, about 2 x (connect + read timeouts): no second sweeper takes a file still being removed)


class FileSweeper:
    """Owns this replica's sweeping task: its rounds, and what each removed."""

    def __init__(
        self,
        files: FileStore,
        *,
        period_s: float,
        round_max: int = ROUND_MAX,
        concurrency: int = CONCURRENCY,
        retry_s: float = RETRY_S,
    ) -> None:
        self._files = files
        self.period_s, self.round_max, self.concurrency, self.retry_s = period_s, round_max, concurrency, retry_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="preft-file-sweeper")

    async def close(self) -> None:
        """Stop the rounds (a file claimed and not removed is due again `retry_s` later)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except PreftError as e:
                log.warning("files: this sweep was cut short: %s", e.message)
            except Exception:
                log.exception("files: this sweep failed")
            await asyncio.sleep(self.period_s)

    async def sweep(self) -> int:
        """One round: claim expired files and remove them; how many this round removed (their bytes deleted)."""
        claimed = await self._files.claim_expired(limit=self.round_max, retry_s=self.retry_s)
        room = asyncio.Semaphore(self.concurrency)

        async def remove(file: Claimed) -> bool:
            async with room:
                try:
                    return await self._files.remove_expired(file)
                except PreftError as e:
                    log.warning(
                        "file %s of %s expired; not removed (again in %.0f s): %s",
                        file.file_id,
                        file.tenant,
                        self.retry_s,
                        e.message,
                    )
                    return False

        return sum(await asyncio.gather(*(remove(file) for file in claimed)))
