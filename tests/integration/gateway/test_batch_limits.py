"""Batches shared fairly between tenants, over real Redis and S3 and the stub engine: a tenant's open batches are
limited, tenants take turns for the runners' room, and no tenant runs more batches at once than it may, over all
replicas."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
import redis

from preft.gateway.batches import runner as batches_module

from .conftest import BASE
from .test_batches import COMPLETIONS, _batches, _ended, _request, _start, _until, _upload


def _lines_of(batch: int, count: int) -> list[dict[str, Any]]:
    """Lines whose prompts name their batch (the engine sees the batch as the prompt's first token, 100 + batch)."""
    body = {"model": BASE, "prompt": [100 + batch, 3], "max_tokens": 4}
    return [_request(f"line-{i}", COMPLETIONS, body) for i in range(count)]


def _completed(client: openai.OpenAI, batch_id: str) -> bool:
    return client.batches.retrieve(batch_id).status == "completed"


def _batch_keys(redis_url: str) -> dict[bytes, Any]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {key: client.dump(key) for key in client.scan_iter("preft:batch*")}
    finally:
        client.close()


def test_a_tenant_past_its_open_batches_is_refused_and_nothing_is_stored(make_gateway, registry, s3_bucket, redis_url):
    key = registry.tenant("acme")
    settings = _batches(s3_bucket, batches_max_open_per_tenant=2)
    idle = make_gateway(**settings, batches_max_running=0)  # (runs none: its batches stay open)
    client = idle.openai(key)
    first = [_start(client, COMPLETIONS, _lines_of(i, 1)) for i in range(2)]
    input_file = _upload(client, _lines_of(2, 1))
    before = _batch_keys(redis_url)
    with pytest.raises(openai.RateLimitError, match="has 2 batches not ended yet"):
        client.batches.create(input_file_id=input_file, endpoint=COMPLETIONS, completion_window="24h")
    assert _batch_keys(redis_url) == before
    assert [b.id for b in client.batches.list().data] == [b.id for b in reversed(first)]
    _start(idle.openai(registry.tenant("beta")), COMPLETIONS, _lines_of(3, 1))  # (another tenant counts its own)
    make_gateway(**settings)  # (a replica that runs them)
    for batch in first:
        assert _ended(client, batch.id).status == "completed"
    client.batches.create(input_file_id=input_file, endpoint=COMPLETIONS, completion_window="24h")  # (room again)


def test_tenants_take_turns_for_a_runners_room(make_gateway, registry, stub, s3_bucket):
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    creator = make_gateway(**_batches(s3_bucket, batches_max_running=0))
    created = [_start(creator.openai(acme), COMPLETIONS, _lines_of(i, 2)) for i in range(3)]  # (a0, a1, a2)
    created.append(_start(creator.openai(beta), COMPLETIONS, _lines_of(3, 2)))  # (b3, the newest)
    runner = make_gateway(**_batches(s3_bucket, batches_max_running=1, batches_line_concurrency=1))
    for batch, tenant in zip(created, (acme, acme, acme, beta), strict=True):
        assert _ended(runner.openai(tenant), batch.id).status == "completed"
    first_seen = list(dict.fromkeys(req.prompt_token_ids[0] - 100 for _, req in stub.received))
    assert first_seen == [0, 3, 1, 2]  # (beta's batch went after acme's first, not after all of acme's)


def test_no_tenant_runs_more_batches_at_once_than_it_may_over_all_replicas(
    make_gateway, registry, stub, s3_bucket, redis_url
):
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    settings = _batches(s3_bucket, batches_max_running_per_tenant=1, batches_line_concurrency=1)
    replicas = [make_gateway(**settings), make_gateway(**settings)]
    stub.token_delay_s = 0.05  # (0.2 s a line, 0.8 s a batch)
    created = [_start(replicas[i % 2].openai(acme), COMPLETIONS, _lines_of(i, 4)) for i in range(3)]
    other = _start(replicas[0].openai(beta), COMPLETIONS, _lines_of(3, 4))
    client = redis.Redis.from_url(redis_url)
    most, beside = 0, False
    deadline = time.monotonic() + 120  # (about 3 s unloaded)
    try:
        while not all(_completed(replicas[0].openai(acme), b.id) for b in created):
            assert time.monotonic() < deadline
            running = len(list(client.scan_iter("preft:batch-lease:acme:*")))
            most = max(most, running)
            beside = beside or (running == 1 and bool(client.exists(f"preft:batch-lease:beta:{other.id}")))
            time.sleep(0.02)
    finally:
        client.close()
    assert most == 1 and beside  # (one of acme's at a time, beta's beside it)
    assert _until(lambda: replicas[1].openai(beta).batches.retrieve(other.id), lambda b: b.status == "completed")


def test_a_backlog_past_one_scan_does_not_starve_newer_tenants(make_gateway, registry, stub, s3_bucket, monkeypatch):
    """acme's open batches fill the runner's first look (`OPEN_SCAN`, here 3) and may run one at a time; beta's batch,
    created after them all, starts beside acme's first, not after acme's whole backlog."""
    monkeypatch.setattr(batches_module, "OPEN_SCAN", 3)
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    creator = make_gateway(**_batches(s3_bucket, batches_max_running=0))
    backlog = [_start(creator.openai(acme), COMPLETIONS, _lines_of(i, 8)) for i in range(5)]
    newer = _start(creator.openai(beta), COMPLETIONS, _lines_of(5, 1))
    stub.token_delay_s = 0.05  # (0.2 s a line, 1.6 s a batch of acme's)
    runner = make_gateway(**_batches(s3_bucket, batches_max_running_per_tenant=1, batches_line_concurrency=1))
    assert _ended(runner.openai(beta), newer.id).status == "completed"
    done = [_completed(runner.openai(acme), b.id) for b in backlog]
    assert done.count(True) <= 2, done  # (beta's ended while acme's backlog still ran)
    for batch in backlog:
        assert _ended(runner.openai(acme), batch.id).status == "completed"
