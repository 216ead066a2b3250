"""A preft-serve deployment on Kubernetes as `preft-admin cluster` sees it: rollout state and engine status computed
from API objects (pure), what an apply sends (HPA-owned replicas left out), and the I/O: the Kubernetes API (the
official client's DynamicClient), the kustomize renderer, and the engine replicas' residency in Redis.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FIELD_MANAGER = "preft-admin"
# Takes spec.replicas of an HPA's target from preft-admin (then the HPA's own updates take it), so that dropping the
# field from preft-admin's applies keeps the running count: the API server removes a field its last owner drops.
HANDOVER_FIELD_MANAGER = "preft-admin-handover-to-hpa"
DEFAULT_NAMESPACE = "preft"
DEFAULT_ENGINE = "preft-engine"
RESIDENCY_PREFIX = "preft:residency:"  # written by the engine replicas (preft.engine.residency)
PART_OF_SELECTOR = "app.kubernetes.io/part-of=preft-serve"
# Apply order: what others refer to first, the workloads after, policies and monitoring last.
APPLY_ORDER = (
    "Namespace",
    "ServiceAccount",
    "ConfigMap",
    "Secret",
    "PersistentVolumeClaim",
    "Service",
    "StatefulSet",
    "Deployment",
    "RayService",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
)
WAITED_KINDS = ("Deployment", "StatefulSet", "RayService")

Obj = dict[str, Any]
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it: rendered overlays are big


class ClusterError(Exception):
    """The cluster refused or could not do what was asked; the message says why (exit code 1)."""


class UsageError(Exception):
    """The command was asked something that cannot be right (exit code 2)."""


# -- rollout state (pure: computed from API objects) -------------------------------------------------------------


@dataclass(frozen=True)
class Rollout:
    """Whether one workload has finished rolling out, and a short reason when it has not."""

    kind: str
    name: str
    ready: bool
    detail: str


def rollout_of(obj: Obj) -> Rollout:
    """The rollout state of a Deployment, StatefulSet or RayService, as `kubectl rollout status` would judge it."""
    kind, meta = obj["kind"], obj["metadata"]
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    generation, observed = meta.get("generation", 0), status.get("observedGeneration", 0)
    if kind in ("Deployment", "StatefulSet"):
        want = spec.get("replicas", 1)
        updated = status.get("updatedReplicas", 0)
        ready = status.get("availableReplicas" if kind == "Deployment" else "readyReplicas", 0)
        current = status.get("replicas", 0)
        if observed < generation:
            return Rollout(kind, meta["name"], False, "waiting for the controller to see the new spec")
        if updated < want:
            return Rollout(kind, meta["name"], False, f"{updated}/{want} updated")
        if current > updated:
            return Rollout(kind, meta["name"], False, f"{current - updated} old replicas pending termination")
        if ready < want:
            return Rollout(kind, meta["name"], False, f"{ready}/{want} ready")
        return Rollout(kind, meta["name"], True, f"{ready}/{want} ready")
    if kind == "RayService":
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        if observed and observed < generation:
            return Rollout(kind, meta["name"], False, "waiting for KubeRay to see the new spec")
        ready_cond = conditions.get("Ready")
        if ready_cond is not None:
            ok = ready_cond.get("status") == "True"
            return Rollout(kind, meta["name"], ok, ready_cond.get("reason") or ready_cond.get("message") or "")
        service_status = status.get("serviceStatus") or "unknown"  # KubeRay < 1.3 has no conditions
        return Rollout(kind, meta["name"], service_status == "Running", service_status)
    raise ValueError(f"no rollout state for {kind}")


# -- engine status (pure) ----------------------------------------------------------------------------------------


@dataclass
class EngineStatus:
    """What the RayService says about the engine: readiness, Serve application and deployments, worker groups."""

    name: str
    ready: bool
    detail: str
    serve_endpoints: int | None
    applications: dict[str, str] = field(default_factory=dict)  # app -> status
    deployments: dict[str, str] = field(default_factory=dict)  # app/deployment -> status
    num_replicas: dict[str, int | None] = field(default_factory=dict)  # app/deployment -> configured replicas
    worker_groups: list[dict[str, Any]] = field(default_factory=list)


def engine_status(rayservice: Obj) -> EngineStatus:
    rollout = rollout_of(rayservice)
    status = rayservice.get("status") or {}
    active = status.get("activeServiceStatus") or {}
    out = EngineStatus(
        name=rayservice["metadata"]["name"],
        ready=rollout.ready,
        detail=rollout.detail,
        serve_endpoints=status.get("numServeEndpoints", status.get("NumServeEndpoints")),
    )
    for app, app_status in (active.get("applicationStatuses") or {}).items():
        out.applications[app] = app_status.get("status", "")
        for dep, dep_status in (app_status.get("serveDeploymentStatuses") or {}).items():
            out.deployments[f"{app}/{dep}"] = dep_status.get("status", "")
    config = yaml.safe_load(rayservice["spec"].get("serveConfigV2") or "") or {}
    for app in config.get("applications") or []:
        for dep in app.get("deployments") or []:
            out.num_replicas[f"{app.get('name', 'default')}/{dep['name']}"] = dep.get("num_replicas")
    for g in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []:
        out.worker_groups.append({k: g.get(k) for k in ("groupName", "replicas", "minReplicas", "maxReplicas")})
    return out


def scaled_rayservice_patch(
    rayservice: Obj,
    replicas: int,
    *,
    workers: int | None = None,
    app: str | None = None,
    deployment: str | None = None,
    group: str | None = None,
) -> list[Obj]:
    """A JSON patch setting the Serve deployment's num_replicas (and a worker group's replicas) in a RayService.

    It starts with a `test` of resourceVersion, so it fails rather than overwrite a concurrent change.
    """
    if replicas < 1:
        raise UsageError("engine replicas must be at least 1")
    config = yaml.safe_load(rayservice["spec"].get("serveConfigV2") or "") or {}
    apps = config.get("applications") or []
    candidates = [a for a in apps if app in (None, a.get("name"))]
    if len(candidates) != 1:
        names = [a.get("name") for a in apps]
        raise UsageError(f"cannot tell which Serve application to scale among {names}: pass --app")
    deps = [d for d in candidates[0].get("deployments") or [] if deployment in (None, d.get("name"))]
    if len(deps) != 1:
        names = [d.get("name") for d in candidates[0].get("deployments") or []]
        raise UsageError(
            f"cannot tell which Serve deployment to scale among {names}: pass --deployment "
            "(the serve config must list the deployment to override its num_replicas)"
        )
    if deps[0].get("autoscaling_config"):
        raise UsageError(f"deployment {deps[0]['name']} autoscales (autoscaling_config): its replicas are Serve's")
    deps[0]["num_replicas"] = replicas
    ops: list[Obj] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rayservice["metadata"]["resourceVersion"]},
        {"op": "replace", "path": "/spec/serveConfigV2", "value": yaml.safe_dump(config, sort_keys=False)},
    ]
    if workers is not None:
        groups = rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []
        index = [i for i, g in enumerate(groups) if group in (None, g.get("groupName"))]
        if len(index) != 1:
            raise UsageError(f"cannot tell which worker group to scale among {[g.get('groupName') for g in groups]}")
        g = groups[index[0]]
        lo, hi = g.get("minReplicas", 0), g.get("maxReplicas", 2**31 - 1)
        if not lo <= workers <= hi:
            raise UsageError(f"worker group {g['groupName']} allows {lo}..{hi} workers, not {workers}")
        ops.append(
            {"op": "replace", "path": f"/spec/rayClusterConfig/workerGroupSpecs/{index[0]}/replicas", "value": workers}
        )
    return ops


def hpa_targets(objects: Iterable[Obj]) -> set[tuple[str, str]]:
    """(kind, name) of the workloads the HorizontalPodAutoscalers among `objects` scale."""
    out = set()
    for o in objects:
        if o.get("kind") == "HorizontalPodAutoscaler":
            ref = (o.get("spec") or {}).get("scaleTargetRef") or {}
            out.add((ref.get("kind"), ref.get("name")))
    return out


def without_hpa_replicas(obj: Obj, targets: set[tuple[str, str]]) -> Obj:
    """`obj` without spec.replicas when an HPA scales it (a copy; `obj` itself otherwise)."""
    if (obj.get("kind"), obj["metadata"]["name"]) not in targets or "replicas" not in (obj.get("spec") or {}):
        return obj
    return {**obj, "spec": {k: v for k, v in obj["spec"].items() if k != "replicas"}}


def _owns_replicas(live: Obj, manager: str) -> bool:
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        fields = entry.get("fieldsV1") or entry.get("fields_v1") or {}
        if entry.get("manager") == manager and "f:replicas" in (fields.get("f:spec") or {}):
            return True
    return False


def order_for_apply(objects: Iterable[Obj]) -> list[Obj]:
    rank = {k: i for i, k in enumerate(APPLY_ORDER)}
    return sorted(objects, key=lambda o: rank.get(o["kind"], len(APPLY_ORDER)))


# -- I/O: the Kubernetes API, the renderer, Redis ----------------------------------------------------------------


def connect(kubeconfig: Path | None = None, context: str | None = None, *, cache_file: Path | None = None):
    """A DynamicClient from a kubeconfig (explicit, $KUBECONFIG or ~/.kube/config), else the in-cluster config."""
    from kubernetes import config as kconfig
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.dynamic import DynamicClient

    try:
        api_client = kconfig.new_client_from_config(
            config_file=str(kubeconfig) if kubeconfig else None, context=context
        )
    except (ConfigException, FileNotFoundError) as e:
        if kubeconfig or context:
            raise ClusterError(f"cannot load kubeconfig: {e}") from e
        try:
            kconfig.load_incluster_config()
        except ConfigException as e2:
            raise ClusterError(f"no kubeconfig and not in a cluster: {e}; {e2}") from e2
        from kubernetes.client import ApiClient

        api_client = ApiClient()
    try:
        return DynamicClient(api_client, cache_file=str(cache_file) if cache_file else None)
    except Exception as e:  # discovery: connection refused, 401, TLS
        raise ClusterError(f"cannot reach the Kubernetes API at {api_client.configuration.host}: {e}") from e


def render_overlay(path: Path, *, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> list[Obj]:
    """`kubectl kustomize PATH` (kustomize as bundled by kubectl) parsed into objects."""
    import shutil

    exe = shutil.which("kubectl")
    cmd = [exe, "kustomize", str(path)] if exe else None
    if cmd is None and (k := shutil.which("kustomize")):
        cmd = [k, "build", str(path)]
    if cmd is None:
        raise UsageError("rendering an overlay needs kubectl (or kustomize) on PATH; or pass -f with rendered YAML")
    proc = run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise UsageError(f"kustomize failed on {path}: {proc.stderr.strip()}")
    return [d for d in yaml.load_all(proc.stdout, Loader=YAML_LOADER) if d]


def read_residency(redis_url: str, *, timeout_s: float = 2.0) -> dict[str, list[str]]:
    """Replica id -> adapter digests it holds, from the engine replicas' `preft:residency:<replica>` sets."""
    import redis

    client = redis.Redis.from_url(
        redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
    )
    try:
        out = {}
        for key in client.scan_iter(match=RESIDENCY_PREFIX + "*", count=500):
            out[key[len(RESIDENCY_PREFIX) :]] = sorted(client.smembers(key))
        return dict(sorted(out.items()))
    finally:
        client.close()


class Cluster:
    """Owns the preft-serve objects of one namespace, through a kubernetes DynamicClient."""

    def __init__(
        self,
        client: Any,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        engine: str = DEFAULT_ENGINE,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.namespace, self.engine = client, namespace, engine
        self._sleep, self._clock = sleep, clock

    # kinds ------------------------------------------------------------------------------------------------------

    def _resource(self, api_version: str, kind: str):
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return self.client.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError as e:
            hint = {
                "ray.io/v1": " (install the KubeRay operator)",
                "monitoring.coreos.com/v1": " (install the prometheus-operator CRDs)",
            }.get(api_version, "")
            raise ClusterError(f"the cluster has no {kind} in {api_version}{hint}") from e

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        from kubernetes.dynamic.exceptions import DynamicApiError

        try:
            return fn()
        except DynamicApiError as e:
            raise ClusterError(f"{what}: {e.status} {e.reason}: {_api_message(e)}") from e

    # reads ------------------------------------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        res = self._resource(api_version, kind)
        try:
            return res.get(name=name, namespace=namespace or self.namespace).to_dict()
        except NotFoundError:
            return None

    def list(self, api_version: str, kind: str, label_selector: str | None = None) -> list[Obj]:
        """Objects of one kind in the namespace (list items carry no kind: it is set here)."""
        res = self._resource(api_version, kind)
        items = self._call(f"list {kind}", lambda: res.get(namespace=self.namespace, label_selector=label_selector))
        return [{**i, "kind": kind, "apiVersion": api_version} for i in items.to_dict().get("items", [])]

    def workloads(self) -> list[Obj]:
        return self.list("apps/v1", "Deployment", PART_OF_SELECTOR) + self.list(
            "apps/v1", "StatefulSet", PART_OF_SELECTOR
        )

    def rayservice(self) -> Obj:
        obj = self.get("ray.io/v1", "RayService", self.engine)
        if obj is None:
            raise ClusterError(f"RayService {self.namespace}/{self.engine} not found")
        return obj

    # writes -----------------------------------------------------------------------------------------------------

    def apply(self, objects: Sequence[Obj], *, dry_run: bool = False) -> list[Obj]:
        """Server-side apply (field manager preft-admin, conflicts forced) in dependency order; returns the objects
        as the API server stored them. Every kind is resolved before anything is applied.

        A workload a HorizontalPodAutoscaler among `objects` scales is applied without `spec.replicas` (the HPA owns
        them; forcing the manifest's count would reset every scale-out), after handing the field over where
        preft-admin owned it (`HANDOVER_FIELD_MANAGER`), so the running count stays."""
        ordered = [without_hpa_replicas(o, hpa_targets(objects)) for o in order_for_apply(objects)]
        resources = [self._resource(o["apiVersion"], o["kind"]) for o in ordered]
        out = []
        for obj, res in zip(ordered, resources, strict=True):
            ns = (obj["metadata"].get("namespace") or self.namespace) if res.namespaced else None
            name = obj["metadata"]["name"]
            if (obj["kind"], name) in hpa_targets(objects) and not dry_run:
                self._hand_replicas_over(obj, res, name, ns)
            options: dict[str, Any] = {"field_manager": FIELD_MANAGER, "force_conflicts": True}
            if dry_run:
                options["dry_run"] = "All"
            stored = self._call(
                f"apply {obj['kind']}/{name}",
                lambda res=res, obj=obj, name=name, ns=ns, options=options: res.server_side_apply(
                    body=obj, name=name, namespace=ns, **options
                ),
            )
            out.append(stored.to_dict())
        return out

    def _hand_replicas_over(self, obj: Obj, res: Any, name: str, ns: str | None) -> None:
        live = self.get(obj["apiVersion"], obj["kind"], name, ns)
        if live is None or "replicas" not in (live.get("spec") or {}) or not _owns_replicas(live, FIELD_MANAGER):
            return
        body = {
            "apiVersion": obj["apiVersion"],
            "kind": obj["kind"],
            "metadata": {"name": name, **({"namespace": ns} if ns else {})},
            "spec": {"replicas": live["spec"]["replicas"]},
        }
        self._call(
            f"hand {obj['kind']}/{name} replicas to its HPA",
            lambda: res.server_side_apply(
                body=body, name=name, namespace=ns, field_manager=HANDOVER_FIELD_MANAGER, force_conflicts=True
            ),
        )

    def scale_engine(
        self,
        replicas: int,
        *,
        workers: int | None = None,
        app: str | None = None,
        deployment: str | None = None,
        group: str | None = None,
    ) -> Obj:
        current = self.rayservice()
        patch = scaled_rayservice_patch(current, replicas, workers=workers, app=app, deployment=deployment, group=group)
        res = self._resource("ray.io/v1", "RayService")
        return self._call(
            f"patch RayService/{self.engine}",
            lambda: res.patch(
                body=patch,
                name=self.engine,
                namespace=self.namespace,
                content_type="application/json-patch+json",
                field_manager=FIELD_MANAGER,
            ),
        ).to_dict()

    def wait(
        self,
        objects: Sequence[Obj],
        *,
        timeout_s: float,
        poll_s: float = 2.0,
        on_change: Callable[[list[Rollout]], None] | None = None,
    ) -> list[Rollout]:
        """Poll until every Deployment, StatefulSet and RayService among `objects` has rolled out, or time runs out.
        Returns the last states (all ready, or not)."""
        targets = [o for o in objects if o["kind"] in WAITED_KINDS]
        deadline = self._clock() + timeout_s
        last: list[Rollout] = []
        while True:
            states = []
            for o in targets:
                ns = o["metadata"].get("namespace") or self.namespace
                live = self.get(o["apiVersion"], o["kind"], o["metadata"]["name"], ns)
                states.append(rollout_of(live) if live else Rollout(o["kind"], o["metadata"]["name"], False, "missing"))
            if states != last and on_change:
                on_change(states)
            last = states
            if all(s.ready for s in states) or self._clock() >= deadline:
                return states
            self._sleep(poll_s)


def _api_message(e: Any) -> str:
    try:
        return json.loads(e.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        return str(getattr(e, "body", "")) or str(e)
