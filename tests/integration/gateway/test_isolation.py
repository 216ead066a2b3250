"""Tenants cannot see each other's adapters on any route: a hidden adapter answers exactly like a missing one
(status, headers that matter, body), and sharing makes it usable. Each tenant's engine requests carry its own
prefix-cache salt (a cache group's tenants one salt), never one a client chose."""

from __future__ import annotations

import openai
import pytest

ROUTES = {
    "completions": lambda http, model: http.post("/v1/completions", json={"model": model, "prompt": "hi"}),
    "completions-stream": lambda http, model: http.post(
        "/v1/completions", json={"model": model, "prompt": "hi", "stream": True}
    ),
    "chat": lambda http, model: http.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}
    ),
    "chat-stream": lambda http, model: http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
    "models-retrieve": lambda http, model: http.get(f"/v1/models/{model}"),
}


def _answer(response):
    return response.status_code, response.headers["content-type"], response.json()


@pytest.mark.parametrize("route", ROUTES)
def test_hidden_adapter_is_indistinguishable_from_a_missing_one(route, make_gateway, registry, stub, tiny_models):
    call = ROUTES[route]
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    gateway = make_gateway(resolve_cache_ttl_s=0)  # every request asks the registry: no stale answers
    http_acme = gateway.http(acme)

    # beta/secret does not exist yet, then exists unshared: acme gets the same answer both times
    missing = _answer(call(http_acme, "beta/secret"))
    registry.publish("beta", "secret", tiny_models["lora"], alias="prod")
    for ref in ("beta/secret", "beta/secret@v1", "beta/secret:prod", "beta/secret:latest"):
        hidden = call(http_acme, ref)
        assert _answer(hidden)[:2] == missing[:2] == (404, "application/json")
        assert hidden.json() == _expected_404(ref), ref
    assert missing[2] == _expected_404("beta/secret")
    # a bare name is always the caller's own adapter, never another tenant's
    assert call(http_acme, "secret").json() == _expected_404("secret")
    assert stub.received == []

    # beta itself uses it; once shared, acme can too (under owner/name)
    assert call(gateway.http(beta), "secret").status_code == 200
    registry.share("beta", "secret", add=("acme",))
    assert call(http_acme, "beta/secret:prod").status_code == 200
    assert call(http_acme, "secret").status_code == 404
    registry.share("beta", "secret", remove=("acme",))
    assert call(http_acme, "beta/secret").json() == _expected_404("beta/secret")


def _expected_404(model: str) -> dict:
    message = f"The model {model!r} does not exist or you do not have access to it."
    return {"error": {"message": message, "type": "invalid_request_error", "code": "model_not_found", "param": None}}


def test_models_list_and_openai_errors_respect_tenants(make_gateway, registry, tiny_models):
    acme, beta = registry.tenant("acme"), registry.tenant("beta")
    registry.publish("beta", "secret", tiny_models["lora"])
    gateway = make_gateway(resolve_cache_ttl_s=0)
    client = gateway.openai(acme)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    with pytest.raises(openai.NotFoundError) as hidden:
        client.completions.create(model="beta/secret", prompt="hi")
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="beta/nothing", prompt="hi")
    assert hidden.value.code == missing.value.code == "model_not_found"
    assert str(hidden.value).replace("secret", "X") == str(missing.value).replace("nothing", "X")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="beta/secret", messages=[{"role": "user", "content": "hi"}])

    registry.share("beta", "secret", add=("acme",))
    assert [m.id for m in client.models.list().data] == ["tiny-llama", "beta/secret"]
    assert client.completions.create(model="beta/secret", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert [m.id for m in gateway.openai(beta).models.list().data] == ["tiny-llama", "secret"]


def test_each_tenant_has_its_own_prefix_cache_salt_unless_grouped(make_gateway, registry, stub):
    keys = {t: registry.tenant(t) for t in ("acme", "beta", "gamma", "delta")}
    gateway = make_gateway(cache_groups={"gamma": "g", "delta": "g"})
    body = {"model": "tiny-llama", "prompt": "a long shared system prompt", "max_tokens": 1}
    salts = {}
    for tenant, key in [*keys.items(), ("acme", keys["acme"])]:
        seen = len(stub.received)
        assert gateway.http(key).post("/v1/completions", json=body).status_code == 200
        [(_, request)] = stub.received[seen:]
        salts.setdefault(tenant, set()).add(request.cache_salt)
    assert all(len(s) == 1 and None not in s for s in salts.values()), salts  # (acme's two requests: one salt)
    assert salts["gamma"] == salts["delta"], salts  # one group
    assert len({*salts["acme"], *salts["beta"], *salts["gamma"]}) == 3, salts
    assert not {*salts["acme"], *salts["beta"], *salts["gamma"]} & set(keys), salts  # (not the tenant ids)
    # another gateway with the same registry token (the default key) gives the same salts
    again = make_gateway()
    seen = len(stub.received)
    assert again.http(keys["acme"]).post("/v1/completions", json=body).status_code == 200
    assert {stub.received[seen][1].cache_salt} == salts["acme"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny-llama", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"model": "tiny-llama", "input": "hi", "store": False}),
    ],
)
def test_a_clients_cache_salt_is_refused(gateway, registry, stub, path, body):
    answer = gateway.http(registry.tenant("acme")).post(path, json=body | {"cache_salt": "beta's"})
    assert answer.status_code == 400, answer.text
    assert "cache_salt" in answer.json()["error"]["message"]
    assert not stub.received
