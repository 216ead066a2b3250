"""Where a GPU waits for its host: the device's idle gaps in a torch-profiler trace, and what the host had open then.

    python3 -m loadtest.engine.trace_gaps TRACE.json[.gz] [--min-gap-us 5] [--top 25] [--out OUT.json]

``bench_table1 --profile-trace`` writes such traces (``trace-{tag}.json.gz`` in --profile-dir). A step whose
device time is T and whose period is longer than T spent the rest with the device idle: waiting for the host
to issue work (host-bound stretches inside the forward) or between forwards (scheduling, input preparation,
sampling, output processing). This reads the trace's device events (kernels, copies, memsets on any stream),
merges them into busy time, and takes every idle gap of at least --min-gap-us between the first and the last of
them. Each host range open on a host thread during a gap (torch ops, ``record_function`` ranges such as vLLM's
``gpu_model_runner: preprocess`` with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, CUDA runtime calls) is credited
with its overlap with the gaps. Ranges nest, so a range's credit includes its children's; idle time while no
range was open on the thread that opened the most is ``(no range open)``: Python outside any torch op or
annotation (the scheduler, our numpy, vLLM's bookkeeping).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}
NO_RANGE = "(no range open)"


def load(path: Path) -> list[dict]:
    """The complete events of a Chrome trace file, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return load_events(json.load(f))


def load_events(trace: dict | list) -> list[dict]:
    """The complete ("X") events of a Chrome trace (an object with traceEvents, or the bare list)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _merge(intervals: np.ndarray) -> np.ndarray:
    """Sorted, non-overlapping union of [start, end] rows."""
    if not len(intervals):
        return intervals.reshape(0, 2)
    intervals = intervals[np.argsort(intervals[:, 0])]
    ends = np.maximum.accumulate(intervals[:, 1])
    new = np.r_[True, intervals[1:, 0] > ends[:-1]]
    starts = intervals[new, 0]
    last = np.r_[np.flatnonzero(new)[1:] - 1, len(intervals) - 1]
    return np.column_stack((starts, ends[last]))


def _overlap(gaps: np.ndarray, start: float, end: float, cum: np.ndarray) -> float:
    """Total length of the sorted, disjoint `gaps` inside [start, end]; `cum`: their lengths' prefix sums."""
    i = int(np.searchsorted(gaps[:, 1], start, side="right"))  # first gap ending after start
    j = int(np.searchsorted(gaps[:, 0], end, side="left"))  # gaps before j start before end
    if i >= j:
        return 0.0
    total = cum[j] - cum[i]
    total -= max(0.0, start - gaps[i, 0])  # the first gap's part before start
    total -= max(0.0, gaps[j - 1, 1] - end)  # the last gap's part after end
    return float(total)


def analyze(events: list[dict], min_gap_us: float = 5.0, top: int = 25) -> dict:
    """Device busy and idle time over the trace's device span, and each host range's overlap with the gaps."""
    device = np.array(
        [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATEGORIES], dtype=float
    ).reshape(-1, 2)
    if not len(device):
        raise ValueError("no device events in this trace (a CPU-only profile?)")
    busy = _merge(device)
    span = (busy[0, 0], busy[-1, 1])
    gaps = np.column_stack((busy[:-1, 1], busy[1:, 0]))
    gaps = gaps[gaps[:, 1] - gaps[:, 0] >= min_gap_us]
    cum = np.r_[0.0, np.cumsum(gaps[:, 1] - gaps[:, 0])]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    credit: Counter = Counter()
    for e in host:
        overlap = _overlap(gaps, e["ts"], e["ts"] + e["dur"], cum) if len(gaps) else 0.0
        if overlap > 0:
            credit[(e.get("cat"), e["name"])] += overlap
    main_thread = Counter((e.get("pid"), e.get("tid")) for e in host).most_common(1)
    if main_thread and len(gaps):
        pid, tid = main_thread[0][0]
        mine = np.array(
            [(e["ts"], e["ts"] + e["dur"]) for e in host if (e.get("pid"), e.get("tid")) == (pid, tid)], dtype=float
        ).reshape(-1, 2)
        covered = _merge(mine)
        cum_covered = np.r_[0.0, np.cumsum(covered[:, 1] - covered[:, 0])]
        in_ranges = sum(_overlap(covered, s, e, cum_covered) for s, e in gaps)
        credit[("host", NO_RANGE)] = float(cum[-1] - in_ranges)
    total_gaps = float(cum[-1])
    return {
        "span_us": round(span[1] - span[0], 1),
        "busy_us": round(float((busy[:, 1] - busy[:, 0]).sum()), 1),
        "idle_us": round(float(span[1] - span[0] - (busy[:, 1] - busy[:, 0]).sum()), 1),
        "min_gap_us": min_gap_us,
        "gaps": len(gaps),
        "idle_in_gaps_us": round(total_gaps, 1),
        "largest_gaps_us": sorted((round(float(g), 1) for g in gaps[:, 1] - gaps[:, 0]), reverse=True)[:10],
        "forwards": sum(e["name"] == "gpu_model_runner: forward" for e in host),
        "ranges": [
            {"category": cat, "name": name, "idle_us": round(us, 1), "share": round(us / total_gaps, 4)}
            for (cat, name), us in credit.most_common(top)
        ]
        if total_gaps
        else [],
    }


def render(result: dict) -> str:
    lines = [
        f"device span {result['span_us'] / 1e3:.2f} ms: busy {result['busy_us'] / 1e3:.2f} ms, idle "
        f"{result['idle_us'] / 1e3:.2f} ms ({result['gaps']} gaps of >= {result['min_gap_us']} us: "
        f"{result['idle_in_gaps_us'] / 1e3:.2f} ms); forwards: {result['forwards']}",
        f"{'idle while open (ms)':>21}  {'share':>6}  range",
    ]
    lines += [
        f"{r['idle_us'] / 1e3:21.3f}  {r['share']:6.1%}  [{r['category']}] {r['name'][:100]}" for r in result["ranges"]
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", type=Path, nargs="+")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None, help="write every trace's result to OUT.json")
    args = ap.parse_args()
    results = {}
    for path in args.traces:
        try:
            results[str(path)] = result = analyze(load(path), args.min_gap_us, args.top)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"trace_gaps: {path}: {e}") from None
        print(f"== {path}\n{render(result)}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
