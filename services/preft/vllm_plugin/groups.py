"""Group a step's tokens by adapter slot, once per step, for the eager (CPU) kernels.

``rows`` lists the tokens that have a slot (>= 0), ordered by slot; ``segments`` gives each slot's run in
``rows``. Tokens with slot -1 ("no adapter") are not in ``rows``: the kernels never touch them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenGroups:
    rows: torch.Tensor  # int64 [n_adapted]
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end) into rows

    @property
    def empty(self) -> bool:
        return not self.segments

    @classmethod
    def from_slots(cls, slots: torch.Tensor) -> TokenGroups:
        valid = torch.nonzero(slots >= 0).squeeze(1)
        if valid.numel() == 0:
            return EMPTY_GROUPS
        sorted_slots, order = torch.sort(slots[valid], stable=True)
        ids, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        starts = [0, *ends[:-1]]
        return cls(rows=valid[order], segments=tuple(zip(ids.tolist(), starts, ends, strict=True)))


EMPTY_GROUPS = TokenGroups(rows=torch.zeros(0, dtype=torch.long), segments=())
