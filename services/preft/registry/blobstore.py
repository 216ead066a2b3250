"""Content-addressed blobs in an S3 bucket: `blobs/sha256/<digest>`, each stored once and never changed.

An upload becomes visible only complete and digest-checked: small blobs are buffered and put in one request,
large ones go up as a multipart upload that is completed only when every byte arrived and the sha256 matches
(and aborted otherwise), so a client killed mid-upload leaves nothing under `blobs/`.

The parts loop is kept over boto3's transfer manager (`upload_fileobj`): the manager completes an upload once its
stream ends, so the size and sha256 check would have to be an exception raised from inside its reads, and the abort
that follows one is s3transfer's internal failure cleanup rather than anything its API promises. Here the check runs
before `complete_multipart_upload`, and the abort is explicit.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import botocore.exceptions

from preft.common import s3
from preft.common.errors import InvalidArgument, NotFound, Unavailable
from preft.common.metrics import BLOB_BYTES
from preft.common.s3 import s3_errors
from preft.common.settings import S3Settings

PREFIX = "blobs/sha256/"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not SHA256_HEX.match(digest):
        raise InvalidArgument(f"{digest!r} is not a lower-case hex sha256 digest")
    return digest


@dataclass(frozen=True)
class StoredBlob:
    """A blob as listed in the bucket."""

    digest: str
    size_bytes: int
    last_modified: datetime


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload that was started and neither completed nor aborted."""

    key: str
    upload_id: str
    initiated: datetime


class BlobStore:
    """Owns the bucket's `blobs/` prefix: digest-checked puts, reads, listing and deletion."""

    def __init__(self, settings: S3Settings, *, client: object | None = None) -> None:
        self.bucket = settings.bucket
        self.part_bytes = settings.multipart_part_bytes
        self.s3 = client or s3.connect(settings)

    @staticmethod
    def key(digest: str) -> str:
        return PREFIX + digest

    def ensure_bucket(self) -> None:
        with s3_errors():
            try:
                self.s3.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError:
                self.s3.create_bucket(Bucket=self.bucket)

    def size(self, digest: str) -> int | None:
        """The stored blob's size, or None when there is no such blob."""
        with s3_errors():
            try:
                return self.s3.head_object(Bucket=self.bucket, Key=self.key(digest))["ContentLength"]
            except botocore.exceptions.ClientError as e:
                if s3.is_missing(e):
                    return None
                raise

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [d for d in dict.fromkeys(digests) if self.size(check_digest(d)) is None]

    def put(self, digest: str, size_bytes: int, chunks: Iterable[bytes]) -> None:
        """Store a blob from a stream of chunks; visible only if exactly `size_bytes` arrive with this sha256."""
        check_digest(digest)
        if size_bytes <= self.part_bytes:
            data = _read_exactly(chunks, size_bytes)
            _verify(data, digest)
            with s3_errors():
                self.s3.put_object(Bucket=self.bucket, Key=self.key(digest), Body=data)
            BLOB_BYTES.labels("upload").inc(size_bytes)
            return
        with s3_errors():
            upload_id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=self.key(digest))["UploadId"]
        try:
            parts = self._put_parts(digest, size_bytes, chunks, upload_id)
            with s3_errors():
                self.s3.complete_multipart_upload(
                    Bucket=self.bucket, Key=self.key(digest), UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
        except BaseException:
            with contextlib.suppress(Exception):
                self.s3.abort_multipart_upload(Bucket=self.bucket, Key=self.key(digest), UploadId=upload_id)
            raise
        BLOB_BYTES.labels("upload").inc(size_bytes)

    def _put_parts(self, digest: str, size_bytes: int, chunks: Iterable[bytes], upload_id: str) -> list[dict]:
        sha, buf, received, parts = hashlib.sha256(), bytearray(), 0, []

        def flush() -> None:
            with s3_errors():
                etag = self.s3.upload_part(
                    Bucket=self.bucket,
                    Key=self.key(digest),
                    UploadId=upload_id,
                    PartNumber=len(parts) + 1,
                    Body=bytes(buf),
                )["ETag"]
            parts.append({"PartNumber": len(parts) + 1, "ETag": etag})
            buf.clear()

        for chunk in chunks:
            received += len(chunk)
            if received > size_bytes:
                raise InvalidArgument(f"blob {digest[:12]}: more bytes arrived than the declared {size_bytes}")
            sha.update(chunk)
            buf += chunk
            if len(buf) >= self.part_bytes:
                flush()
        if received != size_bytes:
            raise InvalidArgument(f"blob {digest[:12]}: upload ended after {received} of {size_bytes} bytes")
        if sha.hexdigest() != digest:
            raise InvalidArgument(f"blob {digest[:12]}: the bytes' sha256 is {sha.hexdigest()}, not the declared one")
        if buf:
            flush()
        return parts

    def read(self, digest: str, *, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of a blob (the whole blob by default)."""
        rng = f"bytes={start}-{'' if end is None else end - 1}"
        with s3_errors():
            try:
                data = self.s3.get_object(Bucket=self.bucket, Key=self.key(digest), Range=rng)["Body"].read()
            except botocore.exceptions.ClientError as e:
                if s3.is_missing(e):
                    raise NotFound(f"blob {digest[:12]} is not in the blob store") from e
                raise
        BLOB_BYTES.labels("download").inc(len(data))
        return data

    def download(self, digest: str, dest: Path) -> None:
        """Write a blob to `dest`, checking its sha256; a mismatch leaves no file behind."""
        tmp = dest.with_name(dest.name + ".part")
        sha = hashlib.sha256()
        with s3_errors():
            try:
                body = self.s3.get_object(Bucket=self.bucket, Key=self.key(digest))["Body"]
            except botocore.exceptions.ClientError as e:
                raise NotFound(f"blob {digest[:12]} is not in the blob store") from e
            with tmp.open("wb") as f:
                for chunk in body.iter_chunks(1 << 20):
                    sha.update(chunk)
                    f.write(chunk)
                    BLOB_BYTES.labels("download").inc(len(chunk))
        if sha.hexdigest() != digest:
            tmp.unlink(missing_ok=True)
            raise Unavailable(f"blob {digest[:12]} is corrupt in the blob store (sha256 {sha.hexdigest()[:12]})")
        tmp.replace(dest)

    def list(self) -> Iterator[StoredBlob]:
        with s3_errors():
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=PREFIX)
            for page in pages:
                for obj in page.get("Contents", []):
                    digest = obj["Key"][len(PREFIX) :]
                    if SHA256_HEX.match(digest):
                        yield StoredBlob(digest, obj["Size"], obj["LastModified"])

    def delete(self, digest: str) -> None:
        with s3_errors():
            self.s3.delete_object(Bucket=self.bucket, Key=self.key(check_digest(digest)))

    def pending_uploads(self) -> list[PendingUpload]:
        # The paginator (paging by upload id marker) is what SeaweedFS answers correctly, as AWS does.
        with s3_errors():
            pages = self.s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=PREFIX)
            return [PendingUpload(u["Key"], u["UploadId"], u["Initiated"]) for p in pages for u in p.get("Uploads", [])]

    def abort(self, upload: PendingUpload) -> None:
        with s3_errors():
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=upload.key, UploadId=upload.upload_id)


def _read_exactly(chunks: Iterable[bytes], size_bytes: int) -> bytes:
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        if len(buf) > size_bytes:
            raise InvalidArgument(f"more bytes arrived than the declared {size_bytes}")
    if len(buf) != size_bytes:
        raise InvalidArgument(f"upload ended after {len(buf)} of {size_bytes} bytes")
    return bytes(buf)


def _verify(data: bytes, digest: str) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise InvalidArgument(f"blob {digest[:12]}: the bytes' sha256 is {actual}, not the declared one")
