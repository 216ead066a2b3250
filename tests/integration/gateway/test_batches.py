"""Batches (OpenAI's Batch API) end to end with the official `openai` client, over real Redis and S3 and the stub
engine: lines answered as the live requests of their endpoint (content, adapters, refusals, metering), the output
and error files, cancel from any replica, a replica stopping mid-batch (another takes it on without answering a
line twice), the completion window, the monthly quota, and bad requests that change nothing."""

from __future__ import annotations

import json
import time
from collections import Counter
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client import REGISTRY

from preft.api.v1 import registry_pb2 as pb
from preft.common import metering
from preft.gateway.core.limits import reservations_key

from .conftest import BASE, error_of, redis_now_ms, until

OPEN = ("validating", "in_progress", "finalizing", "cancelling")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"


def _batches(s3_bucket, **overrides: Any) -> dict[str, Any]:
    """Gateway settings with files and batches on this test's bucket, polling and recording answers often."""
    return {"s3": s3_bucket.settings(), "batches_poll_s": 0.1, "batches_part_s": 0.2, **overrides}


def _request(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": BASE, "messages": [{"role": "user", "content": content}], **fields}


def _upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return client.files.create(file=("requests.jsonl", data), purpose="batch").id


def _start(client: openai.OpenAI, url: str, lines: list[dict[str, Any]], **kw: Any):
    return client.batches.create(input_file_id=_upload(client, lines), endpoint=url, completion_window="24h", **kw)


_until = partial(until, timeout_s=30.0)


def _ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 30.0):
    return _until(lambda: client.batches.retrieve(batch_id), lambda b: b.status not in OPEN, timeout_s=timeout_s)


def _lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A batch output or error file's lines by custom_id (each custom_id once)."""
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id is in the file twice"
    return by_id


def _fake_text(stub, request_id: str) -> str:
    """The stub's answer to the engine request of that id (what the gateway sent it)."""
    (req,) = [req for _, req in stub.received if req.request_id == request_id]
    return "".join(f" w{t}" for t in stub.tokens(req))


def _today_usage(http, requests: int) -> dict[str, dict[str, Any]]:
    """Today's metered usage by model, once it counts `requests` requests."""
    start = int(time.time()) // 86_400 * 86_400
    route = "/v1/organization/usage/completions"

    def read() -> list[dict[str, Any]]:
        return http.get(route, params={"start_time": start, "group_by": "model"}).json()["data"][-1]["results"]

    results = _until(read, lambda rs: sum(r["num_model_requests"] for r in rs) >= requests, timeout_s=10)
    return {r["model"]: r for r in results}


def test_a_chat_batch_is_answered_as_live_requests_and_refusals_go_to_the_error_file(
    make_gateway, registry, stub, s3_bucket, tiny_models
):
    """Lines run through the chat route (the tenant's adapter, its access, the engine), take none of the tenant's
    requests per minute, are metered; a line the route refuses (bad body, another tenant's adapter, a stream) is
    an entry of the error file and the batch goes on."""
    key = registry.tenant("acme", rpm=2)  # (two requests a minute: the batch's seven lines take none of them)
    pre = registry.publish("acme", "pre", tiny_models["lora"])
    registry.tenant("beta")
    registry.publish("beta", "secret", tiny_models["lora"])
    gateway = make_gateway(**_batches(s3_bucket), metering_flush_interval_s=0.1)
    client = gateway.openai(key)
    good = {
        "base": _chat("hello", max_tokens=3, seed=1),
        "adapter": {**_chat("hi there", max_tokens=4), "model": "pre"},
        "two-choices": {**_chat("again", max_tokens=2, n=2), "model": "pre"},
    }
    bad = {
        "bad-body": (_chat("x", temperature=7), 400, "invalid_argument", "temperature"),
        "hidden-adapter": ({**_chat("x"), "model": "beta/secret"}, 404, "model_not_found", "'beta/secret' does not"),
        "streamed": (_chat("x", stream=True), 400, "invalid_argument", "stream"),
        "beam": (_chat("x", use_beam_search=True), 400, "invalid_argument", "use_beam_search is not supported"),
    }
    lines = [_request(cid, CHAT, body) for cid, body in good.items()]
    lines += [_request(cid, CHAT, body) for cid, (body, *_) in bad.items()]
    created = _start(client, CHAT, lines, metadata={"job": "nightly"})
    assert (created.status, created.endpoint, created.metadata, created.completion_window) == (
        "validating",
        CHAT,
        {"job": "nightly"},
        "24h",
    )
    assert created.id.startswith("batch_") and created.expires_at == created.created_at + 86_400

    done = _ended(client, created.id)
    assert done.status == "completed", done
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (7, 3, 4)
    assert created.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is done.cancelled_at is done.expired_at is None and done.errors is None
    outputs, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    assert set(outputs) == set(good) and set(errors) == set(bad)
    output_file = client.files.retrieve(done.output_file_id)
    assert (output_file.purpose, output_file.filename) == ("batch_output", f"{done.id}_output.jsonl")
    assert output_file.expires_at is None  # (no output_expires_after: kept until deleted)

    for cid, body in good.items():
        line = outputs[cid]
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        answer = response["body"]
        assert response["status_code"] == 200 and response["request_id"] == answer["id"]
        assert answer["object"] == "chat.completion" and answer["model"] == body["model"]
        assert len(answer["choices"]) == body.get("n", 1)
        assert answer["choices"][0]["message"]["content"] == _fake_text(stub, answer["id"])
        assert answer["usage"]["completion_tokens"] == body["max_tokens"] * body.get("n", 1)
    engine = {req.request_id: (model_id, req) for model_id, req in stub.received}
    assert len(engine) == 4  # (the refused lines never reached the engine; n=2 is two engine requests)
    assert engine[outputs["adapter"]["response"]["request_id"]][0] == pre.digest  # (routed to acme's adapter)
    assert engine[outputs["base"]["response"]["request_id"]][1].seed == 1
    assert all(req.tenant == "acme" and not req.stream for _, req in engine.values())

    for cid, (_, status, code, says) in bad.items():
        line = errors[cid]
        assert line["error"] is None and line["response"]["status_code"] == status, line
        error = line["response"]["body"]["error"]
        assert error["code"] == code and says in error["message"], error
    message = "The model 'beta/secret' does not exist or you do not have access to it."  # (as a live request's)
    not_found = {"message": message, "type": "invalid_request_error", "code": "model_not_found", "param": None}
    assert errors["hidden-adapter"]["response"]["body"] == {"error": not_found}

    usage = _today_usage(gateway.http(key), 3)  # (metered as live requests are: by model)
    assert usage[BASE]["num_model_requests"] == 1
    assert usage[f"acme/pre@v{pre.version}"]["num_model_requests"] == 2
    prompt = sum(outputs[c]["response"]["body"]["usage"]["prompt_tokens"] for c in good)
    generated = sum(outputs[c]["response"]["body"]["usage"]["completion_tokens"] for c in good)
    assert sum(r["input_tokens"] for r in usage.values()) == prompt == done.usage.input_tokens
    assert sum(r["output_tokens"] for r in usage.values()) == generated == done.usage.output_tokens == 11

    http = gateway.http(key)  # (the batch took none of the tenant's two requests this minute: its bucket is full)
    live = [http.post("/v1/completions", json={"model": BASE, "prompt": [5], "max_tokens": 1}) for _ in range(3)]
    assert [a.status_code for a in live] == [200, 200, 429]


def test_completions_and_responses_batches_answer_what_live_requests_answer(make_gateway, registry, stub, s3_bucket):
    """The same body answered in a batch and live gives the same answer (the stub answers a prompt alike)."""
    gateway = make_gateway(**_batches(s3_bucket), responses_store_ttl_s=60)
    key = registry.tenant("acme")
    client, http = gateway.openai(key), gateway.http(key)
    completions = {
        "text": {"model": BASE, "prompt": "once upon a time", "max_tokens": 4},
        "ids": {"model": BASE, "prompt": [7, 8, 9], "max_tokens": 2, "echo": True, "logprobs": 1},
        "two-prompts": {"model": BASE, "prompt": ["a", "b"], "max_tokens": 1},
    }
    responses = {
        "plain": {"model": BASE, "input": "hello", "max_output_tokens": 3},
        "instructed": {"model": BASE, "input": "hi", "instructions": "be brief", "max_output_tokens": 2},
    }
    batch = _start(client, COMPLETIONS, [_request(c, COMPLETIONS, b) for c, b in completions.items()])
    other = _start(client, RESPONSES, [_request(c, RESPONSES, b) for c, b in responses.items()])
    done, other_done = _ended(client, batch.id), _ended(client, other.id)
    assert (done.status, other_done.status) == ("completed", "completed")
    assert done.error_file_id is None and other_done.error_file_id is None  # (no refusals: no error file)

    def same(answer: dict[str, Any], live: dict[str, Any], *fields: str) -> None:
        for name in fields:
            assert answer[name] == live[name], name

    outputs = _lines(client, done.output_file_id)
    for cid, body in completions.items():
        answer = outputs[cid]["response"]["body"]
        same(answer, http.post(COMPLETIONS, json=body).json(), "object", "model", "choices", "usage")
    outputs = _lines(client, other_done.output_file_id)
    for cid, body in responses.items():
        answer = outputs[cid]["response"]["body"]
        live = http.post(RESPONSES, json=body).json()
        assert answer["id"].startswith("resp_") and answer["store"] is True
        assert answer["output"][0]["content"][0]["text"] == live["output"][0]["content"][0]["text"]
        same(answer, live, "object", "model", "status", "incomplete_details", "usage", "instructions")
        assert client.responses.retrieve(answer["id"]).id == answer["id"]  # (stored, as live ones are)


def _slow_lines(count: int, url: str = COMPLETIONS) -> list[dict[str, Any]]:
    """Lines the stub answers slowly (with its token delay), each prompt its own (its first token is 10 + i)."""
    return [_request(f"line-{i}", url, {"model": BASE, "prompt": [10 + i, 3], "max_tokens": 4}) for i in range(count)]


def _recorded(store: redis.Redis, tenant: str, batch_id: str, total: int) -> set[int]:
    """The request indexes the batch recorded as answered (its bitmap in Redis)."""
    return {i for i in range(total) if store.getbit(f"preft:batch-done:{tenant}:{batch_id}", i)}


def _objects(s3_bucket, prefix: str) -> list[str]:
    """The keys of the test bucket's objects under `prefix`."""
    pages = s3_bucket.client().get_paginator("list_objects_v2").paginate(Bucket=s3_bucket.bucket, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def _stray_part(total: int) -> bytes:
    """A part no runner recorded, as one whose runner stopped between writing it and recording it would be (in the
    parts' format: `<index> <file> <line>`): an answer of its own for each line."""
    response = {"status_code": 200, "request_id": "stray", "body": {}}
    line = {"id": "batch_req_stray", "custom_id": "", "response": response, "error": None}
    return b"".join(f"{i} output {json.dumps({**line, 'custom_id': f'line-{i}'})}\n".encode() for i in range(total))


def _ordered_lines(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _received_lines(stub) -> Counter:
    """How many times the engine received each line (by its prompt's first token)."""
    return Counter(req.prompt_token_ids[0] - 10 for _, req in stub.received)


def test_cancel_on_any_replica_stops_the_batch_and_keeps_what_was_answered(make_gateway, registry, stub, s3_bucket):
    key = registry.tenant("acme")
    one = make_gateway(**_batches(s3_bucket, batches_line_concurrency=1))
    other = make_gateway(**_batches(s3_bucket, batches_max_running=0))  # (runs no batch: cancels through Redis)
    client = one.openai(key)
    stub.token_delay_s = 0.1  # (0.4 s a line: 12 s unless cancelled)
    for canceller in (client, other.openai(key)):
        created = _start(client, COMPLETIONS, _slow_lines(30))
        _until(lambda b=created: client.batches.retrieve(b.id), lambda b: b.request_counts.completed >= 2)
        started = time.monotonic()
        asked = canceller.batches.cancel(created.id)
        assert asked.status in ("cancelling", "cancelled") and asked.cancelling_at is not None
        cancelled = _ended(client, created.id, timeout_s=5)
        assert cancelled.status == "cancelled" and time.monotonic() - started < 3, cancelled
        assert cancelled.cancelled_at >= cancelled.cancelling_at and cancelled.completed_at is None
        outputs = _lines(client, cancelled.output_file_id)
        assert len(outputs) == cancelled.request_counts.completed >= 2 and cancelled.request_counts.total == 30
        assert cancelled.request_counts.failed == 0 and cancelled.error_file_id is None
        for line in outputs.values():  # (what was answered is kept, whole)
            assert line["response"]["body"]["choices"][0]["text"] == _fake_text(stub, line["response"]["request_id"])
        sent = len(stub.received)
        time.sleep(0.6)
        assert len(stub.received) == sent  # (nothing more reaches the engine)
        assert client.batches.cancel(created.id).status == "cancelled"  # (an ended one: as it ended)
    metrics = httpx.get(one.metrics_url, timeout=10).text
    assert 'preft_gateway_batches_ended_total{status="cancelled"}' in metrics


def test_a_replica_stopped_mid_batch_is_taken_over_without_answering_a_line_twice(
    make_gateway, registry, stub, s3_bucket, redis_url
):
    """The runner's replica stops (its lease left to lapse, as after a crash); another replica takes the batch on
    once the lease lapses, answers only the lines not answered, and the files hold every line once."""
    key = registry.tenant("acme")
    # (a lease of 8 s, and 9 s of work: on a loaded 2-core machine the stop has taken over 3 s, the lines answered
    # meanwhile, and with less work the batch ended, or with a shorter lease it lapsed, before the stop returned)
    settings = _batches(s3_bucket, batches_line_concurrency=2, batches_lease_s=8.0, batches_poll_s=0.3)
    first = make_gateway(**settings)
    client = first.openai(key)
    stub.token_delay_s = 0.15  # (0.6 s a line)
    created = _start(client, COMPLETIONS, _slow_lines(30))  # (9 s of work: stopped well before its end)
    _until(lambda: client.batches.retrieve(created.id), lambda b: b.request_counts.completed >= 4)
    runner = first.server.server.config.app.state.batches.runner

    async def crashed(*_: Any) -> None:  # (a crashed replica lets go of nothing)
        return None

    runner._store.release = crashed
    takeovers = REGISTRY.get_sample_value("preft_gateway_batch_takeovers_total")
    first.server.stop()
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    assert store.pttl(f"preft:batch-lease:acme:{created.id}") > 0  # (left to lapse)
    answered_first = _recorded(store, "acme", created.id, 30)  # (what it recorded)
    assert 4 <= len(answered_first) < 30
    store.close()

    second = make_gateway(**settings)
    done = _ended(second.openai(key), created.id)
    assert done.status == "completed" and done.request_counts.completed == 30 and done.error_file_id is None
    outputs = _lines(second.openai(key), done.output_file_id)
    assert set(outputs) == {f"line-{i}" for i in range(30)}
    for line in outputs.values():
        assert line["response"]["body"]["choices"][0]["text"] == _fake_text(stub, line["response"]["request_id"])
    received = _received_lines(stub)
    assert set(received) == set(range(30))
    assert all(received[i] == 1 for i in answered_first), received  # (none of those was answered again)
    assert sum(received.values()) <= 30 + 2  # (at most the two in flight when it stopped, answered again)
    assert REGISTRY.get_sample_value("preft_gateway_batch_takeovers_total") == takeovers + 1


def test_a_running_batch_keeps_its_answers_in_s3_parts_and_in_redis_only_what_it_counts(
    make_gateway, registry, stub, s3_bucket, redis_url
):
    """Answers go to S3 a part at a time (a few lines, or a short time); Redis holds which lines are done, the
    counts and the parts' names, never an answer. A part no runner recorded is ignored; the output is in request
    order, each line once; the batch's objects in S3 and its keys in Redis but its own are gone once it ended."""
    key = registry.tenant("acme")
    settings = _batches(s3_bucket, batches_line_concurrency=2, batches_part_lines=4, batches_part_s=0.5)
    client = make_gateway(**settings).openai(key)
    stub.token_delay_s = 0.1  # (0.4 s a line: 6 s of work)
    created = _start(client, COMPLETIONS, _slow_lines(30))
    running = _until(lambda: client.batches.retrieve(created.id), lambda b: b.request_counts.completed >= 8)
    assert running.status == "in_progress", running

    store = redis.Redis.from_url(redis_url)  # (bytes: the bitmap is not text)
    names = {kind: f"preft:batch{kind}:acme:{created.id}" for kind in ("", "-lease", "-done", "-parts")}
    keys = {k.decode() for k in store.keys(f"preft:batch*:acme:{created.id}")}
    assert keys == set(names.values()), keys  # (no results hash)
    values = [*store.hgetall(names[""]).values(), store.get(names["-lease"]), store.get(names["-done"])]
    held = b"".join([*values, *store.lrange(names["-parts"], 0, -1)])
    assert b"line-" not in held and b"batch_req_" not in held and b"choices" not in held  # (no answer in Redis)
    assert sum(store.memory_usage(k) for k in keys) < 4096
    prefix = f"batches/acme/{created.id}/parts/"
    recorded = [f"{prefix}{n.decode()}.part" for n in store.lrange(names["-parts"], 0, -1)]
    assert len(recorded) >= 2 and set(recorded) <= set(_objects(s3_bucket, prefix))  # (parts in S3 while it runs)
    s3_bucket.client().put_object(Bucket=s3_bucket.bucket, Key=f"{prefix}stray-000000.part", Body=_stray_part(30))

    done = _ended(client, created.id)
    counts = done.request_counts
    assert done.status == "completed" and (counts.total, counts.completed, counts.failed) == (30, 30, 0)
    lines = _ordered_lines(client, done.output_file_id)
    assert [line["custom_id"] for line in lines] == [f"line-{i}" for i in range(30)]  # (request order, each once)
    for line in lines:  # (the answers, not the stray part's)
        assert line["response"]["body"]["choices"][0]["text"] == _fake_text(stub, line["response"]["request_id"])
    assert done.usage.output_tokens == 30 * 4 and done.error_file_id is None
    assert _objects(s3_bucket, f"batches/acme/{created.id}/") == []  # (input copy, parts, the stray: all gone)
    assert {k.decode() for k in store.keys(f"preft:batch*:acme:{created.id}")} == {names[""]}
    store.close()


def test_a_takeover_answers_again_only_the_lines_no_recorded_part_holds(
    make_gateway, registry, stub, s3_bucket, redis_url
):
    """The runner's replica crashes between writing parts to S3 and recording them: those parts (and a stray one)
    are ignored and their lines answered again by the replica that takes over; the output holds every line once,
    and the counts and the tenant's metered usage count each line once."""
    key = registry.tenant("acme")
    settings = _batches(
        s3_bucket,
        batches_line_concurrency=2,
        batches_lease_s=8.0,  # (as the takeover test above: the stop must return before the work or the lease ends)
        batches_poll_s=0.3,
        batches_part_lines=3,
        batches_part_s=60.0,  # (parts of three lines only)
    )
    first = make_gateway(**settings)
    client = first.openai(key)
    stub.token_delay_s = 0.15  # (0.6 s a line: 9 s of work)
    created = _start(client, COMPLETIONS, _slow_lines(30))
    _until(lambda: client.batches.retrieve(created.id), lambda b: b.request_counts.completed >= 6)
    runner = first.server.server.config.app.state.batches.runner

    async def crashed(*_: Any) -> None:  # (a crashed replica lets go of nothing)
        return None

    async def unrecorded(*_: Any) -> int:  # (the part is in S3; the replica crashed before it was recorded)
        return 0

    runner._store.record_part, runner._store.release = unrecorded, crashed
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    prefix = f"batches/acme/{created.id}/parts/"

    def lost_parts() -> set[str]:
        names = store.lrange(f"preft:batch-parts:acme:{created.id}", 0, -1)
        return set(_objects(s3_bucket, prefix)) - {f"{prefix}{n}.part" for n in names}

    _until(lost_parts, bool)
    first.server.stop()
    recorded = _recorded(store, "acme", created.id, 30)
    s3 = s3_bucket.client()
    lost = {
        int(line.split(b" ", 1)[0])
        for part in lost_parts()
        for line in s3.get_object(Bucket=s3_bucket.bucket, Key=part)["Body"].read().splitlines()
    }
    assert lost and not lost & recorded and 6 <= len(recorded) < 30, (lost, recorded)
    s3.put_object(Bucket=s3_bucket.bucket, Key=f"{prefix}stray-000000.part", Body=_stray_part(30))

    second = make_gateway(**settings)
    done = _ended(second.openai(key), created.id)
    counts = done.request_counts
    assert done.status == "completed" and (counts.total, counts.completed, counts.failed) == (30, 30, 0)
    lines = _ordered_lines(second.openai(key), done.output_file_id)
    assert [line["custom_id"] for line in lines] == [f"line-{i}" for i in range(30)]
    for line in lines:
        assert line["response"]["body"]["choices"][0]["text"] == _fake_text(stub, line["response"]["request_id"])
    received = _received_lines(stub)
    assert all(received[i] == 1 for i in recorded), received
    assert all(received[i] == 2 for i in lost), received  # (answered before the crash, and again)
    assert 30 + len(lost) <= sum(received.values()) <= 30 + len(lost) + 2  # (and at most the two in flight)
    assert done.usage.output_tokens == 30 * 4  # (each line counted once)
    (metered,) = _today_usage(second.http(key), 30).values()  # (metered with the parts: each line once too)
    assert (metered["num_model_requests"], metered["output_tokens"]) == (30, 30 * 4), metered
    assert _objects(s3_bucket, f"batches/acme/{created.id}/") == []
    store.close()


def test_stopping_a_gateway_mid_batch_is_quick_and_another_goes_on_at_once(make_gateway, registry, stub, s3_bucket):
    key = registry.tenant("acme")
    settings = _batches(s3_bucket, batches_line_concurrency=2, batches_lease_s=30.0)
    first, second = make_gateway(**settings), make_gateway(**{**settings, "batches_max_running": 0})
    client = first.openai(key)
    stub.token_delay_s = 0.05
    created = _start(client, COMPLETIONS, _slow_lines(30))
    _until(lambda: client.batches.retrieve(created.id), lambda b: b.request_counts.completed >= 2)
    started = time.monotonic()
    first.server.stop()
    assert time.monotonic() - started < 5  # (the shutdown does not wait for the batch)
    left = second.openai(key).batches.retrieve(created.id)
    assert left.status == "in_progress" and left.request_counts.completed < 30  # (stopped midway)
    third = make_gateway(**settings)  # (the stopped one let its lease go: taken on without waiting 30 s)
    done = _ended(third.openai(key), created.id, timeout_s=15)
    assert done.status == "completed" and done.request_counts.completed == 30
    assert second.openai(key).batches.retrieve(created.id).status == "completed"  # (any replica reads it)


def test_a_clean_stop_records_the_lines_its_runs_answered(make_gateway, registry, stub, s3_bucket):
    """No part is due before the stop (parts of a minute): the stop writes and records what was answered, so the
    replica that goes on answers again at most the lines that were in flight."""
    key = registry.tenant("acme")
    settings = _batches(s3_bucket, batches_line_concurrency=2, batches_part_s=60.0)
    first, second = make_gateway(**settings), make_gateway(**{**settings, "batches_max_running": 0})
    client = first.openai(key)
    stub.token_delay_s = 0.1  # (0.4 s a line: 6 s of work)
    created = _start(client, COMPLETIONS, _slow_lines(30))
    _until(lambda: len(stub.received), lambda n: n >= 6)
    assert client.batches.retrieve(created.id).request_counts.completed == 0  # (nothing recorded yet)
    first.server.stop()
    left = second.openai(key).batches.retrieve(created.id)
    assert left.status == "in_progress" and 4 <= left.request_counts.completed < 30, left
    third = make_gateway(**settings)
    done = _ended(third.openai(key), created.id)
    assert done.status == "completed" and done.request_counts.completed == 30
    assert sum(_received_lines(stub).values()) <= 30 + 2  # (at most the two in flight at the stop, answered again)


def test_a_batch_past_its_completion_window_expires(make_gateway, registry, stub, s3_bucket):
    key = registry.tenant("acme")
    gateway = make_gateway(**_batches(s3_bucket, batches_line_concurrency=1, batches_completion_window_s=2.0))
    client = gateway.openai(key)
    stub.token_delay_s = 0.1  # (0.4 s a line: about three answered in the window)
    created = _start(client, COMPLETIONS, _slow_lines(10))
    done = _ended(client, created.id)
    assert done.status == "expired" and done.expired_at is not None and done.completed_at is None
    outputs, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    counts = done.request_counts
    assert 1 <= counts.completed == len(outputs) < 10 and counts.failed == len(errors) == 10 - counts.completed
    assert set(outputs) | set(errors) == {f"line-{i}" for i in range(10)}
    for line in errors.values():
        assert line["response"] is None
        assert line["error"]["code"] == "batch_expired" and "completion window" in line["error"]["message"]
    sent = len(stub.received)
    time.sleep(0.5)
    assert len(stub.received) == sent


def test_the_monthly_quota_stops_the_batch_lines_once_reached(make_gateway, registry, stub, s3_bucket, redis_url):
    key = registry.tenant("acme")
    limits = pb.TenantLimits(tokens_per_month=26)  # (a line reserves and uses 2 + 4 = 6 tokens: 4 lines fit)
    registry.client.call("SetTenantLimits", pb.SetTenantLimitsRequest(id="acme", limits=limits))
    gateway = make_gateway(**_batches(s3_bucket, batches_line_concurrency=8), metering_flush_interval_s=0.05)
    client = gateway.openai(key)
    stub.token_delay_s = 0.05  # (0.2 s a line: 8 lines in flight at once, before anything is metered)
    created = _start(client, COMPLETIONS, _slow_lines(10))
    done = _ended(client, created.id)
    assert done.status == "completed"
    outputs, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    answered = sorted(int(c.split("-")[1]) for c in outputs)
    assert len(answered) == 4  # (as many as their reservations fit, though none was metered when they started)
    assert set(errors) == {f"line-{i}" for i in range(10)} - {f"line-{i}" for i in answered}
    for line in errors.values():
        response = line["response"]
        assert response["status_code"] == 429, line
        error = response["body"]["error"]
        assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert sorted(_received_lines(stub)) == answered  # (the refused lines never reached the engine)
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    month = metering.month_key("acme", metering.day_of(time.time()))
    assert _until(lambda: int(store.get(month) or 0), lambda used: used >= 24) == 24  # (the month's tokens: 4 lines)
    store.close()


def test_a_batch_lines_tokens_stay_reserved_until_its_part_meters_them(
    make_gateway, registry, stub, s3_bucket, redis_url
):
    """A line's tokens reach the month's count with the part that records it, up to `batches_part_s` after its answer:
    its quota reservation holds them until then, so at no moment do they count nowhere."""
    key = registry.tenant("acme")
    limits = pb.TenantLimits(tokens_per_month=100)
    registry.client.call("SetTenantLimits", pb.SetTenantLimitsRequest(id="acme", limits=limits))
    settings = _batches(s3_bucket, batches_part_s=6.0, batches_line_concurrency=1)
    gateway = make_gateway(**settings, metering_flush_interval_s=0.05)  # (a hold of 2.1 s: 0.1 + the Redis deadline)
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    day = metering.day_of(time.time())
    month, reservations = metering.month_key("acme", day), reservations_key("acme", day)

    def held() -> list[tuple[str, float]]:  # (entries of ended requests: lapsing soon, not an hour after admission)
        soon = redis_now_ms(store) + 60_000
        return [(m, lapses) for m, lapses in store.zrange(reservations, 0, -1, withscores=True) if lapses < soon]

    stub.token_delay_s = 0.5  # (2 s a line, one at a time: the first part is recorded 4 s after the first answer)
    created = _start(gateway.openai(key), COMPLETIONS, _slow_lines(4))
    ((member, lapses_ms),) = _until(held, bool, poll_s=0.02)
    assert member.endswith(":6") and store.get(month) is None  # (answered, 2 + 4 tokens; its part not recorded yet)
    assert _until(lambda: int(store.get(month) or 0), lambda used: used > 0, poll_s=0.02) % 6 == 0
    assert lapses_ms > redis_now_ms(store)  # (still held when the part metered it)
    assert _ended(gateway.openai(key), created.id).status == "completed"
    store.close()


def test_a_batch_output_files_expire_as_asked(make_gateway, registry, s3_bucket):
    client = make_gateway(**_batches(s3_bucket)).openai(registry.tenant("acme"))
    lines = [_request("good", CHAT, _chat("hi")), _request("bad", CHAT, _chat("x", temperature=7))]
    created = _start(
        client, CHAT, lines, extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 7200}}
    )
    done = _ended(client, created.id)
    for file_id in (done.output_file_id, done.error_file_id):
        written = client.files.retrieve(file_id)
        assert written.expires_at == written.created_at + 7200


def test_bad_batches_fail_with_errors_naming_their_lines(make_gateway, registry, stub, s3_bucket):
    client = make_gateway(**_batches(s3_bucket)).openai(registry.tenant("acme"))
    ok = {"model": BASE, "prompt": "hi", "max_tokens": 1}
    mismatched = _start(
        client, COMPLETIONS, [_request("a", COMPLETIONS, ok), _request("b", CHAT, _chat("hi")), _request("c", CHAT, {})]
    )
    duplicated = _start(
        client,
        COMPLETIONS,
        [_request("a", COMPLETIONS, ok), _request("b", COMPLETIONS, ok), _request("a", COMPLETIONS, ok)],
    )
    failed = _ended(client, mismatched.id)
    assert failed.status == "failed" and failed.failed_at is not None and failed.output_file_id is None
    assert [(e.code, e.line, e.param) for e in failed.errors.data] == [
        ("mismatched_url", 2, "url"),
        ("mismatched_url", 3, "url"),
    ]
    assert "is not the batch's endpoint '/v1/completions'" in failed.errors.data[0].message
    failed = _ended(client, duplicated.id)
    assert failed.status == "failed"
    assert [(e.code, e.line) for e in failed.errors.data] == [("duplicate_custom_id", 3)]
    assert stub.received == []  # (nothing of a failed batch runs)
    assert failed.request_counts.total == 0


def test_bad_batch_requests_are_refused_and_change_nothing(make_gateway, registry, s3_bucket, redis_url):
    gateway = make_gateway(**_batches(s3_bucket))
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    client, http = gateway.openai(acme), gateway.http(acme)
    requests = client.files.create(
        file=("in.jsonl", json.dumps(_request("a", COMPLETIONS, {"model": BASE, "prompt": "x"})).encode()),
        purpose="batch",
    )
    notes = client.files.create(file=("notes.txt", b"notes"), purpose="user_data")
    theirs = gateway.openai(beta).files.create(file=("in.jsonl", b"{}"), purpose="user_data")
    batch = client.batches.create(input_file_id=requests.id, endpoint=COMPLETIONS, completion_window="24h")
    _ended(client, batch.id)
    store = redis.Redis.from_url(redis_url)
    keys_before = sorted(store.keys("preft:batch*"))
    stored_before = store.hgetall(f"preft:batch:acme:{batch.id}")

    body = {"input_file_id": requests.id, "endpoint": COMPLETIONS, "completion_window": "24h"}
    refused = [
        ({**body, "input_file_id": "file-" + "0" * 32}, 404, "No such File object"),
        ({**body, "input_file_id": "nope"}, 404, "No such File object"),
        ({**body, "input_file_id": theirs.id}, 404, "No such File object"),  # (another tenant's)
        ({**body, "input_file_id": notes.id}, 400, "has purpose 'user_data'"),
        ({**body, "endpoint": "/v1/embeddings"}, 400, "endpoint"),
        ({**body, "completion_window": "1h"}, 400, "completion_window"),
        ({**body, "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
        ({**body, "output_expires_after": {"anchor": "created_at", "seconds": 3599}}, 400, "output_expires_after"),
        ({**body, "output_expires_after": {"anchor": "created_at", "seconds": 2_592_001}}, 400, "seconds"),
        ({**body, "output_expires_after": {"anchor": "created_at", "seconds": "3600"}}, 400, "seconds"),
        ({**body, "output_expires_after": {"anchor": "now", "seconds": 3600}}, 400, "anchor"),
        ({**body, "output_expires_after": {"seconds": 3600}}, 400, "anchor"),
        ({"endpoint": COMPLETIONS, "completion_window": "24h"}, 400, "input_file_id"),
    ]
    for sent, status, says in refused:
        answer = http.post("/v1/batches", json=sent)
        assert answer.status_code == status, (sent, answer.text)
        assert says in error_of(answer)["message"], (sent, answer.text)
    assert (
        http.post("/v1/batches", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    )
    assert http.post("/v1/batches").status_code == 400
    with pytest.raises(openai.BadRequestError, match="has purpose 'user_data'"):
        client.batches.create(input_file_id=notes.id, endpoint=COMPLETIONS, completion_window="24h")

    other = gateway.openai(beta)
    for call in (other.batches.retrieve, other.batches.cancel, client.batches.retrieve, client.batches.cancel):
        with pytest.raises(openai.NotFoundError, match="No such Batch object"):
            call("batch_" + "0" * 32)
    for call in (other.batches.retrieve, other.batches.cancel):  # (another tenant's: as one that does not exist)
        with pytest.raises(openai.NotFoundError, match=f"No such Batch object: {batch.id}"):
            call(batch.id)
    assert http.get("/v1/batches/nope").status_code == 404
    assert http.get("/v1/batches", params={"limit": 101}).status_code == 400
    assert http.get("/v1/batches", params={"after": "batch_unknown"}).status_code == 400
    assert other.batches.list().data == []
    assert gateway.http("preft_unknown_key").post("/v1/batches", json=body).status_code == 401

    assert sorted(store.keys("preft:batch*")) == keys_before  # (no batch was created or changed)
    assert store.hgetall(f"preft:batch:acme:{batch.id}") == stored_before
    assert [b.id for b in client.batches.list().data] == [batch.id]
    assert client.batches.retrieve(batch.id).status == "completed"
    store.close()


def test_batches_are_listed_newest_first_a_page_at_a_time(make_gateway, registry, s3_bucket):
    client = make_gateway(**_batches(s3_bucket, batches_max_running=0)).openai(registry.tenant("acme"))
    file_id = _upload(client, [_request("a", COMPLETIONS, {"model": BASE, "prompt": "x"})])
    created = [
        client.batches.create(input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h") for _ in range(3)
    ]
    newest_first = [b.id for b in reversed(created)]
    assert [b.id for b in client.batches.list().data] == newest_first
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    assert [b.id for b in client.batches.list(limit=2, after=newest_first[1]).data] == newest_first[2:]
    assert [b.id for b in client.batches.list(limit=1)] == newest_first  # (the client pages on)
    assert all(b.status == "validating" for b in client.batches.list().data)  # (no replica here runs batches)
