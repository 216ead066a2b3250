"""A running batch's parts (pure): their line format, their merge by request index, and the done-lines bitmap."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from preft.gateway.batches.parts import encode, merge
from preft.gateway.batches.store import DoneLines, LineRecord


def _line(custom_id: str, text: str = "") -> dict[str, Any]:
    return {"id": "batch_req_1", "custom_id": custom_id, "response": {"body": {"text": text}}, "error": None}


def _part(path: Path, *records: LineRecord) -> Path:
    path.write_bytes(b"".join(encode(r) for r in sorted(records, key=lambda r: r.index)))
    return path


def _merged(paths: list[Path], work_dir: Path, fan_in: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    output, errors = io.BytesIO(), io.BytesIO()
    merge(paths, output, errors, work_dir=work_dir, fan_in=fan_in)
    return [json.loads(x) for x in output.getvalue().splitlines()], [
        json.loads(x) for x in errors.getvalue().splitlines()
    ]


def test_a_part_line_holds_the_file_line_as_json_after_its_index_and_file():
    record = LineRecord(12, "error", _line("a", "two\nlines ünïcode"))
    raw = encode(record)
    assert raw.startswith(b"12 error {") and raw.endswith(b"}\n") and raw.count(b"\n") == 1 and raw.isascii()
    assert json.loads(raw.split(b" ", 2)[2]) == record.line


def test_parts_merge_in_request_order_each_index_once_as_the_part_recorded_first_has_it(tmp_path):
    parts = [
        _part(tmp_path / "a", LineRecord(4, "output", _line("l4", "first")), LineRecord(0, "output", _line("l0"))),
        _part(tmp_path / "b", LineRecord(1, "error", _line("l1")), LineRecord(5, "output", _line("l5"))),
        _part(tmp_path / "c", LineRecord(4, "error", _line("l4", "again")), LineRecord(2, "output", _line("l2"))),
        _part(tmp_path / "d"),  # (an empty part)
        _part(tmp_path / "e", LineRecord(3, "error", _line("l3")), LineRecord(0, "output", _line("l0", "again"))),
    ]
    for fan_in in (64, 2):  # (all at once; in rounds, through merged files)
        copies = []
        for path in parts:
            copy = tmp_path / f"{fan_in}-{path.name}"
            copy.write_bytes(path.read_bytes())
            copies.append(copy)
        work = tmp_path / f"work-{fan_in}"
        work.mkdir()
        output, errors = _merged(copies, work, fan_in)
        assert [x["custom_id"] for x in output] == ["l0", "l2", "l4", "l5"]
        assert [x["custom_id"] for x in errors] == ["l1", "l3"]
        assert output[0]["response"]["body"]["text"] == "" and output[2]["response"]["body"]["text"] == "first"
        if fan_in == 2:  # (the rounds delete the parts they merged)
            assert not any(p.exists() for p in copies)


def test_no_parts_merge_into_empty_files(tmp_path):
    assert _merged([], tmp_path, 4) == ([], [])


def test_done_lines_read_redis_bitmaps_highest_bit_first():
    done = DoneLines(bytes([0b1000_0001, 0, 0b0100_0000]))
    assert [i for i in range(40) if i in done] == [0, 7, 17] and len(done) == 3
    assert -1 not in done and 10_000 not in done and "0" not in done
    assert 0 not in DoneLines(b"")
