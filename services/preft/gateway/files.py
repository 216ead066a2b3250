"""The Files API's files: each tenant's own, their contents in S3 and their metadata in Redis.

S3 holds a file's bytes at `files/<tenant>/<id>` (``object_store``); Redis holds its object (OpenAI's file object, as
JSON) at `preft:file:<tenant>:<id>`, and the tenant's files by creation time at `preft:files:<tenant>` (a sorted set,
what listing pages through). An upload is stored in S3 first and then recorded (one Lua script, refused where the
tenant holds as many files as it may); a deletion forgets the file first and then removes its bytes. Files stay
until they are deleted. Another tenant's file is answered exactly as one that does not exist.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import redis.asyncio as aioredis

from preft.common.errors import InvalidArgument, NotFound, PreftError, ResourceExhausted
from preft.common.metrics import FILE_BYTES_STORED
from preft.gateway.object_store import ObjectStore
from preft.gateway.redis_client import guarded

log = logging.getLogger(__name__)

FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
UPLOAD_PURPOSES = ("batch", "user_data")  # what a client may upload (`batch_output` files are the batches' own)
OUTPUT_PURPOSE = "batch_output"
LIST_WINDOW = 256  # ids read at a time while a listing filters by purpose

# KEYS[1] = the file's key, KEYS[2] = the tenant's index; ARGV[1] = the file object's JSON, ARGV[2] = its score
# (created, ms), ARGV[3] = its id, ARGV[4] = the most files the tenant may hold (0: no limit; a file stored again
# does not count twice). -1 when stored, else the files the tenant holds.
_CREATE = """
local most = tonumber(ARGV[4])
if most > 0 and redis.call('EXISTS', KEYS[1]) == 0 then
  local held = redis.call('ZCARD', KEYS[2])
  if held >= most then return held end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return -1
"""


@dataclass(frozen=True)
class FilePage:
    files: list[dict[str, Any]]
    has_more: bool


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileStore:
    """Owns the tenants' files: their Redis keys and their S3 objects."""

    def __init__(self, redis: aioredis.Redis, objects: ObjectStore, *, timeout_s: float, max_per_tenant: int) -> None:
        self._redis = redis
        self._objects = objects
        self._timeout_s = timeout_s
        self.max_per_tenant = max_per_tenant
        self._create = redis.register_script(_CREATE)

    @staticmethod
    def _key(tenant: str, file_id: str) -> str:
        return f"preft:file:{tenant}:{file_id}"

    @staticmethod
    def _index(tenant: str) -> str:
        return f"preft:files:{tenant}"

    @staticmethod
    def object_key(tenant: str, file_id: str) -> str:
        return f"files/{tenant}/{file_id}"

    @staticmethod
    def _missing(file_id: str) -> NotFound:
        return NotFound(f"No such File object: {file_id}")

    async def create(
        self,
        tenant: str,
        source: BinaryIO,
        *,
        size: int,
        filename: str,
        purpose: str,
        file_id: str | None = None,
        limited: bool = True,
    ) -> dict[str, Any]:
        """Store `source` (`size` bytes) as a new file of the tenant (or again as `file_id`); its file object.
        `limited`: refused (429, nothing stored) where the tenant holds as many files as it may."""
        file_id = file_id or new_file_id()
        now_ms = int(time.time() * 1000)
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": now_ms // 1000,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }
        index = self._index(tenant)
        if limited:  # (checked before the upload too: a tenant at its limit sends nothing to S3)
            held = await guarded(self._redis.zcard(index), self._timeout_s)
            if held >= self.max_per_tenant:
                raise self._full(held)
        key = self.object_key(tenant, file_id)
        await self._objects.put(key, source)
        args = [json.dumps(obj, separators=(",", ":")), now_ms, file_id, self.max_per_tenant if limited else 0]
        # (where this fails, the object stays: the script may have run, and a file without its bytes is worse)
        held = await guarded(self._create(keys=[self._key(tenant, file_id), index], args=args), self._timeout_s)
        if held != -1:
            await self._forget_object(key)
            raise self._full(held)
        FILE_BYTES_STORED.labels(purpose=purpose).inc(size)
        return obj

    @staticmethod
    def _full(held: int) -> ResourceExhausted:
        return ResourceExhausted(f"this tenant holds {held} files, as many as it may; delete some first")

    async def _forget_object(self, key: str) -> None:
        with contextlib.suppress(PreftError):
            await self._objects.delete(key)

    async def get(self, tenant: str, file_id: str) -> dict[str, Any]:
        """The tenant's file object; NotFound for another tenant's, a deleted one or an id never given."""
        if not FILE_ID.match(file_id):
            raise self._missing(file_id)
        data = await guarded(self._redis.get(self._key(tenant, file_id)), self._timeout_s)
        if data is None:
            raise self._missing(file_id)
        return json.loads(data)

    async def page(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> FilePage:
        """Up to `limit` of the tenant's files (of `purpose`, where given) in creation `order`, after the file
        `after`."""
        index, desc = self._index(tenant), order == "desc"
        start = 0
        if after is not None:
            rank = self._redis.zrevrank if desc else self._redis.zrank
            at = await guarded(rank(index, after), self._timeout_s)
            if at is None:
                raise InvalidArgument(f"after: {after!r} is not one of your files")
            start = at + 1
        found: list[dict[str, Any]] = []
        stale: list[str] = []
        window = min(max(limit + 1, 16), LIST_WINDOW) if purpose else limit + 1
        while len(found) <= limit:
            ids = await guarded(self._redis.zrange(index, start, start + window - 1, desc=desc), self._timeout_s)
            if not ids:
                break
            start += len(ids)
            datas = await guarded(self._redis.mget([self._key(tenant, i) for i in ids]), self._timeout_s)
            for file_id, data in zip(ids, datas, strict=True):
                if data is None:  # (its key is gone, its index entry left behind)
                    stale.append(file_id)
                    continue
                obj = json.loads(data)
                if purpose is None or obj["purpose"] == purpose:
                    found.append(obj)
        if stale:
            with contextlib.suppress(PreftError):
                await guarded(self._redis.zrem(index, *stale), self._timeout_s)
        return FilePage(found[:limit], len(found) > limit)

    async def content(self, tenant: str, file_id: str) -> tuple[dict[str, Any], AsyncIterator[bytes]]:
        """The file object and its bytes, a chunk at a time."""
        obj = await self.get(tenant, file_id)
        try:
            return obj, await self._objects.open(self.object_key(tenant, file_id))
        except NotFound:
            raise self._missing(file_id) from None

    async def delete(self, tenant: str, file_id: str) -> None:
        """Forget the file, then remove its bytes (left behind, and logged, where S3 fails then)."""
        if not FILE_ID.match(file_id):
            raise self._missing(file_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._key(tenant, file_id))
        pipe.zrem(self._index(tenant), file_id)
        deleted, _ = await guarded(pipe.execute(), self._timeout_s)
        if not deleted:
            raise self._missing(file_id)
        key = self.object_key(tenant, file_id)
        try:
            await self._objects.delete(key)
        except PreftError as e:
            log.warning("file %s deleted, its object %s left in S3: %s", file_id, key, e.message)
