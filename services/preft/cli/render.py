"""What the command-line tools print alike."""

from __future__ import annotations

import typer
from rich.console import Console

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
