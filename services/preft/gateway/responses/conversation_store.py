"""Conversations (OpenAI's Conversations API): a tenant's list of Responses items, kept in Redis, that a response
given `conversation` continues and then extends with its input and output.

Kept where the server stores responses (`GatewaySettings.responses_store_ttl_s`), each conversation expiring that
long after its last change. Keys per conversation: `preft:conversation:<tenant>:<id>` (a hash: created_at,
metadata, the items' sequence and their bytes), `...-order:...` (the item ids by sequence) and `...-items:...` (id →
item JSON); per tenant, `preft:conversations:<tenant>` (its conversations, each scored with when it expires). Every
change runs as one Lua script (deleting, as one transaction): atomic, and a refused change leaves the conversation as
it was. Limits: the items and their bytes a conversation holds (a 400 past them), the conversations a tenant holds
(a 429).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis

from preft.common.errors import InvalidArgument, NotFound, ResourceExhausted
from preft.gateway.core.redis_client import guarded

CONVERSATION_ID = re.compile(r"^conv_[0-9a-f]{32}$")

# Each script: KEYS the conversation's three keys and the tenant's index; ARGV[1] now (ms), ARGV[2] the TTL (ms),
# ARGV[3] the conversation's id. Each change renews the conversation's keys and its entry in the index.
_RENEW = """
local function renew()
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
  redis.call('ZADD', KEYS[4], tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[3])
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
end
local function add(first, seq)
  for i = first, #ARGV, 2 do
    seq = seq + 1
    redis.call('ZADD', KEYS[2], seq, ARGV[i])
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  end
end
"""
# ARGV[4..]: the tenant's most conversations, created_at, metadata JSON, bytes, then item id and JSON pairs.
# Returns -1 (created) or the conversations the tenant holds (refused: as many as it may).
_CREATE = (
    _RENEW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[4])
if held >= tonumber(ARGV[4]) then return held end
redis.call('HSET', KEYS[1], 'created_at', ARGV[5], 'metadata', ARGV[6], 'bytes', ARGV[7], 'seq', (#ARGV - 7) / 2)
add(8, 0)
renew()
return -1
"""
)
# ARGV[4..]: most items and most bytes (0: no limit), then item id and JSON pairs.
# Returns {0} (added), {1} (no such conversation) or {2, items held, bytes held} (past a limit: nothing added).
_ADD = (
    _RENEW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {1} end
local n, size = (#ARGV - 5) / 2, 0
for i = 7, #ARGV, 2 do size = size + #ARGV[i] end
local held = redis.call('ZCARD', KEYS[2])
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes'))
local most_items, most_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
if (most_items > 0 and held + n > most_items) or (most_bytes > 0 and bytes + size > most_bytes) then
  return {2, held, bytes}
end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', n) - n
redis.call('HINCRBY', KEYS[1], 'bytes', size)
add(6, seq)
renew()
return {0}
"""
)
# ARGV[4..]: metadata JSON or "" (left as it is), an item id to delete or "".
# Returns the conversation's hash fields, or false (no such conversation), or -1 (no such item: nothing changed).
_CHANGE = (
    _RENEW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if ARGV[5] ~= '' then
  local size = redis.call('HSTRLEN', KEYS[3], ARGV[5])
  if redis.call('ZREM', KEYS[2], ARGV[5]) == 0 then return -1 end
  redis.call('HDEL', KEYS[3], ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'bytes', -size)
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'metadata', ARGV[4]) end
renew()
return redis.call('HGETALL', KEYS[1])
"""
)


@dataclass(frozen=True)
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    size: int = 0  # the bytes its items take as kept (`item_json`)

    def as_object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    @classmethod
    def from_fields(cls, conversation_id: str, fields: dict[str, str]) -> Conversation:
        return cls(conversation_id, int(fields["created_at"]), json.loads(fields["metadata"]), int(fields["bytes"]))


@dataclass(frozen=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


@dataclass(frozen=True)
class ConversationLimits:
    items: int  # items one conversation holds
    bytes: int  # bytes of items (their JSON) one conversation holds
    per_tenant: int  # conversations one tenant holds


class ConversationStore:
    """Owns the conversations' Redis keys; each read or change of another tenant's conversation is a NotFound."""

    def __init__(self, redis: aioredis.Redis, *, ttl_s: float, timeout_s: float, limits: ConversationLimits) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self.limits = limits
        self._timeout_s = timeout_s
        self._create = redis.register_script(_CREATE)
        self._add = redis.register_script(_ADD)
        self._change = redis.register_script(_CHANGE)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    @staticmethod
    def _keys(tenant: str, conversation_id: str) -> list[str]:
        return [
            f"preft:conversation:{tenant}:{conversation_id}",
            f"preft:conversation-order:{tenant}:{conversation_id}",
            f"preft:conversation-items:{tenant}:{conversation_id}",
            f"preft:conversations:{tenant}",
        ]

    def _script_args(self, conversation_id: str) -> list[Any]:
        return [int(time.time() * 1000), int(self.ttl_s * 1000), conversation_id]

    def _missing(self, conversation_id: str) -> NotFound:
        return NotFound(f"no conversation {conversation_id!r} (conversations are kept {self.ttl_s:g} s after a change)")

    def _checked(self, tenant: str, conversation_id: str) -> list[str]:
        """The conversation's keys (NotFound for an id this store never gives)."""
        if not self.enabled or not CONVERSATION_ID.match(conversation_id):
            raise self._missing(conversation_id)
        return self._keys(tenant, conversation_id)

    def check_room(self, items: int, size: int) -> None:
        """InvalidArgument where a conversation of `items` items of `size` bytes would be too large."""
        if items > self.limits.items:
            raise InvalidArgument(
                f"conversation: it would hold {items} items; a conversation holds at most {self.limits.items}"
            )
        if size > self.limits.bytes:
            raise InvalidArgument(
                f"conversation: its items would take {size} bytes; a conversation holds at most {self.limits.bytes}"
            )

    async def create(
        self, tenant: str, conversation_id: str, metadata: dict[str, str], items: list[dict[str, Any]]
    ) -> Conversation:
        """A new conversation holding `items` (each with its id); ResourceExhausted where the tenant holds as many
        as it may."""
        conversation = Conversation(conversation_id, int(time.time()), metadata)
        stored = [(item["id"], item_json(item)) for item in items]
        size = sum(len(data.encode()) for _, data in stored)
        self.check_room(len(items), size)
        args = [*self._script_args(conversation_id), self.limits.per_tenant, conversation.created_at]
        args += [json.dumps(metadata), size, *(part for pair in stored for part in pair)]
        held = await guarded(self._create(keys=self._keys(tenant, conversation_id), args=args), self._timeout_s)
        if held != -1:
            raise ResourceExhausted(
                f"this tenant holds {held} conversations, as many as it may; delete some or let them expire"
            )
        return conversation

    async def get(self, tenant: str, conversation_id: str) -> Conversation:
        head = self._checked(tenant, conversation_id)[0]
        fields = await guarded(self._redis.hgetall(head), self._timeout_s)
        if not fields:
            raise self._missing(conversation_id)
        return Conversation.from_fields(conversation_id, fields)

    async def update(self, tenant: str, conversation_id: str, metadata: dict[str, str]) -> Conversation:
        """Replace the conversation's metadata."""
        return await self._changed(tenant, conversation_id, json.dumps(metadata), "")

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> Conversation:
        """Remove one item; the conversation as it then is."""
        return await self._changed(tenant, conversation_id, "", item_id)

    async def _changed(self, tenant: str, conversation_id: str, metadata: str, item_id: str) -> Conversation:
        keys = self._checked(tenant, conversation_id)
        args = [*self._script_args(conversation_id), metadata, item_id]
        reply = await guarded(self._change(keys=keys, args=args), self._timeout_s)
        if reply is None:
            raise self._missing(conversation_id)
        if reply == -1:
            raise NotFound(f"no item {item_id!r} in conversation {conversation_id!r}")
        return Conversation.from_fields(conversation_id, dict(zip(reply[::2], reply[1::2], strict=True)))

    async def delete(self, tenant: str, conversation_id: str) -> None:
        *own, index = self._checked(tenant, conversation_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(*own)
        pipe.zrem(index, conversation_id)
        deleted, _ = await guarded(pipe.execute(), self._timeout_s)
        if not deleted:
            raise self._missing(conversation_id)

    async def add_items(
        self, tenant: str, conversation_id: str, items: list[dict[str, Any]], *, limited: bool = True
    ) -> None:
        """Append `items` (each with its id); `limited`: refused (nothing added) past the conversation's limits."""
        keys = self._checked(tenant, conversation_id)
        stored = [item_json(item) for item in items]
        args = [*self._script_args(conversation_id), *((self.limits.items, self.limits.bytes) if limited else (0, 0))]
        for item, data in zip(items, stored, strict=True):
            args += [item["id"], data]
        reply = await guarded(self._add(keys=keys, args=args), self._timeout_s)
        if reply[0] == 1:
            raise self._missing(conversation_id)
        if reply[0] == 2:
            self.check_room(reply[1] + len(items), reply[2] + sum(len(data.encode()) for data in stored))

    async def items(self, tenant: str, conversation_id: str) -> tuple[Conversation, list[dict[str, Any]]]:
        """The conversation (its items' bytes with it) and every item, oldest first (NotFound where it is not)."""
        conversation = await self.get(tenant, conversation_id)
        return conversation, (await self.page(tenant, conversation_id, after=None, limit=None, order="asc")).items

    async def page(
        self,
        tenant: str,
        conversation_id: str,
        *,
        after: str | None,
        limit: int | None,
        order: Literal["asc", "desc"],
    ) -> ItemPage:
        """Up to `limit` items (None: all) in `order`, after the item `after`."""
        _, order_key, items_key, _ = self._checked(tenant, conversation_id)
        start = 0
        if after is not None:
            rank = self._redis.zrank if order == "asc" else self._redis.zrevrank
            at = await guarded(rank(order_key, after), self._timeout_s)
            if at is None:
                raise InvalidArgument(f"after: {after!r} is not an item of this conversation")
            start = at + 1
        stop = -1 if limit is None else start + limit  # (one more than asked: whether there is more)
        ids = await guarded(self._redis.zrange(order_key, start, stop, desc=order == "desc"), self._timeout_s)
        more = limit is not None and len(ids) > limit
        ids = ids[:limit] if more else ids
        stored = await guarded(self._redis.hmget(items_key, ids), self._timeout_s) if ids else []
        return ItemPage([json.loads(item) for item in stored if item is not None], more)

    async def item(self, tenant: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        items_key = self._checked(tenant, conversation_id)[2]
        stored = await guarded(self._redis.hget(items_key, item_id), self._timeout_s)
        if stored is None:
            await self.get(tenant, conversation_id)  # (NotFound for the conversation first)
            raise NotFound(f"no item {item_id!r} in conversation {conversation_id!r}")
        return json.loads(stored)


def item_json(item: dict[str, Any]) -> str:
    """An item as it is kept (its size counts against the conversation's bytes)."""
    return json.dumps(item, separators=(",", ":"))
