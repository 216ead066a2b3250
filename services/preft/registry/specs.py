"""What an engine needs from a registry manifest: the AdapterSpec (digest, method, files) and the default mode.

Shared by the gateway (per request) and engine replicas (prefetching hot adapters).
"""

from __future__ import annotations

from preft.api.v1 import adapter_pb2 as apb
from preft.common.engine_contract import AdapterFileSpec, AdapterSpec
from preft.common.modes import PositionMode

METHODS = {apb.ADAPTER_METHOD_LORA: "lora", apb.ADAPTER_METHOD_DIREFT: "direft"}
MODES = {apb.POSITION_MODE_PREFILL: PositionMode.PREFILL, apb.POSITION_MODE_ALL: PositionMode.ALL}


def adapter_spec(m: apb.AdapterManifest) -> AdapterSpec:
    return AdapterSpec(
        digest=m.digest,
        method=METHODS[m.method],
        files=[AdapterFileSpec(path=f.path, sha256=f.sha256, size_bytes=f.size_bytes) for f in m.files],
        ref=f"{m.tenant}/{m.name}@v{m.version}",
    )


def default_mode(m: apb.AdapterManifest) -> PositionMode:
    return MODES.get(m.default_mode, PositionMode.PREFILL)
