"""Bodies mutated at random from valid ones (seeded, bounded): the gateway answers each with a success or a 4xx in
OpenAI's error shape, never a 5xx, and keeps serving."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from .conftest import BASE, error_of

VALID = {
    "/v1/completions": {"model": BASE, "prompt": "hello", "max_tokens": 3, "logprobs": 1, "stop": ["x"], "seed": 1},
    "/v1/chat/completions": {
        "model": BASE,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
        "response_format": {"type": "text"},
    },
    "/v1/chat/completions#functions": {
        "model": BASE,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "function", "name": "f", "content": "ok"},
        ],
        "max_tokens": 3,
        "functions": [{"name": "f", "parameters": {"type": "object"}}],
        "function_call": {"name": "f"},
    },
    "/v1/responses": {
        "model": BASE,
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "max_output_tokens": 3,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        "metadata": {"k": "v"},
    },
    "/v1/conversations": {
        "items": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "metadata": {"k": "v"},
    },
    "/v1/conversations/{conv}/items": {
        "items": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
            {"role": "developer", "content": "be brief"},
        ]
    },
}
ODD_VALUES: list[Any] = [
    None, True, -1, 0, 2**70, 1e308, -0.5, "", "x" * 300, "\u0000", [], [None], {}, {"a": {"b": []}}, [1, "a", {}],
]  # fmt: skip


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON value (keys and indexes down to each leaf)."""
    places = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            places += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            places += _paths(v, (*at, i))
    return places


def _mutated(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The body with one to three places replaced by an odd value, removed, or given an unknown sibling."""
    out = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        places = [p for p in _paths(out) if p]
        if not places:
            break
        *parent_path, last = rng.choice(places)
        parent = out
        for step in parent_path:
            parent = parent[step]
        action = rng.random()
        if action < 0.6:
            parent[last] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif action < 0.85:
            del parent[last]
        elif isinstance(parent, dict):
            parent[f"unknown_{rng.randint(0, 9)}"] = rng.choice(ODD_VALUES)
    return out


@pytest.mark.parametrize("path", sorted(VALID))
def test_mutated_bodies_get_an_answer_or_a_4xx(make_gateway, registry, stub, path):
    http = make_gateway(responses_store_ttl_s=60).http(registry.tenant("acme"))
    rng = random.Random(f"{path}-7")
    conversation = http.post("/v1/conversations", json={}).json()["id"]
    route = path.split("#")[0].format(conv=conversation)  # (after #: which body of the route)
    statuses: dict[int, int] = {}
    for _ in range(150):
        body = _mutated(VALID[path], rng)
        answer = http.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
        assert answer.status_code < 500, (body, answer.text)
        if answer.status_code >= 400:
            error_of(answer)
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # (both kinds were met)
    assert http.post(route, json=VALID[path]).status_code == 200  # (still serving)
