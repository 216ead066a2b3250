"""What the command-line tools print alike."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperGroup

err = Console(stderr=True, soft_wrap=True)


def human_size(n: float) -> str:
    """A byte count in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def usage_error(message: str) -> typer.Exit:
    """A bad argument: its message on stderr, exit code 2."""
    err.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(2)


class JsonAnywhere(TyperGroup):
    """A root command group whose `--json` may also come after the command (`tool adapter list --json`, as well as
    `tool --json adapter list`): it is moved in front, where the root's own option reads it."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        if "--json" in args[1:end]:
            args = ["--json", *(a for i, a in enumerate(args) if not (i < end and a == "--json"))]
        return super().parse_args(ctx, args)


def version_option(distribution: str) -> Any:
    """A root `--version` option: prints the installed distribution's version and exits."""

    def show(value: bool) -> None:
        if value:
            typer.echo(f"{distribution} {importlib.metadata.version(distribution)}")
            raise typer.Exit()

    return typer.Option("--version", callback=show, is_eager=True, help="Print the version and exit.")
