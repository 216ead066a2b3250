"""Stored responses (the Responses API's `store`): each answered response kept in Redis for `ttl_s`, readable by its
tenant only, with the conversation it ended (as chat turns) so that `previous_response_id` continues it.

Off unless the operator sets a TTL (`GatewaySettings.responses_store_ttl_s`), as in vLLM: a stored response holds the
prompt's text, which the gateway otherwise never keeps.

A background response (`background: true`) also has a run key while a gateway replica works on it: a lease that
replica renews, which holds `cancel` once a cancel is asked for (on whichever replica). A stored response still in
progress whose lease is gone was left by a replica that stopped. One created with `stream: true` keeps its stream's
events too (a Redis stream, `ttl_s` as the response), so a client can stream it again from any event.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from preft.common.errors import NotFound
from preft.gateway.core.redis_client import guarded
from preft.gateway.responses.protocol import ANSWERED, output_turns

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as it was answered
    conversation: list[dict[str, Any]]  # the chat turns it ended: earlier ones, its input, its output (no instructions)
    input_items: list[dict[str, Any]]  # its own input, as Responses items with ids
    events: bool = False  # its stream's events are kept (a background response created with stream: true)

    def at(self, response: dict[str, Any]) -> StoredResponse:
        """This one as `response` now stands: once answered, its output's turn continues the conversation."""
        turns = output_turns(response["output"]) if response["status"] in ANSWERED else []
        return dataclasses.replace(self, response=response, conversation=self.conversation + turns)


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

    async def save(self, tenant: str, stored: StoredResponse, *, only_existing: bool = False) -> None:
        """Store the response (`only_existing`: update it, unless it was deleted meanwhile)."""
        data = json.dumps(dataclasses.asdict(stored), separators=(",", ":"))
        key = self._key(tenant, stored.response["id"])
        await guarded(self._redis.set(key, data, px=int(self.ttl_s * 1000), xx=only_existing), self._timeout_s)

    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The tenant's stored response; NotFound for one that expired, was deleted, or is another tenant's."""
        if not self.enabled or not RESPONSE_ID.match(response_id):
            raise self._missing(response_id)
        data = await guarded(self._redis.get(self._key(tenant, response_id)), self._timeout_s)
        if data is None:
            raise self._missing(response_id)
        return StoredResponse(**json.loads(data))

    @staticmethod
    def _run_key(tenant: str, response_id: str) -> str:
        return f"preft:response-run:{tenant}:{response_id}"

    async def hold(self, tenant: str, response_id: str, lease_s: float) -> None:
        """Take the run's lease (a background response starts on this replica)."""
        key = self._run_key(tenant, response_id)
        await guarded(self._redis.set(key, "running", px=int(lease_s * 1000)), self._timeout_s)

    async def renew(self, runs: list[tuple[str, str]], lease_s: float) -> list[str | None]:
        """Renew the runs' leases; each one's state: `running`, `cancel` (asked for), or None (its lease was lost)."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant, response_id in runs:
            key = self._run_key(tenant, response_id)
            pipe.pexpire(key, int(lease_s * 1000))
            pipe.get(key)
        replies = await guarded(pipe.execute(), self._timeout_s)
        return replies[1::2]

    async def running(self, tenant: str, response_id: str) -> bool:
        """Whether a replica holds the run's lease."""
        return bool(await guarded(self._redis.exists(self._run_key(tenant, response_id)), self._timeout_s))

    async def ask_cancel(self, tenant: str, response_id: str) -> bool:
        """Mark the run to be cancelled; False where no replica runs it."""
        key = self._run_key(tenant, response_id)
        return bool(await guarded(self._redis.set(key, "cancel", xx=True, keepttl=True), self._timeout_s))

    async def release(self, tenant: str, response_id: str) -> None:
        await guarded(self._redis.delete(self._run_key(tenant, response_id)), self._timeout_s)

    @staticmethod
    def _events_key(tenant: str, response_id: str) -> str:
        return f"preft:response-events:{tenant}:{response_id}"

    async def add_events(self, tenant: str, response_id: str, events: list[dict[str, Any]]) -> None:
        """Keep a background response's stream events, in order."""
        key = self._events_key(tenant, response_id)
        pipe = self._redis.pipeline(transaction=False)
        for event in events:
            pipe.xadd(key, {"e": json.dumps(event, separators=(",", ":"))})
        pipe.pexpire(key, int(self.ttl_s * 1000))
        await guarded(pipe.execute(), self._timeout_s)

    async def events_after(self, tenant: str, response_id: str, after: str, count: int = 256) -> list[tuple[str, dict]]:
        """The kept events after the stream entry `after` ("0": from the first), with their entry ids."""
        key = self._events_key(tenant, response_id)
        entries = await guarded(self._redis.xrange(key, min=f"({after}", count=count), self._timeout_s)
        return [(entry_id, json.loads(fields["e"])) for entry_id, fields in entries]

    async def delete(self, tenant: str, response_id: str) -> None:
        if not self.enabled or not RESPONSE_ID.match(response_id):
            raise self._missing(response_id)
        keys = (self._key(tenant, response_id), self._events_key(tenant, response_id))
        if not await guarded(self._redis.delete(*keys), self._timeout_s):
            raise self._missing(response_id)
