"""Conversations (OpenAI's Conversations API): a tenant's list of Responses items, kept in Redis, that a response
given `conversation` continues and then extends with its input and output.

Kept where the server stores responses (`GatewaySettings.responses_store_ttl_s`), each conversation expiring that
long after its last change. Keys per conversation: `preft:conversation:<tenant>:<id>` (a hash: created_at,
metadata, the items' sequence), `...-order:...` (the item ids by sequence) and `...-items:...` (id → item JSON).
Changes that must see the conversation whole (adding items, deleting one) run as Lua scripts: atomic, and a
refused change leaves the conversation as it was.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis

from preft.common.errors import InvalidArgument, NotFound
from preft.gateway.redis_client import guarded

CONVERSATION_ID = re.compile(r"^conv_[0-9a-f]{32}$")

# KEYS: conversation, order, items. ARGV: ttl ms, most items (0: no limit), then item id and JSON pairs.
# Returns the number of items after, or -1 (no such conversation), or -2 - the items held (past the limit: nothing
# added).
_ADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local n = (#ARGV - 2) / 2
local held = redis.call('ZCARD', KEYS[2])
local most = tonumber(ARGV[2])
if most > 0 and held + n > most then return -2 - held end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', n)
for i = 1, n do
  redis.call('ZADD', KEYS[2], seq - n + i, ARGV[1 + 2 * i])
  redis.call('HSET', KEYS[3], ARGV[1 + 2 * i], ARGV[2 + 2 * i])
end
for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ARGV[1]) end
return held + n
"""
# KEYS: conversation, order, items. ARGV: ttl ms, metadata JSON or "" (left as it is), item id to delete or "".
# Returns the conversation's hash fields, or false (no such conversation), or -1 (no such item: nothing changed).
_CHANGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if ARGV[3] ~= '' then
  if redis.call('ZREM', KEYS[2], ARGV[3]) == 0 then return -1 end
  redis.call('HDEL', KEYS[3], ARGV[3])
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'metadata', ARGV[2]) end
for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ARGV[1]) end
return redis.call('HGETALL', KEYS[1])
"""


@dataclass(frozen=True)
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]

    def as_object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    @classmethod
    def from_fields(cls, conversation_id: str, fields: dict[str, str]) -> Conversation:
        return cls(conversation_id, int(fields["created_at"]), json.loads(fields["metadata"]))


@dataclass(frozen=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


class ConversationStore:
    """Owns the conversations' Redis keys; each read or change of another tenant's conversation is a NotFound."""

    def __init__(self, redis: aioredis.Redis, *, ttl_s: float, timeout_s: float, max_items: int) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self.max_items = max_items
        self._timeout_s = timeout_s
        self._add = redis.register_script(_ADD)
        self._change = redis.register_script(_CHANGE)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    @staticmethod
    def _keys(tenant: str, conversation_id: str) -> list[str]:
        return [
            f"preft:conversation:{tenant}:{conversation_id}",
            f"preft:conversation-order:{tenant}:{conversation_id}",
            f"preft:conversation-items:{tenant}:{conversation_id}",
        ]

    def _missing(self, conversation_id: str) -> NotFound:
        return NotFound(f"no conversation {conversation_id!r} (conversations are kept {self.ttl_s:g} s after a change)")

    def _checked(self, conversation_id: str) -> str:
        if not self.enabled or not CONVERSATION_ID.match(conversation_id):
            raise self._missing(conversation_id)
        return conversation_id

    async def create(
        self, tenant: str, conversation_id: str, metadata: dict[str, str], items: list[dict[str, Any]]
    ) -> Conversation:
        """A new conversation holding `items` (each with its id)."""
        conversation = Conversation(conversation_id, int(time.time()), metadata)
        self.check_room(len(items))
        head, order, stored = self._keys(tenant, conversation_id)
        pipe = self._redis.pipeline(transaction=True)
        fields = {"created_at": conversation.created_at, "metadata": json.dumps(metadata), "seq": len(items)}
        pipe.hset(head, mapping=fields)
        if items:
            pipe.zadd(order, {item["id"]: seq for seq, item in enumerate(items, 1)})
            pipe.hset(stored, mapping={item["id"]: _json(item) for item in items})
        for key in (head, order, stored):
            pipe.pexpire(key, self._ttl_ms)
        await guarded(pipe.execute(), self._timeout_s)
        return conversation

    def check_room(self, items: int) -> None:
        """InvalidArgument where a conversation of `items` items would be too long."""
        if items > self.max_items:
            raise InvalidArgument(
                f"conversation: it would hold {items} items; a conversation holds at most {self.max_items}"
            )

    async def get(self, tenant: str, conversation_id: str) -> Conversation:
        fields = await guarded(
            self._redis.hgetall(self._keys(tenant, self._checked(conversation_id))[0]), self._timeout_s
        )
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
        keys = self._keys(tenant, self._checked(conversation_id))
        reply = await guarded(self._change(keys=keys, args=[self._ttl_ms, metadata, item_id]), self._timeout_s)
        if reply is None:
            raise self._missing(conversation_id)
        if reply == -1:
            raise NotFound(f"no item {item_id!r} in conversation {conversation_id!r}")
        return Conversation.from_fields(conversation_id, dict(zip(reply[::2], reply[1::2], strict=True)))

    async def delete(self, tenant: str, conversation_id: str) -> None:
        keys = self._keys(tenant, self._checked(conversation_id))
        if not await guarded(self._redis.delete(*keys), self._timeout_s):
            raise self._missing(conversation_id)

    async def add_items(
        self, tenant: str, conversation_id: str, items: list[dict[str, Any]], *, limited: bool = True
    ) -> None:
        """Append `items` (each with its id); `limited`: refused (nothing added) past `max_items`."""
        keys = self._keys(tenant, self._checked(conversation_id))
        args: list[Any] = [self._ttl_ms, self.max_items if limited else 0]
        for item in items:
            args += [item["id"], _json(item)]
        held = await guarded(self._add(keys=keys, args=args), self._timeout_s)
        if held == -1:
            raise self._missing(conversation_id)
        if held <= -2:
            self.check_room(-held - 2 + len(items))

    async def items(self, tenant: str, conversation_id: str) -> list[dict[str, Any]]:
        """Every item, oldest first (NotFound where the conversation is not)."""
        await self.get(tenant, conversation_id)
        return (await self.page(tenant, conversation_id, after=None, limit=None, order="asc")).items

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
        _, order_key, items_key = self._keys(tenant, self._checked(conversation_id))
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
        items_key = self._keys(tenant, self._checked(conversation_id))[2]
        stored = await guarded(self._redis.hget(items_key, item_id), self._timeout_s)
        if stored is None:
            await self.get(tenant, conversation_id)  # (NotFound for the conversation first)
            raise NotFound(f"no item {item_id!r} in conversation {conversation_id!r}")
        return json.loads(stored)


def _json(item: dict[str, Any]) -> str:
    return json.dumps(item, separators=(",", ":"))
