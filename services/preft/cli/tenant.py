"""`preft adapters`: a tenant manages its own adapters through the gateway with its API key (the gateway's
`/v1/adapters` API): upload a version from an adapter directory, list, show, alias, share and delete; and offers of
other tenants' adapters: list, accept, decline."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.table import Column, Table

from preft.cli.render import err, human_size, usage_error

app = typer.Typer(help="Your adapters on a preft-serve gateway (your tenant's API key).", no_args_is_help=True)
out = Console(soft_wrap=True)
UPLOAD_TIMEOUT_S = 600.0


@dataclass
class Gateway:
    base_url: str
    api_key: str
    timeout_s: float
    as_json: bool


@app.callback()
def main(
    ctx: typer.Context,
    base_url: Annotated[
        str, typer.Option("--base-url", envvar="PREFT_BASE_URL", help="The gateway's address.")
    ] = "http://127.0.0.1:8080",
    api_key: Annotated[
        str, typer.Option("--api-key", envvar="PREFT_API_KEY", help="Your tenant's API key.", show_default=False)
    ] = "",
    timeout_s: Annotated[float, typer.Option("--timeout", min=1, help="Seconds to wait for an answer.")] = 30.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the gateway's JSON instead of tables.")] = False,
) -> None:
    if not api_key:
        raise usage_error("give your API key (--api-key or PREFT_API_KEY)")
    ctx.obj = Gateway(base_url.rstrip("/"), api_key, timeout_s, as_json)


@contextmanager
def gateway(ctx: typer.Context, timeout_s: float | None = None) -> Iterator[httpx.Client]:
    """A client for one command; a refused request or an unreachable gateway becomes a message and exit code 1."""
    opts: Gateway = ctx.obj
    headers = {"Authorization": f"Bearer {opts.api_key}"}
    try:
        with httpx.Client(base_url=opts.base_url, headers=headers, timeout=timeout_s or opts.timeout_s) as client:
            yield client
    except httpx.HTTPError as e:
        err.print(f"[red]error:[/red] {opts.base_url}: {e}", highlight=False)
        raise typer.Exit(1) from None


def answer(response: httpx.Response) -> dict[str, Any]:
    """The answer's JSON; exit code 1 with the gateway's message where it refused."""
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500] or response.reason_phrase
    err.print(f"[red]error:[/red] {response.status_code}: {message}", highlight=False)
    raise typer.Exit(1)


def emit(ctx: typer.Context, body: dict[str, Any], table: Table | str) -> None:
    if ctx.obj.as_json:
        sys.stdout.write(json.dumps(body, indent=2, sort_keys=True) + "\n")
    else:
        out.print(table, highlight=False)


def _adapters_table(adapters: list[dict[str, Any]]) -> Table:
    table = Table("latest", "method", "mode", "aliases", "size")
    table.columns.insert(0, Column("adapter", no_wrap=True))  # (names whole; the other columns wrap)
    for a in adapters:
        latest = a["latest"]
        aliases = ", ".join(f"{k}→v{v}" for k, v in a["aliases"].items()) or "-"
        table.add_row(
            a["id"],  # (a shared one as owner/name)
            f"v{latest['version']} of {a['version_count']}",
            f"{latest['method']} r{latest['rank']}",
            latest["default_mode"],
            aliases,
            human_size(latest["size_bytes"]),
        )
    return table


def _versions_table(versions: list[dict[str, Any]]) -> Table:
    table = Table("version", "digest", "method", "mode", "size", "uploader")
    for v in versions:
        table.add_row(
            f"v{v['version']}",
            v["digest"][:12],
            f"{v['method']} r{v['rank']}",
            v["default_mode"],
            human_size(v["size_bytes"]),
            v["uploader"],
        )
    return table


def _path(*parts: str) -> str:
    """`/v1/adapters/...` with each part escaped (a name cannot reach another route)."""
    return "/".join(["/v1/adapters", *(quote(p, safe="") for p in parts)])


def adapter_files(directory: Path) -> list[Path]:
    """The adapter directory's files as the gateway takes them: its plain files, hidden ones left out."""
    if not directory.is_dir():
        raise usage_error(f"{directory} is not a directory")
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise usage_error(f"{directory} holds no files")
    return files


@app.command()
def upload(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The adapter's name (a new version if it exists).")],
    directory: Annotated[Path, typer.Argument(help="The adapter directory (adapter_config.json and weights).")],
    mode: Annotated[str, typer.Option(help="Where it applies by default: prefill or all.")] = "prefill",
    alias: Annotated[str, typer.Option(help="Point this alias at the new version.")] = "",
) -> None:
    """Upload a version; the gateway checks it against the base model before publishing it."""
    files = adapter_files(directory)
    with gateway(ctx, UPLOAD_TIMEOUT_S) as client, ExitStack() as opened:
        parts = [("files", (p.name, opened.enter_context(p.open("rb")))) for p in files]
        body = answer(client.post("/v1/adapters", data={"name": name, "mode": mode, "alias": alias}, files=parts))
    v = body["adapter"]
    state = "uploaded" if body["created"] else "unchanged (the latest version has this content and mode)"
    emit(ctx, body, f"{v['id']}: {state}, digest {v['digest'][:12]}")


@app.command("list")
def list_adapters(ctx: typer.Context) -> None:
    """Your adapters and those shared with you."""
    with gateway(ctx) as client:
        body = answer(client.get("/v1/adapters"))
    emit(ctx, body, _adapters_table(body["data"]))


@app.command()
def show(ctx: typer.Context, name: Annotated[str, typer.Argument(help="One of your adapters.")]) -> None:
    """One adapter with every version."""
    with gateway(ctx) as client:
        body = answer(client.get(_path(name)))
    shared = ", ".join(body.get("shared_with", [])) or "nobody"
    offered = ", ".join(body.get("offered_to", []))
    versions = _versions_table(body["versions"])
    versions.title = f"{body['id']} on {body['latest']['base_model']} (shared with {shared}"
    versions.title += f"; offered to {offered})" if offered else ")"
    emit(ctx, body, versions)


@app.command()
def alias(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="One of your adapters.")],
    alias_name: Annotated[str, typer.Argument(metavar="ALIAS", help="The alias (name:alias in requests).")],
    version: Annotated[int | None, typer.Option(min=1, help="The version it points at.")] = None,
    remove: Annotated[bool, typer.Option("--remove", help="Remove the alias.")] = False,
) -> None:
    """Point an alias at a version (or remove it)."""
    if remove == (version is not None):
        raise usage_error("give --version or --remove")
    with gateway(ctx) as client:
        path = _path(name, "aliases", alias_name)
        body = answer(client.delete(path) if remove else client.put(path, json={"version": version}))
    emit(ctx, body, f"{name}:{alias_name} " + ("removed" if remove else f"→ v{version}"))


@app.command()
def share(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="One of your adapters.")],
    tenant: Annotated[str, typer.Argument(help="The tenant who may use it, once it accepts (as your-tenant/name).")],
    remove: Annotated[bool, typer.Option("--remove", help="Withdraw the offer, or stop sharing.")] = False,
) -> None:
    """Offer an adapter to another tenant, which accepts it (`preft adapters accept`) to use it; or stop."""
    with gateway(ctx) as client:
        path = _path(name, "shares", tenant)
        body = answer(client.delete(path) if remove else client.put(path))
    emit(
        ctx, body, f"{name}: " + (f"no longer offered to or shared with {tenant}" if remove else f"offered to {tenant}")
    )


@app.command()
def offers(ctx: typer.Context) -> None:
    """Adapters other tenants offered you (offered) or that you accepted (accepted)."""
    with gateway(ctx) as client:
        body = answer(client.get(_path("shares", "offers")))
    table = Table("adapter", "status", "method", "base model")
    for o in body["data"]:
        latest = o["latest"]
        table.add_row(o["id"], o["status"], f"{latest['method']} r{latest['rank']}", latest["base_model"])
    emit(ctx, body, table)


@app.command()
def accept(ctx: typer.Context, adapter: Annotated[str, typer.Argument(help="owner/name, as offered.")]) -> None:
    """Accept an offer: the adapter becomes usable as owner/name."""
    with gateway(ctx) as client:
        body = answer(client.post(_path("shares", "offers", *_owner_name(adapter), "accept")))
    emit(ctx, body, f"{body['id']}: accepted")


@app.command()
def decline(ctx: typer.Context, adapter: Annotated[str, typer.Argument(help="owner/name, as offered.")]) -> None:
    """Decline an offer, or stop using an adapter you accepted."""
    with gateway(ctx) as client:
        body = answer(client.delete(_path("shares", "offers", *_owner_name(adapter))))
    emit(ctx, body, f"{body['id']}: declined")


def _owner_name(adapter: str) -> tuple[str, str]:
    owner, _, name = adapter.partition("/")
    if not owner or not name:
        raise usage_error(f"{adapter!r}: give the adapter as owner/name")
    return owner, name


@app.command()
def delete(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="One of your adapters.")],
    version: Annotated[int | None, typer.Option(min=1, help="Only this version.")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False,
) -> None:
    """Delete a version, or the adapter with every version."""
    what = f"{name} v{version}" if version is not None else f"{name} and every version of it"
    if not yes and not typer.confirm(f"Delete {what}?"):
        raise typer.Exit(1)
    with gateway(ctx) as client:
        path = _path(name) if version is None else _path(name, "versions", str(version))
        body = answer(client.delete(path))
    emit(ctx, body, f"deleted {name}: " + ", ".join(f"v{v}" for v in body["versions"]))
