"""The gateway answers as its /openapi.json says: Schemathesis (its CLI, as CI runs it) loads the live schema of the
local stack's gateway and sends generated requests to every operation, as a fresh tenant of its own (never the demo
tenant: later tests rely on its adapters). Each answer must not be a 5xx, must have a status the operation declares,
with the declared content type and a body matching the declared schema; an authenticated operation must refuse a
request without its key, and a deleted object must be gone.

The run is bounded by tests/e2e/schemathesis.toml (examples per operation, max-time) and by its hooks (small
generation budgets). Before it, the tenant gets one of everything (an adapter, a share offer, a file, a batch, a
stored response, a conversation), and the run draws those names and ids often enough to get past "no such object".

Run it alone: `pytest tests/e2e/test_openapi_conformance.py` (it starts the local stack, a few minutes here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from preft.api.v1 import registry_pb2 as pb
from preft.devtools.tiny import build_lora
from preft.gateway.openai.schemas import EXAMPLE_MODEL
from preft.registry.client import scan_adapter_dir
from preft.stack.local import BASE_MODEL_ID

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("schemathesis.toml")
TENANT = "conformance"
OWNER = "conformance-owner"  # a tenant that offers its adapter SHARED to TENANT
SHARED = "shared"
# No per-minute bucket runs out during the run (the limits are not what it checks; the hooks bound the tokens)
LIMITS = pb.TenantLimits(requests_per_min=1_000_000, tokens_per_min=100_000_000)
RUN_TIMEOUT_S = 240  # (the run's max-time, with its loading and the checks of the last cases)


def seeded(stack: Any, work: Path) -> tuple[str, dict[str, list[Any]]]:
    """TENANT's key, and the names and ids it has, by the parameter that takes them."""
    model = stack.info.model_dir
    with stack.local().registry_client() as c:
        for tenant, name, seed in ((TENANT, EXAMPLE_MODEL, 61), (OWNER, SHARED, 62)):
            c.call("CreateTenant", pb.CreateTenantRequest(id=tenant, limits=LIMITS))
            lora = build_lora(work / tenant, model, rank=4, seed=seed)
            c.upload_adapter(scan_adapter_dir(lora), tenant=tenant, name=name)
        c.call("Share", pb.ShareRequest(tenant=OWNER, name=SHARED, add=[TENANT], offer=True))
        key = c.call("IssueKey", pb.IssueKeyRequest(tenant=TENANT)).secret
    line = {"method": "POST", "url": "/v1/chat/completions"}
    body = {"model": EXAMPLE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    lines = "".join(json.dumps({"custom_id": f"r{i}", **line, "body": body}) + "\n" for i in range(2))
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.info.gateway_url, headers=headers, timeout=60) as http:

        def made(path: str, **request: Any) -> str:
            return http.post(path, **request).raise_for_status().json()["id"]

        # (two files: the run deletes what it is given, and a batch's input is drawn apart)
        file_id, input_file_id = (
            made("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", lines)}) for _ in range(2)
        )
        batch = {"input_file_id": input_file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch_id = made("/v1/batches", json=batch)
        response = {"model": EXAMPLE_MODEL, "input": "Hi", "max_output_tokens": 2}
        response_ids = [
            made("/v1/responses", json=response),
            made("/v1/responses", json=response | {"background": True}),
        ]
        items = {"items": [{"type": "message", "role": "user", "content": "Hi"}]}
        conversation_id = made("/v1/conversations", json=items)
        item_id = http.get(f"/v1/conversations/{conversation_id}/items").raise_for_status().json()["first_id"]
    values = {
        "model": [BASE_MODEL_ID, EXAMPLE_MODEL, f"{OWNER}/{SHARED}"],
        "name": [EXAMPLE_MODEL, SHARED],
        "owner": [OWNER],
        "tenant": [OWNER],
        "version": [1],
        "file_id": [file_id],
        "input_file_id": [input_file_id],
        "batch_id": [batch_id],
        "response_id": response_ids,  # (a stored one, and a background one to cancel)
        "previous_response_id": response_ids[:1],
        "conversation_id": [conversation_id],
        "item_id": [item_id],
    }
    return key, values


def bindings(values: dict[str, list[Any]]) -> str:
    """The config's dictionaries of these values and their bindings to path and body parameters (TOML)."""
    dictionaries = "".join(f"\n[dictionaries.{name}]\nvalues = {json.dumps(v)}\n" for name, v in values.items())
    rows = [
        f'"{where}.{name}" = {{ dictionary = "{name}", probability = {0.8 if name == "model" else 0.5} }}'
        for name in values
        for where in ("path", "body")
    ]
    return dictionaries + "\n[parameters]\n" + "\n".join(rows) + "\n"


def test_every_answer_matches_the_openapi_schema(stack, tmp_path):
    key, values = seeded(stack, tmp_path)
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG.read_text() + bindings(values))
    env = {
        **os.environ,
        "PREFT_CONFORMANCE_KEY": key,  # (the config reads it: the key stays off the command line)
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),  # (the hooks module)
    }
    schema_url = f"{stack.info.gateway_url}/openapi.json"
    operations = sum(len(ops) for ops in httpx.get(schema_url).raise_for_status().json()["paths"].values())
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", schema_url, "--no-color"]
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = run.stdout + run.stderr
    (tmp_path / "schemathesis.log").write_text(output)  # (the whole report, where the assertion shows its end)
    assert run.returncode == 0, output[-30_000:]
    summary = output[output.find("API Operations:") :]
    assert f"Tested: {operations}\n" in summary, summary  # (every operation was sent requests)
