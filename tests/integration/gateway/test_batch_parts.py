"""A running batch's parts over real Redis and S3: recording one is fenced by the lease and counts each line once,
a part that was never recorded leaves nothing behind where its runner can tell, and finalizing merges the recorded
parts each line once, as the part recorded first has it."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from preft.common import metering
from preft.gateway.batches import parts as batch_parts
from preft.gateway.batches.parts import PartWriter, part_key, parts_prefix
from preft.gateway.batches.store import BatchRecord, BatchStore, LeaseLost, LineRecord
from preft.gateway.core.metering import Metered
from preft.gateway.files.object_store import ObjectStore

TOKEN = "runner-token"


def _line(i: int, text: str) -> dict[str, Any]:
    return {"id": f"batch_req_{i}", "custom_id": f"line-{i}", "response": {"body": {"text": text}}, "error": None}


def _answer(i: int, text: str = "first", file: str = "output") -> LineRecord:
    return LineRecord(i, file, _line(i, text), input_tokens=2, output_tokens=3)


async def _batch(redis: aioredis.Redis, batch_id: str = "batch_" + "1" * 32, total: int = 8) -> BatchRecord:
    """A batch in progress whose lease this test's runner holds (written as BatchStore writes them)."""
    spec = {"id": batch_id, "endpoint": "/v1/completions"}
    fields = {"spec": json.dumps(spec), "status": "in_progress", "total": str(total)}
    await redis.hset(f"preft:batch:acme:{batch_id}", mapping=fields)
    await redis.set(f"preft:batch-lease:acme:{batch_id}", TOKEN)
    return BatchRecord("acme", spec, fields)


def _run(scenario: Any, redis_url: str, s3_bucket: Any, objects_cls: type[ObjectStore] = ObjectStore) -> None:
    async def main() -> None:
        redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        store = BatchStore(redis, timeout_s=2.0, keep_s=60.0, max_open_per_tenant=100)
        try:
            await scenario(redis, store, objects_cls(s3_bucket.settings()))
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_a_recorded_part_counts_each_line_once_and_only_under_the_lease(redis_url, s3_bucket):
    async def scenario(redis: aioredis.Redis, store: BatchStore, _: ObjectStore) -> None:
        batch = await _batch(redis)
        assert await store.record_part(batch, TOKEN, "a", [_answer(0), _answer(1), _answer(5, file="error")]) == 3
        assert await store.record_part(batch, TOKEN, "b", [_answer(1, "again", "error"), _answer(2)]) == 1
        with pytest.raises(LeaseLost):
            await store.record_part(batch, "another-runner", "c", [_answer(3)])
        got = await store.get("acme", batch.id)
        assert (got.count("completed"), got.count("failed")) == (3, 1)  # (line 1 counted once, as part a had it)
        assert (got.count("input_tokens"), got.count("output_tokens")) == (8, 12)
        assert await store.parts("acme", batch.id) == ["a", "b"]
        done = await store.done_lines("acme", batch.id)
        assert [i for i in range(16) if i in done] == [0, 1, 2, 5] and len(done) == 4

        await store.move(batch, TOKEN, from_statuses=("in_progress",), to="completed", ends=True)
        assert await redis.keys("preft:batch*") == [f"preft:batch:acme:{batch.id}"]  # (bitmap, parts, lease: gone)
        assert await store.parts("acme", batch.id) == [] and len(await store.done_lines("acme", batch.id)) == 0

    _run(scenario, redis_url, s3_bucket)


def test_a_recorded_part_meters_its_new_lines_generations_once_on_the_tenants_usage(redis_url, s3_bucket):
    """A line's generations reach the tenant's usage (minute, hour, day, month: the meter's layout) with the part that
    records the line, in the same script: a line answered again and recorded again adds nothing, nor does a part
    refused for the lease; lines with no generation (refused, expired) add no request."""

    async def scenario(redis: aioredis.Redis, store: BatchStore, _: ObjectStore) -> None:
        batch = await _batch(redis)
        base, adapter = Metered("base", 10, 4), Metered("acme/pre@v1", 7, 2)
        first = [
            dataclasses.replace(_answer(0), metered=(base,)),
            dataclasses.replace(_answer(1), metered=(adapter, adapter)),  # (two generations: a Responses tool turn)
            _answer(2, file="error"),
        ]
        before = int(time.time())
        assert await store.record_part(batch, TOKEN, "a", first) == 3
        again = [dataclasses.replace(_answer(1, "again"), metered=(Metered("base", 99, 99),))]
        assert (
            await store.record_part(batch, TOKEN, "b", [*again, dataclasses.replace(_answer(3), metered=(base,))]) == 1
        )
        with pytest.raises(LeaseLost):
            await store.record_part(batch, "another-runner", "c", [dataclasses.replace(_answer(4), metered=(base,))])
        after = int(time.time())

        day = metering.day_of(after)
        rows = {r.model: r for r in metering.parse_day(day, await redis.hgetall(metering.day_key("acme", day)))}
        assert rows == {
            "base": metering.ModelUsage(day, "base", requests=2, input_tokens=20, output_tokens=8),
            "acme/pre@v1": metering.ModelUsage(day, "acme/pre@v1", requests=2, input_tokens=14, output_tokens=4),
        }
        minutes = {m // 60 * 60 for m in (before, after)}
        in_minutes = [await redis.hgetall(metering.minute_key("acme", m)) for m in sorted(minutes)]
        assert sum(int(f.get("requests|base", 0)) for f in in_minutes) == 2
        hour = await redis.hgetall(metering.hour_key("acme", after // 3600 * 3600))
        assert (hour.get("requests|acme/pre@v1"), hour.get("output_tokens|base")) == ("2", "8")
        month = metering.month_key("acme", day)
        assert int(await redis.get(month)) == 20 + 8 + 14 + 4  # (what admission checks a monthly quota against)
        for key in (month, metering.day_key("acme", day)):
            assert await redis.ttl(key) > 30 * metering.DAY_S
        got = await store.get("acme", batch.id)
        assert (got.count("completed"), got.count("failed")) == (3, 1)

    _run(scenario, redis_url, s3_bucket)


def test_parts_written_by_two_runs_merge_each_line_once_as_recorded_first(redis_url, s3_bucket, tmp_path: Path):
    async def scenario(redis: aioredis.Redis, store: BatchStore, objects: ObjectStore) -> None:
        batch = await _batch(redis)
        first = PartWriter(store, objects, batch, TOKEN, part_lines=3, part_s=60)
        await first.add([_answer(4), _answer(0)])
        assert first.held == 2 and await store.parts("acme", batch.id) == []
        await first.add([_answer(2, file="error")])  # (a part's worth: written, sorted, and recorded)
        assert first.held == 0
        (name,) = await store.parts("acme", batch.id)
        body = await objects.open(part_key(batch, name))
        assert [line.split(b" ", 2)[:2] async for chunk in body for line in chunk.splitlines()] == [
            [b"0", b"output"],
            [b"2", b"error"],
            [b"4", b"output"],
        ]
        second = PartWriter(store, objects, batch, TOKEN, part_lines=100, part_s=60)
        await second.add([_answer(1, "second"), _answer(4, "second"), _answer(7, "second", "error")])
        await second.flush()
        await second.flush()  # (nothing held: no part)
        await objects.put(part_key(batch, "stray"), io.BytesIO(b"3 output {}\n"))  # (never recorded)

        names = await store.parts("acme", batch.id)
        assert len(names) == 2 and len(await objects.list_keys(parts_prefix(batch))) == 3
        output, errors = io.BytesIO(), io.BytesIO()
        paths = await batch_parts.download(objects, batch, names, tmp_path)
        batch_parts.merge(paths, output, errors, work_dir=tmp_path)
        outputs = [json.loads(x) for x in output.getvalue().splitlines()]
        assert [(x["custom_id"], x["response"]["body"]["text"]) for x in outputs] == [
            ("line-0", "first"),
            ("line-1", "second"),
            ("line-4", "first"),  # (recorded first by the first run; counted then, and only then)
        ]
        assert [json.loads(x)["custom_id"] for x in errors.getvalue().splitlines()] == ["line-2", "line-7"]
        got = await store.get("acme", batch.id)
        assert (got.count("completed"), got.count("failed")) == (3, 2)

    _run(scenario, redis_url, s3_bucket)


def test_a_part_its_runner_may_not_record_is_deleted_and_its_lines_kept_for_the_next_flush(redis_url, s3_bucket):
    async def scenario(redis: aioredis.Redis, store: BatchStore, objects: ObjectStore) -> None:
        batch = await _batch(redis)
        writer = PartWriter(store, objects, batch, TOKEN, part_lines=100, part_s=60)
        await writer.add([_answer(0), _answer(1)])
        await redis.set(f"preft:batch-lease:acme:{batch.id}", "another-runner")  # (the lease went elsewhere)
        with pytest.raises(LeaseLost):
            await writer.flush()
        assert writer.held == 2  # (not recorded: held, to be written again)
        assert await objects.list_keys(parts_prefix(batch)) == []  # (the part it wrote: deleted)
        assert await store.parts("acme", batch.id) == [] and len(await store.done_lines("acme", batch.id)) == 0

        await redis.set(f"preft:batch-lease:acme:{batch.id}", TOKEN)
        await writer.flush()
        assert writer.held == 0 and len(await store.done_lines("acme", batch.id)) == 2
        assert len(await objects.list_keys(parts_prefix(batch))) == 1

    _run(scenario, redis_url, s3_bucket)


def test_many_objects_are_listed_and_deleted_past_a_page(s3_bucket):
    async def scenario() -> None:
        objects = ObjectStore(s3_bucket.settings())
        keys = [f"batches/acme/b/parts/{i:05d}.part" for i in range(1001)]  # (past S3's 1000 a page, and a request)

        async def put(key: str) -> None:
            await objects.put(key, io.BytesIO(b"x"))

        for first in range(0, len(keys), 100):
            await asyncio.gather(*(put(k) for k in keys[first : first + 100]))
        await objects.put("batches/acme/other/input.jsonl", io.BytesIO(b"x"))
        assert sorted(await objects.list_keys("batches/acme/b/")) == keys
        await objects.delete_many([*await objects.list_keys("batches/acme/b/"), "batches/acme/b/missing"])
        assert await objects.list_keys("batches/acme/b/") == []
        assert await objects.list_keys("batches/acme/") == ["batches/acme/other/input.jsonl"]

    asyncio.run(scenario())
