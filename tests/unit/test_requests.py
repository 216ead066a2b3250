"""JSON-lines request parsing for `preft generate`."""

from __future__ import annotations

import json

from preft.engine.requests import read_requests
from preft.vllm_plugin.modes import PositionMode


def test_valid_lines_parse_and_unknown_keys_are_ignored():
    lines = [
        json.dumps({"id": "a", "prompt_ids": [1, 2, 3], "adapter": "/x", "mode": "all", "max_tokens": 4, "x": 1}),
        json.dumps({"id": "b", "prompt": "hello", "adapter": None}),
    ]
    reqs, failed = read_requests(lines)
    assert not failed
    assert reqs[0].prompt_ids == (1, 2, 3) and reqs[0].mode is PositionMode.ALL and reqs[0].max_tokens == 4
    assert reqs[1].prompt == "hello" and reqs[1].mode is PositionMode.PREFILL and reqs[1].adapter is None


def test_bad_lines_fail_alone_with_their_reason():
    lines = [
        "{not json",
        json.dumps({"id": "both", "prompt": "x", "prompt_ids": [1]}),
        json.dumps({"id": "mode", "prompt": "x", "mode": "decode"}),
        json.dumps({"id": "neg", "prompt_ids": [1, -2]}),
        json.dumps({"id": "tokens", "prompt": "x", "max_tokens": 0}),
        json.dumps([1, 2]),
        json.dumps({"id": "ok", "prompt": "fine"}),
    ]
    reqs, failed = read_requests(lines)
    assert [r.id for r in reqs] == ["ok"]
    errors = {f.id: f.error for f in failed}
    assert "not valid JSON" in errors["line-1"]
    assert "exactly one" in errors["both"]
    assert "'mode'" in errors["mode"]
    assert "prompt_ids" in errors["neg"]
    assert "max_tokens" in errors["tokens"]
    assert "JSON object" in errors["line-6"]
