"""The gateway's objects in S3 (files' contents): put, read, copy, list, delete, each boto3 call in a worker thread.

An object that is not there is a NotFound; an S3 that cannot be reached, or that refuses, is Unavailable (503).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, BinaryIO

import botocore.exceptions

from preft.common import s3
from preft.common.errors import NotFound, Unavailable
from preft.common.settings import S3Settings

READ_CHUNK_BYTES = 1024 * 1024
DELETE_BATCH = 1000  # keys one DeleteObjects call takes at most (S3's limit)


@contextlib.contextmanager
def _errors(key: str) -> Iterator[None]:
    try:
        with s3.s3_errors():
            yield
    except botocore.exceptions.ClientError as e:
        if s3.is_missing(e):
            raise NotFound(f"object {key} is not in the store") from e
        code = e.response.get("Error", {}).get("Code", "unknown")
        raise Unavailable(f"the file store (S3) refused the request ({code})") from e


class ObjectStore:
    """Owns the gateway's S3 client for one bucket."""

    def __init__(self, settings: S3Settings, *, client: Any = None) -> None:
        self.bucket = settings.bucket
        self._part_bytes = settings.multipart_part_bytes
        self.s3 = client or s3.connect(settings)

    def _put(self, key: str, source: BinaryIO) -> None:
        from boto3.exceptions import S3UploadFailedError
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=self._part_bytes, multipart_chunksize=self._part_bytes, use_threads=False
        )
        with _errors(key):
            try:
                self.s3.upload_fileobj(source, self.bucket, key, Config=config)
            except S3UploadFailedError as e:  # (boto3's wrapper of a failed transfer)
                raise Unavailable(f"the file store (S3) failed the upload: {e}") from e

    async def put(self, key: str, source: BinaryIO) -> None:
        """Store `source` (read from its current position to its end) as `key` (large ones as a multipart upload)."""
        await asyncio.to_thread(self._put, key, source)

    def _download(self, key: str, dest: BinaryIO) -> None:
        with _errors(key):
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"]
            try:
                for chunk in body.iter_chunks(READ_CHUNK_BYTES):
                    dest.write(chunk)
            finally:
                body.close()

    async def download(self, key: str, dest: BinaryIO) -> None:
        """Write the object to `dest`."""
        await asyncio.to_thread(self._download, key, dest)

    async def open(self, key: str) -> AsyncIterator[bytes]:
        """The object's bytes, a chunk at a time (NotFound or Unavailable before the first)."""
        with _errors(key):
            body = (await asyncio.to_thread(self.s3.get_object, Bucket=self.bucket, Key=key))["Body"]

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    with _errors(key):
                        chunk = await asyncio.to_thread(body.read, READ_CHUNK_BYTES)
                    if not chunk:
                        return
                    yield chunk
            finally:
                body.close()

        return chunks()

    async def copy(self, source_key: str, key: str) -> None:
        """Copy the object `source_key` to `key`, within S3 (objects up to 5 GB)."""
        source = {"Bucket": self.bucket, "Key": source_key}
        with _errors(source_key):
            await asyncio.to_thread(self.s3.copy_object, Bucket=self.bucket, Key=key, CopySource=source)

    async def delete(self, key: str) -> None:
        with _errors(key):
            await asyncio.to_thread(self.s3.delete_object, Bucket=self.bucket, Key=key)

    def _list(self, prefix: str) -> list[str]:
        keys = []
        with _errors(prefix):
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                keys += [obj["Key"] for obj in page.get("Contents", [])]
        return keys

    async def list_keys(self, prefix: str) -> list[str]:
        """The keys of the objects under `prefix` (all of them, a page of S3's at a time)."""
        return await asyncio.to_thread(self._list, prefix)

    def _delete_many(self, keys: list[str]) -> None:
        for first in range(0, len(keys), DELETE_BATCH):
            block = keys[first : first + DELETE_BATCH]
            with _errors(block[0]):
                deleted = self.s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in block], "Quiet": True}
                )
            if failed := deleted.get("Errors"):
                codes = sorted({e.get("Code", "unknown") for e in failed})
                raise Unavailable(f"the file store (S3) kept {len(failed)} objects it was asked to delete ({codes})")

    async def delete_many(self, keys: list[str]) -> None:
        """Delete the objects `keys` (those not there are no error), up to a thousand per request."""
        await asyncio.to_thread(self._delete_many, keys)
