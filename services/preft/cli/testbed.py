"""`preft testbed`: the platform on a testbed of hosts on one machine (network namespaces; `preft.stack.testbed`).

    preft testbed up [--workers N] [--gateways N]   start it (root, iproute2); prints the gateways' URLs
    preft testbed status                            hosts, services, Ray nodes and engine replicas per host
    preft testbed down [--id ID]                    stop it and remove every namespace and process it made
    preft testbed cut HOST | restore HOST           take a host's link down / up
    preft testbed kill HOST [--hold]                SIGKILL every process on a host (restarted unless held)
    preft testbed release HOST                      restart a held host's services again
    preft testbed restart SERVICE                   stop one service and wait until it is back

Exit codes: 0 done; 1 it failed (the message says why); 2 wrong usage.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from preft.cli.render import usage_error

testbed_app = typer.Typer(
    help="The platform on network-namespace hosts of this machine (a Ray head, workers, gateways, data).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
DEFAULT_DIR = Path(".preft/testbed")
DirOpt = Annotated[Path, typer.Option("--state-dir", help="Where the testbed keeps its state and logs.")]
HostArg = Annotated[str, typer.Argument(help="A host: data, head, gw, w1, w2, ...")]


def _bed(state_dir: Path):
    from preft.common.loopback import ServerError
    from preft.stack.testbed import Testbed

    try:
        return Testbed(state_dir)
    except ServerError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False)
        raise typer.Exit(1) from None


def _needs_root() -> None:
    if os.geteuid() != 0:
        err.print("[red]error:[/red] the testbed makes network namespaces: run it as root", highlight=False)
        raise typer.Exit(1)


@testbed_app.command()
def up(
    state_dir: DirOpt = DEFAULT_DIR,
    workers: Annotated[int, typer.Option(min=1, max=8, help="Ray worker hosts (one engine replica each).")] = 2,
    gateways: Annotated[int, typer.Option(min=1, max=8, help="Gateway processes on the gateway host.")] = 2,
    testbed_id: Annotated[
        str | None, typer.Option("--id", help="1-4 lowercase letters or digits naming its namespaces.")
    ] = None,
    subnet: Annotated[str | None, typer.Option(help="Its /24 [default: a free one of 10.77.0.0/16].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print where everything is as JSON.")] = False,
) -> None:
    """Start the testbed and print where its gateways are (first start: a few minutes)."""
    from preft.common.loopback import ServerError
    from preft.stack import testbed

    _needs_root()
    bed = testbed.running(state_dir)
    if bed is None:
        err.print(f"starting the testbed in {state_dir} ...")
        try:
            bed = testbed.start(state_dir, testbed_id=testbed_id, subnet=subnet, workers=workers, gateways=gateways)
        except (ServerError, ValueError) as e:
            err.print(f"[red]error:[/red] {e}", highlight=False)
            raise typer.Exit(1) from None
    else:
        err.print(f"the testbed in {state_dir} is already running")
    layout, demo = bed.layout, bed.demo()
    where = {
        "testbed_id": layout.testbed_id,
        "subnet": layout.subnet,
        "hosts": {h.name: h.address for h in layout.network.hosts.values()},
        "gateway_urls": layout.gateway_urls,
        "engine_url": layout.engine_url,
        "dashboard_url": layout.dashboard_url,
        "registry_address": layout.registry_address,
        "demo_api_key": demo["api_key"],
    }
    if as_json:
        sys.stdout.write(json.dumps(where, indent=2) + "\n")
        return
    hosts = ", ".join(f"{name} {address}" for name, address in where["hosts"].items())
    sys.stdout.write(
        f"testbed {layout.testbed_id} is up on {layout.subnet}: {hosts}\n"
        f"gateways: {' '.join(layout.gateway_urls)}\n"
        f"engine (the head's Serve proxy): {layout.engine_url}; Ray dashboard: {layout.dashboard_url}\n"
        f"demo tenant {demo['tenant']!r}, adapters {', '.join(demo['adapters'])}\n\n"
        f"curl {layout.gateway_urls[0]}/v1/completions -H 'Authorization: Bearer {demo['api_key']}' "
        '-H \'Content-Type: application/json\' -d \'{"model": "demo-lora", "prompt": "hello", "max_tokens": 8}\'\n\n'
        f"faults: preft testbed cut w1 | restore w1 | kill w1 | restart gateway-1; "
        f"stop with `preft testbed down --state-dir {state_dir}`\n"
    )


@testbed_app.command()
def down(
    state_dir: DirOpt = DEFAULT_DIR,
    testbed_id: Annotated[
        str | None, typer.Option("--id", help="Remove this id's namespaces and processes (no state directory).")
    ] = None,
) -> None:
    """Stop the testbed: every process and namespace it made, also after its supervisor was killed."""
    from preft.stack import netns, testbed

    _needs_root()
    if testbed_id is not None:
        try:
            removed = netns.sweep(testbed_id)
        except ValueError as e:
            raise usage_error(str(e)) from None
        err.print(f"removed {', '.join(removed)}" if removed else f"nothing of testbed {testbed_id} was left")
        return
    err.print("stopped" if testbed.stop(state_dir) else f"no testbed was running in {state_dir}")


@testbed_app.command()
def status(state_dir: DirOpt = DEFAULT_DIR) -> None:
    """Hosts and their services, and the engine replicas per Ray host."""
    from preft.stack import testbed

    bed = _bed(state_dir)
    layout = bed.layout
    alive = testbed.supervisor_pid(bed.state_dir) is not None
    err.print(f"testbed {layout.testbed_id} on {layout.subnet}: supervisor {'running' if alive else 'not running'}")
    services = bed.services()
    try:
        replicas = {h: len(r) for h, r in bed.replicas_by_host().items()}
    except Exception as e:  # the head may be down, which is what status is for
        err.print(f"(the Ray dashboard does not answer: {e})", highlight=False)
        replicas = {}
    table = Table()
    for col in ("host", "address", "link", "services", "replicas"):
        table.add_column(col)
    for host in layout.network.hosts.values():
        mine = [
            f"{name}{'' if s.get('ready') else ' (down)'}" for name, s in services.items() if s.get("host") == host.name
        ]
        try:
            link = "up" if bed.network.link_up(host.name) else "CUT"
        except Exception:
            link = "gone"
        table.add_row(host.name, host.address, link, ", ".join(mine), str(replicas.get(host.name, "")))
    out.print(table)


@testbed_app.command()
def cut(host: HostArg, state_dir: DirOpt = DEFAULT_DIR) -> None:
    """Take a host's link down (its processes keep running, unreachable)."""
    _hook(lambda bed: bed.cut_link(host), state_dir)


@testbed_app.command()
def restore(host: HostArg, state_dir: DirOpt = DEFAULT_DIR) -> None:
    """Bring a host's link back up."""
    _hook(lambda bed: bed.restore_link(host), state_dir)


@testbed_app.command()
def kill(
    host: HostArg,
    state_dir: DirOpt = DEFAULT_DIR,
    hold: Annotated[bool, typer.Option(help="Keep its services down until `preft testbed release HOST`.")] = False,
) -> None:
    """SIGKILL every process on a host; the supervisor starts its services again unless --hold."""
    _hook(lambda bed: err.print(f"killed {len(bed.kill_host(host, hold=hold))} processes"), state_dir)


@testbed_app.command()
def release(host: HostArg, state_dir: DirOpt = DEFAULT_DIR) -> None:
    """Let the supervisor start a held host's services again."""
    _hook(lambda bed: bed.release(host), state_dir)


@testbed_app.command()
def restart(
    service: Annotated[str, typer.Argument(help="redis, s3, registry, ray-head, ray-w1, gateway-1, ...")],
    state_dir: DirOpt = DEFAULT_DIR,
) -> None:
    """Stop one service and wait until the supervisor has it answering again."""
    _hook(lambda bed: err.print(f"{service} is back after {bed.restart_service(service):.1f} s"), state_dir)


def _hook(action, state_dir: Path) -> None:
    from preft.common.loopback import ServerError

    _needs_root()
    bed = _bed(state_dir)
    try:
        action(bed)
    except ValueError as e:
        raise usage_error(str(e)) from None
    except (ServerError, TimeoutError) as e:
        err.print(f"[red]error:[/red] {e}", highlight=False)
        raise typer.Exit(1) from None
