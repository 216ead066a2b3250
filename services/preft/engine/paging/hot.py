"""Where a replica learns which adapters are hot, to prefetch them into host memory at start.

The source is injected: the registry's Hot RPC (time-decayed use counts), a Redis key holding a JSON list of
AdapterSpec (a ranking computed elsewhere), or a fixed list (tests, a pinned set of adapters).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import ValidationError
from redis.exceptions import RedisError

from preft.common.engine_contract import AdapterSpec

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


class RegistryHotSource:
    """The registry's hotness ranking (its Hot RPC), as specs; best effort like the others."""

    def __init__(self, registry_address: str, token: str, *, timeout_s: float = 5.0) -> None:
        self.registry_address, self._token, self._timeout_s = registry_address, token, timeout_s

    async def hot_specs(self, limit: int) -> list[AdapterSpec]:
        return await asyncio.to_thread(self._fetch, limit)

    def _fetch(self, limit: int) -> list[AdapterSpec]:
        from preft.api.v1 import registry_pb2 as pb
        from preft.common.errors import PreftError
        from preft.registry.client import RegistryClient
        from preft.registry.specs import adapter_spec

        try:
            with RegistryClient(self.registry_address, self._token, timeout_s=self._timeout_s) as client:
                entries = client.call("Hot", pb.HotRequest(limit=limit)).entries
        except PreftError as e:
            logger.warning("asking the registry for hot adapters failed, prefetching none: %s", e)
            return []
        return [adapter_spec(e.manifest) for e in entries]
