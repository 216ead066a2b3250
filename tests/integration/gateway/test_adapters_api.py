"""Tenants manage their own adapters through the gateway with their API key (real gateway, Redis, registry and S3;
the stub engine): an uploaded version is served by name, versions and aliases move, deletes stick, bad uploads
are a 400 that leaves nothing behind, and no tenant reaches another's adapters."""

from __future__ import annotations

from pathlib import Path

from preft.adapters import adapter_digest

from .conftest import error_of


def _files(adapter_dir: Path) -> list[tuple[str, tuple[str, bytes]]]:
    return [("files", (p.name, p.read_bytes())) for p in sorted(adapter_dir.iterdir()) if p.is_file()]


def _served_digest(gateway, key: str, model: str, stub) -> str:
    """The adapter digest the engine was asked for, serving `model`."""
    gateway.openai(key).completions.create(model=model, prompt="hello", max_tokens=2)
    return stub.received[-1][0]


def test_upload_serve_alias_and_delete(gateway, registry, stub, tiny_models):
    key = registry.tenant("acme")
    http = gateway.http(key)
    lora, direft = tiny_models["lora"], tiny_models["direft"]

    up = http.post("/v1/adapters", data={"name": "mine"}, files=_files(lora))
    assert up.status_code == 201, up.text
    version = up.json()["adapter"]
    assert up.json()["created"] and version["id"] == "mine@v1" and version["owner"] == "acme"
    assert "x-ratelimit-remaining-requests" in up.headers  # (an upload counts as a request)
    assert (version["method"], version["default_mode"], version["rank"]) == ("lora", "prefill", 4)
    assert version["digest"] == adapter_digest(lora) and version["uploader"].startswith("acme:key ")
    assert {f["path"] for f in version["files"]} == {p.name for p in lora.iterdir()}
    assert _served_digest(gateway, key, "mine", stub) == adapter_digest(lora)
    models = gateway.openai(key).models.list()
    assert "mine" in {m.id for m in models.data}

    again = http.post("/v1/adapters", data={"name": "mine"}, files=_files(lora))
    assert again.status_code == 200 and not again.json()["created"]  # (the same content: no new version)
    second = http.post("/v1/adapters", data={"name": "mine", "mode": "all", "alias": "prod"}, files=_files(direft))
    assert second.status_code == 201 and second.json()["adapter"]["id"] == "mine@v2"
    shown = http.get("/v1/adapters/mine").json()
    assert [v["version"] for v in shown["versions"]] == [1, 2] and shown["aliases"] == {"latest": 2, "prod": 2}
    assert shown["latest"]["method"] == "direft" and shown["latest"]["default_mode"] == "all"
    listed = http.get("/v1/adapters").json()["data"]
    assert [(a["id"], a["version_count"]) for a in listed] == [("mine", 2)]

    moved = http.put("/v1/adapters/mine/aliases/prod", json={"version": 1})
    assert moved.status_code == 200 and moved.json()["aliases"]["prod"] == 1
    assert _served_digest(gateway, key, "mine:prod", stub) == adapter_digest(lora)
    assert http.delete("/v1/adapters/mine/aliases/prod").json()["aliases"] == {"latest": 2}

    assert http.delete("/v1/adapters/mine/versions/1").json()["versions"] == [1]
    assert [v["version"] for v in http.get("/v1/adapters/mine").json()["versions"]] == [2]
    assert http.delete("/v1/adapters/mine").json()["versions"] == [2]
    gone = http.get("/v1/adapters/mine")
    assert gone.status_code == 404 and "mine" in error_of(gone)["message"]
    assert http.get("/v1/adapters").json()["data"] == []


def test_tenants_reach_only_their_own_adapters(gateway, registry, stub, tiny_models):
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    assert gateway.http(acme).post("/v1/adapters", data={"name": "mine"}, files=_files(tiny_models["lora"])).is_success
    other = gateway.http(beta)
    assert other.get("/v1/adapters").json()["data"] == []
    for answer in (
        other.get("/v1/adapters/mine"),
        other.delete("/v1/adapters/mine"),
        other.put("/v1/adapters/mine/aliases/prod", json={"version": 1}),
    ):
        assert answer.status_code == 404, answer.text
    assert gateway.http(acme).get("/v1/adapters/mine").status_code == 200  # (still there)
    mine = gateway.http(acme)
    assert mine.put("/v1/adapters/mine/shares/beta").json()["offered_to"] == ["beta"]
    assert other.post("/v1/adapters/shares/offers/acme/mine/accept").status_code == 200  # (test_share_offers)
    assert mine.get("/v1/adapters/mine").json()["shared_with"] == ["beta"]
    (shared,) = other.get("/v1/adapters").json()["data"]
    assert shared["id"] == "acme/mine" and "shared_with" not in shared
    assert _served_digest(gateway, beta, "acme/mine", stub) == adapter_digest(tiny_models["lora"])
    assert other.put("/v1/adapters/mine/shares/gamma").status_code == 404  # (beta may use it, not share it)
    assert mine.put("/v1/adapters/mine/shares/acme").status_code == 400  # (the owner)
    assert mine.delete("/v1/adapters/mine/shares/beta").json()["shared_with"] == []
    assert other.get("/v1/adapters").json()["data"] == []
    assert gateway.http("preft_nope_nope").get("/v1/adapters").status_code == 401
    unauthenticated = gateway.http().post("/v1/adapters", data={"name": "x"}, files=_files(tiny_models["lora"]))
    assert unauthenticated.status_code == 401


def test_bad_uploads_are_400_and_leave_nothing(make_gateway, registry, stub, tiny_models, tmp_path):
    key = registry.tenant("acme")
    http = make_gateway(max_adapter_upload_bytes=64 * 1024).http(key)
    lora = tiny_models["lora"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_bytes((lora / "adapter_config.json").read_bytes())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    renamed = [("files", ("../adapter_config.json", b"{}"))]
    for data, files, status, says in (
        ({}, _files(lora), 400, "name"),
        ({"name": "mine"}, [], 400, "files"),
        ({"name": "mine", "mode": "decode"}, _files(lora), 400, "mode"),
        ({"name": "mine"}, _files(broken), 400, "safetensors"),
        ({"name": "mine"}, renamed, 400, "plain name"),
        ({"name": "bad name!"}, _files(lora), 400, "name"),
        ({"name": "mine"}, [("files", ("adapter_model.safetensors", b"x" * 70_000))], 413, "larger than"),
        ({"name": "mine"}, [("files", (f"f{i}.json", b"{}")) for i in range(17)], 400, "Too many files"),
        ({"name": "mine"}, [*_files(lora), ("name", ("name.txt", b"other"))], 400, "name: a form field"),
    ):
        answer = http.post("/v1/adapters", data=data, files=files or None)
        assert answer.status_code == status, (data, answer.text)
        assert says in error_of(answer)["message"], (data, answer.text)
    json_upload = http.post("/v1/adapters", json={"name": "mine"})
    assert json_upload.status_code == 400 and "multipart" in error_of(json_upload)["message"]
    assert http.put("/v1/adapters/mine/aliases/prod", json={"version": 0}).status_code == 400
    assert http.get("/v1/adapters").json()["data"] == []
    assert http.post("/v1/adapters", data={"name": "mine"}, files=_files(lora)).status_code == 201  # (then it works)
    slow = make_gateway().http(registry.tenant("slow", rpm=1))
    assert slow.post("/v1/adapters", data={"name": "one"}, files=_files(lora)).status_code == 201
    limited = slow.post("/v1/adapters", data={"name": "two"}, files=_files(lora))
    assert limited.status_code == 429 and "retry-after" in limited.headers
