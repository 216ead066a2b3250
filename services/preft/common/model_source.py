"""Where a base model comes from, fetched once per host into a cache directory and checked before anything uses it.

A source is one of
- a local directory (a path): used as it is (a volume mounted into the pod, or `preft up`'s generated model);
- ``s3://bucket/prefix``: the model directory's files under the prefix beside a manifest, ``preft-model.json``, that
  `push` writes: every file's size and sha256. Each file fetched is checked against it; the cache entry is named by
  the manifest's own digest, so a model replaced in the bucket is fetched anew, never mixed with the old one;
- ``hf://org/name@revision``: a Hugging Face repository at a commit (40 hex digits: a branch could move under a
  running fleet), fetched with huggingface_hub into its own cache under the cache directory (files named by their
  etag, the sha256 for the weights; HF_TOKEN for gated repositories).

`tokenizer_only` fetches what a tokenizer needs (its files, the chat template, config.json), as the gateway does.
An S3 fetch writes into a directory of its own and renames it into place when every file is checked, under a file
lock: concurrent fetches on one host (a node's replicas, an init container beside a restart) download once, and a
fetch killed halfway leaves nothing that a later one would take for complete.

    python -m preft.common.model_source fetch s3://models/llama-3.1-8b --cache-dir /cache --link /models/base
    python -m preft.common.model_source push ./llama-3.1-8b s3://models/llama-3.1-8b
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from preft.common.digests import file_sha256
from preft.common.errors import InvalidArgument, NotFound, Unavailable
from preft.common.settings import S3Settings

MANIFEST = "preft-model.json"
COMPLETE = ".preft-complete"  # written last into a cache entry: its files are all there and checked
# What a tokenizer needs (Hugging Face's file names: fast and slow tokenizers, sentencepiece models, chat templates)
TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template*",
    "*.jinja",
)
_COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelSourceSettings(BaseSettings):
    """The model's source and where it is cached (an init container's or a process's environment)."""

    model_config = SettingsConfigDict(env_prefix="PREFT_MODEL__", env_nested_delimiter="__", extra="ignore")

    source: str = Field("", description="A directory, s3://bucket/prefix or hf://org/name@<commit>")
    cache_dir: Path = Field(Path("/cache/models"), description="Where fetched models are kept (an emptyDir)")
    tokenizer_only: bool = Field(False, description="Fetch only the tokenizer's files and config.json (gateway)")
    s3: S3Settings = Field(default_factory=S3Settings, description="The bucket's endpoint and credentials")


@dataclass(frozen=True)
class ModelSource:
    """A parsed source: kind "path", "s3" (location = bucket, name = prefix) or "hf" (name = repo, revision)."""

    kind: str
    location: str
    name: str = ""
    revision: str = ""

    @classmethod
    def parse(cls, text: str) -> ModelSource:
        if text.startswith("s3://"):
            bucket, _, prefix = text.removeprefix("s3://").partition("/")
            if not bucket or not prefix.strip("/"):
                raise InvalidArgument(f"model source {text!r}: write s3://bucket/prefix")
            return cls("s3", bucket, prefix.strip("/"))
        if text.startswith("hf://"):
            repo, _, revision = text.removeprefix("hf://").partition("@")
            if repo.count("/") != 1 or not _COMMIT.fullmatch(revision):
                raise InvalidArgument(
                    f"model source {text!r}: write hf://org/name@<commit> (40 hex digits: a branch can move)"
                )
            return cls("hf", "huggingface.co", repo, revision)
        if "://" in text:
            raise InvalidArgument(f"model source {text!r}: a directory, s3://bucket/prefix or hf://org/name@<commit>")
        return cls("path", text)


def fetch(source: str, cache_dir: Path, *, s3: S3Settings | None = None, tokenizer_only: bool = False) -> Path:
    """The model's directory on this host: the source's own where it is a path, else a checked cache entry."""
    parsed = ModelSource.parse(source)
    if parsed.kind == "path":
        path = Path(parsed.location)
        if not (path / "config.json").is_file():
            raise NotFound(f"model directory {path} has no config.json")
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    if parsed.kind == "s3":
        return _fetch_s3(parsed, cache_dir, s3 or S3Settings(), tokenizer_only)
    return _fetch_hf(parsed, cache_dir, tokenizer_only)


def push(model_dir: Path, target: str, *, s3: S3Settings | None = None) -> dict[str, Any]:
    """Upload a model directory under an S3 prefix with its manifest (written last: a half-pushed model has none)."""
    from preft.common.s3 import connect, s3_errors

    parsed = ModelSource.parse(target)
    if parsed.kind != "s3":
        raise InvalidArgument(f"push goes to s3://bucket/prefix, not {target!r}")
    if not (model_dir / "config.json").is_file():
        raise InvalidArgument(f"{model_dir} is not a model directory (no config.json)")
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    client = connect(s3 or S3Settings())
    manifest: dict[str, Any] = {"files": {}}
    with s3_errors():
        for path in files:
            rel = path.relative_to(model_dir).as_posix()
            manifest["files"][rel] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            client.upload_file(str(path), parsed.location, f"{parsed.name}/{rel}")
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        client.put_object(Bucket=parsed.location, Key=f"{parsed.name}/{MANIFEST}", Body=body)
    return manifest


def wanted(files: list[str], tokenizer_only: bool) -> list[str]:
    """The files to fetch of a model's: all, or what a tokenizer needs (matched on the file's name)."""
    if not tokenizer_only:
        return files
    return [f for f in files if any(fnmatch.fnmatch(f.rsplit("/", 1)[-1], p) for p in TOKENIZER_FILES)]


def _fetch_s3(source: ModelSource, cache_dir: Path, settings: S3Settings, tokenizer_only: bool) -> Path:
    import botocore.exceptions

    from preft.common.s3 import connect, is_missing, s3_errors

    client = connect(settings)
    with s3_errors():
        try:
            raw = client.get_object(Bucket=source.location, Key=f"{source.name}/{MANIFEST}")["Body"].read()
        except botocore.exceptions.ClientError as e:
            if is_missing(e):
                raise NotFound(f"s3://{source.location}/{source.name} has no {MANIFEST} (push the model first)") from e
            raise Unavailable(f"model manifest unreadable: {e}") from e
    manifest = json.loads(raw)
    files = wanted(sorted(manifest["files"]), tokenizer_only)
    digest = hashlib.sha256(raw).hexdigest()[:16]
    entry = cache_dir / f"s3-{_slug(source.name)}-{digest}{'-tokenizer' if tokenizer_only else ''}"

    def download(into: Path) -> None:
        for rel in files:
            expected = manifest["files"][rel]
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with s3_errors():
                client.download_file(source.location, f"{source.name}/{rel}", str(target))
            if target.stat().st_size != expected["bytes"] or file_sha256(target) != expected["sha256"]:
                raise Unavailable(f"model file {rel} does not match its manifest's digest (changed while fetched?)")
        (into / MANIFEST).write_bytes(raw)

    return _filled(entry, download)


def _fetch_hf(source: ModelSource, cache_dir: Path, tokenizer_only: bool) -> Path:
    """The repository's snapshot in huggingface_hub's own cache under cache_dir (content-addressed, fetched under
    its file locks, each file renamed into place when whole): the snapshot directory is the model directory."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = snapshot_download(
            source.name,
            revision=source.revision,
            cache_dir=cache_dir / "huggingface",
            allow_patterns=list(TOKENIZER_FILES) if tokenizer_only else None,
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise Unavailable(f"hf://{source.name}@{source.revision} could not be fetched: {e}") from e
    return Path(path)


def _filled(entry: Path, download: Any) -> Path:
    """The cache entry, downloaded into a directory of its own and renamed into place once complete (under a lock)."""
    if (entry / COMPLETE).is_file():
        return entry
    with _locked(entry.with_name(entry.name + ".lock")):
        if (entry / COMPLETE).is_file():  # (another process fetched it while this one waited)
            return entry
        partial = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(entry, ignore_errors=True)  # (an entry without its marker: an older layout or a crash)
        partial.mkdir(parents=True)
        try:
            download(partial)
            (partial / COMPLETE).write_text("")
            partial.rename(entry)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return entry


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:64]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preft.common.model_source", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch", help="Fetch a model into the cache; print its directory")
    get.add_argument("source", nargs="?", help="default: PREFT_MODEL__SOURCE")
    get.add_argument("--cache-dir", type=Path, help="default: PREFT_MODEL__CACHE_DIR")
    get.add_argument("--tokenizer-only", action="store_true", default=None, help="only the tokenizer's files")
    get.add_argument("--link", type=Path, help="also make this path a symlink to the model's directory")
    put = commands.add_parser("push", help="Upload a model directory to s3://bucket/prefix with its manifest")
    put.add_argument("model_dir", type=Path)
    put.add_argument("target")
    args = parser.parse_args(argv)
    overrides = {"source": getattr(args, "source", None) or "", "cache_dir": getattr(args, "cache_dir", None)}
    overrides["tokenizer_only"] = getattr(args, "tokenizer_only", None)
    try:
        settings = ModelSourceSettings(**{k: v for k, v in overrides.items() if v not in (None, "")})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.command == "push":
            manifest = push(args.model_dir, args.target, s3=settings.s3)
            print(f"pushed {len(manifest['files'])} files to {args.target}")
            return 0
        if not settings.source:
            print("error: no model source: give one or set PREFT_MODEL__SOURCE", file=sys.stderr)
            return 2
        path = fetch(settings.source, settings.cache_dir, s3=settings.s3, tokenizer_only=settings.tokenizer_only)
        if args.link is not None:
            args.link.parent.mkdir(parents=True, exist_ok=True)
            args.link.unlink(missing_ok=True)
            args.link.symlink_to(path.resolve(), target_is_directory=True)
        print(path)
        return 0
    except (InvalidArgument, NotFound, Unavailable) as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2 if isinstance(e, InvalidArgument) else 1


if __name__ == "__main__":
    raise SystemExit(main())
