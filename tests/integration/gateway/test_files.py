"""The Files API with the official `openai` client over a real S3 (SeaweedFS) and Redis: upload, list (paged,
filtered, ordered), retrieve, content, delete; each tenant sees only its own files; uploads are checked before
anything is stored; without a bucket the routes answer 400."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import BASE, error_of


def _line(custom_id: str, prompt: str = "hi") -> dict:
    body = {"model": BASE, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _objects(s3_bucket, prefix: str = "files/") -> dict[str, bytes]:
    """The bucket's objects under `prefix`, with their bytes."""
    s3 = s3_bucket.client()
    listed = s3.list_objects_v2(Bucket=s3_bucket.bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: s3.get_object(Bucket=s3_bucket.bucket, Key=o["Key"])["Body"].read() for o in listed}


def test_upload_list_retrieve_content_delete(make_gateway, registry, s3_bucket):
    client = make_gateway(s3=s3_bucket.settings()).openai(registry.tenant("acme"))
    notes = b"any bytes \x00\xff at all\n" * 1000
    batch_input = _jsonl([_line("a"), _line("b", "hello")])
    first = client.files.create(file=("notes.bin", notes), purpose="user_data")
    second = client.files.create(file=("requests.jsonl", batch_input), purpose="batch")
    third = client.files.create(file=("more.txt", b"three"), purpose="user_data")
    assert (first.object, first.filename, first.purpose, first.bytes, first.status) == (
        "file",
        "notes.bin",
        "user_data",
        len(notes),
        "processed",
    )
    assert first.id.startswith("file-") and len({first.id, second.id, third.id}) == 3
    assert second.purpose == "batch" and second.bytes == len(batch_input)

    assert client.files.retrieve(second.id) == second
    assert client.files.content(first.id).content == notes
    assert client.files.content(second.id).content == batch_input
    stored = _objects(s3_bucket)  # (the bytes are in S3, under the tenant's prefix)
    assert stored == {
        f"files/acme/{f.id}": data for f, data in ((first, notes), (second, batch_input), (third, b"three"))
    }

    listed = client.files.list()
    assert [f.id for f in listed.data] == [third.id, second.id, first.id]  # (newest first)
    assert [f.id for f in client.files.list(order="asc").data] == [first.id, second.id, third.id]
    assert [f.id for f in client.files.list(purpose="batch").data] == [second.id]
    assert [f.id for f in client.files.list(purpose="user_data").data] == [third.id, first.id]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == [third.id, second.id] and page.has_more
    assert [f.id for f in client.files.list(limit=2, after=second.id).data] == [first.id]
    assert [f.id for f in client.files.list(limit=1)] == [third.id, second.id, first.id]  # (the client pages on)

    deleted = client.files.delete(second.id)
    assert (deleted.id, deleted.deleted) == (second.id, True)
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError, match=f"No such File object: {second.id}"):
            call(second.id)
    assert [f.id for f in client.files.list().data] == [third.id, first.id]
    assert f"files/acme/{second.id}" not in _objects(s3_bucket)


def test_tenants_see_only_their_own_files(make_gateway, registry, s3_bucket):
    gateway = make_gateway(s3=s3_bucket.settings())
    acme, beta = gateway.openai(registry.tenant("acme")), gateway.openai(registry.tenant("beta"))
    mine = acme.files.create(file=("mine.txt", b"acme's"), purpose="user_data")
    theirs = beta.files.create(file=("theirs.txt", b"beta's"), purpose="user_data")
    unknown = "file-" + "0" * 32
    for call in (beta.files.retrieve, beta.files.content, beta.files.delete):
        with pytest.raises(openai.NotFoundError) as other:
            call(mine.id)
        with pytest.raises(openai.NotFoundError) as missing:
            call(unknown)
        assert other.value.body["message"] == missing.value.body["message"].replace(unknown, mine.id)
    assert [f.id for f in beta.files.list().data] == [theirs.id]
    assert [f.id for f in acme.files.list().data] == [mine.id]
    assert acme.files.content(mine.id).content == b"acme's"  # (untouched by beta's tries)
    with pytest.raises(openai.BadRequestError, match="not one of your files"):
        beta.files.list(after=mine.id)


BAD_LINES = [
    (b"not json\n", "line 1: not valid JSON"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n[1, 2]\n', "line 2: a JSON"),
    (b'\n\n{"method": "POST", "url": "/v1/completions", "body": {}}\n', "line 3: custom_id"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}\n', "line 1: method must be POST"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}\n', "line 1: url must be one of"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "hi"}\n', "line 1: body must be"),
    (b"\n  \n", "holds no requests"),
]


ANCHOR, SECONDS = "expires_after[anchor]", "expires_after[seconds]"
BAD_EXPIRES_AFTER = [
    ({ANCHOR: "created_at"}, "expires_after[seconds]: give both"),
    ({SECONDS: "3600"}, "expires_after[anchor]: give both"),
    ({ANCHOR: "last_active_at", SECONDS: "3600"}, "expires_after[anchor]: the only anchor is created_at"),
    ({ANCHOR: "", SECONDS: "3600"}, "expires_after[anchor]: the only anchor is created_at"),
    ({ANCHOR: "created_at", SECONDS: "3599"}, "expires_after[seconds]: an integer number of seconds from 3600"),
    ({ANCHOR: "created_at", SECONDS: "2592001"}, "expires_after[seconds]: an integer"),
    ({ANCHOR: "created_at", SECONDS: "3600.5"}, "expires_after[seconds]: an integer"),
    ({ANCHOR: "created_at", SECONDS: "1e4"}, "expires_after[seconds]: an integer"),
    ({ANCHOR: "created_at", SECONDS: "-3600"}, "expires_after[seconds]: an integer"),
    ({ANCHOR: "created_at", SECONDS: ""}, "expires_after[seconds]: an integer"),
    ({ANCHOR: "created_at", SECONDS: ["3600", "7200"]}, "expires_after[seconds]: give it once"),
    ({"expires_after": '{"anchor": "created_at", "seconds": 3600}'}, "expires_after: send it as the fields"),
]


def test_bad_uploads_are_refused_and_store_nothing(make_gateway, registry, s3_bucket):
    gateway = make_gateway(s3=s3_bucket.settings(), files_max_bytes=4096, batches_max_requests=3)
    key = registry.tenant("acme")
    client, http = gateway.openai(key), gateway.http(key)
    kept = client.files.create(file=("kept.txt", b"kept"), purpose="user_data")
    before = _objects(s3_bucket)

    for data, says in BAD_LINES:
        with pytest.raises(openai.BadRequestError, match=says):
            client.files.create(file=("in.jsonl", data), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 4: a batch file holds at most 3 requests"):
        client.files.create(file=("in.jsonl", _jsonl([_line(str(i)) for i in range(4)])), purpose="batch")
    too_large = http.post("/v1/files", files={"file": ("big.bin", b"x" * 4097)}, data={"purpose": "user_data"})
    assert too_large.status_code == 413 and "larger than 4096 bytes" in error_of(too_large)["message"]
    far_too_large = http.post("/v1/files", files={"file": ("big.bin", b"x" * 80_000)}, data={"purpose": "user_data"})
    assert far_too_large.status_code == 413  # (refused on its Content-Length, before it is read)
    refused = {
        "no purpose": http.post("/v1/files", files={"file": ("a.txt", b"a")}),
        "bad purpose": http.post("/v1/files", files={"file": ("a.txt", b"a")}, data={"purpose": "fine-tune"}),
        "output purpose": http.post("/v1/files", files={"file": ("a.txt", b"a")}, data={"purpose": "batch_output"}),
        "no file": http.post("/v1/files", data={"purpose": "user_data"}, files={"other": ("a.txt", b"a")}),
        "file as a field": http.post("/v1/files", data={"purpose": "user_data", "file": "text"}),
        "empty file": http.post("/v1/files", files={"file": ("a.txt", b"")}, data={"purpose": "user_data"}),
        "no file name": http.post("/v1/files", files={"file": ("", b"a")}, data={"purpose": "user_data"}),
        "unknown field": http.post(
            "/v1/files", files={"file": ("a.txt", b"a")}, data={"purpose": "user_data", "fine_tune": "yes"}
        ),
        "json": http.post("/v1/files", json={"purpose": "user_data"}),
        "two files": http.post(
            "/v1/files", files=[("file", ("a.txt", b"a")), ("file", ("b.txt", b"b"))], data={"purpose": "user_data"}
        ),
    }
    for case, answer in refused.items():
        assert answer.status_code == 400, (case, answer.status_code, answer.text)
        assert error_of(answer)["type"] == "invalid_request_error", case
    assert "purpose" in error_of(refused["bad purpose"])["message"]
    assert "fine_tune is not supported" in error_of(refused["unknown field"])["message"]
    for fields, says in BAD_EXPIRES_AFTER:
        answer = http.post("/v1/files", files={"file": ("a.txt", b"a")}, data={"purpose": "user_data", **fields})
        assert answer.status_code == 400, (fields, answer.text)
        assert error_of(answer)["message"].startswith(says), (fields, answer.text)
    for expires_after in ({"anchor": "created_at", "seconds": 3599}, {"anchor": "last_active_at", "seconds": 3600}):
        with pytest.raises(openai.BadRequestError, match=r"expires_after\["):
            client.files.create(file=("a.txt", b"a"), purpose="batch", expires_after=expires_after)  # type: ignore[arg-type]
    chunked = http.post(
        "/v1/files", content=iter([b"--x\r\n"]), headers={"content-type": "multipart/form-data; boundary=x"}
    )
    assert chunked.status_code == 411
    bad_ids = {
        "/v1/files/nope": 404,
        "/v1/files/file-" + "0" * 32: 404,
        "/v1/files/file-" + "0" * 32 + "/content": 404,
        "/v1/files?limit=0": 400,
        "/v1/files?limit=10001": 400,
        "/v1/files?order=sideways": 400,
        "/v1/files?after=file-unknown": 400,
    }
    for path, status in bad_ids.items():
        assert http.get(path).status_code == status, path
    assert http.delete("/v1/files/nope").status_code == 404
    assert gateway.http("preft_unknown_key").get("/v1/files").status_code == 401

    assert _objects(s3_bucket) == before  # (nothing stored, nothing changed)
    assert [f.id for f in client.files.list().data] == [kept.id]


def test_a_tenant_holds_at_most_its_number_of_files(make_gateway, registry, s3_bucket):
    gateway = make_gateway(s3=s3_bucket.settings(), files_max_per_tenant=2)
    client = gateway.openai(registry.tenant("acme"))
    kept = [client.files.create(file=(f"{i}.txt", b"x"), purpose="user_data") for i in range(2)]
    with pytest.raises(openai.RateLimitError, match="holds 2 files"):
        client.files.create(file=("2.txt", b"x"), purpose="user_data")
    assert len(_objects(s3_bucket)) == 2
    client.files.delete(kept[0].id)
    client.files.create(file=("3.txt", b"x"), purpose="user_data")
    gateway.openai(registry.tenant("beta")).files.create(file=("b.txt", b"x"), purpose="user_data")  # (its own)


def test_without_a_bucket_files_and_batches_are_off(gateway, registry):
    http = gateway.http(registry.tenant("acme"))
    answers = [
        http.get("/v1/files"),
        http.post("/v1/files", files={"file": ("a.txt", b"a")}, data={"purpose": "user_data"}),
        http.get("/v1/batches"),
        http.post(
            "/v1/batches",
            json={"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h"},
        ),
    ]
    for answer in answers:
        assert answer.status_code == 400
        assert "does not store files" in error_of(answer)["message"]
