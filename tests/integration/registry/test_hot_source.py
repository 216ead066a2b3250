"""Engine replicas prefetch what the registry ranks hottest: RegistryHotSource over the real Hot RPC."""

from __future__ import annotations

import asyncio

from preft.adapters import adapter_digest
from preft.api.v1 import registry_pb2 as pb
from preft.engine.paging.hot import RegistryHotSource
from preft.registry.client import scan_adapter_dir

from .conftest import READER_TOKEN


def test_hot_specs_follow_the_registry_ranking(client, registry_address, tiny, base_config):
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="tiny-llama", config_json=base_config))
    client.call("CreateTenant", pb.CreateTenantRequest(id="acme"))
    for name, path in (("warm", tiny["lora"]), ("hot", tiny["direft"]), ("cold", tiny["lora2"])):
        client.upload_adapter(scan_adapter_dir(path), tenant="acme", name=name)
    for name, uses in (("hot", 5), ("warm", 2)):
        client.call("RecordUse", pb.RecordUseRequest(tenant="acme", name=name, version=1, weight=uses))

    specs = asyncio.run(RegistryHotSource(registry_address, READER_TOKEN).hot_specs(10))  # (the engines' token)
    assert [s.ref for s in specs] == ["acme/hot@v1", "acme/warm@v1"]  # never-used adapters are not hot
    assert specs[0].method == "direft" and specs[0].digest == adapter_digest(tiny["direft"])
    assert {f.path for f in specs[1].files} == {"adapter_config.json", "adapter_model.safetensors"}
    assert asyncio.run(RegistryHotSource("127.0.0.1:1", READER_TOKEN, timeout_s=1).hot_specs(10)) == []  # best effort
