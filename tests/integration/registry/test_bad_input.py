"""Every bad input is a clear error of the right kind, and leaves Redis and S3 exactly as they were."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PreftError,
    ResourceExhausted,
    Unauthenticated,
)
from preft.devtools.tiny import build_direft
from preft.registry.client import LocalFile, RegistryClient, as_domain_error, scan_adapter_dir
from tests.bad_adapters import make_bad_adapters

from .conftest import config_json, state_snapshot


@pytest.fixture
def world(client, tiny, base_config) -> RegistryClient:
    """acme owns chat (v1, alias prod); beta exists; one revoked key; base model tiny-llama."""
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="tiny-llama", config_json=base_config))
    for t in ("acme", "beta"):
        client.call("CreateTenant", pb.CreateTenantRequest(id=t))
    client.upload_adapter(scan_adapter_dir(tiny["lora"]), tenant="acme", name="chat", alias="prod")
    return client


def publish_files(c: RegistryClient, files: list[LocalFile], **kw) -> pb.PublishResponse:
    """Upload the blobs, then publish with the given overrides (tenant acme, name new by default)."""
    kw = {"tenant": "acme", "name": "new", **kw}
    return c.upload_adapter(files, **kw)


def entries(files: list[LocalFile]) -> list[apb.AdapterFile]:
    return [apb.AdapterFile(path=f.path.name, sha256=f.sha256, size_bytes=f.size_bytes) for f in files]


def raw_upload(c: RegistryClient, data: bytes, declared_sha: str, declared_size: int) -> None:
    msgs = [pb.UploadBlobChunk(sha256=declared_sha, size_bytes=declared_size, data=data)]
    try:
        c.stub.UploadBlob(iter(msgs), metadata=c.metadata, timeout=10)
    except grpc.RpcError as e:
        raise as_domain_error(e) from None


Case = Callable[[RegistryClient, dict[str, Path], Path], object]


def _renamed(tiny: dict[str, Path], tmp: Path, new_name: str) -> list[LocalFile]:
    files = scan_adapter_dir(tiny["lora"])
    return [
        LocalFile(f.path.with_name(new_name), f.sha256, f.size_bytes) if f.path.suffix == ".json" else f for f in files
    ]


def _publish_request(c: RegistryClient, **kw) -> object:
    return c.call("Publish", pb.PublishRequest(**{"tenant": "acme", "name": "new", **kw}))


def _upload_then_publish_entries(c: RegistryClient, tiny, mutate: Callable[[list[apb.AdapterFile]], None]):
    files = scan_adapter_dir(tiny["lora"])
    files_pb = entries(files)
    mutate(files_pb)
    return _publish_request(c, files=files_pb)


def _other_arch_base(c: RegistryClient, tiny, tmp) -> object:
    return c.call(
        "RegisterBaseModel",
        pb.RegisterBaseModelRequest(id="tiny-llama", config_json=config_json(tiny["model"], hidden_size=128)),
    )


def _big_weights(c: RegistryClient, tiny, tmp) -> object:
    def grow(files):
        files[1].size_bytes = 65 * 1024 * 1024

    return _upload_then_publish_entries(c, tiny, grow)


def _huge_config(c: RegistryClient, tiny, tmp) -> object:
    def grow(files):
        files[0].size_bytes = 64 * 1024 + 1

    return _upload_then_publish_entries(c, tiny, grow)


CASES: dict[str, tuple[Case, type[PreftError], tuple[str, ...]]] = {
    "path-traversal-name": (
        lambda c, tiny, tmp: publish_files(c, _renamed(tiny, tmp, "..")),
        InvalidArgument,
        ("plain file names",),
    ),
    "nested-path-name": (
        lambda c, tiny, tmp: _upload_then_publish_entries(
            c, tiny, lambda fs: setattr(fs[0], "path", "../../etc/adapter_config.json")
        ),
        InvalidArgument,
        ("not paths",),
    ),
    "unknown-file": (
        lambda c, tiny, tmp: publish_files(c, _renamed(tiny, tmp, "notes.txt")),
        InvalidArgument,
        ("notes.txt", "allowed files"),
    ),
    "file-listed-twice": (
        lambda c, tiny, tmp: _upload_then_publish_entries(c, tiny, lambda fs: fs.append(fs[0])),
        InvalidArgument,
        ("listed twice",),
    ),
    "no-files": (lambda c, tiny, tmp: _publish_request(c), InvalidArgument, ("needs files",)),
    "huge-weights": (_big_weights, ResourceExhausted, ("adapter limit",)),
    "huge-config": (_huge_config, ResourceExhausted, ("adapter_config.json", "limit")),
    "declared-size-mismatch": (
        lambda c, tiny, tmp: _upload_then_publish_entries(c, tiny, lambda fs: setattr(fs[0], "size_bytes", 3)),
        InvalidArgument,
        ("adapter_config.json", "stored blob"),
    ),
    "blob-never-uploaded": (
        lambda c, tiny, tmp: _upload_then_publish_entries(c, tiny, lambda fs: setattr(fs[0], "sha256", "ab" * 32)),
        InvalidArgument,
        ("was not uploaded",),
    ),
    "bad-digest-text": (
        lambda c, tiny, tmp: c.call("MissingBlobs", pb.MissingBlobsRequest(sha256=["../../x"])),
        InvalidArgument,
        ("sha256",),
    ),
    "upload-bytes-do-not-match-digest": (
        lambda c, tiny, tmp: raw_upload(c, b"hello", hashlib.sha256(b"other").hexdigest(), 5),
        InvalidArgument,
        ("sha256",),
    ),
    "upload-shorter-than-declared": (
        lambda c, tiny, tmp: raw_upload(c, b"hello", hashlib.sha256(b"hello!").hexdigest(), 6),
        InvalidArgument,
        ("5 of 6",),
    ),
    "upload-over-size-limit": (
        lambda c, tiny, tmp: raw_upload(c, b"", "cd" * 32, 1 << 40),
        InvalidArgument,
        ("declared size",),
    ),
    "unknown-tenant": (
        lambda c, tiny, tmp: publish_files(c, scan_adapter_dir(tiny["lora"]), tenant="nobody"),
        NotFound,
        ("tenant 'nobody'",),
    ),
    "invalid-adapter-name": (
        lambda c, tiny, tmp: publish_files(c, scan_adapter_dir(tiny["lora"]), name="Bad Name"),
        InvalidArgument,
        ("not a valid name",),
    ),
    "unknown-base-model": (
        lambda c, tiny, tmp: publish_files(c, scan_adapter_dir(tiny["lora"]), base_model="gpt-x"),
        NotFound,
        ("gpt-x",),
    ),
    "base-config-not-json": (
        lambda c, tiny, tmp: c.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="b2", config_json="{oops")),
        InvalidArgument,
        ("config.json",),
    ),
    "base-reregistered-with-other-architecture": (_other_arch_base, FailedPrecondition, ("another architecture",)),
    "mode-out-of-range": (
        lambda c, tiny, tmp: _publish_request(c, files=entries(scan_adapter_dir(tiny["lora"])), default_mode=7),
        InvalidArgument,
        ("default_mode",),
    ),
    "alias-to-missing-version": (
        lambda c, tiny, tmp: c.call(
            "SetAlias", pb.SetAliasRequest(tenant="acme", name="chat", alias="prod", version=9)
        ),
        NotFound,
        ("no version 9",),
    ),
    "alias-latest-by-hand": (
        lambda c, tiny, tmp: c.call(
            "SetAlias", pb.SetAliasRequest(tenant="acme", name="chat", alias="latest", version=1)
        ),
        InvalidArgument,
        ("latest",),
    ),
    "delete-version-an-alias-names": (
        lambda c, tiny, tmp: c.call("Delete", pb.DeleteRequest(tenant="acme", name="chat", version=1)),
        FailedPrecondition,
        ("prod",),
    ),
    "delete-missing-adapter": (
        lambda c, tiny, tmp: c.call("Delete", pb.DeleteRequest(tenant="acme", name="ghost")),
        NotFound,
        ("ghost",),
    ),
    "malformed-reference": (lambda c, tiny, tmp: c.resolve("acme", "chat@@v1"), InvalidArgument, ("reference",)),
    "other-tenants-adapter": (lambda c, tiny, tmp: c.resolve("beta", "acme/chat"), NotFound, ("not found",)),
    "duplicate-tenant": (
        lambda c, tiny, tmp: c.call("CreateTenant", pb.CreateTenantRequest(id="acme")),
        AlreadyExists,
        ("acme",),
    ),
    "share-with-unknown-tenant": (
        lambda c, tiny, tmp: c.call("Share", pb.ShareRequest(tenant="acme", name="chat", add=["beta", "ghost"])),
        NotFound,
        ("ghost",),
    ),
    "unknown-api-key": (
        lambda c, tiny, tmp: c.call("Authenticate", pb.AuthenticateRequest(secret="preft_abc_def")),
        Unauthenticated,
        ("unknown or revoked",),
    ),
    "revoke-unknown-key": (
        lambda c, tiny, tmp: c.call("RevokeKey", pb.RevokeKeyRequest(id="nope")),
        NotFound,
        ("nope",),
    ),
    "negative-limits": (
        lambda c, tiny, tmp: c.call(
            "SetTenantLimits", pb.SetTenantLimitsRequest(id="acme", limits=pb.TenantLimits(max_bytes=-1))
        ),
        InvalidArgument,
        ("positive",),
    ),
    "negative-monthly-quota": (
        lambda c, tiny, tmp: c.call(
            "SetTenantLimits",
            pb.SetTenantLimitsRequest(id="acme", limits=pb.TenantLimits(requests_per_min=5, tokens_per_month=-1)),
        ),
        InvalidArgument,
        ("tokens_per_month", "positive"),
    ),
    "negative-monthly-quota-at-create": (
        lambda c, tiny, tmp: c.call(
            "CreateTenant", pb.CreateTenantRequest(id="gamma", limits=pb.TenantLimits(tokens_per_month=-1))
        ),
        InvalidArgument,
        ("tokens_per_month", "positive"),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_is_refused_and_changes_nothing(case, world, tiny, tmp_path, redis_client, service, s3_bucket):
    action, error, words = CASES[case]
    before = state_snapshot(redis_client, service.blobs.s3, s3_bucket.bucket)
    with pytest.raises(error) as info:
        action(world, tiny, tmp_path)
    for word in words:
        assert word in str(info.value), f"{case}: {word!r} not in {info.value}"
    assert state_snapshot(redis_client, service.blobs.s3, s3_bucket.bucket) == before
    assert world.resolve("acme", "chat:prod").version == 1  # and the registry keeps serving


@pytest.fixture(scope="module")
def bad_adapter_dirs(tiny, tmp_path_factory) -> dict[str, tuple[Path, tuple[str, ...]]]:
    direft = build_direft(tmp_path_factory.mktemp("direft-src") / "d", tiny["model"], rank=4, layers=(0, 2))
    cases = make_bad_adapters(tiny["lora"], direft, tmp_path_factory.mktemp("bad"))
    del cases["missing-directory"]  # a local problem: the CLI refuses it (tests/integration/registry/test_cli.py)
    return cases


BAD_ADAPTERS = [
    "missing-weights",
    "missing-config",
    "pickle-bin",
    "corrupt-header",
    "truncated",
    "garbage-file",
    "config-not-json",
    "lora-wrong-shape",
    "lora-missing-tensor",
    "lora-rank-over-limit",
    "lora-layer-out-of-range",
    "lora-unknown-target",
    "lora-dora",
    "lora-int-dtype",
    "direft-layer-out-of-range",
    "direft-wrong-shape",
    "direft-missing-bias",
    "direft-rank-over-limit",
    "direft-wrong-method",
    "other-model",
]


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_broken_adapter_is_refused_at_publish(case, bad_adapter_dirs, world, redis_client, service, s3_bucket):
    """The engine's 20 broken adapters: the registry refuses each with the same file/tensor message."""
    path, words = bad_adapter_dirs[case]
    files = scan_adapter_dir(path)
    missing = world.call("MissingBlobs", pb.MissingBlobsRequest(sha256=[f.sha256 for f in files])).sha256
    for f in files:
        if f.sha256 in missing and f.path.name != "adapter_model.bin":
            world.upload_blob(f)
    before = state_snapshot(redis_client, service.blobs.s3, s3_bucket.bucket)
    with pytest.raises(InvalidArgument) as info:
        world.call("Publish", pb.PublishRequest(tenant="acme", name="broken", files=entries(files)))
    for word in words:
        assert word in str(info.value), f"{case}: {word!r} not in {info.value}"
    assert state_snapshot(redis_client, service.blobs.s3, s3_bucket.bucket) == before
    with pytest.raises(NotFound):
        world.resolve("acme", "broken")
