"""The weight update being received: tensors staged between TRL's start and finish calls, checked as they arrive,
handed to the engine only at finish — so an update that fails or whose trainer goes away changes nothing served.

Pure bookkeeping over the served adapter's manifest (`preft.adapters.updates`): no engine, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from preft.adapters.updates import WeightManifest, WeightUpdateError, check_weight_update
from preft.common.errors import FailedPrecondition, InvalidArgument


class UpdateStaging:
    """Owns the one open update: its staged tensors, or why it was abandoned.

    A `begin` while an update is open drops that one: its trainer restarted or went away without finishing. A bad
    batch of tensors abandons the whole update (a trainer sends all of a step's tensors or none), and `finish`
    then says why.
    """

    def __init__(self, manifest: WeightManifest) -> None:
        self.manifest = manifest
        self._staged: dict[str, Any] | None = None
        self._abandoned: str | None = None

    @property
    def open(self) -> bool:
        return self._staged is not None

    @property
    def state(self) -> str:
        """ "open" (tensors staged: the count), "abandoned: <why>", or "none"."""
        if self._staged is not None:
            return f"open ({len(self._staged)} tensors staged)"
        return f"abandoned: {self._abandoned}" if self._abandoned is not None else "none"

    def begin(self) -> bool:
        """Open a new update; True when an unfinished one was dropped."""
        dropped = self._staged is not None
        self._staged, self._abandoned = {}, None
        return dropped

    def add(self, tensors: Mapping[str, Any]) -> None:
        """Stage tensors of the open update (names, shapes, dtypes as the served adapter's; finite values)."""
        staged = self._require_open()
        again = sorted(set(tensors) & set(staged))
        try:
            if again:
                raise WeightUpdateError(f"tensors sent twice in one update: {', '.join(again[:3])}")
            check_weight_update(self.manifest, tensors, finite=True)
        except WeightUpdateError as e:
            self.abandon(f"adapter update: {e}")
            raise InvalidArgument(f"adapter update: {e}") from e
        staged.update(tensors)

    def abandon(self, reason: str) -> None:
        """Drop the open update (nothing of it will serve); a later `finish` answers `reason`."""
        self._staged, self._abandoned = None, reason

    def finish(self) -> dict[str, Any]:
        """Close the open update and return its tensors (empty: nothing was sent)."""
        staged = self._require_open()
        self._staged = None
        return staged

    def _require_open(self) -> dict[str, Any]:
        if self._staged is None:
            if self._abandoned is not None:
                raise FailedPrecondition(f"the weight update was abandoned ({self._abandoned}); start a new one")
            raise FailedPrecondition("no weight update is open: call /start_weight_update first")
        return self._staged


def read_safetensors(body: bytes) -> dict[str, Any]:
    """The tensors of a safetensors file's bytes; InvalidArgument for anything else (a truncated body included)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not body:
        raise InvalidArgument("adapter update: the body is empty (expected a safetensors file)")
    try:
        return load(body)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise InvalidArgument(f"adapter update: the body is not a complete safetensors file: {e}") from e
