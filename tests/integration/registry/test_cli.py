"""`preft-admin` against a real registry: tables and --json, exit codes, and a kill in the middle of an upload."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from preft.cli import admin as admin_cli
from preft.cli.admin import app
from preft.common.errors import NotFound
from preft.devtools.tiny import build_lora

from .conftest import TOKEN

runner = CliRunner()


@pytest.fixture
def admin(registry_address):
    def run(*args: str, expect: int = 0) -> str:
        result = runner.invoke(app, ["--registry", registry_address, "--token", TOKEN, *args])
        assert result.exit_code == expect, f"{args}: exit {result.exit_code}\n{result.output}"
        return result.output

    return run


def test_operator_workflow(admin, tiny):
    admin("base", "register", "tiny-llama", "--config", str(tiny["model"]))
    assert "acme" in admin("tenant", "create", "acme", "--rpm", "60")
    admin("tenant", "create", "beta")
    tenants = json.loads(admin("--json", "tenant", "list"))
    assert [(t["id"], t["limits"]["requests_per_min"]) for t in tenants] == [("acme", "60"), ("beta", "600")]

    issued = json.loads(admin("--json", "key", "issue", "acme", "--label", "laptop"))
    assert issued["secret"].startswith("preft_") and issued["key"]["tenant"] == "acme"
    listing = admin("--json", "key", "list", "--tenant", "acme")
    assert issued["key"]["id"] in listing and issued["secret"] not in listing and "hash" not in listing

    up = json.loads(admin("--json", "adapter", "upload", str(tiny["lora"]), "--tenant", "acme", "--name", "chat"))
    assert up["created"] and up["manifest"]["version"] == 1
    admin(
        "adapter",
        "upload",
        str(tiny["lora2"]),
        "--tenant",
        "acme",
        "--name",
        "chat",
        "--mode",
        "all",
        "--alias",
        "prod",
    )
    assert "unchanged" in admin(
        "adapter", "upload", str(tiny["lora2"]), "--tenant", "acme", "--name", "chat", "--mode", "all"
    )
    admin("adapter", "upload", str(tiny["direft"]), "--tenant", "acme", "--name", "style")
    assert "adapter_model.safetensors" in admin("adapter", "show", "acme/chat")
    shown = json.loads(admin("--json", "adapter", "show", "acme/chat"))
    assert shown["aliases"] == {"latest": 2, "prod": 2} and shown["version_count"] == 2
    versions = json.loads(admin("--json", "adapter", "versions", "acme/chat"))
    assert [v["version"] for v in versions] == [1, 2] and versions[1]["default_mode"] == "POSITION_MODE_ALL"
    admin("adapter", "alias", "acme/chat", "prod", "1")
    assert json.loads(admin("--json", "adapter", "resolve", "acme/chat:prod"))["version"] == 1
    admin("adapter", "share", "acme/style", "--with", "beta")
    admin("adapter", "list", "--tenant", "beta")
    listed = json.loads(admin("--json", "adapter", "list", "--tenant", "beta"))
    assert [(a["tenant"], a["name"], a["shared_with"]) for a in listed] == [("acme", "style", ["beta"])]
    assert json.loads(admin("--json", "adapter", "resolve", "acme/style", "--as", "beta"))["method"] == (
        "ADAPTER_METHOD_DIREFT"
    )
    admin("adapter", "hot")
    admin("adapter", "delete", "acme/style", "--yes")
    gc = json.loads(admin("--json", "gc", "--min-age-s", "0"))
    assert len(gc["deleted_blobs"]) == 2
    admin("tenant", "disable", "beta")
    assert json.loads(admin("--json", "tenant", "list"))[1]["disabled"] is True


def test_exit_codes(admin, tiny, tmp_path, registry_address):
    admin("tenant", "create", "acme")
    # 1: the registry refuses (the message says why)
    assert "already exists" in admin("tenant", "create", "acme", expect=1)
    assert "not found" in admin("adapter", "show", "acme/ghost", expect=1)
    assert "tenant 'nobody'" in admin(
        "adapter", "upload", str(tiny["lora"]), "--tenant", "nobody", "--name", "x", expect=1
    )
    # 2: wrong usage, caught before anything is sent
    assert "not a directory" in admin(
        "adapter", "upload", str(tmp_path / "nope"), "--tenant", "acme", "--name", "x", expect=2
    )
    assert "--mode" in admin(
        "adapter", "upload", str(tiny["lora"]), "--tenant", "acme", "--name", "x", "--mode", "sometimes", expect=2
    )
    assert "tenant/name" in admin("adapter", "show", "justaname", expect=2)
    admin("tenant", "nonsense", expect=2)
    # 1 as well when the registry cannot be reached or the token is wrong
    result = runner.invoke(app, ["--registry", "127.0.0.1:1", "--token", TOKEN, "tenant", "list"])
    assert result.exit_code == 1 and "unavailable" in result.output
    result = runner.invoke(app, ["--registry", registry_address, "--token", "wrong", "tenant", "list"])
    assert result.exit_code == 1 and "token" in result.output


def test_json_after_the_command_help_with_env_hints_and_version(admin):
    admin("tenant", "create", "acme")
    # --json where a user types it: after the command, as well as before it
    assert json.loads(admin("tenant", "list", "--json")) == json.loads(admin("--json", "tenant", "list"))
    assert json.loads(admin("key", "issue", "acme", "--json", "--label", "ci"))["key"]["label"] == "ci"
    helped = runner.invoke(app, ["--help"]).output
    assert "[env PREFT_ADMIN__REGISTRY]" in helped and "PREFT_ADMIN__TOKEN" in helped
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.split() == [
        "preft-serve",
        importlib.metadata.version("preft-serve"),
    ]


def table_rows(output: str) -> list[list[str]]:
    """The cells of a rich table's lines, header first (rules left out)."""
    lines = [line.strip("│┃ ") for line in output.splitlines() if line.startswith(("│", "┃"))]
    return [[cell.strip() for cell in line.replace("┃", "│").split("│")] for line in lines]


def test_tenant_monthly_token_quota(admin, monkeypatch):
    monkeypatch.setattr(admin_cli.out, "width", 200)  # the whole table on one line per tenant
    created = json.loads(admin("--json", "tenant", "create", "acme", "--rpm", "60"))
    assert created["limits"]["tokens_per_month"] == "0"
    beta = json.loads(admin("--json", "tenant", "create", "beta", "--tokens-per-month", "5000000"))
    assert (beta["limits"]["requests_per_min"], beta["limits"]["tokens_per_month"]) == ("600", "5000000")

    changed = json.loads(admin("--json", "tenant", "limits", "acme", "--tokens-per-month", "1000000", "--tpm", "900"))
    assert changed["limits"] == {
        "requests_per_min": "60",
        "tokens_per_min": "900",
        "max_adapters": "5",
        "max_bytes": str(50 * 1024**3),
        "tokens_per_month": "1000000",
    }
    kept = json.loads(admin("--json", "tenant", "limits", "acme", "--max-adapters", "2"))
    assert (kept["limits"]["max_adapters"], kept["limits"]["tokens_per_month"]) == ("2", "1000000")
    removed = json.loads(admin("--json", "tenant", "limits", "beta", "--tokens-per-month", "0"))
    assert removed["limits"]["tokens_per_month"] == "0" and removed["limits"]["requests_per_min"] == "600"
    admin("tenant", "limits", "beta", "--tokens-per-month", "7000")

    header, *rows = table_rows(admin("tenant", "list"))
    assert header[:6] == ["tenant", "state", "req/min", "tok/min", "tokens/month", "adapters"]
    assert [row[:6] for row in rows] == [
        ["acme", "active", "60", "900", "1000000", "0/2"],
        ["beta", "active", "600", "200000", "7000", "0/5"],
    ]
    admin("tenant", "limits", "acme", "--tokens-per-month", "0")
    assert [row[:5] for row in table_rows(admin("tenant", "limits", "acme", "--rpm", "61"))[1:]] == [
        ["acme", "active", "61", "900", "-"]
    ]
    listed = json.loads(admin("--json", "tenant", "list"))
    assert [(t["id"], t["limits"]["tokens_per_month"]) for t in listed] == [("acme", "0"), ("beta", "7000")]

    # wrong usage: refused before anything is sent
    assert "--tokens-per-month" in admin("tenant", "limits", "beta", "--tokens-per-month", "-1", expect=2)
    assert "--tokens-per-month" in admin("tenant", "create", "gamma", "--tokens-per-month", "x", expect=2)
    assert [t["id"] for t in json.loads(admin("--json", "tenant", "list"))] == ["acme", "beta"]


@pytest.fixture
def large_adapter(tmp_path) -> tuple[Path, Path]:
    """A ~40 MB LoRA for a made-up larger base model (hidden 2048, 16 layers), and that model's directory."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "intermediate_size": 5504,
        "vocab_size": 32000,
    }
    model = tmp_path / "big-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return build_lora(tmp_path / "big-lora", model, rank=16), model


def test_killed_upload_leaves_nothing_visible_and_gc_cleans_up(registry_address, service, large_adapter, admin):
    path, model = large_adapter
    admin("base", "register", "big", "--config", str(model))
    admin("tenant", "create", "acme")
    env = {**os.environ, "PREFT_ADMIN__REGISTRY": registry_address, "PREFT_ADMIN__TOKEN": TOKEN}
    cli = subprocess.Popen(
        [sys.executable, "-m", "preft.cli.admin", "adapter", "upload", str(path), "--tenant", "acme", "--name", "big"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not service.blobs.pending_uploads():  # the weights' multipart upload has begun
            assert cli.poll() is None, "the upload finished before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        cli.send_signal(signal.SIGKILL)
        cli.wait(10)
    finally:
        cli.kill()
    deadline = time.monotonic() + 30
    while service.blobs.pending_uploads():  # the registry notices the dead stream and aborts the upload
        assert time.monotonic() < deadline, "the registry kept the half upload"
        time.sleep(0.1)
    with pytest.raises(NotFound):
        service.resolve("acme", "big")
    assert service.list_adapters("acme") == []
    weights = path / "adapter_model.safetensors"
    stored = [b.digest for b in service.blobs.list()]
    assert len(stored) == 1 and service.blobs.size(stored[0]) == (path / "adapter_config.json").stat().st_size
    assert weights.stat().st_size > 30e6

    report = json.loads(admin("--json", "gc", "--min-age-s", "0"))
    assert report["deleted_blobs"] == stored
    assert list(service.blobs.list()) == []


def test_gc_aborts_uploads_a_crashed_registry_left(service):
    s3, bucket = service.blobs.s3, service.blobs.bucket
    key = "blobs/sha256/" + "ee" * 32
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * (5 << 20))
    assert service.collect_garbage().aborted_uploads == 0  # younger than the grace period
    assert service.collect_garbage(min_age_s=0).aborted_uploads == 1
    assert service.blobs.pending_uploads() == [] and list(service.blobs.list()) == []
