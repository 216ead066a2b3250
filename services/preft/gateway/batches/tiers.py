"""Which of a running batch's recorded parts to compact next (pure policy; ``batches.compaction`` does the merging).

A slow batch records a small part every `part_s` (8,640 a day at 10 s), and finalizing would download every one of
them. Compaction merges a run of recorded parts into one, in place, so the list stays short. The policy is tiered,
as an LSM tree's levels are (a tier counts the parts written that a part holds, a measure of its size that needs no
request to S3):

- A part's tier is in its name: a part a run writes is tier 0; the merge of `fan_in` parts of tier t is one part of
  tier t + 1 (so a tier-t part holds `fan_in ** t` written parts, at most `fan_in ** t * PART_MAX_BYTES` bytes).
- Only `fan_in` consecutive parts of one tier below `max_tier` merge, the lowest such tier first, the oldest of
  them: a large part is never merged again with small ones, and a line is rewritten at most once per tier it
  climbs, `max_tier` times at most (and `log_fan_in(parts written)` times at most).
- Nothing merges while the batch has fewer than `compact_at` recorded parts: a batch of few parts (finalized in one
  pass of ``batch_parts.MERGE_FAN_IN``) pays no compaction at all.

Merging only consecutive parts, its result in their place, keeps the order of the list, so the merge of the whole
list still keeps each index as the part recorded first has it. Written parts are appended and merged parts replace
the oldest parts of their tier, so tiers never rise along the list: the parts of a tier are consecutive, and once
no compaction is due a list of `compact_at` parts or more holds fewer than `fan_in` parts of each tier below
`max_tier`: `(fan_in - 1) * max_tier` parts at most, and one of `max_tier` per `fan_in ** max_tier` parts written
(with the defaults, 28, and one per 4,096: 30 for a day of 10 s parts). Parts recorded while a merge runs come on
top, until the next merges.
"""

from __future__ import annotations

from dataclasses import dataclass

FAN_IN = 8  # parts merged by one compaction: bounded work, and a tier is 8 times the one below
MAX_TIER = 4  # parts of this tier (4,096 written parts: over 11 hours of 10 s parts) are never merged again
COMPACT_AT = 32  # recorded parts before any merges: half of MERGE_FAN_IN, room for those recorded meanwhile
TIER_MARK = ".t"  # a merged part's name ends with it and its tier


def tier_of(name: str) -> int:
    """The tier of a part (by its name): 0 for a part a run wrote."""
    _, mark, tier = name.rpartition(TIER_MARK)
    return int(tier) if mark and tier.isdigit() else 0


def merged_name(stem: str, tier: int) -> str:
    """The name of a merged part of `tier` (`stem`: unique, without the mark)."""
    return f"{stem}{TIER_MARK}{tier}"


@dataclass(frozen=True)
class Pick:
    """A compaction to do: the parts `names`, at `start` in the list, merged as one part of `tier`."""

    start: int
    names: list[str]
    tier: int


@dataclass(frozen=True)
class Tiers:
    """The compaction policy: when a batch's parts merge, and which of them."""

    fan_in: int = FAN_IN
    max_tier: int = MAX_TIER
    compact_at: int = COMPACT_AT  # (0: never)

    def pick(self, names: list[str]) -> Pick | None:
        """The next compaction of the recorded parts `names` (in the order recorded), or None where none is due:
        the oldest `fan_in` consecutive parts of the lowest tier below `max_tier` that has as many in a row."""
        if self.compact_at <= 0 or len(names) < max(self.compact_at, self.fan_in) or self.fan_in < 2:
            return None
        best: Pick | None = None
        start = 0
        while start < len(names):
            tier = tier_of(names[start])
            end = start + 1
            while end < len(names) and tier_of(names[end]) == tier:
                end += 1
            if end - start >= self.fan_in and tier < self.max_tier and (best is None or tier < best.tier):
                best = Pick(start, names[start : start + self.fan_in], tier + 1)
            start = end
        return best
