"""Compacting a running batch's parts over real Redis and S3: the swap script replaces exactly the parts merged, in
place, and refuses where the list changed or the lease went; a compaction keeps each index once, as the part
recorded first has it, and deletes what it replaced; one that loses the lease midway changes nothing and leaves
nothing behind; and a batch of a part a line keeps few parts while it runs, and ends with every line once."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import redis
import redis.asyncio as aioredis

from preft.gateway.batches import parts as batch_parts
from preft.gateway.batches.compaction import Compactor
from preft.gateway.batches.parts import PartWriter, part_key, parts_prefix
from preft.gateway.batches.store import BatchRecord, BatchStore, LeaseLost
from preft.gateway.batches.tiers import Tiers, tier_of
from preft.gateway.files.object_store import ObjectStore

from .conftest import BASE
from .test_batch_parts import TOKEN, _answer, _run
from .test_batch_parts import _batch as batch_of

COMPLETIONS = "/v1/completions"


async def _batch(client: aioredis.Redis) -> BatchRecord:
    return await batch_of(client, "batch_" + "2" * 32, total=40)


async def _state(client: aioredis.Redis, store: BatchStore, batch: BatchRecord) -> tuple[Any, ...]:
    """What compaction must not change: the counts and the done lines."""
    got = await store.get("acme", batch.id)
    done = (await store.done_lines("acme", batch.id)).bits
    return tuple(got.count(n) for n in ("completed", "failed", "input_tokens", "output_tokens")), done


async def _merged(objects: ObjectStore, batch: BatchRecord, names: list[str], work: Path) -> tuple[bytes, bytes]:
    """The output and error files finalizing would write from the parts `names`."""
    work.mkdir()
    output, errors = io.BytesIO(), io.BytesIO()
    paths = await batch_parts.download(objects, batch, names, work)
    batch_parts.merge(paths, output, errors, work_dir=work)
    return output.getvalue(), errors.getvalue()


async def _write_parts(store: BatchStore, objects: ObjectStore, batch: BatchRecord) -> list[str]:
    """Ten recorded parts, some lines in two of them (answered twice: recorded once, and kept as recorded first)."""
    writer = PartWriter(store, objects, batch, TOKEN, part_lines=100, part_s=60)
    for part in range(10):
        records = [_answer(part * 3 + k, file="error" if k == 2 else "output") for k in range(3)]
        if part in (3, 7):
            records.append(_answer(part * 3 - 4, "again"))  # (an earlier part's line, answered again)
        await writer.add(records)
        await writer.flush()
    return await store.parts("acme", batch.id)


def test_the_swap_script_replaces_exactly_those_parts_in_place_or_nothing(redis_url, s3_bucket):
    async def scenario(client: aioredis.Redis, store: BatchStore, _: ObjectStore) -> None:
        batch = await _batch(client)
        for n, name in enumerate("abcdef"):
            await store.record_part(batch, TOKEN, name, [_answer(n)])
        before = await _state(client, store, batch)
        refused = [
            (1, ["c", "d"]),  # (not there)
            (1, ["b", "d"]),  # (not consecutive)
            (1, ["c", "b"]),  # (not in order)
            (5, ["f", "g"]),  # (past the end)
            (6, ["f"]),
            (1, []),
        ]
        for start, names in refused:
            assert not await store.swap_parts(batch, TOKEN, start, names, "m"), (start, names)
        assert await store.parts("acme", batch.id) == list("abcdef")
        with pytest.raises(LeaseLost):
            await store.swap_parts(batch, "another-runner", 1, ["b", "c"], "m")
        assert await store.parts("acme", batch.id) == list("abcdef")

        assert await store.swap_parts(batch, TOKEN, 1, ["b", "c", "d"], "m")
        assert await store.parts("acme", batch.id) == ["a", "m", "e", "f"]
        assert not await store.swap_parts(batch, TOKEN, 1, ["b", "c", "d"], "m2")  # (done once: the list changed)
        assert await store.swap_parts(batch, TOKEN, 2, ["e", "f"], "n")
        assert await store.swap_parts(batch, TOKEN, 0, ["a"], "o")
        assert await store.parts("acme", batch.id) == ["o", "m", "n"]
        assert await _state(client, store, batch) == before  # (no line moved in or out)

        await store.move(batch, TOKEN, from_statuses=("in_progress",), to="completed", ends=True)
        with pytest.raises(LeaseLost):  # (an ended batch: no lease, no list)
            await store.swap_parts(batch, TOKEN, 0, ["o"], "p")
        assert await client.exists(f"preft:batch-parts:acme:{batch.id}") == 0

    _run(scenario, redis_url, s3_bucket)


def test_a_compaction_merges_the_oldest_parts_in_place_each_index_once_and_deletes_them(
    redis_url, s3_bucket, tmp_path: Path
):
    async def scenario(client: aioredis.Redis, store: BatchStore, objects: ObjectStore) -> None:
        batch = await _batch(client)
        names = await _write_parts(store, objects, batch)
        before, expected = await _state(client, store, batch), await _merged(objects, batch, names, tmp_path / "a")
        compactor = Compactor(store, objects, batch, TOKEN, tiers=Tiers(fan_in=4, compact_at=6))

        assert await compactor.compact_once()
        after = await store.parts("acme", batch.id)
        assert len(after) == 7 and after[1:] == names[4:] and tier_of(after[0]) == 1  # (the oldest four, in place)
        body = b"".join([chunk async for chunk in await objects.open(part_key(batch, after[0]))])
        lines = [
            (int(x.split(b" ")[0]), x.split(b" ", 2)[1], json.loads(x.split(b" ", 2)[2])) for x in body.splitlines()
        ]
        assert [i for i, *_ in lines] == list(range(12))  # (sorted by index, each once)
        assert [i for i, file, _ in lines if file == b"error"] == [2, 5, 8, 11]
        assert {line["response"]["body"]["text"] for *_, line in lines} == {"first"}  # (line 5: as part 1 has it)
        keys = set(await objects.list_keys(parts_prefix(batch)))
        assert keys == {part_key(batch, n) for n in after}  # (the parts it replaced: deleted)

        assert await compactor.compact_once()  # (seven parts: four of tier 0 in a row)
        assert not await compactor.compact_once()  # (four left: below compact_at)
        final = await store.parts("acme", batch.id)
        assert [tier_of(n) for n in final] == [1, 1, 0, 0] and final[2:] == names[8:]
        assert set(await objects.list_keys(parts_prefix(batch))) == {part_key(batch, n) for n in final}
        assert await _merged(objects, batch, final, tmp_path / "b") == expected  # (the same files, lines once)
        assert await _state(client, store, batch) == before

    _run(scenario, redis_url, s3_bucket)


class _TakenOverMidway(ObjectStore):
    """S3, as a runner sees it whose lease goes to another replica while it uploads a merged part."""

    redis_url = ""

    async def put(self, key: str, source: BinaryIO) -> None:
        if tier_of(key.removesuffix(".part")) > 0:
            with redis.Redis.from_url(self.redis_url) as client:
                client.set("preft:batch-lease:acme:batch_" + "2" * 32, "another-runner")
        await super().put(key, source)


class _ChangedMidway(ObjectStore):
    """S3, as a runner sees it while the list of parts changes under its compaction (as no runner would do)."""

    redis_url = ""

    async def put(self, key: str, source: BinaryIO) -> None:
        if tier_of(key.removesuffix(".part")) > 0:
            with redis.Redis.from_url(self.redis_url) as client:
                client.lset("preft:batch-parts:acme:batch_" + "2" * 32, 1, "changed")
        await super().put(key, source)


@pytest.mark.parametrize("midway", [_TakenOverMidway, _ChangedMidway])
def test_a_compaction_that_loses_its_lease_or_its_parts_midway_changes_nothing_and_leaves_nothing(
    redis_url, s3_bucket, midway: type[ObjectStore]
):
    midway.redis_url = redis_url  # type: ignore[attr-defined]

    async def scenario(client: aioredis.Redis, store: BatchStore, objects: ObjectStore) -> None:
        batch = await _batch(client)
        names = await _write_parts(store, objects, batch)
        before = await _state(client, store, batch)
        keys = set(await objects.list_keys(parts_prefix(batch)))
        compactor = Compactor(store, objects, batch, TOKEN, tiers=Tiers(fan_in=4, compact_at=6))
        if midway is _TakenOverMidway:
            with pytest.raises(LeaseLost):
                await compactor.compact_once()
            assert await store.parts("acme", batch.id) == names
        else:
            assert not await compactor.compact_once()
            assert await store.parts("acme", batch.id) == [names[0], "changed", *names[2:]]
        assert set(await objects.list_keys(parts_prefix(batch))) == keys  # (the merged part: deleted; the rest kept)
        assert await _state(client, store, batch) == before

    _run(scenario, redis_url, s3_bucket, midway)


def _objects(s3: Any, bucket: str, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def test_a_batch_of_a_part_a_line_keeps_few_parts_while_it_runs_and_ends_with_every_line_once(
    make_gateway, registry, stub, s3_bucket, redis_url
):
    """Every answer is a part of its own (240 of them): compaction keeps the recorded parts, and those in S3, few
    while the batch runs; the output holds every line once, in order, the counts are right, and no part is left."""
    total = 240
    key = registry.tenant("acme")
    gateway = make_gateway(
        s3=s3_bucket.settings(),
        batches_poll_s=0.1,
        batches_line_concurrency=4,
        batches_part_lines=1,
        batches_part_s=60.0,
        batches_compact_parts=8,
    )
    client = gateway.openai(key)
    stub.token_delay_s = 0.01
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": COMPLETIONS,
            "body": {"model": BASE, "prompt": [10 + i % 50, 3]},
        }
        for i in range(total)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file_id = client.files.create(file=("requests.jsonl", data), purpose="batch").id
    created = client.batches.create(input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h")

    store, s3 = redis.Redis.from_url(redis_url, decode_responses=True), s3_bucket.client()
    parts_key = f"preft:batch-parts:acme:{created.id}"
    prefix = f"batches/acme/{created.id}/parts/"
    recorded, in_s3, tiers_seen = [0], [0], set()
    ended = threading.Event()

    def sample() -> None:
        while not ended.is_set():
            names = store.lrange(parts_key, 0, -1)
            recorded.append(len(names))
            tiers_seen.update(tier_of(n) for n in names)
            in_s3.append(len(_objects(s3, s3_bucket.bucket, prefix)))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        deadline = time.monotonic() + 60
        while (done := client.batches.retrieve(created.id)).status not in ("completed", "failed", "expired"):
            assert time.monotonic() < deadline, (done.status, done.request_counts)
            time.sleep(0.1)
    finally:
        ended.set()
        sampler.join()
    counts = done.request_counts
    assert done.status == "completed" and (counts.total, counts.completed, counts.failed) == (total, total, 0)
    assert done.usage.output_tokens == total * 8 and done.error_file_id is None
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in output] == [f"line-{i}" for i in range(total)]  # (in order, each once)
    assert len(recorded) > 20 and {1, 2} <= tiers_seen, (len(recorded), tiers_seen)  # (sampled; compacted twice over)
    # (8 to start compacting, fewer than 8 a tier below tier 2 after, and what is recorded while a merge runs)
    assert max(recorded) <= 30 and max(in_s3) <= 40, (max(recorded), max(in_s3))
    assert _objects(s3, s3_bucket.bucket, f"batches/acme/{created.id}/") == []
    assert store.exists(parts_key) == 0
    store.close()
