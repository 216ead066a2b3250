"""Adapter use counts for the registry's hotness ranking, sent in batches and never in a request's way."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from preft.common.errors import PreftError
from preft.gateway.core.flushing import flush_every
from preft.gateway.core.registry import AsyncRegistry

log = logging.getLogger(__name__)


class UsageRecorder:
    """Owns the uses counted since the last flush; `run()` sends them every `interval_s` as RecordUse calls
    (weight = uses), one per adapter version, concurrently. Failed sends are dropped: hotness is advisory."""

    def __init__(self, registry: AsyncRegistry, *, interval_s: float) -> None:
        self._registry = registry
        self._interval_s = interval_s
        self._pending: Counter[tuple[str, str, int]] = Counter()

    def record(self, owner: str, name: str, version: int) -> None:
        self._pending[(owner, name, version)] += 1

    async def flush(self) -> None:
        batch, self._pending = self._pending, Counter()
        if not batch:
            return
        results = await asyncio.gather(
            *(self._registry.record_use(t, n, v, float(w)) for (t, n, v), w in batch.items()), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            unexpected = [r for r in failed if not isinstance(r, PreftError)]
            log.warning("dropped %d of %d adapter use records (%s)", len(failed), len(batch), failed[0])
            if unexpected:
                log.error("unexpected error recording adapter use", exc_info=unexpected[0])

    async def run(self) -> None:
        """Flush every interval until cancelled, then once more (``flushing.flush_every``)."""
        await flush_every(self._interval_s, self.flush)
