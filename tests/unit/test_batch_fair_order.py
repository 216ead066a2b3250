"""The order in which a runner starts waiting batches: tenants take turns."""

from __future__ import annotations

from collections import Counter

from preft.gateway.batches.runner import fair_order


def _ids(order: list[tuple[str, str]]) -> list[str]:
    return [batch_id for _, batch_id in order]


def test_one_tenant_alone_goes_oldest_first():
    waiting = [("a", "a1"), ("a", "a2"), ("a", "a3")]
    assert _ids(fair_order(waiting, Counter(), {})) == ["a1", "a2", "a3"]


def test_a_tenant_with_many_waiting_does_not_go_ahead_of_a_later_tenant_twice():
    waiting = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1")]
    assert _ids(fair_order(waiting, Counter(), {})) == ["a1", "b1", "c1", "a2", "a3"]


def test_tenants_with_fewer_running_go_first():
    waiting = [("a", "a1"), ("b", "b1"), ("b", "b2"), ("c", "c1")]
    running = Counter({"a": 2, "b": 0, "c": 1})
    assert _ids(fair_order(waiting, running, {})) == ["b1", "b2", "c1", "a1"]


def test_on_a_tie_the_tenant_served_longest_ago_goes_first():
    waiting = [("a", "a2"), ("a", "a3"), ("b", "b1")]
    last_started = {"a": 2_000, "b": 1_000}
    assert _ids(fair_order(waiting, Counter(), last_started)) == ["b1", "a2", "a3"]
    assert _ids(fair_order(waiting, Counter(), {"a": 1_000, "b": 2_000})) == ["a2", "b1", "a3"]
    assert _ids(fair_order(waiting, Counter(), {"a": 2_000})) == ["b1", "a2", "a3"]  # (b never ran)


def test_nothing_waiting():
    assert fair_order([], Counter({"a": 1}), {"a": 5}) == []
