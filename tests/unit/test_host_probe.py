"""The host probe around benchmark passes: steal share from /proc/stat, process CPU, GC time, speed probe."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from loadtest.engine.host_probe import HostProbe, _cpu_jiffies, _rss_mb, speed_probe_ms


def _stat(path: Path, user: int, idle: int, steal: int) -> None:
    path.write_text(f"cpu  {user} 0 10 {idle} 0 0 0 {steal} 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\nintr 5\n")


def test_steal_share_is_the_steal_jiffies_over_all_jiffies_between_samples(tmp_path):
    stat = tmp_path / "stat"
    _stat(stat, user=100, idle=880, steal=10)
    assert _cpu_jiffies(stat) == (10, 1000)
    probe = HostProbe(stat)
    try:
        before = probe.sample()
        _stat(stat, user=150, idle=910, steal=30)  # +50 user, +30 idle, +20 steal: 20 of 100 jiffies
        notes = probe.since(before)
    finally:
        probe.close()
    assert notes["cpu_steal_pct"] == pytest.approx(20.0)


def test_a_machine_without_proc_stat_reports_no_steal(tmp_path):
    probe = HostProbe(tmp_path / "missing")
    try:
        notes = probe.since(probe.sample())
    finally:
        probe.close()
    assert "cpu_steal_pct" not in notes and notes["gc_collections"] >= 0


def test_process_cpu_and_garbage_collections_are_counted():
    probe = HostProbe()
    try:
        before = probe.sample()
        speed_probe_ms(repeats=5)  # busy on one thread: about one CPU second per second
        gc.collect()
        notes = probe.since(before)
    finally:
        probe.close()
    assert notes["process_cpu_per_s"] > 0.5
    assert notes["gc_collections"] >= 1 and notes["gc_s"] >= 0
    assert probe._on_gc not in gc.callbacks


def test_speed_probe_gives_the_first_and_the_fastest_run():
    first, best = speed_probe_ms(repeats=4)
    assert 0 < best <= first < 5_000


def test_the_heap_a_pass_leaves_behind_shows_in_objects_and_resident_memory():
    probe = HostProbe()
    try:
        before = probe.since(probe.sample())
        kept = [[i] for i in range(300_000)]  # 300k tracked lists, ~25 MiB
        after = probe.since(probe.sample())
    finally:
        probe.close()
    assert after["gc_tracked_objects"] - before["gc_tracked_objects"] >= 290_000
    assert after["rss_mb"] - before["rss_mb"] >= 10
    assert after["gc_frozen_objects"] == before["gc_frozen_objects"] == gc.get_freeze_count()
    assert len(kept) == 300_000


def test_a_machine_without_proc_statm_reports_no_resident_memory(tmp_path):
    (tmp_path / "garbled").write_text("12\n")
    assert _rss_mb(tmp_path / "garbled") is None
    probe = HostProbe(statm=tmp_path / "missing")
    try:
        notes = probe.since(probe.sample())
    finally:
        probe.close()
    assert "rss_mb" not in notes and notes["gc_tracked_objects"] > 0
