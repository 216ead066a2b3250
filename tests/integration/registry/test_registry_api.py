"""The registry over gRPC on real Redis and S3: versions, aliases, dedup, sharing, keys, hotness, quotas, gc."""

from __future__ import annotations

import time

import pytest

from preft.adapters import adapter_digest
from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from preft.registry.client import RegistryClient, scan_adapter_dir
from preft.registry.server import build_server, build_service

from .conftest import TOKEN


def publish(client: RegistryClient, tenant: str, name: str, path, **kw) -> pb.PublishResponse:
    return client.upload_adapter(scan_adapter_dir(path), tenant=tenant, name=name, **kw)


@pytest.fixture
def acme(client, base_config) -> RegistryClient:
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="tiny-llama", config_json=base_config))
    for t in ("acme", "beta"):
        client.call("CreateTenant", pb.CreateTenantRequest(id=t))
    return client


def blob_count(s3, bucket: str) -> int:
    return s3.list_objects_v2(Bucket=bucket, Prefix="blobs/").get("KeyCount", 0)


def test_publish_resolve_versions_and_aliases(acme, tiny):
    v1 = publish(acme, "acme", "chat", tiny["lora"], uploader="ops")
    assert v1.created and v1.manifest.version == 1
    m = v1.manifest
    assert m.method == apb.ADAPTER_METHOD_LORA and m.default_mode == apb.POSITION_MODE_PREFILL and m.rank == 8
    assert sorted(m.target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert list(m.layers) == [0, 1, 2] and m.base_model == "tiny-llama" and m.uploader == "ops"
    assert m.digest == adapter_digest(tiny["lora"])  # the engine computes the same identity
    assert m.size_bytes == sum(p.stat().st_size for p in tiny["lora"].iterdir())
    assert [f.path for f in m.files] == ["adapter_config.json", "adapter_model.safetensors"]

    v2 = publish(acme, "acme", "chat", tiny["lora2"], mode=apb.POSITION_MODE_ALL, alias="prod")
    assert v2.manifest.version == 2 and v2.manifest.default_mode == apb.POSITION_MODE_ALL
    assert acme.resolve("acme", "chat").version == 2
    assert acme.resolve("acme", "chat@v1").digest == m.digest
    assert acme.resolve("acme", "chat@1").version == 1
    assert acme.resolve("acme", "chat:prod").version == 2
    assert acme.resolve("", "acme/chat:latest").version == 2
    with pytest.raises(NotFound, match="no version 3"):
        acme.resolve("acme", "chat@v3")

    # aliases move atomically; a version an alias names cannot be deleted
    acme.call("SetAlias", pb.SetAliasRequest(tenant="acme", name="chat", alias="prod", version=1))
    assert acme.resolve("acme", "chat:prod").version == 1
    with pytest.raises(FailedPrecondition, match="prod"):
        acme.call("Delete", pb.DeleteRequest(tenant="acme", name="chat", version=1))
    acme.call("SetAlias", pb.SetAliasRequest(tenant="acme", name="chat", alias="prod", version=0))
    assert acme.call("Delete", pb.DeleteRequest(tenant="acme", name="chat", version=1)).versions == [1]
    versions = acme.call("ListVersions", pb.ListVersionsRequest(tenant="acme", name="chat")).versions
    assert [v.version for v in versions] == [2]

    # deleting the latest moves `latest` back; numbers are never reused
    publish(acme, "acme", "chat", tiny["direft"])
    acme.call("Delete", pb.DeleteRequest(tenant="acme", name="chat", version=3))
    assert acme.resolve("acme", "chat").version == 2
    acme.call("Delete", pb.DeleteRequest(tenant="acme", name="chat"))
    with pytest.raises(NotFound):
        acme.resolve("acme", "chat")
    assert publish(acme, "acme", "chat", tiny["direft"]).manifest.version == 4
    tenant = acme.call("ListTenants", pb.ListTenantsRequest()).tenants[0]
    assert tenant.id == "acme" and tenant.adapter_count == 1
    assert tenant.bytes_used == sum(p.stat().st_size for p in tiny["direft"].iterdir())


def test_same_bytes_are_stored_once(acme, tiny, s3_bucket, service):
    s3 = service.blobs.s3
    publish(acme, "acme", "one", tiny["lora"])
    stored = blob_count(s3, s3_bucket.bucket)
    files = scan_adapter_dir(tiny["lora"])
    assert acme.call("MissingBlobs", pb.MissingBlobsRequest(sha256=[f.sha256 for f in files])).sha256 == []
    publish(acme, "acme", "two", tiny["lora"])
    publish(acme, "beta", "three", tiny["lora"])
    assert blob_count(s3, s3_bucket.bucket) == stored == 2
    again = publish(acme, "acme", "one", tiny["lora"])
    assert not again.created and again.manifest.version == 1  # identical re-publish is a no-op


def test_tenants_see_only_their_own_and_shared_adapters(acme, tiny):
    publish(acme, "acme", "secret", tiny["lora"])
    with pytest.raises(NotFound) as hidden:
        acme.resolve("beta", "acme/secret")
    with pytest.raises(NotFound) as absent:
        acme.resolve("beta", "acme/nothing-here")
    assert str(hidden.value).replace("secret", "X") == str(absent.value).replace("nothing-here", "X")
    assert acme.call("ListAdapters", pb.ListAdaptersRequest(tenant="beta")).adapters == []

    acme.call("Share", pb.ShareRequest(tenant="acme", name="secret", add=["beta"]))
    assert acme.resolve("beta", "acme/secret").version == 1
    listed = acme.call("ListAdapters", pb.ListAdaptersRequest(tenant="beta")).adapters
    assert [(a.tenant, a.name, list(a.shared_with)) for a in listed] == [("acme", "secret", ["beta"])]
    with pytest.raises(NotFound):
        acme.resolve("beta", "secret")  # a bare name is the caller's own adapter

    acme.call("SetTenantDisabled", pb.SetTenantDisabledRequest(id="acme", disabled=True))
    with pytest.raises(NotFound):
        acme.resolve("beta", "acme/secret")
    acme.call("SetTenantDisabled", pb.SetTenantDisabledRequest(id="acme", disabled=False))
    acme.call("Share", pb.ShareRequest(tenant="acme", name="secret", remove=["beta"]))
    with pytest.raises(NotFound):
        acme.resolve("beta", "acme/secret")


def test_api_keys_issue_authenticate_revoke_expire(acme):
    issued = acme.call("IssueKey", pb.IssueKeyRequest(tenant="acme", label="ci"))
    assert issued.secret.startswith(f"preft_{issued.key.id}_") and len(issued.secret) > 40
    assert acme.call("Authenticate", pb.AuthenticateRequest(secret=issued.secret)).id == "acme"
    listed = acme.call("ListKeys", pb.ListKeysRequest(tenant="acme")).keys
    assert [k.id for k in listed] == [issued.key.id] and issued.secret not in str(listed)

    short = acme.call("IssueKey", pb.IssueKeyRequest(tenant="acme", ttl_s=1))
    acme.call("RevokeKey", pb.RevokeKeyRequest(id=issued.key.id))
    with pytest.raises(Unauthenticated, match="revoked"):
        acme.call("Authenticate", pb.AuthenticateRequest(secret=issued.secret))
    time.sleep(1.1)
    with pytest.raises(Unauthenticated, match="expired"):
        acme.call("Authenticate", pb.AuthenticateRequest(secret=short.secret))

    other = acme.call("IssueKey", pb.IssueKeyRequest(tenant="beta"))
    acme.call("SetTenantDisabled", pb.SetTenantDisabledRequest(id="beta", disabled=True))
    with pytest.raises(PermissionDenied, match="disabled"):
        acme.call("Authenticate", pb.AuthenticateRequest(secret=other.secret))


def test_hotness_ranks_and_decays(registry_settings, tiny, base_config):
    settings = registry_settings.model_copy(update={"hot_half_life_s": 2.0})
    svc = build_service(settings)
    server, port = build_server(settings, svc)
    try:
        with RegistryClient(f"127.0.0.1:{port}", TOKEN) as c:
            c.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="tiny-llama", config_json=base_config))
            c.call("CreateTenant", pb.CreateTenantRequest(id="acme"))
            publish(c, "acme", "busy", tiny["lora"])
            publish(c, "acme", "quiet", tiny["direft"])
            for _ in range(3):
                c.call("RecordUse", pb.RecordUseRequest(tenant="acme", name="busy", version=1))
            c.call("RecordUse", pb.RecordUseRequest(tenant="acme", name="quiet", version=1, weight=1.0))
            hot = c.call("Hot", pb.HotRequest(limit=10)).entries
            assert [e.manifest.name for e in hot] == ["busy", "quiet"]
            assert hot[0].score == pytest.approx(3.0, rel=0.05) and hot[1].score == pytest.approx(1.0, rel=0.05)
            assert hot[0].manifest.digest == adapter_digest(tiny["lora"])
            time.sleep(2.0)  # one half-life
            later = c.call("Hot", pb.HotRequest(limit=10)).entries
            assert later[0].score == pytest.approx(hot[0].score / 2, rel=0.1)
            with pytest.raises(NotFound):
                c.call("RecordUse", pb.RecordUseRequest(tenant="acme", name="busy", version=9))
    finally:
        server.stop(grace=None)


def test_storage_quotas(acme, tiny):
    acme.call("SetTenantLimits", pb.SetTenantLimitsRequest(id="acme", limits=pb.TenantLimits(max_adapters=1)))
    publish(acme, "acme", "first", tiny["lora"])
    with pytest.raises(ResourceExhausted, match="already owns 1 adapters"):
        publish(acme, "acme", "second", tiny["direft"])
    small = tiny["lora"].joinpath("adapter_model.safetensors").stat().st_size
    acme.call("SetTenantLimits", pb.SetTenantLimitsRequest(id="beta", limits=pb.TenantLimits(max_bytes=small)))
    with pytest.raises(ResourceExhausted, match="storage limit"):
        publish(acme, "beta", "big", tiny["lora"])


def test_monthly_token_quota(client, redis_client):
    """tokens_per_month: none by default, set, changed, kept by other changes, removed with 0 (other limits stay),
    never negative; stored as the tenant hash's `tokens_per_month` field, which the gateway reads."""

    def set_limits(tenant: str, **limits: int) -> pb.TenantLimits:
        request = pb.SetTenantLimitsRequest(id=tenant, limits=pb.TenantLimits(**limits))
        return client.call("SetTenantLimits", request).limits

    def stored(tenant: str) -> bytes | None:
        return redis_client.hget(f"preft:tenant:{tenant}", "tokens_per_month")

    acme = client.call("CreateTenant", pb.CreateTenantRequest(id="acme")).limits
    assert acme.HasField("tokens_per_month") and acme.tokens_per_month == 0 and stored("acme") == b"0"
    assert (acme.requests_per_min, acme.tokens_per_min, acme.max_adapters) == (600, 200_000, 5)
    beta = pb.TenantLimits(requests_per_min=60, tokens_per_month=1_000_000)
    beta = client.call("CreateTenant", pb.CreateTenantRequest(id="beta", limits=beta)).limits
    assert (beta.requests_per_min, beta.tokens_per_min, beta.tokens_per_month) == (60, 200_000, 1_000_000)
    assert stored("beta") == b"1000000"

    limits = set_limits("acme", tokens_per_min=5000, tokens_per_month=2_000_000)
    assert (limits.tokens_per_min, limits.tokens_per_month) == (5000, 2_000_000) and stored("acme") == b"2000000"
    limits = set_limits("acme", tokens_per_month=3_000_000)
    assert (limits.tokens_per_min, limits.tokens_per_month) == (5000, 3_000_000)
    limits = set_limits("acme", max_adapters=3, max_bytes=10**9)  # the quota not given: kept
    assert (limits.max_adapters, limits.max_bytes, limits.tokens_per_month) == (3, 10**9, 3_000_000)
    limits = set_limits("acme", tokens_per_month=0)  # removed; every other limit stays
    assert (limits.requests_per_min, limits.tokens_per_min, limits.max_adapters, limits.max_bytes) == (
        600,
        5000,
        3,
        10**9,
    )
    assert limits.tokens_per_month == 0 and stored("acme") == b"0"

    with pytest.raises(InvalidArgument, match="tokens_per_month must be positive"):
        set_limits("beta", requests_per_min=1, tokens_per_month=-1)
    with pytest.raises(InvalidArgument, match="tokens_per_month must be positive"):
        client.call("CreateTenant", pb.CreateTenantRequest(id="gamma", limits=pb.TenantLimits(tokens_per_month=-5)))
    tenants = client.call("ListTenants", pb.ListTenantsRequest()).tenants
    assert [(t.id, t.limits.requests_per_min, t.limits.tokens_per_month) for t in tenants] == [
        ("acme", 600, 0),
        ("beta", 60, 1_000_000),
    ]


def test_tenant_from_before_the_monthly_quota_has_none(client, redis_client):
    """A tenant hash written before tokens_per_month existed reads as no quota (ListTenants and Authenticate),
    keeps having none through other limit changes, and can be given one."""
    old = {"created_unix_ms": 1, "disabled": "0", "adapter_count": 0, "bytes_used": 0}
    old |= {"requests_per_min": 60, "tokens_per_min": 6000, "max_adapters": 2, "max_bytes": 1000}
    redis_client.hset("preft:tenant:old", mapping=old)
    redis_client.sadd("preft:tenants", "old")
    [tenant] = client.call("ListTenants", pb.ListTenantsRequest()).tenants
    assert tenant.id == "old" and tenant.limits.HasField("tokens_per_month")
    assert (tenant.limits.requests_per_min, tenant.limits.tokens_per_min, tenant.limits.tokens_per_month) == (
        60,
        6000,
        0,
    )
    secret = client.call("IssueKey", pb.IssueKeyRequest(tenant="old")).secret
    assert client.call("Authenticate", pb.AuthenticateRequest(secret=secret)).limits.tokens_per_month == 0

    request = pb.SetTenantLimitsRequest(id="old", limits=pb.TenantLimits(max_adapters=4))
    assert client.call("SetTenantLimits", request).limits.tokens_per_month == 0
    assert not redis_client.hexists("preft:tenant:old", "tokens_per_month")
    request = pb.SetTenantLimitsRequest(id="old", limits=pb.TenantLimits(tokens_per_month=750))
    limits = client.call("SetTenantLimits", request).limits
    assert (limits.max_adapters, limits.tokens_per_month) == (4, 750)
    assert redis_client.hget("preft:tenant:old", "tokens_per_month") == b"750"


def test_gc_removes_only_unreferenced_blobs(acme, tiny, service, s3_bucket):
    publish(acme, "acme", "keep", tiny["lora"])
    publish(acme, "acme", "drop", tiny["direft"])
    acme.call("Delete", pb.DeleteRequest(tenant="acme", name="drop"))
    s3 = service.blobs.s3
    assert blob_count(s3, s3_bucket.bucket) == 4
    # within the grace period nothing goes
    assert acme.call("CollectGarbage", pb.CollectGarbageRequest()).deleted_blobs == []
    dry = acme.call("CollectGarbage", pb.CollectGarbageRequest(min_age_s=0, dry_run=True))
    assert len(dry.deleted_blobs) == 2 and blob_count(s3, s3_bucket.bucket) == 4
    # the deletion touched the blobs, so gc with no grace still needs them to be idle past the cutoff
    time.sleep(0.01)
    res = acme.call("CollectGarbage", pb.CollectGarbageRequest(min_age_s=0))
    assert sorted(res.deleted_blobs) == sorted(dry.deleted_blobs) and res.kept_blobs == 2
    assert blob_count(s3, s3_bucket.bucket) == 2
    assert acme.resolve("acme", "keep").version == 1
    # a later publish of the collected content uploads it again
    assert publish(acme, "acme", "drop", tiny["direft"]).manifest.version == 2
    assert blob_count(s3, s3_bucket.bucket) == 4


def test_wrong_admin_token_is_refused(registry_address):
    with RegistryClient(registry_address, "not-the-token") as c, pytest.raises(Unauthenticated, match="token"):
        c.call("ListTenants", pb.ListTenantsRequest())
