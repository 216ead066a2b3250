"""The residency policy of one paging tier: which adapters stay, as a byte- and count-bounded LRU with pinning.

Pure and synchronous: no I/O, no clock, no locks. The pager asks it what to evict and does the evicting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class CapacityError(Exception):
    """An entry cannot be admitted: it is bigger than the tier, or pinned entries fill what it needs."""


@dataclass
class _Entry:
    size_bytes: int
    pins: int = 0


class LruPolicy(Generic[K]):
    """Owns the recency order, sizes and pin counts of a tier's entries, and decides evictions.

    Bounds: at most `max_entries` entries and `max_bytes` bytes (None = unbounded). Pinned entries (pin count > 0)
    are never evicted; pins nest (each `pin` needs its `unpin`). An entry that does not fit is refused as a whole:
    `admit` either evicts enough unpinned entries and inserts, or changes nothing and raises CapacityError.
    """

    def __init__(self, *, max_entries: int | None = None, max_bytes: int | None = None) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be >= 1 or None")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 or None")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[K, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0

    # -- reading ---------------------------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recently used."""
        return iter(list(self._entries))

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def size_of(self, key: K) -> int:
        return self._entries[key].size_bytes

    def pins(self, key: K) -> int:
        return self._entries[key].pins

    # -- deciding --------------------------------------------------------------------------------------------------

    def admit(self, key: K, size_bytes: int, *, pin: bool = False) -> list[K]:
        """Insert `key` as most recently used (optionally pinned once); return the keys evicted to make room.

        Admitting a key already present just touches it (and pins it when asked); its size is not changed.
        """
        if size_bytes < 0:
            raise ValueError("size_bytes must be >= 0")
        if key in self._entries:
            self.touch(key)
            if pin:
                self.pin(key)
            return []
        if self.max_bytes is not None and size_bytes > self.max_bytes:
            raise CapacityError(f"{size_bytes} bytes exceed the tier's capacity of {self.max_bytes} bytes")
        victims = self._victims(extra_entries=1, extra_bytes=size_bytes)
        for victim in victims:
            self._bytes -= self._entries.pop(victim).size_bytes
        self._entries[key] = _Entry(size_bytes, pins=1 if pin else 0)
        self._bytes += size_bytes
        return victims

    def _victims(self, *, extra_entries: int, extra_bytes: int) -> list[K]:
        """Least recently used unpinned keys whose removal makes room for the extra; CapacityError if none do."""
        entries_over = 0 if self.max_entries is None else len(self._entries) + extra_entries - self.max_entries
        bytes_over = 0 if self.max_bytes is None else self._bytes + extra_bytes - self.max_bytes
        victims: list[K] = []
        for key, entry in self._entries.items():
            if entries_over <= 0 and bytes_over <= 0:
                break
            if entry.pins:
                continue
            victims.append(key)
            entries_over -= 1
            bytes_over -= entry.size_bytes
        if entries_over > 0 or bytes_over > 0:
            pinned = sum(1 for e in self._entries.values() if e.pins)
            raise CapacityError(
                f"no room: {pinned} of {len(self._entries)} entries are pinned "
                f"(limits: {self.max_entries} entries, {self.max_bytes} bytes)"
            )
        return victims

    def touch(self, key: K) -> None:
        """Mark `key` most recently used (KeyError if absent)."""
        self._entries.move_to_end(key)

    def pin(self, key: K) -> None:
        """Protect `key` from eviction until a matching `unpin` (KeyError if absent)."""
        self._entries[key].pins += 1

    def unpin(self, key: K) -> None:
        """Release one pin of `key`; unpinning an absent or unpinned key is an error (it means a pin leaked)."""
        entry = self._entries[key]
        if entry.pins <= 0:
            raise ValueError(f"{key!r} is not pinned")
        entry.pins -= 1

    def remove(self, key: K) -> bool:
        """Forget `key` even if pinned (the caller dropped the thing itself); True if it was present."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry.size_bytes
        return True
