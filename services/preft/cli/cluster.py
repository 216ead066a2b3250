"""`preft-admin cluster`: look at and change a preft-serve deployment on Kubernetes.

    preft-admin cluster status [--redis-url URL]          Deployments, StatefulSets, the engine's RayService, and
                                                          which adapters each engine replica holds (from Redis)
    preft-admin cluster apply --overlay dev|gpu|DIR       server-side apply of a rendered kustomize overlay (or of
                                                          -f FILE), then wait for the rollout
    preft-admin cluster scale engine N [--workers M]      set the Serve deployment's num_replicas (and the Ray worker
                                                          group's replicas) in the RayService

It talks to the Kubernetes API with the official client's DynamicClient, configured from a kubeconfig (--kubeconfig,
$KUBECONFIG, ~/.kube/config; --context) or, inside a pod, from the service account. Exit codes: 0 done (status: all
ready); 1 the cluster refused, something is not ready, or a wait timed out; 2 wrong usage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.table import Table

from preft.cli.kube import (
    DEFAULT_ENGINE,
    DEFAULT_NAMESPACE,
    YAML_LOADER,
    Cluster,
    ClusterError,
    Rollout,
    UsageError,
    connect,
    engine_status,
    read_residency,
    render_overlay,
    rollout_of,
)

# -- the typer app -----------------------------------------------------------------------------------------------

GROUP = dict(no_args_is_help=True, rich_markup_mode=None)
cluster_app = typer.Typer(help="preft-serve on Kubernetes: status, apply, scale.", **GROUP)
scale_app = typer.Typer(help="Scale parts of the deployment.", **GROUP)
cluster_app.add_typer(scale_app, name="scale")
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


@dataclass
class ClusterOptions:
    kubeconfig: Path | None
    context: str | None
    namespace: str
    engine: str
    as_json: bool

    def cluster(self) -> Cluster:
        return Cluster(connect(self.kubeconfig, self.context), self.namespace, engine=self.engine)


@cluster_app.callback()
def cluster_main(
    ctx: typer.Context,
    kubeconfig: Annotated[
        Path | None, typer.Option(help="kubeconfig file [default: $KUBECONFIG, ~/.kube/config, in-cluster].")
    ] = None,
    context: Annotated[str | None, typer.Option(help="kubeconfig context [default: the current one].")] = None,
    namespace: Annotated[
        str, typer.Option("--namespace", "-n", help="Namespace of the deployment.")
    ] = DEFAULT_NAMESPACE,
    engine: Annotated[str, typer.Option(help="Name of the engine's RayService.")] = DEFAULT_ENGINE,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    parent = ctx.find_root().obj
    as_json = as_json or bool(getattr(parent, "as_json", False))  # `preft-admin --json cluster ...` too
    ctx.obj = ClusterOptions(kubeconfig, context, namespace, engine, as_json)


def _run(fn: Callable[[], int]) -> None:
    try:
        code = fn()
    except UsageError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False)
        raise typer.Exit(2) from None
    except ClusterError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def _rollout_table(states: list[Rollout], title: str) -> Table:
    t = Table(title=title)
    for c in ("kind", "name", "ready", "detail"):
        t.add_column(c)
    for s in states:
        t.add_row(s.kind, s.name, "[green]yes[/green]" if s.ready else "[yellow]no[/yellow]", s.detail)
    return t


@cluster_app.command()
def status(
    ctx: typer.Context,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="PREFT_ADMIN__REDIS_URL",
            help="Redis the engine replicas publish residency to (e.g. through `kubectl port-forward svc/preft-redis "
            "6379`); without it, adapters per replica are not shown.",
        ),
    ] = None,
) -> None:
    """Health of the Deployments, StatefulSets and the engine's RayService, and the adapters each replica holds."""
    opts: ClusterOptions = ctx.obj

    def go() -> int:
        cluster = opts.cluster()
        workloads = [rollout_of(o) for o in cluster.workloads()]
        engine = engine_status(cluster.rayservice())
        residency: dict[str, list[str]] | None = None
        residency_error = None
        if redis_url:
            try:
                residency = read_residency(redis_url)
            except Exception as e:  # Redis is optional here: report, do not fail the status
                residency_error = f"{type(e).__name__}: {e}"
        ok = engine.ready and all(w.ready for w in workloads)
        if opts.as_json:
            out.print_json(
                json.dumps(
                    {
                        "ready": ok,
                        "workloads": [asdict(w) for w in workloads],
                        "engine": asdict(engine),
                        "residency": residency,
                        "residency_error": residency_error,
                    }
                )
            )
            return 0 if ok else 1
        out.print(_rollout_table(workloads, f"workloads in {opts.namespace}"))
        t = Table(title=f"engine: RayService {engine.name}")
        t.add_column("what")
        t.add_column("state")
        t.add_row("ready", ("[green]yes[/green] " if engine.ready else "[yellow]no[/yellow] ") + engine.detail)
        t.add_row("serve endpoints", str(engine.serve_endpoints if engine.serve_endpoints is not None else "?"))
        for app, st in engine.applications.items():
            t.add_row(f"application {app}", st)
        for dep, st in engine.deployments.items():
            t.add_row(f"deployment {dep}", f"{st} (num_replicas {engine.num_replicas.get(dep, '?')})")
        for dep, n in engine.num_replicas.items():
            if dep not in engine.deployments:
                t.add_row(f"deployment {dep}", f"configured num_replicas {n}")
        for g in engine.worker_groups:
            t.add_row(
                f"worker group {g['groupName']}",
                f"{g['replicas']} pods (min {g['minReplicas']}, max {g['maxReplicas']})",
            )
        out.print(t)
        if residency is not None:
            r = Table(title="adapters held per engine replica (preft:residency:*)")
            for c in ("replica", "adapters", "digests"):
                r.add_column(c)
            for replica, digests in residency.items():
                shown = ", ".join(d.split(":")[-1][:12] for d in digests[:5]) + (" …" if len(digests) > 5 else "")
                r.add_row(replica, str(len(digests)), shown)
            if not residency:
                r.add_row("(none published)", "0", "")
            out.print(r)
        elif residency_error:
            err.print(f"[yellow]adapters: Redis not reachable ({residency_error})[/yellow]", highlight=False)
        else:
            out.print("adapters per replica: pass --redis-url (or PREFT_ADMIN__REDIS_URL) to show them")
        return 0 if ok else 1

    _run(go)


@cluster_app.command()
def apply(
    ctx: typer.Context,
    overlay: Annotated[
        str | None,
        typer.Option(help="Overlay name under DEPLOY_DIR/overlays (dev, gpu, gpu-s3) or a kustomization directory."),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="Rendered manifests (YAML) to apply instead, e.g. from `helm template`."),
    ] = None,
    deploy_dir: Annotated[Path, typer.Option(help="Where the overlays live.")] = Path("deploy"),
    wait: Annotated[
        bool, typer.Option(help="Wait for the Deployments, StatefulSets and RayService to roll out.")
    ] = True,
    timeout_s: Annotated[float, typer.Option(help="How long to wait for the rollout.")] = 900.0,
    poll_s: Annotated[float, typer.Option(help="Polling interval while waiting.")] = 5.0,
    dry_run: Annotated[bool, typer.Option(help="Server-side dry run: validated and admitted, not stored.")] = False,
) -> None:
    """Server-side apply of an overlay (rendered with kustomize) or of rendered YAML, then wait for the rollout."""
    opts: ClusterOptions = ctx.obj

    def go() -> int:
        if (overlay is None) == (file is None):
            raise UsageError("pass exactly one of --overlay and --file")
        if file is not None:
            try:
                objects = [d for d in yaml.load_all(file.read_text(), Loader=YAML_LOADER) if d]
            except (OSError, yaml.YAMLError) as e:
                raise UsageError(f"cannot read {file}: {e}") from e
        else:
            path = Path(overlay)
            if not (path / "kustomization.yaml").is_file():
                path = deploy_dir / "overlays" / overlay
            if not (path / "kustomization.yaml").is_file():
                raise UsageError(f"no kustomization.yaml in {overlay} or {path}")
            objects = render_overlay(path)
        if not objects:
            raise UsageError("nothing to apply")
        cluster = opts.cluster()
        applied = cluster.apply(objects, dry_run=dry_run)
        if not opts.as_json:
            for o in applied:
                ns = o["metadata"].get("namespace")
                out.print(
                    f"{o['kind']}/{o['metadata']['name']}{f' -n {ns}' if ns else ''} "
                    f"{'validated (dry run)' if dry_run else 'applied'}",
                    highlight=False,
                )
        if dry_run or not wait:
            if opts.as_json:
                out.print_json(json.dumps({"applied": [[o["kind"], o["metadata"]["name"]] for o in applied]}))
            return 0

        def show(states: list[Rollout]) -> None:
            if not opts.as_json:
                pending = [f"{s.kind}/{s.name}: {s.detail}" for s in states if not s.ready]
                out.print("waiting: " + "; ".join(pending) if pending else "rolled out", highlight=False)

        states = cluster.wait(applied, timeout_s=timeout_s, poll_s=poll_s, on_change=show)
        ok = all(s.ready for s in states)
        if opts.as_json:
            out.print_json(
                json.dumps(
                    {
                        "applied": [[o["kind"], o["metadata"]["name"]] for o in applied],
                        "rollout": [asdict(s) for s in states],
                        "ready": ok,
                    }
                )
            )
        elif not ok:
            err.print(f"[red]timed out after {timeout_s:g} s[/red]")
            out.print(_rollout_table(states, "rollout"))
        return 0 if ok else 1

    _run(go)


@scale_app.command("engine")
def scale_engine(
    ctx: typer.Context,
    replicas: Annotated[int, typer.Argument(help="Engine replicas (the Serve deployment's num_replicas).", min=1)],
    workers: Annotated[int | None, typer.Option(help="Also set the Ray worker group's pod count.", min=0)] = None,
    app: Annotated[str | None, typer.Option(help="Serve application [default: the only one].")] = None,
    deployment: Annotated[str | None, typer.Option(help="Serve deployment [default: the only one].")] = None,
    group: Annotated[str | None, typer.Option(help="Ray worker group [default: the only one].")] = None,
    wait: Annotated[bool, typer.Option(help="Wait until the RayService is ready again.")] = False,
    timeout_s: Annotated[float, typer.Option(help="How long to wait.")] = 900.0,
    poll_s: Annotated[float, typer.Option(help="Polling interval while waiting.")] = 5.0,
) -> None:
    """Set the engine's replica count in the RayService's Serve config (an in-place Serve update, no new cluster)."""
    opts: ClusterOptions = ctx.obj

    def go() -> int:
        cluster = opts.cluster()
        patched = cluster.scale_engine(replicas, workers=workers, app=app, deployment=deployment, group=group)
        engine = engine_status(patched)
        if not opts.as_json:
            out.print(
                f"RayService/{engine.name}: num_replicas "
                + ", ".join(f"{d}={n}" for d, n in engine.num_replicas.items())
                + "".join(f"; {g['groupName']} {g['replicas']} pods" for g in engine.worker_groups),
                highlight=False,
            )
        states = cluster.wait([patched], timeout_s=timeout_s, poll_s=poll_s) if wait else [rollout_of(patched)]
        if opts.as_json:
            out.print_json(json.dumps({"engine": asdict(engine), "rollout": [asdict(s) for s in states]}))
        return 0 if (not wait or all(s.ready for s in states)) else 1

    _run(go)
