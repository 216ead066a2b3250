"""The paging tiers' residency policy: an LRU bounded by entries and bytes, with nested pins."""

from __future__ import annotations

import random

import pytest

from preft.engine.paging.lru import CapacityError, LruPolicy


def test_count_bound_evicts_least_recently_used():
    lru: LruPolicy[str] = LruPolicy(max_entries=2)
    assert lru.admit("a", 1) == []
    assert lru.admit("b", 1) == []
    lru.touch("a")  # b is now the least recently used
    assert lru.admit("c", 1) == ["b"]
    assert list(lru) == ["a", "c"]
    assert "b" not in lru and len(lru) == 2


def test_byte_bound_evicts_as_many_as_needed():
    lru: LruPolicy[str] = LruPolicy(max_bytes=100)
    for key in "abcd":
        lru.admit(key, 25)
    assert lru.total_bytes == 100
    assert lru.admit("big", 60) == ["a", "b", "c"]
    assert list(lru) == ["d", "big"] and lru.total_bytes == 85


def test_both_bounds_apply():
    lru: LruPolicy[str] = LruPolicy(max_entries=3, max_bytes=100)
    lru.admit("a", 10)
    lru.admit("b", 10)
    lru.admit("c", 10)
    assert lru.admit("d", 10) == ["a"]  # the count binds
    assert lru.admit("e", 85) == ["b", "c"]  # the bytes bind: 10 + 85 <= 100 once b and c are gone
    assert list(lru) == ["d", "e"]


def test_pinned_entries_are_never_evicted():
    lru: LruPolicy[str] = LruPolicy(max_entries=2)
    lru.admit("a", 1, pin=True)
    lru.admit("b", 1)
    assert lru.admit("c", 1) == ["b"]  # a is older but pinned
    assert list(lru) == ["a", "c"]


def test_refuses_when_pinned_entries_fill_the_tier_and_changes_nothing():
    lru: LruPolicy[str] = LruPolicy(max_bytes=100)
    lru.admit("a", 50, pin=True)
    lru.admit("b", 30)
    before = (list(lru), lru.total_bytes)
    with pytest.raises(CapacityError, match="pinned"):
        lru.admit("c", 60)  # evicting b is not enough: a is pinned
    assert (list(lru), lru.total_bytes) == before


def test_refuses_an_entry_bigger_than_the_tier():
    lru: LruPolicy[str] = LruPolicy(max_bytes=10)
    with pytest.raises(CapacityError, match="exceed"):
        lru.admit("huge", 11)
    assert len(lru) == 0


def test_pins_nest_and_unpin_must_match():
    lru: LruPolicy[str] = LruPolicy(max_entries=1)
    lru.admit("a", 1)
    lru.pin("a")
    lru.pin("a")
    lru.unpin("a")
    assert lru.pins("a") == 1
    with pytest.raises(CapacityError):
        lru.admit("b", 1)
    lru.unpin("a")
    assert lru.admit("b", 1) == ["a"]
    with pytest.raises(ValueError, match="not pinned"):
        lru.unpin("b")
    with pytest.raises(KeyError):
        lru.pin("a")


def test_admitting_a_present_key_touches_and_optionally_pins():
    lru: LruPolicy[str] = LruPolicy(max_entries=2)
    lru.admit("a", 5)
    lru.admit("b", 5)
    assert lru.admit("a", 999, pin=True) == []  # present: size unchanged, now most recent and pinned
    assert list(lru) == ["b", "a"] and lru.size_of("a") == 5 and lru.pins("a") == 1
    assert lru.admit("c", 1) == ["b"]


def test_remove_forgets_even_pinned_entries():
    lru: LruPolicy[str] = LruPolicy(max_bytes=10)
    lru.admit("a", 4, pin=True)
    assert lru.remove("a") is True
    assert lru.remove("a") is False
    assert lru.total_bytes == 0 and len(lru) == 0


def test_unbounded_policy_never_evicts():
    lru: LruPolicy[int] = LruPolicy()
    for i in range(1000):
        assert lru.admit(i, 1_000_000) == []
    assert len(lru) == 1000


def test_bad_bounds_and_sizes_are_refused():
    with pytest.raises(ValueError):
        LruPolicy(max_entries=0)
    with pytest.raises(ValueError):
        LruPolicy(max_bytes=-1)
    with pytest.raises(ValueError):
        LruPolicy().admit("a", -1)


def test_random_operations_keep_the_invariants():
    """Against a reference model: bounds hold, pinned keys stay, evictions are the oldest unpinned keys."""
    rng = random.Random(5)
    lru: LruPolicy[int] = LruPolicy(max_entries=6, max_bytes=60)
    order: list[int] = []  # reference recency order
    sizes: dict[int, int] = {}
    pins: dict[int, int] = {}
    for _ in range(3000):
        op = rng.random()
        key = rng.randrange(12)
        if op < 0.5:
            size = rng.randrange(1, 25)
            if key in sizes:
                lru.admit(key, size)
                order.remove(key)
                order.append(key)
                continue
            try:
                evicted = lru.admit(key, size)
            except CapacityError:
                assert key not in lru
                continue
            for victim in evicted:
                assert pins.get(victim, 0) == 0
                # each victim is the oldest unpinned key at the time
                oldest_unpinned = next(k for k in order if pins.get(k, 0) == 0)
                assert victim == oldest_unpinned
                order.remove(victim)
                del sizes[victim]
            order.append(key)
            sizes[key] = size
        elif op < 0.65 and key in sizes:
            lru.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif op < 0.85 and pins.get(key, 0) > 0:
            lru.unpin(key)
            pins[key] -= 1
        elif key in sizes:
            lru.touch(key)
            order.remove(key)
            order.append(key)
        assert list(lru) == order
        assert lru.total_bytes == sum(sizes.values()) <= 60
        assert len(lru) <= 6
