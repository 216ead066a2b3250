"""The registry's roles over real gRPC: the admin token calls everything, the gateway's token the calls it makes for
tenants, the engines' reader token only the hotness ranking; any other token is refused."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import PermissionDenied, Unauthenticated
from preft.registry.client import RegistryClient, scan_adapter_dir
from preft.registry.roles import GATEWAY_RPCS, READER_RPCS
from tests.integration.conftest import make_registry_settings

from .conftest import GATEWAY_TOKEN, READER_TOKEN

# Calls that change tenants, keys, limits, base models or blobs: neither the gateway nor an engine may make them.
ADMIN_ONLY = [
    ("CreateTenant", pb.CreateTenantRequest(id="mallory")),
    ("SetTenantLimits", pb.SetTenantLimitsRequest(id="acme", limits=pb.TenantLimits(requests_per_min=10**6))),
    ("SetTenantDisabled", pb.SetTenantDisabledRequest(id="acme", disabled=True)),
    ("IssueKey", pb.IssueKeyRequest(tenant="acme")),
    ("ListKeys", pb.ListKeysRequest(tenant="acme")),
    ("RegisterBaseModel", pb.RegisterBaseModelRequest(id="other", config_json="{}")),
    ("CollectGarbage", pb.CollectGarbageRequest(dry_run=False)),
    ("GetTokenUsage", pb.GetTokenUsageRequest(tenant="acme")),
]


@pytest.fixture
def acme(client, tiny, base_config) -> None:
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="tiny-llama", config_json=base_config))
    client.call("CreateTenant", pb.CreateTenantRequest(id="acme"))
    client.upload_adapter(scan_adapter_dir(tiny["lora"]), tenant="acme", name="a")
    client.call("RecordUse", pb.RecordUseRequest(tenant="acme", name="a", version=1, weight=1))


def test_the_reader_token_reads_the_ranking_and_changes_nothing(registry_address, acme, tiny):
    with RegistryClient(registry_address, READER_TOKEN, timeout_s=10) as reader:
        assert [e.manifest.name for e in reader.call("Hot", pb.HotRequest(limit=5)).entries] == ["a"]
        for rpc, request in [*ADMIN_ONLY, ("Resolve", pb.ResolveRequest(tenant="acme", ref="a")),
                             ("Delete", pb.DeleteRequest(tenant="acme", name="a"))]:  # fmt: skip
            with pytest.raises(PermissionDenied, match=f"reader token may not call {rpc}"):
                reader.call(rpc, request)
        with pytest.raises(PermissionDenied, match="may not call UploadBlob"):  # (a client stream, guarded alike)
            reader.upload_blob(scan_adapter_dir(tiny["lora2"])[0])


def test_the_gateway_token_manages_adapters_but_no_tenant_or_key(registry_address, client, acme, tiny):
    with RegistryClient(registry_address, GATEWAY_TOKEN, timeout_s=10) as gateway:
        assert gateway.call("Resolve", pb.ResolveRequest(tenant="acme", ref="a")).version == 1
        files = scan_adapter_dir(tiny["direft"])
        for f in files:  # (as the gateway publishes: every blob uploaded, no MissingBlobs asked)
            gateway.upload_blob(f)
        listed = [apb.AdapterFile(path=f.path.name, sha256=f.sha256, size_bytes=f.size_bytes) for f in files]
        gateway.call("Publish", pb.PublishRequest(tenant="acme", name="b", files=listed))
        gateway.call("Delete", pb.DeleteRequest(tenant="acme", name="b"))
        for rpc, request in [*ADMIN_ONLY, ("Hot", pb.HotRequest(limit=5))]:
            with pytest.raises(PermissionDenied, match=f"gateway token may not call {rpc}"):
                gateway.call(rpc, request)
    tenant = client.call("ListTenants", pb.ListTenantsRequest()).tenants
    assert [(t.id, t.disabled) for t in tenant] == [("acme", False)]  # nothing the refused calls asked happened
    assert len(client.call("ListKeys", pb.ListKeysRequest(tenant="acme")).keys) == 0


def test_an_unknown_token_is_unauthenticated(registry_address):
    with RegistryClient(registry_address, READER_TOKEN + "x", timeout_s=10) as stranger, pytest.raises(Unauthenticated):
        stranger.call("Hot", pb.HotRequest(limit=5))


def test_the_role_tables_name_real_rpcs_and_tokens_must_differ(redis_url, s3_bucket):
    rpcs = set(pb.DESCRIPTOR.services_by_name["Registry"].methods_by_name)
    assert rpcs > GATEWAY_RPCS and rpcs > READER_RPCS and not GATEWAY_RPCS & READER_RPCS
    with pytest.raises(ValueError, match="must be non-empty and differ"):
        make_registry_settings(redis_url, s3_bucket, "same", reader_token=SecretStr("same"))
    with pytest.raises(ValueError, match="must be non-empty and differ"):
        make_registry_settings(redis_url, s3_bucket, "admin", gateway_token=SecretStr(""))
