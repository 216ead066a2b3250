"""Per-tenant prefix-cache salts: each engine request carries its tenant's salt (vLLM's `cache_salt`), so cached
prompt blocks are shared only within a tenant, and one tenant cannot tell from its time to first token whether
another sent a prompt.

A salt is HMAC-SHA256(key, scope), where the scope is the tenant, or its cache group where the operator put it in
one (`GatewaySettings.cache_groups`: opt-in sharing, e.g. one customer's tenants sharing a long system prompt).
Groups are a gateway setting, not a tenant field in the registry: joining a group exposes the group's prompts'
timing, so the operator decides, never a tenant alone, and the registry's tenant records stay as they are. The
key is `cache_salt_key`, else derived from the registry token (a secret every gateway replica already shares, so
a tenant's salt is the same through every replica): someone who reaches an engine directly cannot compute a
tenant's salt. Clients cannot set a salt (a body's `cache_salt` is refused, see `schemas`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

# (a domain of its own: the registry token, where it is the key material, is never used as is)
KEY_LABEL = b"preft-gateway prefix-cache salt key v1"


def salt_key(secret: str) -> bytes:
    """The HMAC key of the salts, from a secret (the setting, or the registry token)."""
    return hmac.new(secret.encode(), KEY_LABEL, hashlib.sha256).digest()


class CacheSalts:
    """Owns the salt key and the tenant → group map."""

    def __init__(self, key: bytes, groups: Mapping[str, str]) -> None:
        self._key = key
        self._groups = dict(groups)

    def salt(self, tenant: str) -> str:
        """The tenant's salt: its group's where it has one (the scopes are typed, so no group can be named as a
        tenant to share its salt)."""
        group = self._groups.get(tenant)
        scope = f"group\0{group}" if group is not None else f"tenant\0{tenant}"
        return hmac.new(self._key, scope.encode(), hashlib.sha256).hexdigest()
