"""Stored responses (the Responses API's `store`): each answered response kept in Redis for `ttl_s`, readable by its
tenant only, with the conversation it ended (as chat turns) so that `previous_response_id` continues it.

Off unless the operator sets a TTL (`GatewaySettings.responses_store_ttl_s`), as in vLLM: a stored response holds the
prompt's text, which the gateway otherwise never keeps.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from preft.common.errors import NotFound
from preft.gateway.redis_client import guarded

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as it was answered
    conversation: list[dict[str, Any]]  # the chat turns it ended: earlier ones, its input, its output (no instructions)
    input_items: list[dict[str, Any]]  # its own input, as Responses items with ids


class ResponseStore:
    """Owns the stored responses' Redis keys (`preft:response:<tenant>:<id>`, each expiring after `ttl_s`)."""

    def __init__(self, redis: aioredis.Redis, *, ttl_s: float, timeout_s: float) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self._timeout_s = timeout_s

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    @staticmethod
    def _key(tenant: str, response_id: str) -> str:
        return f"preft:response:{tenant}:{response_id}"

    def _missing(self, response_id: str) -> NotFound:
        return NotFound(f"no stored response {response_id!r} (responses are kept {self.ttl_s:g} s)")

    async def save(self, tenant: str, stored: StoredResponse) -> None:
        data = json.dumps(dataclasses.asdict(stored), separators=(",", ":"))
        key = self._key(tenant, stored.response["id"])
        await guarded(self._redis.set(key, data, px=int(self.ttl_s * 1000)), self._timeout_s)

    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The tenant's stored response; NotFound for one that expired, was deleted, or is another tenant's."""
        if not self.enabled or not RESPONSE_ID.match(response_id):
            raise self._missing(response_id)
        data = await guarded(self._redis.get(self._key(tenant, response_id)), self._timeout_s)
        if data is None:
            raise self._missing(response_id)
        return StoredResponse(**json.loads(data))

    async def delete(self, tenant: str, response_id: str) -> None:
        if not self.enabled or not RESPONSE_ID.match(response_id):
            raise self._missing(response_id)
        if not await guarded(self._redis.delete(self._key(tenant, response_id)), self._timeout_s):
            raise self._missing(response_id)
