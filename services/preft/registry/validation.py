"""Publish-time checks: file names and sizes, then the adapter itself against the registered base model.

The adapter check is the engine's own (`preft.adapters.check_adapter`), run on a staging directory that holds the
JSON files and, for the weights, a sparse file of the real size with only the safetensors header filled in: the
registry reads a few kilobytes from S3 per publish, never the tensors, and never unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from preft.adapters import ADAPTER_FILES, AdapterCheck, AdapterError, ModelShape, check_adapter
from preft.adapters.formats import MAX_HEADER_BYTES, PICKLE_WEIGHTS, WEIGHTS
from preft.common.errors import InvalidArgument, ResourceExhausted
from preft.registry.blobstore import BlobStore, check_digest
from preft.registry.model import FileEntry

README = "README.md"
ALLOWED_FILES = (*ADAPTER_FILES, README)


def model_shape(config_json: str) -> ModelShape:
    """The dimensions of a base model from its config.json text; InvalidArgument if it lacks any."""
    try:
        config = json.loads(config_json)
        if not isinstance(config, dict):
            raise TypeError("not a JSON object")
        return ModelShape.from_config(config)
    except (json.JSONDecodeError, TypeError, KeyError, ZeroDivisionError) as e:
        raise InvalidArgument(f"base model config.json is not a usable Hugging Face config: {e!r}") from e


def architecture_digest(shape: ModelShape) -> str:
    """Digest of what adapters must fit; two configs with equal dimensions share it."""
    return hashlib.sha256(json.dumps(asdict(shape), sort_keys=True).encode()).hexdigest()


def check_files(files: Sequence[FileEntry], *, max_adapter_bytes: int, max_config_bytes: int) -> None:
    """Names (plain, known, once each), digests and sizes of a version's files."""
    if not files:
        raise InvalidArgument("a version needs files: none were given")
    seen: set[str] = set()
    for f in files:
        name = f.path
        if not name or "/" in name or "\\" in name or "\0" in name or name in (".", "..") or name.startswith("."):
            raise InvalidArgument(f"file name {name!r} is refused: names must be plain file names, not paths")
        if name in PICKLE_WEIGHTS or name.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle")):
            raise InvalidArgument(
                f"{name}: pickled files are refused (loading them can run code); save the adapter as safetensors"
            )
        if name not in ALLOWED_FILES:
            raise InvalidArgument(f"{name}: not part of an adapter (allowed files: {', '.join(ALLOWED_FILES)})")
        if name in seen:
            raise InvalidArgument(f"{name}: listed twice")
        seen.add(name)
        check_digest(f.sha256)
        if f.size_bytes < 0:
            raise InvalidArgument(f"{name}: negative size")
        if name != WEIGHTS and f.size_bytes > max_config_bytes:
            raise ResourceExhausted(f"{name}: {f.size_bytes} bytes is over the {max_config_bytes}-byte limit")
    total = sum(f.size_bytes for f in files)
    if total > max_adapter_bytes:
        raise ResourceExhausted(f"the version's {total} bytes are over the {max_adapter_bytes}-byte adapter limit")


def check_uploaded_adapter(
    files: Sequence[FileEntry], blobs: BlobStore, shape: ModelShape, *, max_rank: int
) -> AdapterCheck:
    """Validate uploaded files as an adapter for `shape` (every blob must exist with its declared size)."""
    for f in files:
        stored = blobs.size(f.sha256)
        if stored is None:
            raise InvalidArgument(f"{f.path}: blob {f.sha256[:12]} was not uploaded")
        if stored != f.size_bytes:
            raise InvalidArgument(f"{f.path}: declared {f.size_bytes} bytes, the stored blob has {stored}")
    with tempfile.TemporaryDirectory(prefix="preft-validate-") as tmp:
        staging = Path(tmp)
        for f in files:
            if f.path == WEIGHTS:
                _stage_header(blobs, f, staging / f.path)
            elif f.path in ADAPTER_FILES:
                (staging / f.path).write_bytes(blobs.read(f.sha256))
        try:
            return check_adapter(staging, shape, max_rank=max_rank)
        except AdapterError as e:
            raise InvalidArgument(str(e)) from e


def _stage_header(blobs: BlobStore, f: FileEntry, dest: Path) -> None:
    """Write a sparse copy of a safetensors file: the real header, then zeros up to the real size."""
    head = blobs.read(f.sha256, start=0, end=min(8, f.size_bytes)) if f.size_bytes else b""
    data: Any = head
    if len(head) == 8:
        (header_len,) = struct.unpack("<Q", head)
        if 0 < header_len <= min(MAX_HEADER_BYTES, f.size_bytes - 8):
            data = head + blobs.read(f.sha256, start=8, end=8 + header_len)
    with dest.open("wb") as out:
        out.write(data)
        out.truncate(f.size_bytes)
