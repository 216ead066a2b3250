"""How fast the host ran during a timed pass, to tell a slower engine from a slower machine.

A host-bound engine (a small model's decode on a GPU) runs at the pace of the host's CPU, and a lent machine's
CPU pace is not constant: passes of one engine on the same requests have differed by 1.6 x. Around a pass this
records what the process and the machine did: a fixed pure-Python loop's time before and after (the same work
taking longer means a slower CPU, not more work), the share of the machine's CPU time the hypervisor gave to
others (steal, from /proc/stat), the process's own CPU time per second, the time spent in Python's garbage
collector, and the process's size after it (resident memory; objects the collector tracks, and those frozen):
a heap that grows pass after pass would make later passes slower by itself."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_STATM = Path("/proc/self/statm")
SPEED_LOOP = 200_000  # iterations of the speed probe's loop: 11-20 ms a run on this project's 2-core VM


@dataclass(frozen=True)
class HostSample:
    wall_s: float
    process_cpu_s: float
    cpu_jiffies: tuple[int, int] | None  # (steal, total) over all CPUs, None without /proc/stat
    gc_s: float
    gc_collections: int


def speed_probe_ms(repeats: int = 10) -> tuple[float, float]:
    """A fixed pure-Python loop's time, first and fastest of `repeats` runs back to back, in ms.

    Their spread shows a CPU coming up to speed: on this project's 2-core VM the loop took ~20 ms a run for the
    first 1.2 s of back-to-back runs, then 11.3-11.6 ms, and ~20 ms again after a 1 s sleep."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        acc = 0
        for i in range(SPEED_LOOP):
            acc += i * i
        times.append(time.perf_counter() - t)
    return round(times[0] * 1e3, 3), round(min(times) * 1e3, 3)


def _rss_mb(statm: Path = PROC_STATM) -> float | None:
    """The process's resident memory in MiB (statm's second field is in pages), None without /proc."""
    try:
        pages = int(statm.read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def _cpu_jiffies(stat: Path = PROC_STAT) -> tuple[int, int] | None:
    """(steal, total) jiffies of the machine's aggregate `cpu` line; guest time is already in user time."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (values[7] if len(values) > 7 else 0), sum(values)


class HostProbe:
    """Samples of the host's state; `since(sample)` is what happened between a sample and now."""

    def __init__(self, stat: Path = PROC_STAT, statm: Path = PROC_STATM) -> None:
        self.stat, self.statm = stat, statm
        self.gc_s = 0.0
        self.gc_collections = 0
        self._gc_start: float | None = None
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_collections += 1
            self._gc_start = None

    def sample(self) -> HostSample:
        jiffies = _cpu_jiffies(self.stat)
        return HostSample(time.perf_counter(), time.process_time(), jiffies, self.gc_s, self.gc_collections)

    def since(self, before: HostSample) -> dict:
        """Steal share of the machine's CPU time (%), the process's CPU seconds per second, GC time; its size now."""
        now = self.sample()
        wall = max(now.wall_s - before.wall_s, 1e-9)
        notes = {
            "process_cpu_per_s": round((now.process_cpu_s - before.process_cpu_s) / wall, 3),
            "gc_s": round(now.gc_s - before.gc_s, 4),
            "gc_collections": now.gc_collections - before.gc_collections,
            # After the pass, outside the timing. vLLM freezes the heap it built at start-up (gc.freeze): the
            # collector skips those objects, so only the ones made since then can cost it time.
            "gc_tracked_objects": len(gc.get_objects()),
            "gc_frozen_objects": gc.get_freeze_count(),
        }
        rss = _rss_mb(self.statm)
        if rss is not None:
            notes["rss_mb"] = rss
        if before.cpu_jiffies and now.cpu_jiffies:
            steal = now.cpu_jiffies[0] - before.cpu_jiffies[0]
            total = now.cpu_jiffies[1] - before.cpu_jiffies[1]
            notes["cpu_steal_pct"] = round(100 * steal / total, 2) if total > 0 else 0.0
        return notes
