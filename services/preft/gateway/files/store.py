"""The Files API's files: each tenant's own, their contents in S3 and their metadata in Redis.

S3 holds a file's bytes at `files/<tenant>/<id>` (``object_store``); Redis holds its object (OpenAI's file object, as
JSON) at `preft:file:<tenant>:<id>`, and the tenant's files by creation time at `preft:files:<tenant>` (a sorted set,
what listing pages through). An upload is stored in S3 first and then recorded (one Lua script, refused where the
tenant holds as many files as it may); a deletion forgets the file first and then removes its bytes. Another
tenant's file is answered exactly as one that does not exist.

A file may expire (`expires_at`, Unix seconds; OpenAI's default: `batch` uploads after 30 days, others never). From
then on it answers as one that does not exist, while its keys and bytes are still there; its entry in
`preft:files:expiring` (a sorted set of `<tenant>:<id>` by when it is due) is how the replicas' sweepers
(``files.sweeper``) find it. A sweeper claims due entries atomically (their score moves `retry_s` on), forgets the
file's record (it no longer counts against the tenant's limit), deletes its bytes and then drops the entry; an
entry it did not finish (S3 failed, the replica stopped) is due again once `retry_s` passed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import redis.asyncio as aioredis

from preft.common.errors import InvalidArgument, NotFound, PreftError, ResourceExhausted
from preft.common.metrics import FILE_BYTES_STORED, FILES_EXPIRED
from preft.gateway.core.redis_client import guarded
from preft.gateway.files.object_store import ObjectStore

log = logging.getLogger(__name__)

FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
UPLOAD_PURPOSES = ("batch", "user_data")  # what a client may upload (`batch_output` files are the batches' own)
OUTPUT_PURPOSE = "batch_output"
LIST_WINDOW = 256  # ids read at a time while a listing filters by purpose
DEFAULT_EXPIRES_AFTER_S = {"batch": 30 * 86_400}  # OpenAI's: batch files expire after 30 days, others never
EXPIRES_AFTER_S = (3600, 30 * 86_400)  # the expiries a client may ask for (OpenAI's bounds: an hour to 30 days)
EXPIRING = "preft:files:expiring"

# KEYS[1] = the file's key, KEYS[2] = the tenant's index, KEYS[3] = the expiring set; ARGV[1] = the file object's
# JSON, ARGV[2] = its score (created, ms), ARGV[3] = its id, ARGV[4] = the most files the tenant may hold (0: no
# limit; a file stored again does not count twice), ARGV[5] = its expires_at ('': never), ARGV[6] = its entry in the
# expiring set. -1 when stored, else the files the tenant holds.
_CREATE = """
local most = tonumber(ARGV[4])
if most > 0 and redis.call('EXISTS', KEYS[1]) == 0 then
  local held = redis.call('ZCARD', KEYS[2])
  if held >= most then return held end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
if ARGV[5] == '' then
  redis.call('ZREM', KEYS[3], ARGV[6])
else
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6])
end
return -1
"""

# The file's expires_at, where its object (JSON) has one.
_EXPIRES_AT = """
local function expires_at(data)
  local at = cjson.decode(data)['expires_at']
  if type(at) == 'number' then return at end
  return nil
end
"""

# KEYS as _CREATE's; ARGV[1] = the file's id, ARGV[2] = its entry in the expiring set, ARGV[3] = now (s). 1 when
# deleted, 0 where there is no such file or it has expired (left to the sweepers).
_DELETE = (
    _EXPIRES_AT
    + """
local data = redis.call('GET', KEYS[1])
if not data then return 0 end
local at = expires_at(data)
if at and at <= tonumber(ARGV[3]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
return 1
"""
)

# KEYS[1] = the expiring set; ARGV[1] = now (s), ARGV[2] = when a claimed entry is due again, ARGV[3] = the most
# entries to claim. The entries claimed (`<tenant>:<id>`), due the soonest first.
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, entry in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[2], entry) end
return due
"""

# KEYS as _CREATE's; ARGV as _DELETE's. {1, purpose} when the file's record is forgotten here, {0, ''} where it is
# gone already (its bytes may be left: delete them), {-1, ''} where the file no longer expires by now (stored again
# since: its entry is set to its new expiry, or dropped).
_FORGET = (
    _EXPIRES_AT
    + """
local data = redis.call('GET', KEYS[1])
if not data then return {0, ''} end
local at = expires_at(data)
if not at then
  redis.call('ZREM', KEYS[3], ARGV[2])
  return {-1, ''}
end
if at > tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[3], at, ARGV[2])
  return {-1, ''}
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return {1, cjson.decode(data)['purpose']}
"""
)

# KEYS[1] = the expiring set; ARGV[1] = the entry, ARGV[2] = the score its claim gave it. Drops the entry unless it
# was set anew since (the file stored again).
_DROP = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""


@dataclass(frozen=True)
class FilePage:
    files: list[dict[str, Any]]
    has_more: bool


@dataclass(frozen=True)
class Claimed:
    """An expired file a sweeper claimed: whose, which, and the score its claim gave its entry."""

    tenant: str
    file_id: str
    due_again: float

    @property
    def entry(self) -> str:
        return _entry(self.tenant, self.file_id)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def _entry(tenant: str, file_id: str) -> str:
    return f"{tenant}:{file_id}"


def expired(obj: dict[str, Any], now_s: float) -> bool:
    """Whether the file object's expiry has come."""
    at = obj.get("expires_at")
    return at is not None and at <= now_s


class FileStore:
    """Owns the tenants' files: their Redis keys and their S3 objects."""

    def __init__(self, redis: aioredis.Redis, objects: ObjectStore, *, timeout_s: float, max_per_tenant: int) -> None:
        self._redis = redis
        self._objects = objects
        self._timeout_s = timeout_s
        self.max_per_tenant = max_per_tenant
        self._create = redis.register_script(_CREATE)
        self._delete = redis.register_script(_DELETE)
        self._claim = redis.register_script(_CLAIM)
        self._forget = redis.register_script(_FORGET)
        self._drop = redis.register_script(_DROP)

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
        expires_after_s: float | None = None,
    ) -> dict[str, Any]:
        """Store `source` (`size` bytes) as a new file of the tenant (or again as `file_id`); its file object.
        `limited`: refused (429, nothing stored) where the tenant holds as many files as it may. `expires_after_s`:
        the file expires this long after its creation (rounded up to a second); None: never."""
        if expires_after_s is not None and not expires_after_s > 0:
            raise ValueError(f"expires_after_s must be positive, not {expires_after_s}")
        file_id = file_id or new_file_id()
        now_ms = int(time.time() * 1000)
        created_at = now_ms // 1000
        expires_at = None if expires_after_s is None else created_at + math.ceil(expires_after_s)
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": created_at,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": expires_at,
        }
        index = self._index(tenant)
        if limited:  # (checked before the upload too: a tenant at its limit sends nothing to S3)
            held = await guarded(self._redis.zcard(index), self._timeout_s)
            if held >= self.max_per_tenant:
                raise self._full(held)
        key = self.object_key(tenant, file_id)
        await self._objects.put(key, source)
        args = [
            json.dumps(obj, separators=(",", ":")),
            now_ms,
            file_id,
            self.max_per_tenant if limited else 0,
            "" if expires_at is None else expires_at,
            _entry(tenant, file_id),
        ]
        keys = [self._key(tenant, file_id), index, EXPIRING]
        # (where this fails, the object stays: the script may have run, and a file without its bytes is worse)
        held = await guarded(self._create(keys=keys, args=args), self._timeout_s)
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
        """The tenant's file object; NotFound for another tenant's, a deleted or expired one or an id never given."""
        if not FILE_ID.match(file_id):
            raise self._missing(file_id)
        data = await guarded(self._redis.get(self._key(tenant, file_id)), self._timeout_s)
        if data is None:
            raise self._missing(file_id)
        obj = json.loads(data)
        if expired(obj, time.time()):
            raise self._missing(file_id)
        return obj

    async def page(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> FilePage:
        """Up to `limit` of the tenant's files (of `purpose`, where given) in creation `order`, after the file
        `after`; expired files are left out."""
        index, desc = self._index(tenant), order == "desc"
        now_s = time.time()
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
                if (purpose is None or obj["purpose"] == purpose) and not expired(obj, now_s):
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
        """Forget the file, then remove its bytes (left behind, and logged, where S3 fails then); an expired file is
        NotFound (the sweepers remove it)."""
        if not FILE_ID.match(file_id):
            raise self._missing(file_id)
        keys = [self._key(tenant, file_id), self._index(tenant), EXPIRING]
        args = [file_id, _entry(tenant, file_id), time.time()]
        if not await guarded(self._delete(keys=keys, args=args), self._timeout_s):
            raise self._missing(file_id)
        key = self.object_key(tenant, file_id)
        try:
            await self._objects.delete(key)
        except PreftError as e:
            log.warning("file %s deleted, its object %s left in S3: %s", file_id, key, e.message)

    async def claim_expired(self, *, limit: int, retry_s: float) -> list[Claimed]:
        """Claim up to `limit` expired files for this sweeper (no other claims them for `retry_s`), the soonest
        due first."""
        now_s = time.time()
        due_again = now_s + retry_s
        entries = await guarded(self._claim(keys=[EXPIRING], args=[now_s, due_again, limit]), self._timeout_s)
        claimed = []
        for entry in entries:
            tenant, _, file_id = entry.rpartition(":")
            claimed.append(Claimed(tenant, file_id, due_again))
        return claimed

    async def remove_expired(self, claimed: Claimed) -> bool:
        """Forget the claimed file's record, delete its bytes, then drop its entry; False where the file no longer
        expires by now (stored again since: nothing removed). A failure of S3 (or Redis) is raised and leaves the
        entry claimed: due again once the claim's `retry_s` passed."""
        tenant, file_id = claimed.tenant, claimed.file_id
        keys = [self._key(tenant, file_id), self._index(tenant), EXPIRING]
        args = [file_id, claimed.entry, time.time()]
        state, purpose = await guarded(self._forget(keys=keys, args=args), self._timeout_s)
        if state == -1:
            return False
        if state == 1:  # (0: a claim before this one forgot the record, and did not finish)
            FILES_EXPIRED.labels(purpose=purpose).inc()
        with contextlib.suppress(NotFound):
            await self._objects.delete(self.object_key(tenant, file_id))
        await guarded(self._drop(keys=[EXPIRING], args=[claimed.entry, claimed.due_again]), self._timeout_s)
        return True
