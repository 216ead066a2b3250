"""Which adapters of a replica serve live weights (updated in place, so no longer their digest's), whose they are, and
who may update or use them. Pure policy: no I/O, no engine.

A replica knows an adapter by its content digest, which two tenants' identical uploads share. The first update of an
adapter makes it live for the updating tenant (its owner, as the registry's reference names it): from then on only
that tenant may update or restore it, and only requests for that tenant's adapter may use it (another tenant's
request for the same content would get weights that are not its own). At most `max_live` adapters are live at once:
each stays pinned in host memory until restored (see ``EngineService``), which takes room from the paging tier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from preft.common.errors import FailedPrecondition, NotFound, PermissionDenied, ResourceExhausted


@dataclass(frozen=True)
class LiveAdapter:
    """An adapter serving updated weights: whose, at which version, since when (time.time())."""

    digest: str
    owner: str
    version: int
    updated_at: float


class LiveAdapters:
    """Owns the replica's live adapters and decides whether an update, a restore or a request may touch one."""

    def __init__(self, *, max_live: int) -> None:
        self.max_live = max_live
        self._live: dict[str, LiveAdapter] = {}

    def __contains__(self, digest: object) -> bool:
        return digest in self._live

    def __len__(self) -> int:
        return len(self._live)

    def get(self, digest: str) -> LiveAdapter | None:
        return self._live.get(digest)

    def check_update(self, digest: str, owner: str, *, other_users: int = 0) -> None:
        """Refuse an update of `digest` by `owner`: another tenant's live adapter (PermissionDenied); a first update
        while other tenants' requests use the content (FailedPrecondition) or with `max_live` live already
        (ResourceExhausted)."""
        live = self._live.get(digest)
        if live is not None:
            if live.owner != owner:
                raise PermissionDenied(f"adapter {digest[:12]} is being updated by another tenant on this replica")
            return
        if other_users:
            raise FailedPrecondition(
                f"adapter {digest[:12]}: {other_users} request(s) of other tenants use the same content on this replica"
            )
        if len(self._live) >= self.max_live:
            raise ResourceExhausted(f"{len(self._live)} adapters are already updated in place on this replica")

    def check_restore(self, digest: str, owner: str) -> LiveAdapter:
        live = self._live.get(digest)
        if live is None:
            raise NotFound(f"adapter {digest[:12]} serves its published weights on this replica")
        if live.owner != owner:
            raise PermissionDenied(f"adapter {digest[:12]} is being updated by another tenant on this replica")
        return live

    def check_request(self, digest: str, owner: str | None) -> None:
        """Refuse (FailedPrecondition) a request of another tenant's adapter for content served live."""
        live = self._live.get(digest)
        if live is not None and owner != live.owner:
            raise FailedPrecondition(
                f"adapter {digest[:12]}: this replica serves another tenant's live weights for the same content"
            )

    def record(self, digest: str, owner: str, version: int) -> LiveAdapter:
        live = LiveAdapter(digest=digest, owner=owner, version=version, updated_at=time.time())
        self._live[digest] = live
        return live

    def forget(self, digest: str) -> None:
        self._live.pop(digest, None)
