"""`preft adapters`: a tenant's adapters managed from the command line through a real gateway (Redis, registry and
S3 real; the stub engine): upload, list, show, alias, share and delete, as the HTTP API does them; refusals and an
unreachable gateway are a message and exit code 1, bad arguments exit code 2, and nothing is left changed."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from preft.cli import tenant
from preft.cli.main import app


def _cli(gateway, key: str):
    runner = CliRunner()
    tenant.out.width = 200  # (tables whole, not cut to the runner's terminal)

    def run(*args: str, code: int = 0, input: str | None = None):
        result = runner.invoke(app, ["adapters", "--base-url", gateway.url, "--api-key", key, *args], input=input)
        assert result.exit_code == code, (args, result.output, result.exception)
        return result

    return run


def test_a_tenant_manages_its_adapters_from_the_command_line(gateway, registry, tiny_models, tmp_path):
    key, other = registry.tenant("acme"), registry.tenant("globex")
    cli = _cli(gateway, key)
    assert "mine@v1: uploaded" in cli("upload", "mine", str(tiny_models["lora"])).output
    assert "unchanged" in cli("upload", "mine", str(tiny_models["lora"])).output
    second = json.loads(cli("--json", "upload", "mine", str(tiny_models["direft"]), "--mode", "all").output)
    assert second["created"] and second["adapter"]["id"] == "mine@v2"

    listed = cli("list").output
    assert "mine" in listed and "direft" in listed and "latest→v2" in listed
    shown = json.loads(cli("--json", "show", "mine").output)
    assert [v["version"] for v in shown["versions"]] == [1, 2] and shown["shared_with"] == []
    assert "v1" in cli("show", "mine").output

    assert json.loads(cli("--json", "alias", "mine", "prod", "--version", "1").output)["aliases"]["prod"] == 1
    assert gateway.http(key).get("/v1/adapters/mine").json()["aliases"] == {"latest": 2, "prod": 1}
    cli("alias", "mine", "prod", "--remove")
    assert gateway.http(key).get("/v1/adapters/mine").json()["aliases"] == {"latest": 2}

    assert "offered to globex" in cli("share", "mine", "globex").output
    assert "offered to globex" in cli("show", "mine").output
    recipient = _cli(gateway, other)
    assert gateway.http(other).get("/v1/adapters").json()["data"] == []  # (not until globex accepts)
    assert "acme/mine" in recipient("offers").output and "offered" in recipient("offers").output
    assert "accepted" in recipient("accept", "acme/mine").output
    shared = gateway.http(other).get("/v1/adapters").json()["data"]
    assert [a["id"] for a in shared] == ["acme/mine"]
    assert "acme/mine" in recipient("list").output
    assert "declined" in recipient("decline", "acme/mine").output
    assert gateway.http(other).get("/v1/adapters").json()["data"] == []
    assert "404" in recipient("accept", "acme/mine", code=1).output
    assert recipient("accept", "mine", code=2).exit_code == 2  # (not owner/name)
    cli("share", "mine", "globex")
    recipient("accept", "acme/mine")
    cli("share", "mine", "globex", "--remove")
    assert gateway.http(other).get("/v1/adapters").json()["data"] == []

    assert "deleted mine: v1" in cli("delete", "mine", "--version", "1", "--yes").output
    refused = cli("delete", "mine", input="n\n", code=1)  # (asked, and answered no: nothing deleted)
    assert "Delete mine and every version of it?" in refused.output
    assert [v["version"] for v in gateway.http(key).get("/v1/adapters/mine").json()["versions"]] == [2]
    cli("delete", "mine", input="y\n")
    assert gateway.http(key).get("/v1/adapters/mine").status_code == 404


def test_refusals_and_bad_arguments_are_messages(gateway, registry, tiny_models, tmp_path):
    key = registry.tenant("acme")
    cli = _cli(gateway, key)
    missing = cli("show", "nope", code=1)
    assert "404" in missing.output and "nope" in missing.output
    assert "401" in _cli(gateway, "sk-wrong")("list", code=1).output
    (tmp_path / "empty").mkdir()
    assert "holds no files" in cli("upload", "x", str(tmp_path / "empty"), code=2).output
    assert "not a directory" in cli("upload", "x", str(tmp_path / "nowhere"), code=2).output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    assert "400" in cli("upload", "x", str(bad), code=1).output
    assert "400" in cli("upload", "x", str(tiny_models["lora"]), "--mode", "sometimes", code=1).output
    assert "--version or --remove" in cli("alias", "x", "prod", code=2).output
    cli("upload", "odd/name?", str(tiny_models["lora"]), code=1)  # (the registry refuses the name: no other route)
    assert gateway.http(key).get("/v1/adapters").json()["data"] == []  # (nothing was left behind)
    unreachable = CliRunner().invoke(app, ["adapters", "--base-url", "http://127.0.0.1:9", "--api-key", key, "list"])
    assert unreachable.exit_code == 1 and "127.0.0.1:9" in unreachable.output
    no_key = CliRunner().invoke(app, ["adapters", "list"], env={"PREFT_API_KEY": ""})
    assert no_key.exit_code == 2 and "API key" in no_key.output
