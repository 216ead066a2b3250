"""loadtest.engine.trace_gaps: the device's idle gaps in a profiler timeline, credited to the host ranges open then."""

from __future__ import annotations

import gzip
import json

import pytest
from loadtest.engine import trace_gaps


def _x(cat, name, ts, dur, tid=1, pid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def _trace():
    """Device busy 0-100 and 130-200 on one stream, 150-260 on another, 300-310 (a memcpy): gaps 100-130 (30 us)
    and 260-300 (40 us). Host: a forward range 0-120 holding an op 90-115; preprocess 250-280; an op on
    another thread over the second gap; nothing open 280-300 on the main thread."""
    return {
        "traceEvents": [
            _x("kernel", "mm", 0, 100, tid=20, pid=0),
            _x("kernel", "lora_expand", 130, 70, tid=20, pid=0),
            _x("kernel", "attention", 150, 110, tid=21, pid=0),
            _x("gpu_memcpy", "Memcpy HtoD", 300, 10, tid=20, pid=0),
            _x("user_annotation", "gpu_model_runner: forward", 0, 120),
            _x("cpu_op", "preft::lora_linear", 90, 25),
            _x("user_annotation", "gpu_model_runner: preprocess", 250, 30),
            _x("cpu_op", "aten::copy_", 255, 100, tid=2),  # another thread
            {"ph": "i", "name": "marker", "ts": 5},  # not a complete event: ignored
        ]
    }


def test_gaps_are_credited_to_the_ranges_open_during_them(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    result = trace_gaps.analyze(trace_gaps.load(path), min_gap_us=5)
    assert (result["span_us"], result["busy_us"], result["idle_us"]) == (310, 240, 70)
    assert result["gaps"] == 2 and result["idle_in_gaps_us"] == 70 and result["largest_gaps_us"] == [40, 30]
    assert result["forwards"] == 1
    credit = {r["name"]: r["idle_us"] for r in result["ranges"]}
    assert credit == {
        "gpu_model_runner: forward": 20,  # 100-120
        "preft::lora_linear": 15,  # 100-115
        "gpu_model_runner: preprocess": 20,  # 260-280
        "aten::copy_": 40,  # 260-300, on its own thread
        trace_gaps.NO_RANGE: 30,  # main thread: 120-130 and 280-300
    }
    top = result["ranges"][0]
    assert top["name"] == "aten::copy_" and top["share"] == pytest.approx(40 / 70, abs=1e-4)
    assert "gpu_model_runner: preprocess" in trace_gaps.render(result)


def test_short_gaps_are_left_out_and_a_trace_without_device_events_is_refused(tmp_path):
    result = trace_gaps.analyze(trace_gaps.load_events(_trace()), min_gap_us=35)
    assert result["gaps"] == 1 and result["idle_in_gaps_us"] == 40 and result["idle_us"] == 70
    host_only = {"traceEvents": [_x("cpu_op", "aten::mm", 0, 10)]}
    with pytest.raises(ValueError, match="no device events"):
        trace_gaps.analyze(trace_gaps.load_events(host_only))
