"""`preft-admin`: operate the registry (tenants, API keys, base models, adapters, token usage, gc).

Exit codes: 0 done; 1 the registry refused or could not do it (the message says why); 2 wrong usage
(bad arguments, a local path that is not an adapter directory).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.cli.cluster import cluster_app
from preft.cli.render import JsonAnywhere, err, human_size, usage_error, version_option
from preft.common.errors import InvalidArgument, PreftError
from preft.common.metering import MAX_QUERY_DAYS, day_of
from preft.common.refs import AdapterRef
from preft.common.settings import AdminSettings
from preft.registry.client import RegistryClient, scan_adapter_dir
from preft.registry.usage import parse_iso_day, query_days
from preft.stack.local import local_admin_token

# (help texts are plain text: Rich markup would swallow the "[env …]" hints)
GROUP = dict(no_args_is_help=True, rich_markup_mode=None)
app = typer.Typer(help="Operate the preft-serve adapter registry.", add_completion=False, cls=JsonAnywhere, **GROUP)
tenant_app = typer.Typer(help="Tenants and their limits.", **GROUP)
key_app = typer.Typer(help="Tenant API keys (the secret is shown once, at issue).", **GROUP)
base_app = typer.Typer(help="Base models that adapters are validated against.", **GROUP)
adapter_app = typer.Typer(help="Adapters: upload, list, show, versions, alias, share, delete, hot.", **GROUP)
for sub, name in (
    (tenant_app, "tenant"),
    (key_app, "key"),
    (base_app, "base"),
    (adapter_app, "adapter"),
    (cluster_app, "cluster"),
):
    app.add_typer(sub, name=name)

out = Console(soft_wrap=True)
MODES = {"prefill": apb.POSITION_MODE_PREFILL, "all": apb.POSITION_MODE_ALL}
DEFAULT_USAGE_DAYS = 7


@dataclass
class Options:
    registry: str
    token: str
    timeout_s: float
    as_json: bool


@app.callback()
def main(
    ctx: typer.Context,
    registry: Annotated[str | None, typer.Option(help="Registry host:port [env PREFT_ADMIN__REGISTRY].")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="Registry admin token [env PREFT_ADMIN__TOKEN; default: the local stack's, from "
            "PREFT_ADMIN__STACK_DIR (.preft/stack)/secrets.json, while `preft up` runs it]."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of tables (or --json after a command).")
    ] = False,
    _version: Annotated[bool, version_option("preft-serve")] = False,
) -> None:
    settings = AdminSettings()
    given = settings.model_fields_set  # (what the environment sets; the rest are defaults)
    asked = registry or (settings.registry if "registry" in given else None)
    local = None
    if token is None and "token" not in given:
        # The stack `preft up` runs here keeps a random token in its owner-only secrets.json: use it when the
        # registry asked for is that stack's, or none was asked for (its ports may not be the default ones).
        local = local_admin_token(Path(settings.stack_dir), asked)
    address, secret = local or (asked or settings.registry, token or settings.token.get_secret_value())
    ctx.obj = Options(registry=address, token=secret, timeout_s=settings.timeout_s, as_json=as_json)


@contextmanager
def registry(ctx: typer.Context) -> Iterator[RegistryClient]:
    """A client for one command; domain errors become a message and exit code 1."""
    opts: Options = ctx.obj
    client = RegistryClient(opts.registry, opts.token, timeout_s=opts.timeout_s)
    try:
        yield client
    except PreftError as e:
        err.print(f"[red]error:[/red] {e.message}", highlight=False)
        raise typer.Exit(1) from None
    finally:
        client.close()


def emit(ctx: typer.Context, message: Any, table: Table | str | None = None) -> None:
    """JSON of the proto message with --json, else the human form."""
    if ctx.obj.as_json:
        sys.stdout.write(json.dumps(_as_dict(message), indent=2, sort_keys=True) + "\n")
    elif table is not None:
        out.print(table, highlight=False)


def _as_dict(message: Any) -> Any:
    if isinstance(message, list):
        return [_as_dict(m) for m in message]
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _when(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S") if unix_ms else "-"


def _owner_name(text: str) -> tuple[str, str, int | None]:
    try:
        ref = AdapterRef.parse(text)
    except InvalidArgument as e:
        raise usage_error(e.message) from None
    if ref.owner is None:
        raise usage_error(f"{text!r}: write the adapter as tenant/name")
    return ref.owner, ref.name, ref.version


# -- tenants -------------------------------------------------------------------------------------------------------

RpmOpt = Annotated[int, typer.Option("--rpm", min=0, help="Requests per minute (0 = default).")]
TpmOpt = Annotated[int, typer.Option("--tpm", min=0, help="Tokens per minute (0 = default).")]
MaxAdaptersOpt = Annotated[int, typer.Option("--max-adapters", min=0, help="Adapters owned (0 = default).")]
MaxBytesOpt = Annotated[int, typer.Option("--max-bytes", min=0, help="Bytes of adapters owned (0 = default).")]
MonthOpt = Annotated[
    int | None,
    typer.Option("--tokens-per-month", min=0, help="Prompt + generated tokens per UTC calendar month (0 = no quota)."),
]


def _tenant_table(tenants: list[pb.Tenant]) -> Table:
    table = Table("tenant", "state", "req/min", "tok/min", "tokens/month", "adapters", "storage", "created")
    for t in tenants:
        table.add_row(
            t.id,
            "[red]disabled[/red]" if t.disabled else "active",
            str(t.limits.requests_per_min),
            str(t.limits.tokens_per_min),
            str(t.limits.tokens_per_month or "-"),
            f"{t.adapter_count}/{t.limits.max_adapters}",
            f"{human_size(t.bytes_used)}/{human_size(t.limits.max_bytes)}",
            _when(t.created_unix_ms),
        )
    return table


def _limits(rpm: int, tpm: int, max_adapters: int, max_bytes: int, tokens_per_month: int | None) -> pb.TenantLimits:
    """The request's limits; tokens_per_month is sent only when given (absent keeps it on a change)."""
    return pb.TenantLimits(
        requests_per_min=rpm,
        tokens_per_min=tpm,
        max_adapters=max_adapters,
        max_bytes=max_bytes,
        tokens_per_month=tokens_per_month,
    )


@tenant_app.command("create")
def tenant_create(
    ctx: typer.Context,
    tenant: str,
    rpm: RpmOpt = 0,
    tpm: TpmOpt = 0,
    max_adapters: MaxAdaptersOpt = 0,
    max_bytes: MaxBytesOpt = 0,
    tokens_per_month: MonthOpt = None,
) -> None:
    """Create a tenant (no monthly token quota unless --tokens-per-month is given)."""
    limits = _limits(rpm, tpm, max_adapters, max_bytes, tokens_per_month)
    with registry(ctx) as r:
        t = r.call("CreateTenant", pb.CreateTenantRequest(id=tenant, limits=limits))
    emit(ctx, t, _tenant_table([t]))


@tenant_app.command("list")
def tenant_list(ctx: typer.Context) -> None:
    """List tenants."""
    with registry(ctx) as r:
        tenants = list(r.call("ListTenants", pb.ListTenantsRequest()).tenants)
    emit(ctx, tenants, _tenant_table(tenants))


@tenant_app.command("disable")
def tenant_disable(ctx: typer.Context, tenant: str) -> None:
    """Disable a tenant: its keys stop working and its adapters stop resolving."""
    with registry(ctx) as r:
        t = r.call("SetTenantDisabled", pb.SetTenantDisabledRequest(id=tenant, disabled=True))
    emit(ctx, t, _tenant_table([t]))


@tenant_app.command("enable")
def tenant_enable(ctx: typer.Context, tenant: str) -> None:
    """Enable a disabled tenant again."""
    with registry(ctx) as r:
        t = r.call("SetTenantDisabled", pb.SetTenantDisabledRequest(id=tenant, disabled=False))
    emit(ctx, t, _tenant_table([t]))


@tenant_app.command("limits")
def tenant_limits(
    ctx: typer.Context,
    tenant: str,
    rpm: RpmOpt = 0,
    tpm: TpmOpt = 0,
    max_adapters: MaxAdaptersOpt = 0,
    max_bytes: MaxBytesOpt = 0,
    tokens_per_month: MonthOpt = None,
) -> None:
    """Change a tenant's limits (options not given or 0 keep their value; --tokens-per-month 0 removes the quota)."""
    limits = _limits(rpm, tpm, max_adapters, max_bytes, tokens_per_month)
    with registry(ctx) as r:
        t = r.call("SetTenantLimits", pb.SetTenantLimitsRequest(id=tenant, limits=limits))
    emit(ctx, t, _tenant_table([t]))


# -- keys ----------------------------------------------------------------------------------------------------------


def _key_table(keys: list[pb.ApiKey]) -> Table:
    table = Table("key id", "tenant", "label", "created", "expires", "state")
    for k in keys:
        state = "[red]revoked[/red]" if k.revoked_unix_ms else "active"
        table.add_row(k.id, k.tenant, k.label, _when(k.created_unix_ms), _when(k.expires_unix_ms), state)
    return table


@key_app.command("issue")
def key_issue(
    ctx: typer.Context,
    tenant: str,
    label: Annotated[str, typer.Option(help="Free text to tell keys apart.")] = "",
    ttl_s: Annotated[int, typer.Option("--ttl-s", min=0, help="Seconds until it expires (0 = never).")] = 0,
) -> None:
    """Issue an API key; the secret is printed once and cannot be shown again."""
    with registry(ctx) as r:
        res = r.call("IssueKey", pb.IssueKeyRequest(tenant=tenant, label=label, ttl_s=ttl_s))
    emit(ctx, res, _key_table([res.key]))
    if not ctx.obj.as_json:
        out.print(f"secret (shown once): [bold]{res.secret}[/bold]", highlight=False)


@key_app.command("revoke")
def key_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke a key by id."""
    with registry(ctx) as r:
        k = r.call("RevokeKey", pb.RevokeKeyRequest(id=key_id))
    emit(ctx, k, _key_table([k]))


@key_app.command("list")
def key_list(ctx: typer.Context, tenant: Annotated[str, typer.Option(help="Only this tenant's keys.")] = "") -> None:
    """List keys (never their secrets)."""
    with registry(ctx) as r:
        keys = list(r.call("ListKeys", pb.ListKeysRequest(tenant=tenant)).keys)
    emit(ctx, keys, _key_table(keys))


# -- base models ---------------------------------------------------------------------------------------------------


def _base_table(models: list[pb.BaseModel]) -> Table:
    table = Table("base model", "architecture", "digest", "registered")
    for m in models:
        arch = (json.loads(m.config_json).get("architectures") or ["?"])[0]
        table.add_row(m.id, arch, m.architecture_digest[:16], _when(m.created_unix_ms))
    return table


@base_app.command("register")
def base_register(
    ctx: typer.Context,
    model_id: str,
    config: Annotated[Path, typer.Option(help="The model's config.json, or its model directory.")],
) -> None:
    """Register a base model by its config.json."""
    path = config / "config.json" if config.is_dir() else config
    try:
        text = path.read_text()
    except OSError as e:
        raise usage_error(f"cannot read {path}: {e.strerror}") from None
    with registry(ctx) as r:
        m = r.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id=model_id, config_json=text))
    emit(ctx, m, _base_table([m]))


@base_app.command("list")
def base_list(ctx: typer.Context) -> None:
    """List registered base models."""
    with registry(ctx) as r:
        models = list(r.call("ListBaseModels", pb.ListBaseModelsRequest()).models)
    emit(ctx, models, _base_table(models))


# -- adapters ------------------------------------------------------------------------------------------------------


def _method(m: apb.AdapterManifest) -> str:
    return apb.AdapterMethod.Name(m.method).removeprefix("ADAPTER_METHOD_").lower()


def _mode(m: apb.AdapterManifest) -> str:
    return apb.PositionMode.Name(m.default_mode).removeprefix("POSITION_MODE_").lower()


def _adapter_table(adapters: list[pb.Adapter]) -> Table:
    table = Table("adapter", "latest", "method", "mode", "rank", "size", "aliases", "shared with", "published")
    for a in adapters:
        m = a.latest
        aliases = ", ".join(f"{k}→v{v}" for k, v in sorted(a.aliases.items()) if k != "latest")
        table.add_row(
            f"{a.tenant}/{a.name}",
            f"v{m.version} ({a.version_count})",
            _method(m),
            _mode(m),
            str(m.rank),
            human_size(m.size_bytes),
            aliases,
            ", ".join([*a.shared_with, *(f"{t} (offered)" for t in a.offered_to)]),
            _when(m.created_unix_ms),
        )
    return table


def _version_table(versions: list[apb.AdapterManifest]) -> Table:
    table = Table("version", "digest", "method", "mode", "rank", "targets / layers", "base", "size", "published", "by")
    for m in versions:
        targets = ",".join(m.target_modules) or "layers " + ",".join(map(str, m.layers))
        table.add_row(
            f"{m.tenant}/{m.name}@v{m.version}",
            m.digest[:16],
            _method(m),
            _mode(m),
            str(m.rank),
            targets,
            m.base_model,
            human_size(m.size_bytes),
            _when(m.created_unix_ms),
            m.uploader,
        )
    return table


@adapter_app.command("upload")
def adapter_upload(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="Adapter directory (PEFT LoRA or PreFT DiReFT).")],
    tenant: Annotated[str, typer.Option(help="Owning tenant.")],
    name: Annotated[str, typer.Option(help="Adapter name; a new name creates the adapter.")],
    mode: Annotated[str, typer.Option(help="Default position mode: prefill | all.")] = "prefill",
    alias: Annotated[str, typer.Option(help="Also point this alias at the new version.")] = "",
    base: Annotated[str, typer.Option(help="Base model id (default: the only registered one).")] = "",
) -> None:
    """Upload an adapter directory as the next version (only blobs the registry lacks are sent)."""
    if mode not in MODES:
        raise usage_error(f"--mode must be prefill or all, not {mode!r}")
    try:
        files = scan_adapter_dir(path)
    except InvalidArgument as e:
        raise usage_error(e.message) from None
    total = sum(f.size_bytes for f in files)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with (
        registry(ctx) as r,
        Progress(*columns, TimeRemainingColumn(), console=err, disable=ctx.obj.as_json) as bar,
    ):
        task = bar.add_task(f"{tenant}/{name}", total=total)
        res = r.upload_adapter(
            files,
            tenant=tenant,
            name=name,
            mode=MODES[mode],
            alias=alias,
            base_model=base,
            progress=lambda n: bar.advance(task, n),
        )
    emit(ctx, res, _version_table([res.manifest]))
    if not ctx.obj.as_json and not res.created:
        out.print("unchanged: the latest version already has this content", highlight=False)


@adapter_app.command("list")
def adapter_list(
    ctx: typer.Context, tenant: Annotated[str, typer.Option(help="Owned by or shared with this tenant.")] = ""
) -> None:
    """List adapters (all, or those a tenant owns or may use)."""
    with registry(ctx) as r:
        adapters = list(r.call("ListAdapters", pb.ListAdaptersRequest(tenant=tenant)).adapters)
    emit(ctx, adapters, _adapter_table(adapters))


@adapter_app.command("show")
def adapter_show(ctx: typer.Context, adapter: Annotated[str, typer.Argument(help="tenant/name")]) -> None:
    """One adapter: aliases, sharing and its latest version's files."""
    tenant, name, _ = _owner_name(adapter)
    with registry(ctx) as r:
        a = r.call("GetAdapter", pb.GetAdapterRequest(tenant=tenant, name=name))
    files = Table("file", "sha256", "size")
    for f in a.latest.files:
        files.add_row(f.path, f.sha256, human_size(f.size_bytes))
    emit(ctx, a, _adapter_table([a]))
    if not ctx.obj.as_json:
        out.print(_version_table([a.latest]), files, highlight=False)


@adapter_app.command("versions")
def adapter_versions(ctx: typer.Context, adapter: Annotated[str, typer.Argument(help="tenant/name")]) -> None:
    """Every version of an adapter, oldest first."""
    tenant, name, _ = _owner_name(adapter)
    with registry(ctx) as r:
        versions = list(r.call("ListVersions", pb.ListVersionsRequest(tenant=tenant, name=name)).versions)
    emit(ctx, versions, _version_table(versions))


@adapter_app.command("resolve")
def adapter_resolve(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="tenant/name, tenant/name@v3, tenant/name:alias (or name as --as).")],
    as_tenant: Annotated[str, typer.Option("--as", help="Resolve as this tenant would.")] = "",
) -> None:
    """Resolve a reference to the version it names."""
    with registry(ctx) as r:
        m = r.resolve(as_tenant, ref)
    emit(ctx, m, _version_table([m]))


@adapter_app.command("alias")
def adapter_alias(
    ctx: typer.Context,
    adapter: Annotated[str, typer.Argument(help="tenant/name")],
    alias: str,
    version: Annotated[int, typer.Argument(min=0, help="Version to point at; 0 removes the alias.")],
) -> None:
    """Point an alias (e.g. prod) at a version; it moves atomically."""
    tenant, name, _ = _owner_name(adapter)
    with registry(ctx) as r:
        a = r.call("SetAlias", pb.SetAliasRequest(tenant=tenant, name=name, alias=alias, version=version))
    emit(ctx, a, _adapter_table([a]))


@adapter_app.command("share")
def adapter_share(
    ctx: typer.Context,
    adapter: Annotated[str, typer.Argument(help="tenant/name")],
    with_: Annotated[list[str] | None, typer.Option("--with", help="Tenant to share with (repeatable).")] = None,
    remove: Annotated[list[str] | None, typer.Option("--remove", help="Tenant to stop sharing with.")] = None,
) -> None:
    """Share an adapter read-only with other tenants at once, or stop (withdrawing offers too).

    An operator's direct share: the tenants must exist and nothing asks them (a tenant's own share through the
    gateway is an offer its recipient accepts)."""
    tenant, name, _ = _owner_name(adapter)
    if not with_ and not remove:
        raise usage_error("give --with TENANT and/or --remove TENANT")
    with registry(ctx) as r:
        a = r.call("Share", pb.ShareRequest(tenant=tenant, name=name, add=with_ or [], remove=remove or []))
    emit(ctx, a, _adapter_table([a]))


@adapter_app.command("delete")
def adapter_delete(
    ctx: typer.Context,
    adapter: Annotated[str, typer.Argument(help="tenant/name (all versions) or tenant/name@vN (one)")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete one version or a whole adapter (its blobs go at the next gc)."""
    tenant, name, version = _owner_name(adapter)
    if not yes and not typer.confirm(f"delete {adapter}?", err=True):
        raise typer.Exit(1)
    with registry(ctx) as r:
        res = r.call("Delete", pb.DeleteRequest(tenant=tenant, name=name, version=version or 0))
    emit(ctx, res, "deleted versions: " + ", ".join(f"v{v}" for v in res.versions))


@adapter_app.command("hot")
def adapter_hot(
    ctx: typer.Context, limit: Annotated[int, typer.Option(min=1, max=1000, help="How many.")] = 20
) -> None:
    """The hottest adapter versions (decayed use counts), hottest first."""
    with registry(ctx) as r:
        entries = list(r.call("Hot", pb.HotRequest(limit=limit)).entries)
    table = Table("version", "score", "digest", "method", "mode")
    for e in entries:
        m = e.manifest
        table.add_row(f"{m.tenant}/{m.name}@v{m.version}", f"{e.score:.2f}", m.digest[:16], _method(m), _mode(m))
    emit(ctx, entries, table)


# -- token usage ---------------------------------------------------------------------------------------------------


def _usage_range(days: int | None, since: str | None, until: str | None) -> tuple[date, date]:
    """The first and last UTC day the options name (the last `days` up to today by default); usage errors else."""
    today = day_of(time.time())
    if since is None:
        if until is not None:
            raise usage_error("--until needs --since")
        return today - timedelta(days=(days or DEFAULT_USAGE_DAYS) - 1), today
    if days is not None:
        raise usage_error("give either --days or --since (and --until), not both")
    try:
        first = parse_iso_day(since, "--since")
        last = parse_iso_day(until, "--until") if until is not None else today
        query_days(first, last)
    except ValueError as e:
        raise usage_error(str(e)) from None
    return first, last


def _counts(c: pb.TokenUsageRow | pb.TokenCounts) -> tuple[str, str, str]:
    return f"{c.requests:,}", f"{c.input_tokens:,}", f"{c.output_tokens:,}"


def _usage_table(res: pb.GetTokenUsageResponse, by_model: bool) -> Table:
    table = Table(title=f"{res.tenant}: {res.start_date} .. {res.end_date} (UTC days)")
    table.add_column("date")
    if by_model:
        table.add_column("model")
    for name in ("requests", "input tokens", "output tokens"):
        table.add_column(name, justify="right")
    for r in res.rows:
        table.add_row(r.date, *([r.model] if by_model else []), *_counts(r))
    table.add_section()
    table.add_row("total", *([""] if by_model else []), *_counts(res.total), style="bold")
    return table


@app.command("usage")
def usage(
    ctx: typer.Context,
    tenant: str,
    days: Annotated[
        int | None,
        typer.Option(
            min=1, max=MAX_QUERY_DAYS, help=f"The last N UTC days, today included (default {DEFAULT_USAGE_DAYS})."
        ),
    ] = None,
    since: Annotated[str | None, typer.Option(help="First UTC day, YYYY-MM-DD (instead of --days).")] = None,
    until: Annotated[str | None, typer.Option(help="Last UTC day, YYYY-MM-DD, included (default today).")] = None,
    by_model: Annotated[bool, typer.Option("--by-model", help="One row per day and model.")] = False,
) -> None:
    """A tenant's metered requests and tokens per UTC day (as the gateway counts them), with totals."""
    first, last = _usage_range(days, since, until)
    with registry(ctx) as r:
        res = r.token_usage(tenant, first, last, by_model=by_model)
    emit(ctx, res, _usage_table(res, by_model))


# -- maintenance ---------------------------------------------------------------------------------------------------


@app.command("gc")
def gc(
    ctx: typer.Context,
    min_age_s: Annotated[
        int | None, typer.Option("--min-age-s", min=0, help="Grace period in seconds (default: the registry's).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would go.")] = False,
) -> None:
    """Delete unreferenced blobs and abort stale uploads, both older than the grace period."""
    with registry(ctx) as r:
        res = r.call("CollectGarbage", pb.CollectGarbageRequest(min_age_s=min_age_s, dry_run=dry_run), timeout_s=600)
    verb = "would delete" if dry_run else "deleted"
    emit(
        ctx,
        res,
        f"{verb} {len(res.deleted_blobs)} blobs ({human_size(res.deleted_bytes)}), "
        f"aborted {res.aborted_uploads} uploads, kept {res.kept_blobs} referenced blobs",
    )


if __name__ == "__main__":
    app()
