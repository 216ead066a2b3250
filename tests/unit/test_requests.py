"""JSON-lines request parsing for `preft generate`."""

from __future__ import annotations

import json

from preft.common.modes import PositionMode
from preft.engine.requests import read_requests


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


def test_sampling_options_come_from_the_line_over_the_defaults():
    """Keys beyond the request's are sampling options (the serving engine's): greedy with EOS ignored unless a line
    or the defaults say otherwise; a bad option fails its line alone, naming it."""
    lines = [
        json.dumps({"id": "plain", "prompt": "x"}),
        json.dumps({"id": "own", "prompt": "x", "temperature": 0.7, "seed": 3, "ignore_eos": False, "stop": ["."]}),
        json.dumps({"id": "p", "prompt": "x", "top_p": 0}),
        json.dumps({"id": "min", "prompt": "x", "max_tokens": 4, "min_tokens": 5}),
        json.dumps({"id": "words", "prompt": "x", "bad_words": [" "]}),
        json.dumps({"id": "two", "prompt": "x", "constraint": {"regex": "a", "choice": ["b"]}}),
    ]
    reqs, failed = read_requests(lines, {"temperature": 0.2, "logprobs": 1})
    plain, own = (r.sampling for r in reqs)
    assert (plain.temperature, plain.ignore_eos, plain.logprobs, plain.seed) == (0.2, True, 1, None)
    assert (own.temperature, own.ignore_eos, own.logprobs, own.seed, own.stop) == (0.7, False, 1, 3, ["."])
    assert read_requests(lines[:1])[0][0].sampling.temperature == 0.0
    errors = {f.id: f.error for f in failed}
    assert errors["p"].startswith("line 3: top_p:")
    assert errors["min"] == "line 4: min_tokens (5) exceeds max_tokens (4)"
    assert "bad_words.0" in errors["words"] and "give exactly one of" in errors["two"]
