"""The local servers themselves: persistence across restarts, S3 semantics the registry relies on, auth."""

from __future__ import annotations

import os
from pathlib import Path

import boto3
import httpx
import psutil
import pytest
import redis
from botocore.exceptions import ClientError

from preft.stack import RedisServer, SeaweedS3, free_port
from tests.integration.conftest import S3Target

MiB = 1 << 20


def _get(url: str, key: str) -> bytes | None:
    client = redis.Redis.from_url(url)
    try:
        return client.get(key)
    finally:
        client.close()


def _set(url: str, key: str, value: bytes) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.set(key, value)
    finally:
        client.close()


@pytest.mark.parametrize("persist", [True, False])
def test_redis_restart_keeps_data_only_when_persistent(tmp_path: Path, persist: bool) -> None:
    server = RedisServer(tmp_path, free_port(), persist=persist)
    with server:
        _set(server.url, "adapter:1", b"v1")
    assert not server.running
    with server:
        assert _get(server.url, "adapter:1") == (b"v1" if persist else None)


def test_redis_url_starts_empty(redis_url: str) -> None:
    assert redis.Redis.from_url(redis_url).dbsize() == 0
    _set(redis_url, "left-behind", b"x")  # the next test's redis_url must not see it


def test_redis_url_is_flushed_between_tests(redis_url: str) -> None:
    assert _get(redis_url, "left-behind") is None


def test_s3_put_get_roundtrip(s3_bucket: S3Target) -> None:
    s3 = s3_bucket.client()
    body = os.urandom(MiB + 17)
    s3.put_object(Bucket=s3_bucket.bucket, Key="adapters/a/weights.safetensors", Body=body)

    assert s3.get_object(Bucket=s3_bucket.bucket, Key="adapters/a/weights.safetensors")["Body"].read() == body
    ranged = s3.get_object(Bucket=s3_bucket.bucket, Key="adapters/a/weights.safetensors", Range="bytes=10-19")
    assert ranged["Body"].read() == body[10:20]
    listed = s3.list_objects_v2(Bucket=s3_bucket.bucket, Prefix="adapters/")["Contents"]
    assert [o["Key"] for o in listed] == ["adapters/a/weights.safetensors"]


def test_s3_incomplete_multipart_upload_is_invisible(s3_bucket: S3Target) -> None:
    s3, bucket, key = s3_bucket.client(), s3_bucket.bucket, "adapters/big"
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    part = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=os.urandom(5 * MiB))

    with pytest.raises(ClientError) as missing:
        s3.head_object(Bucket=bucket, Key=key)
    assert missing.value.response["Error"]["Code"] == "404"
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 0
    uploads = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [(key, upload_id)]
    assert uploads[0]["Initiated"] is not None

    parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload=parts)
    assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == 5 * MiB


@pytest.mark.parametrize("secret", ["wrong-secret", None], ids=["wrong-secret", "anonymous"])
def test_s3_refuses_bad_credentials(s3_bucket: S3Target, secret: str | None) -> None:
    from botocore import UNSIGNED
    from botocore.config import Config

    s3_bucket.client().put_object(Bucket=s3_bucket.bucket, Key="k", Body=b"private")
    if secret is None:
        unsigned = Config(signature_version=UNSIGNED)
        client = boto3.client("s3", endpoint_url=s3_bucket.endpoint_url, region_name="us-east-1", config=unsigned)
    else:
        client = boto3.client(
            "s3",
            endpoint_url=s3_bucket.endpoint_url,
            aws_access_key_id=s3_bucket.access_key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )
    for call in (
        lambda: client.get_object(Bucket=s3_bucket.bucket, Key="k"),
        lambda: client.put_object(Bucket=s3_bucket.bucket, Key="k", Body=b"overwritten"),
        lambda: client.list_objects_v2(Bucket=s3_bucket.bucket),
        lambda: client.delete_object(Bucket=s3_bucket.bucket, Key="k"),
    ):
        with pytest.raises(ClientError) as refused:
            call()
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert s3_bucket.client().get_object(Bucket=s3_bucket.bucket, Key="k")["Body"].read() == b"private"


def test_s3_server_listens_on_loopback_only(s3_server: SeaweedS3) -> None:
    process = psutil.Process(s3_server.pid)
    listening = [
        c.laddr
        for p in (process, *process.children(recursive=True))
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert {s3_server.s3_port, s3_server.ports["master"], s3_server.ports["filer_grpc"]} <= {a.port for a in listening}
    assert {a.ip for a in listening} == {"127.0.0.1"}


def test_s3_server_serves_blobs_only_through_signed_s3(s3_server: SeaweedS3, s3_bucket: S3Target) -> None:
    """The filer's and the volume server's own HTTP ports bypass S3's signature check: they must not serve blobs."""
    s3_bucket.client().put_object(Bucket=s3_bucket.bucket, Key="blobs/k", Body=b"private")
    filer = f"http://127.0.0.1:{s3_server.ports['filer']}/buckets/{s3_bucket.bucket}"
    with httpx.Client(timeout=5) as http:
        assert http.get(f"{filer}/blobs/k").status_code == 404
        assert http.get(f"{filer}/").status_code == 404  # (no listing either)
        assert http.delete(f"{filer}/blobs/k").status_code == 404
        assigned = http.get(f"http://127.0.0.1:{s3_server.ports['master']}/dir/assign").json()
        needle = f"http://{assigned['url']}/{assigned['fid']}"
        assert http.post(needle, files={"file": ("f", b"planted")}).status_code == 401
        assert http.get(needle).status_code == 401
    assert s3_bucket.client().get_object(Bucket=s3_bucket.bucket, Key="blobs/k")["Body"].read() == b"private"
