"""Who may touch which Redis keys: one ACL user per service, each limited to its own key patterns and commands.

The one definition every Redis of the platform is configured from (or checked against): the local stack's ACL file
(`preft.stack`), the chart's and the dev overlay's Redis (tests compare their lines with `rules`). The patterns follow
the key builders of each service (documented where they are built: `registry.index`, `common.metering`, the gateway's
stores); a key one service only reads is `%R~` for it, so the gateway, which reads API keys and tenants to
authenticate, cannot write the two keys that would make an API key for any tenant.

`default` is the admin (the operator, health checks, tests): all keys and commands, its own password.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

SERVICES = ("gateway", "registry", "engine", "ray")
ADMIN_USER = "default"


@dataclass(frozen=True)
class ServiceAcl:
    """One service's Redis user: the key patterns it writes (and reads), those it only reads, its commands."""

    writes: tuple[str, ...]
    reads: tuple[str, ...]
    commands: tuple[str, ...]

    def rules(self) -> str:
        """The ACL rules (ACL SETUSER / ACL file syntax), password left out."""
        keys = [f"~{p}" for p in self.writes] + [f"%R~{p}" for p in self.reads]
        return " ".join(["resetkeys", *keys, "resetchannels", "-@all", *self.commands])


# Plain reads and writes, MULTI/EXEC (pipelines), the connection's own commands (AUTH, PING, CLIENT SETINFO); never a
# keyless command that reaches other services' data (FLUSHALL, KEYS, SCAN, RANDOMKEY: every key's name) nor one that
# changes the server (@dangerous, FUNCTION).
_DATA = ("+@read", "+@write", "+@transaction", "+@connection")
_DENY = ("-@dangerous", "-scan", "-randomkey", "-function")
# Scripts: EVALSHA (EVALSHA_RO for a read-only script on keys the user only reads: EVALSHA's declared keys need
# write access), loaded once by SCRIPT LOAD; TIME for scripts that read Redis' clock.
_SCRIPTS = ("+evalsha", "+evalsha_ro", "+script|load", "+script|exists")

ACLS: dict[str, ServiceAcl] = {
    "gateway": ServiceAcl(
        writes=(
            "preft:limits:*",  # rate-limit buckets (gateway.limits)
            "preft:quota-reserved:*",
            "preft:quota-reservations:*",
            "preft:usage:*",  # token metering (common.metering), written by the gateway's meter
            "preft:usage-hour:*",
            "preft:usage-minute:*",
            "preft:usage-month:*",
            "preft:usage-batch:*",
            "preft:file:*",  # Files API (gateway.files)
            "preft:files:*",
            "preft:batch:*",  # Batch API (gateway.batch_store)
            "preft:batch-done:*",
            "preft:batch-parts:*",
            "preft:batch-lease:*",
            "preft:batches:*",
            "preft:batches-open",
            "preft:batches-open:*",
            "preft:batches-started",
            "preft:offline-slots",
            "preft:response:*",  # Responses API (gateway.response_store)
            "preft:response-run:*",
            "preft:response-events:*",
            "preft:conversation:*",  # Conversations API (gateway.conversation_store)
            "preft:conversation-order:*",
            "preft:conversation-items:*",
            "preft:conversations:*",
        ),
        # API keys and tenants (the registry's, `registry.lua.KEY_STATE`), read to authenticate and to admit
        reads=("preft:key:*", "preft:keyid:*", "preft:tenant:*"),
        commands=(*_DATA, *_SCRIPTS, "+time", *_DENY),
    ),
    "registry": ServiceAcl(
        writes=(
            "preft:tenant:*",
            "preft:tenants",
            "preft:key:*",
            "preft:keyid:*",
            "preft:keys",
            "preft:base:*",
            "preft:bases",
            "preft:adapter:*",
            "preft:adapters",
            "preft:blobrefs",
            "preft:blobtouch",
            "preft:gc:deleting",
            "preft:hot",
        ),
        reads=("preft:usage:*",),  # GetTokenUsage reads the gateway's daily metering
        commands=(*_DATA, *_SCRIPTS, *_DENY),
    ),
    "engine": ServiceAcl(
        writes=("preft:residency:*",),  # engine.residency
        reads=("preft:hot:specs",),  # EngineSettings.hot_specs_redis_key's default (prefetch)
        commands=(*_DATA, *_DENY),
    ),
    # Ray's GCS, with GCS fault tolerance (the RayService's gcsFaultToleranceOptions): its tables are hashes named
    # RAY<external storage namespace>@<table> (KubeRay's namespace: the RayCluster's uid, new with each cluster), plus
    # the key DUMMY it deletes at connect to detect a Redis cluster's MOVED. Commands as Ray 2.60's GCS sends them
    # (INFO SENTINEL/CLUSTER at connect, hash reads and writes, INCRBY of RAY<ns>@JobCounter for each driver that
    # connects: the dashboard's first Serve deploy is one; refused, the GCS exits). SCAN, for KubeRay's cleanup Job
    # that deletes a removed cluster's keys (`SCAN MATCH RAY<ns>@*`): it lists every key's name (not its value) —
    # preft's key names hold ids and digests, no secrets — and without it each replaced cluster would leave its tables
    # behind.
    "ray": ServiceAcl(
        writes=("RAY*", "DUMMY"),
        reads=(),
        commands=(
            "+@connection",
            "+info",
            "+hget",
            "+hmget",
            "+hset",
            "+hsetnx",
            "+hdel",
            "+hscan",
            "+hexists",
            "+hkeys",
            "+hlen",
            "+incrby",
            "+del",
            "+exists",
            "+scan",
        ),
    ),
}

ADMIN_RULES = "~* &* +@all"


def _password_rule(password: str) -> str:
    # an ACL file line is split on spaces, and a password cannot be quoted there
    if not password or any(c.isspace() for c in password):
        raise ValueError("a Redis password must be non-empty and without whitespace")
    return f">{password}"


def acl_lines(passwords: Mapping[str, str]) -> list[str]:
    """The ACL file: `default` (the admin) and one user per service, each with its password from `passwords`
    (keys: ADMIN_USER and every name in SERVICES)."""
    lines = [f"user {ADMIN_USER} on {_password_rule(passwords[ADMIN_USER])} {ADMIN_RULES}"]
    lines += [f"user {name} on {_password_rule(passwords[name])} {ACLS[name].rules()}" for name in SERVICES]
    return lines


def acl_file(passwords: Mapping[str, str]) -> str:
    return "\n".join(acl_lines(passwords)) + "\n"


def new_passwords() -> dict[str, str]:
    """Random passwords for the admin and every service (a throwaway Redis: tests, benchmarks)."""
    return {user: secrets.token_urlsafe(24) for user in (ADMIN_USER, *SERVICES)}
