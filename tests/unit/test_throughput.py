"""Tokens per second over a sliding window, per mode."""

from __future__ import annotations

import pytest

from preft.engine.throughput import ThroughputWindow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_counts_only_the_window_and_keys_are_separate():
    clock = Clock()
    w = ThroughputWindow(window_s=10, clock=clock)
    assert w.rate("prefill") == 0.0
    w.record("prefill", 100)
    clock.now += 5
    w.record("prefill", 50)
    w.record("all", 30)
    assert w.rate("prefill") == pytest.approx(15.0)
    assert w.rate("all") == pytest.approx(3.0)
    clock.now += 5.5  # the first event is now older than 10 s
    assert w.rate("prefill") == pytest.approx(5.0)
    clock.now += 10
    assert w.rate("prefill") == 0.0 and w.rate("all") == 0.0


def test_ignores_empty_records_and_refuses_a_bad_window():
    w = ThroughputWindow(window_s=1)
    w.record("base", 0)
    assert w.rate("base") == 0.0
    with pytest.raises(ValueError):
        ThroughputWindow(window_s=0)
