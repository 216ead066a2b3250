"""Names of tenants, adapters and aliases, and adapter references as requests write them.

A reference is `[owner/]name`, optionally followed by `@v3` (a version; `@3` works too) or `:alias`.
Without either it means `:latest`. Without an owner it means the caller's own adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from preft.common.errors import InvalidArgument

NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,62}"
_NAME = re.compile(rf"^{NAME_PATTERN}$")
_REF = re.compile(
    rf"^(?:(?P<owner>{NAME_PATTERN})/)?(?P<name>{NAME_PATTERN})"
    rf"(?:@v?(?P<version>[0-9]{{1,9}})|:(?P<alias>{NAME_PATTERN}))?$"
)
LATEST = "latest"


def check_name(value: str, what: str) -> str:
    """Return value if it is a valid tenant/adapter/alias name, else raise InvalidArgument saying why."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise InvalidArgument(
            f"{what} {value!r} is not a valid name: 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class AdapterRef:
    """A parsed reference: whose adapter, which name, and which version or alias."""

    owner: str | None
    name: str
    version: int | None = None
    alias: str | None = None

    @classmethod
    def parse(cls, text: str) -> AdapterRef:
        m = _REF.match(text or "")
        if not m or ".." in text:
            raise InvalidArgument(f"adapter reference {text!r} is not of the form [owner/]name, name@v3 or name:alias")
        version = int(m["version"]) if m["version"] is not None else None
        if version == 0:
            raise InvalidArgument(f"adapter reference {text!r}: versions start at v1")
        alias = m["alias"] if version is None else None
        return cls(owner=m["owner"], name=m["name"], version=version, alias=alias or (None if version else LATEST))

    def owned_by(self, default_owner: str) -> AdapterRef:
        """The same reference with the owner filled in (a bare name means the caller's own adapter)."""
        return AdapterRef(self.owner or default_owner, self.name, self.version, self.alias)

    def __str__(self) -> str:
        head = f"{self.owner}/{self.name}" if self.owner else self.name
        if self.version is not None:
            return f"{head}@v{self.version}"
        return head if self.alias in (None, LATEST) else f"{head}:{self.alias}"
