"""Who may call which registry RPC: each bearer token holds one role, and a role names the RPCs it may call.

The admin token (operators, `preft-admin`) may call every RPC. The gateway's token may call what it calls for
tenants (resolve and manage their adapters, record uses), so a gateway host cannot create tenants, issue keys, lift
limits, register base models or collect garbage. The engines' reader token may only read the hotness ranking their
prefetch pages in: a replica, which runs tenants' adapters, holds no credential that changes anything.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from preft.common.settings import RegistrySettings

GATEWAY_RPCS = frozenset(
    {
        "Resolve", "ListAdapters", "GetAdapter", "ListVersions", "ListBaseModels", "RecordUse",
        "UploadBlob", "Publish", "SetAlias", "Share", "ListShareOffers", "AnswerShareOffer", "Delete",
    }
)  # fmt: skip
READER_RPCS = frozenset({"Hot"})


@dataclass(frozen=True)
class Role:
    """A named role and the RPCs (method names, e.g. "Hot") it may call; `rpcs=None`: every one."""

    name: str
    rpcs: frozenset[str] | None

    def allows(self, rpc: str) -> bool:
        return self.rpcs is None or rpc in self.rpcs


ADMIN = Role("admin", None)
GATEWAY = Role("gateway", GATEWAY_RPCS)
READER = Role("reader", READER_RPCS)


class TokenRoles:
    """Maps an `authorization` metadata value to the role of the token it carries (None: no known token)."""

    def __init__(self, tokens: dict[str, Role]) -> None:
        if not all(tokens):
            raise ValueError("registry tokens must be non-empty")
        self._bearers = [(f"Bearer {token}".encode(), role) for token, role in tokens.items()]

    @classmethod
    def from_settings(cls, settings: RegistrySettings) -> TokenRoles:
        tokens = {settings.admin_token.get_secret_value(): ADMIN}
        for secret, role in ((settings.gateway_token, GATEWAY), (settings.reader_token, READER)):
            if secret is not None:
                tokens[secret.get_secret_value()] = role
        return cls(tokens)

    def role_of(self, sent: str | bytes) -> Role | None:
        value = sent.encode() if isinstance(sent, str) else sent
        found = None
        for bearer, role in self._bearers:  # every one compared, in constant time: no early exit to time
            if hmac.compare_digest(value, bearer):
                found = role
        return found
