"""Where a replica learns which adapters are hot, to prefetch them into host memory at start.

The source is injected: a Redis key holding a JSON list of AdapterSpec (written by whoever ranks hotness, e.g. a job
over the registry's Hot RPC), or a fixed list (tests, a pinned set of adapters).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import ValidationError
from redis.exceptions import RedisError

from preft.engine.contract import AdapterSpec

logger = logging.getLogger(__name__)


class HotSource(Protocol):
    """Hands out the hottest adapters, hottest first."""

    async def hot_specs(self, limit: int) -> list[AdapterSpec]: ...


class StaticHotSource:
    """A fixed list of adapters, hottest first."""

    def __init__(self, specs: Sequence[AdapterSpec]) -> None:
        self._specs = list(specs)

    async def hot_specs(self, limit: int) -> list[AdapterSpec]:
        return self._specs[:limit]


class RedisHotSource:
    """A Redis key holding a JSON list of AdapterSpec objects, hottest first; unreadable entries are skipped.

    Best effort: Redis down or the key missing means nothing to prefetch.
    """

    def __init__(self, client: Any, key: str) -> None:
        self._redis, self.key = client, key

    async def hot_specs(self, limit: int) -> list[AdapterSpec]:
        try:
            raw = await self._redis.get(self.key)
        except (RedisError, OSError) as e:
            logger.warning("reading hot adapters from Redis failed, prefetching none: %s", e)
            return []
        if raw is None:
            return []
        try:
            items = json.loads(raw)
        except ValueError:
            logger.warning("%s does not hold JSON; prefetching none", self.key)
            return []
        specs = []
        for item in items if isinstance(items, list) else []:
            try:
                specs.append(AdapterSpec.model_validate(item))
            except ValidationError:
                logger.warning("%s: skipping an entry that is not an AdapterSpec", self.key)
            if len(specs) >= limit:
                break
        return specs
