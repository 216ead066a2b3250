"""Fetching one adapter version's files from the blob store into a directory, and proving it is what was asked for.

Blocking (boto3); the pager runs it in a thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from preft.adapters import ADAPTER_FILES, adapter_digest
from preft.common.engine_contract import AdapterSpec
from preft.common.errors import InvalidArgument, NotFound, Unavailable


class BlobSource(Protocol):
    """Where adapter files come from: `preft.registry.blobstore.BlobStore` in production."""

    def download(self, digest: str, dest: Path) -> None:
        """Write the blob to `dest`, sha256-checked (a mismatch leaves no file and raises)."""
        ...


def engine_files(spec: AdapterSpec) -> list[tuple[str, str, int]]:
    """(name, sha256, size) of the files the engine reads (others, e.g. a README, are not fetched)."""
    names = [f.path for f in spec.files]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"adapter {spec.ref}: the file list names a file twice")
    files = [(f.path, f.sha256, f.size_bytes) for f in spec.files if f.path in ADAPTER_FILES]
    if not files:
        raise InvalidArgument(f"adapter {spec.ref}: none of its files is an adapter file ({', '.join(ADAPTER_FILES)})")
    return files


def fetch_adapter(blobs: BlobSource, spec: AdapterSpec, dest_dir: Path) -> int:
    """Download the spec's adapter files into `dest_dir` and check its content digest; return the bytes written.

    Raises InvalidArgument when the files do not make up `spec.digest` (a wrong spec), Unavailable when the blob
    store cannot be reached, holds a corrupt blob or lacks one (the registry says it exists: retrying may work).
    """
    total = 0
    for name, sha256, size_bytes in engine_files(spec):
        dest = dest_dir / name
        try:
            blobs.download(sha256, dest)
        except NotFound as e:
            raise Unavailable(f"adapter {spec.ref}: {name} is missing from the blob store") from e
        actual = dest.stat().st_size
        if actual != size_bytes:
            raise InvalidArgument(f"adapter {spec.ref}: {name} has {actual} bytes, the spec says {size_bytes}")
        total += actual
    digest = adapter_digest(dest_dir)
    if digest != spec.digest:
        raise InvalidArgument(
            f"adapter {spec.ref}: its files make up content digest {digest[:12]}…, "
            f"not the requested {spec.digest[:12]}…"
        )
    return total
