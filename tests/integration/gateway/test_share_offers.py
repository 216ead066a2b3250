"""Sharing through the gateway is an offer the recipient accepts (real gateway, Redis, registry and S3; the stub
engine): an owner's answer never tells whether the named tenant exists, an offer is invisible to the recipient
until it accepts, the recipient can decline or leave a share and the owner withdraw it, and a recipient never sees
the owner's API key ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .conftest import error_of


def _files(adapter_dir: Path) -> list[tuple[str, tuple[str, bytes]]]:
    return [("files", (p.name, p.read_bytes())) for p in sorted(adapter_dir.iterdir()) if p.is_file()]


def _shape(value: Any) -> Any:
    """A JSON value's structure: keys and value types, not the values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def _model_ids(http) -> list[str]:
    return [m["id"] for m in http.get("/v1/models").json()["data"]]


def _complete(http, model: str):
    return http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})


def test_a_share_answers_the_same_for_an_unknown_tenant(gateway, registry, tiny_models):
    acme, _ = registry.tenant("acme"), registry.tenant("beta")
    http = gateway.http(acme)
    for name in ("one", "two"):
        assert http.post("/v1/adapters", data={"name": name}, files=_files(tiny_models["lora"])).status_code == 201

    existing, unknown = http.put("/v1/adapters/one/shares/beta"), http.put("/v1/adapters/two/shares/ghost")
    assert existing.status_code == unknown.status_code == 202, (existing.text, unknown.text)
    assert _shape(existing.json()) == _shape(unknown.json())
    assert existing.json()["offered_to"] == ["beta"] and unknown.json()["offered_to"] == ["ghost"]
    assert existing.json()["shared_with"] == unknown.json()["shared_with"] == []  # (offered, not shared)
    withdrawn = [http.delete("/v1/adapters/one/shares/beta"), http.delete("/v1/adapters/two/shares/ghost")]
    assert [w.status_code for w in withdrawn] == [200, 200]
    assert _shape(withdrawn[0].json()) == _shape(withdrawn[1].json())
    never = [http.delete("/v1/adapters/one/shares/beta"), http.delete("/v1/adapters/one/shares/nobody")]
    assert [n.status_code for n in never] == [200, 200]  # (nothing to withdraw: the same answer either way)
    assert http.put("/v1/adapters/one/shares/acme").status_code == 400  # (the owner itself)
    assert http.put("/v1/adapters/nothing/shares/beta").status_code == 404  # (no such adapter of acme's)


def test_an_offer_is_used_only_once_accepted_and_either_side_ends_it(make_gateway, registry, stub, tiny_models):
    acme, beta, gamma = registry.tenant("acme"), registry.tenant("beta"), registry.tenant("gamma")
    gateway = make_gateway(resolve_cache_ttl_s=0)  # (every request asks the registry)
    owner, recipient, bystander = gateway.http(acme), gateway.http(beta), gateway.http(gamma)
    assert owner.post("/v1/adapters", data={"name": "mine"}, files=_files(tiny_models["lora"])).status_code == 201
    missing = _complete(recipient, "acme/nothing")

    assert owner.put("/v1/adapters/mine/shares/beta").status_code == 202
    assert _model_ids(recipient) == ["tiny-llama"]
    assert recipient.get("/v1/adapters").json()["data"] == []
    pending = _complete(recipient, "acme/mine")
    assert pending.status_code == 404 and pending.json() == {
        "error": {**missing.json()["error"], "message": missing.json()["error"]["message"].replace("nothing", "mine")}
    }
    (offer,) = recipient.get("/v1/adapters/shares/offers").json()["data"]
    assert (offer["id"], offer["owner"], offer["name"], offer["status"]) == ("acme/mine", "acme", "mine", "offered")
    assert bystander.get("/v1/adapters/shares/offers").json()["data"] == []
    assert bystander.post("/v1/adapters/shares/offers/acme/mine/accept").status_code == 404  # (not offered to it)

    accepted = recipient.post("/v1/adapters/shares/offers/acme/mine/accept")
    assert accepted.status_code == 200 and accepted.json()["status"] == "accepted", accepted.text
    assert _model_ids(recipient) == ["tiny-llama", "acme/mine"]
    assert _complete(recipient, "acme/mine").status_code == 200
    assert owner.get("/v1/adapters/mine").json()["shared_with"] == ["beta"]
    assert [o["status"] for o in recipient.get("/v1/adapters/shares/offers").json()["data"]] == ["accepted"]

    # the recipient leaves the share: gone from its models and unusable, and the owner sees it
    assert recipient.delete("/v1/adapters/shares/offers/acme/mine").status_code == 200
    assert _model_ids(recipient) == ["tiny-llama"] and _complete(recipient, "acme/mine").status_code == 404
    assert owner.get("/v1/adapters/mine").json()["shared_with"] == []
    assert recipient.get("/v1/adapters/shares/offers").json()["data"] == []
    again = recipient.delete("/v1/adapters/shares/offers/acme/mine")
    unknown = recipient.delete("/v1/adapters/shares/offers/ghost/mine")
    assert again.status_code == unknown.status_code == 404
    assert error_of(again)["message"].replace("acme", "X") == error_of(unknown)["message"].replace("ghost", "X")

    # declining an offer, and the owner withdrawing an accepted share
    owner.put("/v1/adapters/mine/shares/beta")
    assert recipient.delete("/v1/adapters/shares/offers/acme/mine").status_code == 200
    assert recipient.post("/v1/adapters/shares/offers/acme/mine/accept").status_code == 404
    owner.put("/v1/adapters/mine/shares/beta")
    assert recipient.post("/v1/adapters/shares/offers/acme/mine/accept").status_code == 200
    assert owner.delete("/v1/adapters/mine/shares/beta").json()["shared_with"] == []
    assert _model_ids(recipient) == ["tiny-llama"] and _complete(recipient, "acme/mine").status_code == 404


def test_a_recipient_never_sees_the_owners_key_ids(make_gateway, registry, tiny_models):
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    gateway = make_gateway(resolve_cache_ttl_s=0)
    owner, recipient = gateway.http(acme), gateway.http(beta)
    uploaded = owner.post("/v1/adapters", data={"name": "mine"}, files=_files(tiny_models["lora"]))
    key_id = acme.split("_")[1]
    assert uploaded.status_code == 201 and key_id in uploaded.json()["adapter"]["uploader"]  # (the owner sees it)
    registry.share("acme", "mine", add=("beta",))  # (an operator's direct share: no offer to accept)

    views = [
        recipient.get("/v1/adapters"),
        recipient.get("/v1/adapters/shares/offers"),
        recipient.get("/v1/models"),
        recipient.get("/v1/models/acme/mine"),
    ]
    for view in views:
        assert key_id not in view.text and "uploader" not in view.text, view.text
    assert [v.status_code for v in views] == [200] * 4, [v.text for v in views]
    assert [a["id"] for a in views[0].json()["data"]] == ["acme/mine"]
    assert [o["status"] for o in views[1].json()["data"]] == ["accepted"]
