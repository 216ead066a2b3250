"""A small Kubernetes API server on 127.0.0.1, for testing `preft-admin cluster` over real HTTP.

It answers what the official client's DynamicClient and the CLI use, with the shapes the real API server returns:
discovery (/version, /api, /apis, APIResourceLists), GET of one object or a list (with equality label selectors),
and PATCH as server-side apply (application/apply-patch+yaml, fieldManager required), JSON patch (RFC 6902, `test`
ops included) and merge patch, dryRun=All, bearer-token auth, Status objects for errors. Stored objects get uid,
resourceVersion, generation (bumped when spec changes), creationTimestamp and managedFields.

A toy controller stands in for the Deployment/StatefulSet controllers and KubeRay: after `rollout_polls` GETs of a
workload since its spec last changed, its status reports it rolled out (a RayService: Ready, its Serve application
RUNNING and its deployments HEALTHY).

Not a Kubernetes: no admission, no validation, no watches, no real field ownership merging (an apply replaces what
the manager sent; fine for one manager), but for `spec.replicas`, the field a HorizontalPodAutoscaler shares: its
owners are tracked (managedFields' fieldsV1 shows them), an apply that leaves it out keeps it while another manager
owns it (else it is gone, as the real server removes a field its last owner dropped), an update that changes it makes
the updater its only owner, and an apply of `spec.replicas` alone merges into the object (a hand-over to the HPA).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import yaml

Obj = dict[str, Any]

# (group, version, kind, plural, namespaced)
CORE = [
    ("", "v1", "Namespace", "namespaces", False),
    ("", "v1", "ServiceAccount", "serviceaccounts", True),
    ("", "v1", "ConfigMap", "configmaps", True),
    ("", "v1", "Secret", "secrets", True),
    ("", "v1", "Service", "services", True),
    ("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims", True),
    ("", "v1", "Pod", "pods", True),
    ("apps", "v1", "Deployment", "deployments", True),
    ("apps", "v1", "StatefulSet", "statefulsets", True),
    ("autoscaling", "v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", True),
    ("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets", True),
    ("networking.k8s.io", "v1", "NetworkPolicy", "networkpolicies", True),
]
KUBERAY = [
    ("ray.io", "v1", "RayService", "rayservices", True),
    ("ray.io", "v1", "RayCluster", "rayclusters", True),
]
PROMETHEUS_OPERATOR = [
    ("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors", True),
    ("monitoring.coreos.com", "v1", "PodMonitor", "podmonitors", True),
    ("monitoring.coreos.com", "v1", "PrometheusRule", "prometheusrules", True),
]
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
WORKLOADS = ("Deployment", "StatefulSet", "RayService")


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 (add, remove, replace, test) on a copy of doc."""
    doc = copy.deepcopy(doc)

    def split(path: str) -> list[str]:
        return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")] if path else []

    def parent(parts: list[str]) -> tuple[Any, str]:
        node: Any = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        return node, parts[-1]

    for op in ops:
        parts = split(op["path"])
        try:
            node, last = parent(parts)
            if op["op"] == "test":
                current = node[int(last)] if isinstance(node, list) else node[last]
                if current != op["value"]:
                    raise ApiError(
                        422,
                        "Invalid",
                        f"the server rejected our request due to an error in our request: "
                        f"testing value {op['path']} failed",
                    )
            elif op["op"] in ("replace", "add"):
                if isinstance(node, list):
                    if last == "-":
                        node.append(op["value"])
                    elif op["op"] == "add":
                        node.insert(int(last), op["value"])
                    else:
                        node[int(last)] = op["value"]
                else:
                    if op["op"] == "replace" and last not in node:
                        raise ApiError(422, "Invalid", f"replace operation does not apply: {op['path']} is missing")
                    node[last] = op["value"]
            elif op["op"] == "remove":
                del node[int(last) if isinstance(node, list) else last]
            else:
                raise ApiError(422, "Invalid", f"unsupported JSON patch op {op['op']}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"JSON patch {op} does not apply: {e}") from e
    return doc


def merge_patch(doc: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(doc) if isinstance(doc, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeApiServer:
    """The API server: an object store keyed by (group/version, plural, namespace, name) behind an HTTP handler."""

    def __init__(self, *, token: str = "test-token", resources: list[tuple] | None = None, rollout_polls: int = 2):
        self.token = token
        self.resources = resources if resources is not None else CORE + KUBERAY + PROMETHEUS_OPERATOR
        self.rollout_polls = rollout_polls
        self.objects: dict[tuple[str, str, str | None, str], Obj] = {}
        self.requests: list[dict[str, Any]] = []
        self.before_patch: Callable[[FakeApiServer, Obj], None] | None = None  # a hook: races in tests
        self._polls: dict[tuple, int] = {}
        self._replica_owners: dict[tuple, set[str]] = {}
        self._rv = 1000
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    # lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> FakeApiServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._handle("GET")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                code, payload = server.handle(method, self.path, dict(self.headers), body)
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True, name="fake-apiserver").start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def kubeconfig(self, namespace: str = "preft") -> str:
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": self.token}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": namespace}}
                ],
            }
        )

    # store access for tests ------------------------------------------------------------------------------------

    def find(self, kind: str, name: str, namespace: str | None = "preft") -> Obj | None:
        for (_, _plural, ns, n), obj in self.objects.items():
            if obj["kind"] == kind and n == name and ns == (namespace if self._namespaced(kind) else None):
                return obj
        return None

    def _namespaced(self, kind: str) -> bool:
        return next(r[4] for r in self.resources if r[2] == kind)

    # HTTP ------------------------------------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> tuple[int, Obj]:
        url = urlparse(raw_path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        self.requests.append({"method": method, "path": url.path, "query": query, "content_type": ctype})
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        if auth != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized", "Unauthorized")
        try:
            with self._lock:
                return 200, self._route(method, url.path, query, ctype, body)
        except ApiError as e:
            return e.code, _status(e.code, e.reason, e.message)

    def _group_versions(self) -> dict[str, list[tuple]]:
        out: dict[str, list[tuple]] = {}
        for r in self.resources:
            out.setdefault(f"{r[0]}/{r[1]}" if r[0] else r[1], []).append(r)
        return out

    def _resource_list(self, gv: str) -> Obj:
        rs = self._group_versions().get(gv)
        if rs is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({gv})")
        resources = []
        for _, _, kind, plural, namespaced in rs:
            resources.append(
                {"name": plural, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind, "verbs": VERBS}
            )
            if kind in WORKLOADS:
                resources.append(
                    {
                        "name": f"{plural}/status",
                        "singularName": "",
                        "namespaced": namespaced,
                        "kind": kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    def _route(self, method: str, path: str, query: dict[str, str], ctype: str, body: bytes) -> Obj:
        if method == "GET" and path == "/version":
            return {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "platform": "linux/amd64"}
        if method == "GET" and path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
            }
        if method == "GET" and path == "/apis":
            groups: dict[str, list[str]] = {}
            for g, v, *_ in self.resources:
                if g and v not in groups.setdefault(g, []):
                    groups[g].append(v)
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    }
                    for g, vs in groups.items()
                ],
            }
        m = re.fullmatch(r"/api/v1", path) or re.fullmatch(r"/apis/([^/]+)/([^/]+)", path)
        if m and method == "GET":
            return self._resource_list("v1" if path == "/api/v1" else f"{m.group(1)}/{m.group(2)}")
        if path.startswith("/api/v1/"):
            gv, rest = "v1", path[len("/api/v1/") :].split("/")
        elif m := re.fullmatch(r"/apis/([^/]+)/([^/]+)/(.+)", path):
            gv, rest = f"{m[1]}/{m[2]}", m[3].split("/")
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        ns = None
        if rest[0] == "namespaces" and len(rest) >= 3:  # /namespaces/<ns>/<plural>[/<name>]
            ns, rest = rest[1], rest[2:]
        plural, name = rest[0], (rest[1] if len(rest) > 1 else None)
        spec = next((r for r in self._group_versions().get(gv, []) if r[3] == plural), None)
        if spec is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({gv} {plural})")
        kind, namespaced = spec[2], spec[4]
        if namespaced and ns is None and name is not None:
            raise ApiError(404, "NotFound", "namespaced resource without a namespace")
        key = (gv, plural, ns if namespaced else None, name)
        if method == "GET":
            if name is None:
                return self._list(gv, plural, kind, ns, query.get("labelSelector"))
            obj = self.objects.get(key)
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural}.{gv.split("/")[0]} "{name}" not found')
            self._advance(key)
            return self.objects[key]
        if method == "PATCH" and name is not None:
            return self._patch(key, gv, kind, ctype, body, query)
        raise ApiError(405, "MethodNotAllowed", f"{method} {path}")

    def _list(self, gv: str, plural: str, kind: str, ns: str | None, selector: str | None) -> Obj:
        want = dict(p.split("=", 1) for p in selector.split(",")) if selector else {}
        items = []
        for key, obj in sorted(self.objects.items()):
            g, p, n, _ = key
            labels = obj["metadata"].get("labels") or {}
            if g == gv and p == plural and (ns is None or n == ns) and all(labels.get(k) == v for k, v in want.items()):
                self._advance(key)
                item = copy.deepcopy(self.objects[key])
                item.pop("kind", None)  # list items carry no kind/apiVersion, as from the real server
                item.pop("apiVersion", None)
                items.append(item)
        return {"kind": f"{kind}List", "apiVersion": gv, "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _patch(self, key: tuple, gv: str, kind: str, ctype: str, body: bytes, query: dict[str, str]) -> Obj:
        current = self.objects.get(key)
        ctype = ctype.split(";")[0].strip()
        if ctype == "application/apply-patch+yaml":
            if not query.get("fieldManager"):
                raise ApiError(422, "Invalid", "PatchOptions.meta.k8s.io is invalid: fieldManager: Required value")
            applied = yaml.safe_load(body)
            if applied.get("kind") != kind or applied.get("apiVersion") != gv:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"apply of {applied.get('apiVersion')}/{applied.get('kind')} to the {gv} {kind} endpoint",
                )
            new = copy.deepcopy(applied)
            manager = query["fieldManager"]
            owners = self._replica_owners.setdefault(key, set())
            sent = (applied.get("spec") or {}).keys()
            if current is not None and set(sent) == {"replicas"}:  # a hand-over: merged, not replaced
                new = copy.deepcopy(current)
                new["spec"]["replicas"] = applied["spec"]["replicas"]
            elif (
                current is not None
                and "replicas" not in sent
                and (owners - {manager})
                and "replicas" in (current.get("spec") or {})
            ):
                new.setdefault("spec", {})["replicas"] = current["spec"]["replicas"]
            if "replicas" in sent:
                owners.add(manager)
            else:
                owners.discard(manager)
            if current is not None:
                for k in ("uid", "creationTimestamp", "generation", "resourceVersion"):
                    new["metadata"][k] = current["metadata"][k]
                if "status" in current:
                    new["status"] = current["status"]
            operation = "Apply"
        else:
            if current is None:
                raise ApiError(404, "NotFound", f'{key[1]} "{key[3]}" not found')
            if self.before_patch:
                self.before_patch(self, current)
                current = self.objects[key]
            patch = json.loads(body)
            if ctype == "application/json-patch+json":
                new = json_patch(current, patch)
            elif ctype == "application/merge-patch+json":
                new = merge_patch(current, patch)
            else:
                raise ApiError(
                    415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}"
                )
            operation = "Update"
            if (new.get("spec") or {}).get("replicas") != (current.get("spec") or {}).get("replicas"):
                self._replica_owners[key] = {query.get("fieldManager", "unknown")}
        meta = new.setdefault("metadata", {})
        if key[2] is not None:
            meta["namespace"] = key[2]
        if current is None:
            meta.update(
                uid=str(uuid.uuid4()), creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), generation=1
            )
        elif new.get("spec") != current.get("spec"):
            meta["generation"] = current["metadata"]["generation"] + 1
        else:
            meta["generation"] = current["metadata"]["generation"]
        manager = query.get("fieldManager", "unknown")
        meta["managedFields"] = [
            {"manager": manager, "operation": operation, "apiVersion": gv, "fieldsType": "FieldsV1"}
        ]
        meta["managedFields"] += [
            {"manager": other, "operation": "Update", "apiVersion": gv, "fieldsType": "FieldsV1"}
            for other in sorted(self._replica_owners.get(key, set()) - {manager})
        ]
        for entry in meta["managedFields"]:
            if entry["manager"] in self._replica_owners.get(key, set()):
                entry["fieldsV1"] = {"f:spec": {"f:replicas": {}}}
        changed = (
            current is None
            or {k: v for k, v in new.items() if k != "metadata"}
            != {k: v for k, v in current.items() if k != "metadata"}
            or new["metadata"].get("labels") != current["metadata"].get("labels")
        )
        meta["resourceVersion"] = self._next_rv() if changed else current["metadata"]["resourceVersion"]
        if query.get("dryRun") == "All":
            return new
        self.objects[key] = new
        if current is None or meta["generation"] != current["metadata"]["generation"]:
            self._polls[key] = 0
        return new

    # the toy controller ----------------------------------------------------------------------------------------

    def _advance(self, key: tuple) -> None:
        obj = self.objects[key]
        if obj["kind"] not in WORKLOADS:
            return
        self._polls[key] = self._polls.get(key, 0) + 1
        done = self._polls[key] > self.rollout_polls
        gen = obj["metadata"]["generation"]
        if obj["kind"] in ("Deployment", "StatefulSet"):
            want = obj["spec"].get("replicas", 1)
            obj["status"] = {
                "observedGeneration": gen,
                "replicas": want,
                "updatedReplicas": want if done else 0,
                "readyReplicas": want if done else 0,
                "availableReplicas": want if done else 0,
            }
        else:
            config = yaml.safe_load(obj["spec"].get("serveConfigV2") or "") or {}
            apps = {
                a.get("name", "default"): {
                    "status": "RUNNING" if done else "DEPLOYING",
                    "serveDeploymentStatuses": {
                        d["name"]: {"status": "HEALTHY" if done else "UPDATING"} for d in a.get("deployments") or []
                    },
                }
                for a in config.get("applications") or []
            }
            workers = sum(g.get("replicas", 0) for g in obj["spec"]["rayClusterConfig"].get("workerGroupSpecs") or [])
            obj["status"] = {
                "observedGeneration": gen,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True" if done else "False",
                        "reason": "RayServiceReady" if done else "Initializing",
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ],
                "numServeEndpoints": workers + 1 if done else 0,
                "activeServiceStatus": {"applicationStatuses": apps, "rayClusterName": f"{obj['metadata']['name']}-x"},
            }
