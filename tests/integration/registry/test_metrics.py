"""The registry's /metrics (registry.metrics) over a real server on real Redis and S3: RPCs by method and status
(the guard's UNAUTHENTICATED and the mapped domain errors included), their latency, blob bytes uploaded, the index's
size read on scrape, and Redis/S3 outages counted by store."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import AlreadyExists, Unauthenticated, Unavailable
from preft.common.settings import RedisSettings
from preft.registry.blobstore import BlobStore
from preft.registry.client import RegistryClient, scan_adapter_dir
from preft.registry.index import RedisIndex
from preft.registry.metrics import IndexEntries, serve_metrics
from preft.stack import free_port


@pytest.fixture
def metrics_url(service) -> Iterator[str]:
    listener = serve_metrics("127.0.0.1:0", service.index, index_max_age_s=0)  # (each scrape reads Redis)
    yield f"http://127.0.0.1:{listener.port}/metrics"
    listener.close()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_rpcs_blob_bytes_and_index_size(client, registry_address, metrics_url, base_config, tiny):
    before = scrape(metrics_url)
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="tiny-llama", config_json=base_config))
    client.call("CreateTenant", pb.CreateTenantRequest(id="acme"))
    with pytest.raises(AlreadyExists):
        client.call("CreateTenant", pb.CreateTenantRequest(id="acme"))
    with RegistryClient(registry_address, "not-the-token") as stranger, pytest.raises(Unauthenticated):
        stranger.call("ListTenants", pb.ListTenantsRequest())
    files = scan_adapter_dir(tiny["lora"])
    client.upload_adapter(files, tenant="acme", name="chat")
    after = scrape(metrics_url)

    def rose(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    rpcs = "preft_registry_rpcs_total"
    assert rose(rpcs, method="CreateTenant", code="OK") == 1
    assert rose(rpcs, method="CreateTenant", code="ALREADY_EXISTS") == 1
    assert rose(rpcs, method="ListTenants", code="UNAUTHENTICATED") == 1
    assert rose(rpcs, method="UploadBlob", code="OK") == len(files)  # (a client-streaming RPC)
    assert rose(rpcs, method="Publish", code="OK") == 1
    assert rose("preft_registry_rpc_duration_seconds_count", method="CreateTenant") == 2
    assert rose("preft_registry_rpc_duration_seconds_sum", method="Publish") > 0
    assert not any(name == rpcs and dict(labels).get("method") == "Check" for name, labels in after)  # (probes)
    assert rose("preft_blob_bytes_total", direction="upload") == sum(f.size_bytes for f in files)
    assert rose("preft_blob_bytes_total", direction="download") > 0  # (publish reads the headers back to validate)
    entries = "preft_registry_index_entries"
    assert value(after, entries, kind="tenants") == 1 and value(after, entries, kind="adapters") == 1
    assert value(after, entries, kind="base_models") == 1 and value(after, entries, kind="blobs") == len(files)


def test_redis_and_s3_outages_are_counted_by_store(service, s3_bucket):
    def errors(store: str) -> float:
        from prometheus_client import REGISTRY

        return REGISTRY.get_sample_value("preft_store_errors_total", {"store": store}) or 0.0

    redis_before, s3_before = errors("redis"), errors("s3")
    dead = RedisIndex(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    entries = IndexEntries(dead)
    assert math.isnan(entries.get("tenants"))  # (the scrape still answers; the gauge reads NaN)
    assert errors("redis") == redis_before + 1
    blobs = BlobStore(s3_bucket.settings().model_copy(update={"endpoint_url": f"http://127.0.0.1:{free_port()}"}))
    with pytest.raises(Unavailable, match="S3"):
        blobs.size("0" * 64)
    assert errors("s3") == s3_before + 1
