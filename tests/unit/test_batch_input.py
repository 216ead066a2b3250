"""A batch input file's checks (pure): each line on its own at upload, the whole file against its batch."""

from __future__ import annotations

import json

import pytest

from preft.common.errors import InvalidArgument
from preft.gateway.files.batch_input import MAX_ERRORS, BatchPlan, check_lines, parse_line, requests


def _line(custom_id: str = "a", url: str = "/v1/completions", **fields) -> bytes:
    data = {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", "prompt": "x"}, **fields}
    return json.dumps(data).encode() + b"\n"


def test_a_line_is_parsed_into_its_request():
    line = parse_line(_line("req-1", "/v1/chat/completions"), 7, 3)
    assert (line.number, line.index, line.custom_id, line.url) == (7, 3, "req-1", "/v1/chat/completions")
    assert line.body == {"model": "m", "prompt": "x"}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{", "line 4: not valid JSON"),
        (b"\xff\xfe", "line 4: not valid JSON"),
        (b'"a string"', "line 4: a JSON object with custom_id, method, url and body, not str"),
        (_line(""), "line 4: custom_id must be a non-empty string"),
        (_line(custom_id=None), "custom_id must be a non-empty string"),  # type: ignore[arg-type]
        (_line("x" * 513), "custom_id is longer than 512"),
        (_line(method="GET"), "line 4: method must be POST"),
        (_line(url="/v1/embeddings"), "line 4: url must be one of /v1/chat/completions, /v1/completions, /v1/resp"),
        (_line(body=[1]), "line 4: body must be a JSON object"),
        (_line(body=None), "line 4: body must be a JSON object"),
    ],
)
def test_a_bad_line_is_named(raw, says):
    with pytest.raises(InvalidArgument, match=says.replace("(", r"\(")):
        parse_line(raw, 4, 0)


def test_blank_lines_are_skipped_and_lines_keep_their_numbers():
    data = [b"\n", _line("a"), b"   \r\n", _line("b"), _line("c")]
    assert [(r.number, r.index, r.custom_id) for r in requests(data)] == [(2, 0, "a"), (4, 1, "b"), (5, 2, "c")]
    assert check_lines(data, 3) == 3
    with pytest.raises(InvalidArgument, match="line 5: a batch file holds at most 2 requests"):
        check_lines(data, 2)
    with pytest.raises(InvalidArgument, match="holds no requests"):
        check_lines([b"\n", b" "], 2)
    with pytest.raises(InvalidArgument, match="line 3: not valid JSON"):
        check_lines([_line("a"), b"\n", b"{oops"], 5)


def test_the_plan_names_every_line_that_fails_the_batch():
    data = [
        _line("a"),
        _line("b", "/v1/chat/completions"),
        b"[]\n",
        _line("a"),
        b"\n",
        _line("c"),
    ]
    plan = BatchPlan.of(data, "/v1/completions", 10)
    assert plan.total == 5
    assert [(e["code"], e["line"]) for e in plan.errors] == [
        ("mismatched_url", 2),
        ("invalid_request", 3),
        ("duplicate_custom_id", 4),
    ]
    assert plan.errors[0]["param"] == "url" and "not the batch's endpoint" in plan.errors[0]["message"]
    assert BatchPlan.of([_line("a"), _line("b")], "/v1/completions", 10).errors == []
    too_many = BatchPlan.of([_line(str(i)) for i in range(3)], "/v1/completions", 2)
    assert [e["code"] for e in too_many.errors] == ["too_many_requests"]
    assert [e["code"] for e in BatchPlan.of([b"\n"], "/v1/completions", 2).errors] == ["empty_file"]
    crowded = BatchPlan.of([_line("same")] * (MAX_ERRORS + 20), "/v1/completions", 10**6)
    assert len(crowded.errors) == MAX_ERRORS and crowded.total == MAX_ERRORS + 20  # (the errors are capped)
