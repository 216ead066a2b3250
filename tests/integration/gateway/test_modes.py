"""Position modes: the version's registered default reaches the engine; a per-request `preft_mode` is honoured
only where the operator allows it."""

from __future__ import annotations

import openai
import pytest

from preft.common.modes import PositionMode


def test_registered_default_mode_reaches_the_engine(gateway, registry, stub, tiny_models):
    key = registry.tenant("acme")
    registry.publish("acme", "pre", tiny_models["lora"], mode="prefill")
    registry.publish("acme", "full", tiny_models["direft"], mode="all")
    registry.publish("acme", "full", tiny_models["lora"], mode="prefill")  # v2: prefill; v1 stays all
    client = gateway.openai(key)
    for model, mode, method in [
        ("pre", PositionMode.PREFILL, "lora"),
        ("full@v1", PositionMode.ALL, "direft"),
        ("full", PositionMode.PREFILL, "lora"),
    ]:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
        _, req = stub.received[-1]
        assert (req.mode, req.adapter.method) == (mode, method), model


def test_mode_override_is_refused_unless_the_operator_allows_it(make_gateway, registry, stub, tiny_models):
    key = registry.tenant("acme")
    registry.publish("acme", "pre", tiny_models["lora"], mode="prefill")
    client = make_gateway().openai(key)
    with pytest.raises(openai.BadRequestError, match="preft_mode cannot be chosen"):
        client.completions.create(model="pre", prompt="hi", extra_body={"preft_mode": "all"})
    with pytest.raises(openai.BadRequestError, match="preft_mode cannot be chosen"):
        client.chat.completions.create(
            model="pre", messages=[{"role": "user", "content": "x"}], extra_body={"preft_mode": "prefill"}
        )
    assert stub.received == []

    client = make_gateway(allow_mode_override=True).openai(key)
    client.completions.create(model="pre", prompt="hi", max_tokens=1, extra_body={"preft_mode": "all"})
    assert stub.received[-1][1].mode == PositionMode.ALL
    client.chat.completions.create(model="pre", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert stub.received[-1][1].mode == PositionMode.PREFILL  # no override: the default again
    with pytest.raises(openai.BadRequestError, match="preft_mode"):
        client.completions.create(model="pre", prompt="hi", extra_body={"preft_mode": "decode"})
