"""The compaction policy of a running batch's parts (pure): which parts merge and when, how often a line is rewritten
at most, and how many parts a batch keeps."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from preft.gateway.batches.tiers import COMPACT_AT, FAN_IN, MAX_TIER, Tiers, merged_name, tier_of


def _written(n: int) -> str:
    return f"0123456789abcdef-{n:06d}"  # (as a PartWriter names its parts)


def _tiered(n: int, tier: int) -> str:
    return merged_name(f"fedcba9876543210-{n:06d}", tier)


class _Batch:
    """A batch's recorded parts as compaction leaves them: each part's written parts (their numbers), in order."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self.names: list[str] = []
        self.holds: dict[str, list[int]] = {}
        self.rewrites: Counter[int] = Counter()
        self.merged = 0

    def write(self, n: int) -> None:
        self.names.append(_written(n))
        self.holds[self.names[-1]] = [n]

    def compact(self, *, written_meanwhile: tuple[int, ...] = ()) -> bool:
        pick = self.tiers.pick(self.names)
        if pick is None:
            return False
        assert len(pick.names) == self.tiers.fan_in
        assert self.names[pick.start : pick.start + len(pick.names)] == pick.names  # (consecutive, in place)
        assert {tier_of(n) for n in pick.names} == {pick.tier - 1} and pick.tier <= self.tiers.max_tier
        for n in written_meanwhile:  # (recorded while the merge ran: appended after it)
            self.write(n)
        name = _tiered(self.merged, pick.tier)
        self.merged += 1
        self.holds[name] = [n for part in pick.names for n in self.holds.pop(part)]
        self.rewrites.update(self.holds[name])
        self.names[pick.start : pick.start + len(pick.names)] = [name]
        return True

    def written_in_order(self) -> list[int]:
        return [n for name in self.names for n in self.holds[name]]


def test_written_parts_are_tier_0_and_merged_ones_carry_their_tier_in_their_name():
    assert tier_of(_written(3)) == 0 and tier_of("stray-000000") == 0 and tier_of("x.tx") == 0
    assert [tier_of(_tiered(7, t)) for t in (1, 2, 4, 12)] == [1, 2, 4, 12]
    assert _tiered(7, 2).endswith(".t2")


def test_nothing_merges_below_compact_at_or_when_compaction_is_off():
    names = [_written(i) for i in range(31)]
    assert Tiers(compact_at=32).pick(names) is None
    assert Tiers(compact_at=0).pick([_written(i) for i in range(500)]) is None
    pick = Tiers(compact_at=32).pick([*names, _written(31)])
    assert pick is not None and (pick.start, pick.names, pick.tier) == (0, names[:8], 1)


def test_the_oldest_run_of_the_lowest_tier_merges_and_only_consecutive_parts_of_one_tier():
    tiers = Tiers(fan_in=3, max_tier=2, compact_at=1)
    t1 = [_tiered(i, 1) for i in range(4)]
    w = [_written(i) for i in range(6)]
    pick = tiers.pick([*t1, w[0], w[1], w[2], w[3]])
    assert pick is not None and (pick.start, pick.names, pick.tier) == (4, w[:3], 1)  # (tier 0 before tier 1)
    pick = tiers.pick([*t1, w[0], w[1]])
    assert pick is not None and (pick.start, pick.names, pick.tier) == (0, t1[:3], 2)
    assert tiers.pick([w[0], w[1], t1[0], w[2], w[3], t1[1], w[4]]) is None  # (never three in a row of one tier)
    assert tiers.pick([_tiered(i, 2) for i in range(9)]) is None  # (max_tier: never merged again)


@pytest.mark.parametrize("written", [40, 700, 5000])
@pytest.mark.parametrize("tiers", [Tiers(), Tiers(max_tier=20), Tiers(fan_in=2, max_tier=3, compact_at=4)])
def test_a_line_is_rewritten_once_a_tier_at_most_and_the_parts_stay_few(tiers: Tiers, written: int):
    """Parts recorded one at a time, compacted as the runner does until nothing is due: every written part is
    still there once, in order; each is rewritten at most once per tier, and log_fan_in(parts written) times at
    most; once nothing is due, the batch holds fewer than compact_at parts, or fewer than fan_in of each tier."""
    batch = _Batch(tiers)
    longest = 0
    for n in range(written):
        batch.write(n)
        while batch.compact():
            pass
        longest = max(longest, len(batch.names))
        tier_counts = Counter(tier_of(name) for name in batch.names)
        assert len(batch.names) < tiers.compact_at or all(
            c < tiers.fan_in for t, c in tier_counts.items() if t < tiers.max_tier
        )
        tiers_along = [tier_of(name) for name in batch.names]
        assert tiers_along == sorted(tiers_along, reverse=True)  # (a tier's parts are consecutive)
    assert batch.written_in_order() == list(range(written))  # (each written part once, in the order recorded)
    most = min(tiers.max_tier, math.ceil(math.log(written, tiers.fan_in)))
    assert max(batch.rewrites.values(), default=0) <= most
    top = written // tiers.fan_in**tiers.max_tier
    assert longest <= max(tiers.compact_at, (tiers.fan_in - 1) * tiers.max_tier + top + 1)


def test_parts_recorded_during_a_merge_keep_the_bound():
    """Two parts recorded while each merge runs, one merge at a time: the parts stay few all along."""
    batch = _Batch(Tiers())
    n = 0
    for _ in range(2000):
        batch.write(n)
        n += 1
        if batch.compact(written_meanwhile=(n, n + 1)):  # (two parts recorded while each merge ran)
            n += 2
        assert len(batch.names) <= COMPACT_AT + 2 * (FAN_IN - 1)  # (and what lands while merges catch up)
    assert batch.written_in_order() == list(range(n))
    assert max(batch.rewrites.values()) <= MAX_TIER
