"""Files that expire (OpenAI's `expires_after`) over a real S3 (SeaweedFS) and Redis: expires_at as asked or by
OpenAI's defaults, an expired file gone from the API at once, the sweepers of several gateways removing each file
once (record and bytes), and an S3 failure leaving the file for a later round."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time

import openai
import pytest
import redis
from prometheus_client import REGISTRY

from preft.gateway.core import redis_client
from preft.gateway.files.object_store import ObjectStore
from preft.gateway.files.store import EXPIRING, FileStore
from preft.gateway.files.sweeper import FileSweeper
from preft.stack import free_port
from tests.integration.conftest import service_redis

from .conftest import Gateway

DAY_S = 86_400


def _objects(s3_bucket, prefix: str = "files/") -> set[str]:
    s3 = s3_bucket.client()
    return {o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket.bucket, Prefix=prefix).get("Contents", [])}


def _expired_total(purpose: str) -> float:
    return REGISTRY.get_sample_value("preft_gateway_files_expired_total", {"purpose": purpose}) or 0.0


def _expire(redis_url: str, tenant: str, file_id: str, ago_s: int = 5) -> None:
    """Move the file's expiry into the past (as the API allows an hour at least), where the sweepers look too."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        key = f"preft:file:{tenant}:{file_id}"
        obj = json.loads(r.get(key))
        obj["expires_at"] = int(time.time()) - ago_s
        r.set(key, json.dumps(obj))
        assert r.zadd(EXPIRING, {f"{tenant}:{file_id}": obj["expires_at"]}) == 0  # (the upload had entered it)
    finally:
        r.close()


def _redis_keys(redis_url: str) -> set[str]:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return {k for k in r.keys("preft:file*")}
    finally:
        r.close()


def _wait(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_expires_at_as_asked_or_by_openais_defaults(make_gateway, registry, s3_bucket):
    client = make_gateway(s3=s3_bucket.settings()).openai(registry.tenant("acme"))
    batch_input = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    hour = client.files.create(
        file=("a.txt", b"a"), purpose="user_data", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    month = client.files.create(
        file=("b.txt", b"b"), purpose="user_data", expires_after={"anchor": "created_at", "seconds": 30 * DAY_S}
    )
    kept = client.files.create(file=("c.txt", b"c"), purpose="user_data")
    batch = client.files.create(file=("in.jsonl", batch_input), purpose="batch")
    short_batch = client.files.create(
        file=("in.jsonl", batch_input), purpose="batch", expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert hour.expires_at == hour.created_at + 3600
    assert month.expires_at == month.created_at + 30 * DAY_S
    assert kept.expires_at is None  # (user_data: kept until deleted)
    assert batch.expires_at == batch.created_at + 30 * DAY_S  # (batch: 30 days unless told)
    assert short_batch.expires_at == short_batch.created_at + 7200
    for file in (hour, month, kept, batch, short_batch):
        assert client.files.retrieve(file.id) == file
    assert {f.id: f.expires_at for f in client.files.list()} == {
        f.id: f.expires_at for f in (hour, month, kept, batch, short_batch)
    }
    client.files.delete(hour.id)  # (a file not yet expired is deleted as any other)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(hour.id)


def test_an_expired_file_is_gone_at_once_and_removed_by_a_sweep(make_gateway, registry, redis_url, s3_bucket):
    gateway = make_gateway(s3=s3_bucket.settings(), files_max_per_tenant=2, files_sweep_period_s=3600)
    client = gateway.openai(registry.tenant("acme"))
    expiring = client.files.create(
        file=("a.txt", b"a"), purpose="user_data", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    kept = client.files.create(file=("b.txt", b"b"), purpose="user_data")
    _expire(redis_url, "acme", expiring.id)

    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError, match=f"No such File object: {expiring.id}"):
            call(expiring.id)
    assert [f.id for f in client.files.list()] == [kept.id]
    assert [f.id for f in client.files.list(purpose="user_data")] == [kept.id]
    # (not removed yet: this gateway's next sweep is an hour away, and the delete above left it)
    assert _objects(s3_bucket) == {f"files/acme/{expiring.id}", f"files/acme/{kept.id}"}
    assert f"preft:file:acme:{expiring.id}" in _redis_keys(redis_url)
    with pytest.raises(openai.RateLimitError, match="holds 2 files"):  # (it counts until it is removed)
        client.files.create(file=("c.txt", b"c"), purpose="user_data")

    before = _expired_total("user_data")
    make_gateway(s3=s3_bucket.settings(), files_sweep_period_s=0.1)  # (another replica: it sweeps at once)
    _wait(lambda: f"files/acme/{expiring.id}" not in _objects(s3_bucket), "the expired file's object to go")
    _wait(lambda: _redis_keys(redis_url) == {"preft:files:acme", f"preft:file:acme:{kept.id}"}, "its keys to go")
    assert _expired_total("user_data") == before + 1
    assert client.files.content(kept.id).content == b"b"
    client.files.create(file=("c.txt", b"c"), purpose="user_data")  # (it no longer counts)


def test_two_gateways_sweeping_remove_each_file_once(make_gateway, registry, redis_url, s3_bucket):
    gateways: list[Gateway] = [make_gateway(s3=s3_bucket.settings(), files_sweep_period_s=3600)]
    client = gateways[0].openai(registry.tenant("acme"))
    expiring = [
        client.files.create(
            file=(f"{i}.txt", b"x"), purpose="user_data", expires_after={"anchor": "created_at", "seconds": 3600}
        )
        for i in range(30)
    ]
    kept = client.files.create(file=("kept.txt", b"k"), purpose="user_data")
    for file in expiring:
        _expire(redis_url, "acme", file.id)
    before = _expired_total("user_data")
    gateways += [make_gateway(s3=s3_bucket.settings(), files_sweep_period_s=0.05) for _ in range(2)]
    _wait(lambda: _objects(s3_bucket) == {f"files/acme/{kept.id}"}, "the expired files' objects to go")
    _wait(lambda: _redis_keys(redis_url) == {"preft:files:acme", f"preft:file:acme:{kept.id}"}, "their keys to go")
    time.sleep(0.3)  # (a few more rounds of both)
    assert _expired_total("user_data") == before + len(expiring)
    assert [f.id for f in client.files.list()] == [kept.id]


def _store(redis_url: str, s3_settings) -> FileStore:
    r = redis_client.connect(service_redis(redis_url, "gateway"), 2.0)
    return FileStore(r, ObjectStore(s3_settings), timeout_s=2.0, max_per_tenant=100)


async def _close(*stores: FileStore) -> None:
    for store in stores:
        await store._redis.aclose()


def test_sweepers_claim_each_expired_file_once(redis_url, s3_bucket):
    """Two replicas' sweeps at the same moment: each file is claimed, and removed, by one of them."""

    async def scenario() -> None:
        first, second = _store(redis_url, s3_bucket.settings()), _store(redis_url, s3_bucket.settings())
        try:
            created = [
                await first.create(
                    "acme", io.BytesIO(b"x"), size=1, filename=f"{i}.txt", purpose="user_data", expires_after_s=3600
                )
                for i in range(20)
            ]
            kept = await first.create("acme", io.BytesIO(b"k"), size=1, filename="k.txt", purpose="user_data")
            assert all(f["expires_at"] == f["created_at"] + 3600 for f in created) and kept["expires_at"] is None
            sweepers = [FileSweeper(store, period_s=60, concurrency=4) for store in (first, second)]
            assert await sweepers[0].sweep() == 0  # (none due yet)
            for file in created:
                _expire(redis_url, "acme", file["id"])
            removed = await asyncio.gather(*(s.sweep() for s in sweepers))
            assert sum(removed) == len(created), removed
            assert await first._redis.zcard(EXPIRING) == 0
            page = await second.page("acme", purpose=None, after=None, limit=100, order="asc")
            assert [f["id"] for f in page.files] == [kept["id"]]
            assert _objects(s3_bucket) == {f"files/acme/{kept['id']}"}
        finally:
            await _close(first, second)

    asyncio.run(scenario())


def test_an_s3_failure_leaves_the_file_for_a_later_round(redis_url, s3_bucket, caplog):
    s3_down = s3_bucket.settings(connect_timeout_s=0.5, read_timeout_s=1.0).model_copy(
        update={"endpoint_url": f"http://127.0.0.1:{free_port()}"}
    )

    async def scenario() -> None:
        up, down = _store(redis_url, s3_bucket.settings()), _store(redis_url, s3_down)
        try:
            file = await up.create(
                "acme", io.BytesIO(b"x"), size=1, filename="a.txt", purpose="batch", expires_after_s=3600
            )
            _expire(redis_url, "acme", file["id"])
            before = _expired_total("batch")
            with caplog.at_level(logging.WARNING, logger="preft.gateway.files.sweeper"):
                assert await FileSweeper(down, period_s=60, retry_s=1.5).sweep() == 0
            assert f"file {file['id']} of acme expired; not removed" in caplog.text
            assert _objects(s3_bucket) == {f"files/acme/{file['id']}"}  # (its bytes are still there)
            assert (await up._redis.zscore(EXPIRING, f"acme:{file['id']}")) > time.time()  # (claimed: due later)
            assert not await up._redis.exists(f"preft:file:acme:{file['id']}")  # (its record is forgotten)

            sweeper = FileSweeper(up, period_s=60, retry_s=1.5)
            assert await sweeper.sweep() == 0  # (still claimed by the failed round)
            await asyncio.sleep(await up._redis.zscore(EXPIRING, f"acme:{file['id']}") - time.time() + 0.05)
            assert await sweeper.sweep() == 1
            assert _objects(s3_bucket) == set()
            assert await up._redis.zcard(EXPIRING) == 0
            assert _expired_total("batch") == before + 1  # (its record was forgotten once)
        finally:
            await _close(up, down)

    asyncio.run(scenario())
