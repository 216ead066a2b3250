"""Create a load-test fleet on a running stack: tenants, their API keys, and adapters of both modes.

    .venv/bin/python -m loadtest.fleet --state-dir .preft/stack --tenants 4 --adapters-per-tenant 8

Half of each tenant's adapters (by default) are registered with default mode `prefill`, the rest `all`;
methods alternate LoRA / DiReFT. Writes the fleet (gateway URL, keys, adapter names and modes) as JSON for the
locustfile; keys are secrets, so the file is owner-only and lives in the (ignored) state directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import AlreadyExists
from preft.devtools.tiny import build_direft, build_lora
from preft.registry.client import scan_adapter_dir
from preft.stack.local import BASE_MODEL_ID, LocalStack, StackInfo

MODES = {"prefill": apb.POSITION_MODE_PREFILL, "all": apb.POSITION_MODE_ALL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", type=Path, default=Path(".preft/stack"))
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--adapters-per-tenant", type=int, default=8)
    ap.add_argument("--all-fraction", type=float, default=0.5, help="Share of adapters with default mode `all`")
    ap.add_argument("--out", type=Path, default=None, help="Default: STATE_DIR/fleet.json")
    args = ap.parse_args()
    info = StackInfo.read(args.state_dir)
    if info is None:
        raise SystemExit(f"no running stack in {args.state_dir} (start it with `preft up`)")
    stack = LocalStack(args.state_dir, info.ports)
    rng = random.Random(0)
    work = args.state_dir / "fleet-adapters"
    model = Path(info.model_dir)
    fleet = {"gateway_url": info.gateway_url, "base_model": BASE_MODEL_ID, "tenants": []}
    with stack.registry_client() as c:
        for t in range(args.tenants):
            tenant = f"load-{t:02d}"
            limits = pb.TenantLimits(requests_per_min=100_000, tokens_per_min=100_000_000)
            try:
                c.call("CreateTenant", pb.CreateTenantRequest(id=tenant, limits=limits))
            except AlreadyExists:
                c.call("SetTenantLimits", pb.SetTenantLimitsRequest(id=tenant, limits=limits))
            key = c.call("IssueKey", pb.IssueKeyRequest(tenant=tenant, label="load test")).secret
            adapters = []
            for i in range(args.adapters_per_tenant):
                mode = "all" if rng.random() < args.all_fraction else "prefill"
                method = "lora" if i % 2 == 0 else "direft"
                src = work / tenant / f"a{i:02d}"
                seed = 1000 * t + i
                if not src.exists():
                    if method == "lora":
                        build_lora(src, model, rank=8, seed=seed)
                    else:
                        build_direft(src, model, rank=4, layers=(0, 2), seed=seed)
                name = f"{method}-{i:02d}"
                c.upload_adapter(scan_adapter_dir(src), tenant=tenant, name=name, mode=MODES[mode], uploader="fleet")
                adapters.append({"model": name, "mode": mode, "method": method})
            fleet["tenants"].append({"tenant": tenant, "api_key": key, "adapters": adapters})
    out = args.out or args.state_dir / "fleet.json"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(fleet, f, indent=2)
    total = sum(len(t["adapters"]) for t in fleet["tenants"])
    print(f"fleet: {len(fleet['tenants'])} tenants, {total} adapters -> {out}")


if __name__ == "__main__":
    main()
