"""Integration fixtures: one real Redis and one real S3 server (SeaweedFS) per session, on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import SecretStr

from preft.common.redis_acl import new_passwords
from preft.common.settings import RedisSettings, RegistrySettings, S3Settings
from preft.stack import RedisServer, SeaweedS3, free_port
from preft.stack.servers import s3_client


@dataclass(frozen=True)
class S3Target:
    """Where a test may write: one fresh bucket on the session's S3 server, and credentials for it."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str

    def client(self, **config: Any) -> Any:
        return s3_client(self.endpoint_url, self.access_key, self.secret_key, **config)

    def settings(self, **overrides: Any) -> S3Settings:
        """The services' S3 settings for this bucket; `overrides` change any field."""
        return S3Settings(
            endpoint_url=self.endpoint_url,
            bucket=self.bucket,
            access_key=self.access_key,
            secret_key=SecretStr(self.secret_key),
            **overrides,
        )


_ACL_SERVERS: dict[str, RedisServer] = {}  # admin URL -> its server (`service_redis` finds the services' passwords)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The session's Redis, with the platform's ACL users: every service under test connects as its own user
    (`service_redis`), so each test also checks that the service's ACL (`common.redis_acl`) lets it work."""
    with acl_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def acl_redis(data_dir: Path, **options: Any) -> RedisServer:
    """A Redis (not started) with the platform's ACL users and new passwords, known to `service_redis`."""
    server = RedisServer(data_dir, free_port(), passwords=new_passwords(), **options)
    _ACL_SERVERS[server.admin_url] = server
    return server


def service_redis(redis_url: str, service: str, **overrides: Any) -> RedisSettings:
    """A service's Redis settings on the session's Redis (`redis_url`, the admin's), as that service's ACL user."""
    return RedisSettings(url=_ACL_SERVERS[redis_url].url_for(service), **overrides)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied before the test: its admin's URL (every key; services: `service_redis`)."""
    client = redis.Redis.from_url(redis_server.admin_url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.admin_url


@pytest.fixture
def s3_bucket(s3_server: SeaweedS3) -> Iterator[S3Target]:
    """A new, uniquely named bucket, emptied and deleted after the test."""
    bucket = f"test-{uuid.uuid4().hex[:24]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    yield S3Target(s3_server.endpoint_url, s3_server.access_key, s3_server.secret_key, bucket)
    _delete_bucket(client, bucket)


def _delete_bucket(client: Any, bucket: str) -> None:
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


def make_registry_settings(redis_url: str, s3: S3Target, token: str, **overrides: Any) -> RegistrySettings:
    """Registry settings on the session's Redis and a test's bucket (loopback, port chosen by the OS)."""
    fields: dict[str, Any] = {
        "environment": "prod",
        "listen_address": "127.0.0.1:0",
        "admin_token": SecretStr(token),
        "worker_threads": 8,
        "redis": service_redis(redis_url, "registry"),
        "s3": s3.settings(),
        "max_rank": 16,
    }
    return RegistrySettings(**{**fields, **overrides})
