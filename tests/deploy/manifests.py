"""Render preft's manifests (real kustomize, real Helm engine) and check them: schemas, security, wiring, policies.

Rendering:
- kustomize: `kubectl kustomize` (kubectl bundles kustomize; this machine's image ships kubectl with Kustomize v5.5.0).
- Helm: helm-python-sdk, the Helm v4 Go SDK behind a C ABI (`helm_python.Chart.render` = `helm template`).

Validation:
- built-in kinds: kubernetes-validate's strict OpenAPI-derived JSON schemas for Kubernetes K8S_VERSION (unknown fields
  rejected, as `kubectl apply` with field validation Strict does);
- CRDs (RayService, ServiceMonitor, PodMonitor, PrometheusRule): the JSON schemas in schemas/, written for the fields
  preft uses, with pod templates and label selectors checked against the Kubernetes definitions.

Every check returns a list of problems (empty = fine), so tests can show all of them at once and negative tests can
assert on a specific one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = REPO / "helm" / "preft"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_VERSION = "1.31.0"  # the oldest minor preft supports that kubernetes-validate 1.37 bundles with gRPC probes etc.
OVERLAYS = ("dev", "gpu", "gpu-s3")
CRD_SCHEMAS = {
    ("ray.io/v1", "RayService"): "rayservice.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.json",
}
# Secrets the manifests read but never create (deploy/secrets.example.env documents them).
EXTERNAL_SECRETS = {
    "preft-registry-token",
    "preft-engine-token",
    "preft-s3",
    "preft-redis",
    "preft-redis-acl",
    "preft-hf-token",
}

Obj = dict[str, Any]


# -- rendering ---------------------------------------------------------------------------------------------------


class RenderError(RuntimeError):
    pass


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise RenderError("kubectl (which bundles kustomize) is not on PATH: install Debian's `kubectl` package")
    return path


def kustomize_version() -> str:
    out = subprocess.run([kubectl(), "version", "--client"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Kustomize Version:\s*(\S+)", out)
    return m.group(1) if m else "unknown"


def kustomize_build(path: Path) -> list[Obj]:
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RenderError(f"kustomize build {path} failed: {proc.stderr.strip()}")
    return load_all(proc.stdout)


def load_all(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d]


def helm_render(values: dict[str, Any] | None = None, *, release: str = "preft", namespace: str = "preft") -> list[Obj]:
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=release, namespace=namespace, is_install=True)
    docs: list[Obj] = []
    for name, text in sorted(rendered.items()):
        if name.endswith(".yaml"):
            docs.extend(load_all(text))
    return docs


def helm_values_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / name).read_text())


# -- object access -----------------------------------------------------------------------------------------------


def key(o: Obj) -> tuple[str, str]:
    return (o["kind"], o["metadata"]["name"])


def by_kind(docs: list[Obj], kind: str) -> list[Obj]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Obj], kind: str, name: str) -> Obj:
    found = [d for d in docs if key(d) == (kind, name)]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_templates(o: Obj) -> Iterator[tuple[str, Obj]]:
    """(where, pod template) for every pod template an object carries: workloads and the RayService's groups."""
    kind = o["kind"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        yield f"{kind}/{o['metadata']['name']}", o["spec"]["template"]
    elif kind == "RayService":
        cluster = o["spec"]["rayClusterConfig"]
        yield f"RayService/{o['metadata']['name']}/head", cluster["headGroupSpec"]["template"]
        for g in cluster.get("workerGroupSpecs", []):
            yield f"RayService/{o['metadata']['name']}/{g['groupName']}", g["template"]


def containers(pod_spec: Obj) -> Iterator[tuple[str, Obj]]:
    for c in pod_spec.get("initContainers") or []:
        yield "init", c
    for c in pod_spec.get("containers") or []:
        yield "main", c


def serve_config(rayservice: Obj) -> Obj:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def engine_args(docs: list[Obj]) -> Obj:
    """The engine's settings: the `args` of the (one) RayService's Serve application."""
    (ray,) = by_kind(docs, "RayService")
    (app,) = serve_config(ray)["applications"]
    return app.get("args") or {}


# -- schema validation -------------------------------------------------------------------------------------------


@cache
def _crd_registry() -> Registry:
    defs_file = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / f"v{K8S_VERSION}-local-strict"
        / "_definitions.json"
    )
    defs = json.loads(defs_file.read_text())
    return Registry().with_resource(defs["$id"], Resource.from_contents(defs))


@cache
def _crd_validator(schema_file: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / schema_file).read_text())
    return jsonschema.Draft202012Validator(schema, registry=_crd_registry())


def schema_errors(o: Obj) -> list[str]:
    """Schema violations of one object (strict: unknown fields are errors)."""
    where = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
    crd = CRD_SCHEMAS.get((o.get("apiVersion"), o.get("kind")))
    if crd is not None:
        return [
            f"{where}: {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in sorted(_crd_validator(crd).iter_errors(o), key=lambda e: list(map(str, e.absolute_path)))
        ]
    try:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{where}: {e.message}"]
    return []


def serve_config_errors(o: Obj) -> list[str]:
    """The RayService's serveConfigV2 checked by Ray Serve's own schema (ray.serve.schema.ServeDeploySchema)."""
    import warnings

    from pydantic import ValidationError

    with warnings.catch_warnings():  # Ray's own pydantic models warn about deprecated Field arguments
        warnings.simplefilter("ignore")
        from ray.serve.schema import ServeDeploySchema
    try:
        ServeDeploySchema.model_validate(serve_config(o))
    except (ValidationError, yaml.YAMLError) as e:
        return [f"RayService/{o['metadata']['name']}: serveConfigV2: {e}"]
    return []


# -- properties --------------------------------------------------------------------------------------------------

WRITABLE_ROOT_ALLOWED = ("RayService/",)  # Ray, vLLM and torch.compile write caches under $HOME and /tmp


def security_problems(docs: list[Obj]) -> list[str]:
    """Pod Security `restricted` requirements, limits on every container, read-only roots outside Ray."""
    problems = []
    for o in docs:
        for where, tpl in pod_templates(o):
            spec = tpl["spec"]
            psc = spec.get("securityContext") or {}
            if psc.get("runAsNonRoot") is not True:
                problems.append(f"{where}: pod securityContext.runAsNonRoot is not true")
            if psc.get("runAsUser", 1) == 0:
                problems.append(f"{where}: pod runs as uid 0")
            if (psc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{where}: pod seccompProfile is not RuntimeDefault")
            if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
                problems.append(f"{where}: uses host namespaces")
            for v in spec.get("volumes") or []:
                if "hostPath" in v:
                    problems.append(f"{where}: hostPath volume {v['name']}")
            for role, c in containers(spec):
                cw = f"{where}/{role}:{c['name']}"
                sc = c.get("securityContext") or {}
                if sc.get("allowPrivilegeEscalation") is not False:
                    problems.append(f"{cw}: allowPrivilegeEscalation is not false")
                if sc.get("privileged"):
                    problems.append(f"{cw}: privileged")
                if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                    problems.append(f"{cw}: capabilities do not drop ALL")
                if (sc.get("capabilities") or {}).get("add"):
                    problems.append(f"{cw}: adds capabilities")
                if sc.get("runAsUser", 1) == 0 or sc.get("runAsNonRoot") is False:
                    problems.append(f"{cw}: runs as root")
                if sc.get("readOnlyRootFilesystem") is not True and not where.startswith(WRITABLE_ROOT_ALLOWED):
                    problems.append(f"{cw}: root filesystem is writable")
                limits = (c.get("resources") or {}).get("limits") or {}
                requests = (c.get("resources") or {}).get("requests") or {}
                for r in ("cpu", "memory"):
                    if r not in limits:
                        problems.append(f"{cw}: no {r} limit")
                    if r not in requests:
                        problems.append(f"{cw}: no {r} request")
    return problems


def probe_problems(docs: list[Obj]) -> list[str]:
    """Every Deployment/StatefulSet container has liveness and readiness probes."""
    problems = []
    for o in docs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in o["spec"]["template"]["spec"]["containers"]:
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in c:
                    problems.append(f"{o['kind']}/{o['metadata']['name']}/{c['name']}: no {probe}")
    return problems


def image_problems(docs: list[Obj]) -> list[str]:
    """Every image names a tag or a digest, never `latest` (and so never a bare kustomize placeholder)."""
    problems = []
    for o in docs:
        for where, tpl in pod_templates(o):
            for _, c in containers(tpl["spec"]):
                image = c.get("image", "")
                if "@" in image:
                    if not re.search(r"@sha256:[a-f0-9]{64}$", image):
                        problems.append(f"{where}/{c['name']}: image {image!r} has a malformed digest")
                    continue
                last = image.rsplit("/", 1)[-1]
                if ":" not in last:
                    problems.append(f"{where}/{c['name']}: image {image!r} has no tag or digest")
                elif last.endswith(":latest"):
                    problems.append(f"{where}/{c['name']}: image {image!r} uses :latest")
    return problems


def secret_problems(docs: list[Obj], *, allow_generated: bool) -> list[str]:
    """Committed manifests carry no Secret values; a chart may generate Secrets at install (allow_generated)."""
    problems = []
    for o in by_kind(docs, "Secret"):
        if (o.get("data") or o.get("stringData")) and not allow_generated:
            problems.append(f"Secret/{o['metadata']['name']} carries data")
    return problems


def reference_problems(docs: list[Obj], *, external_secrets: set[str]) -> list[str]:
    """ConfigMaps, Secrets, ServiceAccounts and PVC claims that pods refer to exist (or are documented externals);
    every Service selects some pod template; every PDB, HPA target and NetworkPolicy selector matches something."""
    names = {(o["kind"], o["metadata"]["name"]) for o in docs}
    problems = []
    templates = [(w, t) for o in docs for w, t in pod_templates(o)]
    for where, tpl in templates:
        spec = tpl["spec"]
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in names:
            problems.append(f"{where}: ServiceAccount {sa} is not rendered")
        for _, c in containers(spec):
            for ef in c.get("envFrom") or []:
                if "configMapRef" in ef and ("ConfigMap", ef["configMapRef"]["name"]) not in names:
                    problems.append(f"{where}/{c['name']}: ConfigMap {ef['configMapRef']['name']} is not rendered")
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ("Secret", ref["name"]) not in names and ref["name"] not in external_secrets:
                    problems.append(f"{where}/{c['name']}: Secret {ref['name']} is neither rendered nor documented")
                cref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                if cref and ("ConfigMap", cref["name"]) not in names:
                    problems.append(f"{where}/{c['name']}: ConfigMap {cref['name']} is not rendered")
            mounts = {m["name"] for m in c.get("volumeMounts") or []}
            declared = {v["name"] for v in spec.get("volumes") or []}
            claims = set()
            for o in docs:
                if o["kind"] == "StatefulSet":
                    claims |= {t["metadata"]["name"] for t in o["spec"].get("volumeClaimTemplates") or []}
            for m in mounts - declared - claims:
                problems.append(f"{where}/{c['name']}: mounts undeclared volume {m}")
    pod_labels = [t.get("metadata", {}).get("labels") or {} for _, t in templates]

    def selects(selector: Obj) -> bool:
        return any(label_selector_matches(selector, labels) for labels in pod_labels)

    for o in by_kind(docs, "Service"):
        sel = o["spec"].get("selector")
        if sel and not selects({"matchLabels": sel}):
            problems.append(f"Service/{o['metadata']['name']}: selector matches no pod template")
    for o in by_kind(docs, "PodDisruptionBudget"):
        if not selects(o["spec"]["selector"]):
            problems.append(f"PodDisruptionBudget/{o['metadata']['name']}: selector matches no pod template")
    for o in by_kind(docs, "HorizontalPodAutoscaler"):
        t = o["spec"]["scaleTargetRef"]
        if (t["kind"], t["name"]) not in names:
            problems.append(f"HorizontalPodAutoscaler/{o['metadata']['name']}: target {t['kind']}/{t['name']} missing")
    for o in by_kind(docs, "NetworkPolicy"):
        if not selects(o["spec"]["podSelector"]):
            problems.append(f"NetworkPolicy/{o['metadata']['name']}: podSelector matches no pod template")
    for o in by_kind(docs, "ServiceMonitor"):
        if not any(
            label_selector_matches(o["spec"]["selector"], s["metadata"].get("labels") or {})
            for s in by_kind(docs, "Service")
        ):
            problems.append(f"ServiceMonitor/{o['metadata']['name']}: selector matches no Service")
    for o in by_kind(docs, "PodMonitor"):
        if not selects(o["spec"]["selector"]):
            problems.append(f"PodMonitor/{o['metadata']['name']}: selector matches no pod template")
        ports = {
            p.get("name")
            for _, t in templates
            if label_selector_matches(o["spec"]["selector"], t["metadata"].get("labels") or {})
            for _, c in containers(t["spec"])
            for p in c.get("ports") or []
        }
        for ep in o["spec"].get("podMetricsEndpoints") or []:
            if ep.get("port") and ep["port"] not in ports:
                problems.append(f"PodMonitor/{o['metadata']['name']}: no selected pod has a port named {ep['port']}")
    return problems


def rayservice_problems(o: Obj) -> list[str]:
    """What KubeRay's validation and the engine need beyond the schema."""
    problems = []
    where = f"RayService/{o['metadata']['name']}"
    for g in o["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        lo, n, hi = g.get("minReplicas", 0), g.get("replicas"), g.get("maxReplicas", 2**31 - 1)
        if n is None and not o["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling"):
            problems.append(f"{where}/{g['groupName']}: no replicas, and no autoscaler to set them")
        if n is not None and not lo <= n <= hi:
            problems.append(f"{where}/{g['groupName']}: replicas {n} outside [{lo}, {hi}]")
    cfg = serve_config(o)
    apps = cfg.get("applications") or []
    if len(apps) != 1:
        problems.append(f"{where}: expected one Serve application, found {len(apps)}")
    for app in apps:
        if app.get("import_path") != "preft.engine.serve_app:app_builder":
            problems.append(f"{where}: import_path is {app.get('import_path')!r}")
    http = cfg.get("http_options") or {}
    if http.get("port", 8000) != 8000 or http.get("host") != "0.0.0.0":
        problems.append(f"{where}: Serve must listen on 0.0.0.0:8000 (the serve Service and the gateway use it)")
    return problems


# -- the model: fetched by an init container into each pod that reads it ------------------------------------------

FETCH_INIT = "fetch-model"


def model_dirs_read(docs: list[Obj], o: Obj, spec: Obj) -> dict[str, str]:
    """The model directories a pod's services read, by setting: the engine's serveConfigV2 `model_dir` (RayService),
    `PREFT_*__MODEL_DIR` in its containers' env or the ConfigMaps they take whole."""
    if o["kind"] == "RayService":
        return {"serveConfigV2 model_dir": engine_args([o]).get("model_dir", "")}
    configmaps = {c["metadata"]["name"]: c.get("data") or {} for c in by_kind(docs, "ConfigMap")}
    found: dict[str, str] = {}
    for c in spec.get("containers") or []:
        for ef in c.get("envFrom") or []:
            data = configmaps.get((ef.get("configMapRef") or {}).get("name"), {})
            found |= {k: v for k, v in data.items() if k.endswith("__MODEL_DIR")}
        found |= {
            e["name"]: e["value"] for e in c.get("env") or [] if e["name"].endswith("__MODEL_DIR") and "value" in e
        }
    return found


def _arg(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command[:-1] else None


def model_fetch_problems(docs: list[Obj]) -> list[str]:
    """Where some pod fetches the model (a fetch-model init container), every pod that reads it does, the same model:
    into a `models` emptyDir with a size limit, mounted by its containers read-only at the init container's path (the
    link it makes is absolute), linked at the directory the pod's service reads; the gateway (a MODEL_DIR setting)
    fetches the tokenizer only, the engine the whole model; keys and tokens come from Secrets, never literals."""
    problems: list[str] = []
    fetching: list[tuple[str, Obj, Obj, Obj]] = []
    readers: list[str] = []
    for o in docs:
        for where, tpl in pod_templates(o):
            spec = tpl["spec"]
            volumes = {v["name"]: v for v in spec.get("volumes") or []}
            if "models" not in volumes:
                continue
            readers.append(where)
            inits = [c for c in spec.get("initContainers") or [] if c["name"] == FETCH_INIT]
            if inits:
                fetching.append((where, o, spec, inits[0]))
    if not fetching:
        return []
    fetched = {where for where, *_ in fetching}
    problems += [
        f"{where}: reads the model but has no {FETCH_INIT} init container" for where in readers if where not in fetched
    ]
    sources = set()
    for where, o, spec, init in fetching:
        w = f"{where}/init:{FETCH_INIT}"
        volume = {v["name"]: v for v in spec["volumes"]}["models"]
        if "emptyDir" not in volume or len(volume) != 2:
            problems.append(f"{where}: the models volume is not an emptyDir alone: {volume}")
        elif not (volume["emptyDir"] or {}).get("sizeLimit"):
            problems.append(f"{where}: the models emptyDir has no sizeLimit")
        mounts = [m for m in init.get("volumeMounts") or [] if m["name"] == "models"]
        if len(mounts) != 1 or mounts[0].get("readOnly"):
            problems.append(f"{w}: does not mount models writable once: {mounts}")
            continue
        root = mounts[0]["mountPath"].rstrip("/")
        for c in spec.get("containers") or []:
            for mnt in c.get("volumeMounts") or []:
                if mnt["name"] != "models":
                    continue
                if mnt["mountPath"].rstrip("/") != root or mnt.get("readOnly") is not True:
                    problems.append(
                        f"{where}/{c['name']}: mounts models at {mnt['mountPath']}, not read-only at {root}"
                    )
        command = init.get("command") or []
        if command[:4] != ["python", "-m", "preft.common.model_source", "fetch"]:
            problems.append(f"{w}: command {command} is not `python -m preft.common.model_source fetch`")
        link, cache = _arg(command, "--link"), _arg(command, "--cache-dir")
        for flag, value in (("--link", link), ("--cache-dir", cache)):
            if value is None or not value.startswith(root + "/"):
                problems.append(f"{w}: {flag} {value} is not inside the models volume ({root})")
        for setting, path in model_dirs_read(docs, o, spec).items():
            if path != link:
                problems.append(f"{where}: {setting} is {path}, the init container links {link}")
        env = {e["name"]: e for e in init.get("env") or []}
        source = (env.get("PREFT_MODEL__SOURCE") or {}).get("value")
        if not source:
            problems.append(f"{w}: no PREFT_MODEL__SOURCE value")
        sources.add(source)
        tokenizer_only = (env.get("PREFT_MODEL__TOKENIZER_ONLY") or {}).get("value", "false")
        wants = "false" if o["kind"] == "RayService" else "true"
        if tokenizer_only != wants:
            problems.append(f"{w}: PREFT_MODEL__TOKENIZER_ONLY is {tokenizer_only}, the {o['kind']} needs {wants}")
        for name, e in env.items():
            if re.search(r"ACCESS_KEY$|SECRET_KEY$|TOKEN$", name) and "secretKeyRef" not in (e.get("valueFrom") or {}):
                problems.append(f"{w}: {name} is not read from a Secret")
        images = {c.get("image") for c in spec.get("containers") or []}
        if init.get("image") not in images:
            problems.append(f"{w}: image {init.get('image')} is none of the pod's ({sorted(images)})")
    if len(sources) > 1:
        problems.append(f"the pods fetch different models: {sorted(map(str, sources))}")
    return problems


# -- settings: every PREFT_* variable names a real settings field ------------------------------------------------


def settings_env_names() -> dict[str, set[str]]:
    """The PREFT_<SERVICE>__... variable names each service's settings class reads (nested with `__`)."""
    from pydantic import BaseModel

    from preft.common.settings import RegistrySettings
    from preft.engine.settings import EngineSettings
    from preft.gateway.settings import GatewaySettings

    def walk(model: type[BaseModel], prefix: str, out: set[str]) -> None:
        for name, field in model.model_fields.items():
            env = f"{prefix}{name.upper()}"
            out.add(env)
            for ann in typing.get_args(field.annotation) or (field.annotation,):  # (an optional model's too)
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    walk(ann, env + "__", out)

    result: dict[str, set[str]] = {}
    for prefix, model in (
        ("PREFT_GATEWAY__", GatewaySettings),
        ("PREFT_REGISTRY__", RegistrySettings),
        ("PREFT_ENGINE__", EngineSettings),
    ):
        result[prefix] = set()
        walk(model, prefix, result[prefix])
    return result


def env_name_problems(docs: list[Obj]) -> list[str]:
    known = settings_env_names()
    problems = []
    names: list[tuple[str, str]] = []
    for o in by_kind(docs, "ConfigMap"):
        names += [(f"ConfigMap/{o['metadata']['name']}", k) for k in (o.get("data") or {})]
    for o in docs:
        for where, tpl in pod_templates(o):
            for _, c in containers(tpl["spec"]):
                names += [(f"{where}/{c['name']}", e["name"]) for e in c.get("env") or []]
    for where, name in names:
        for prefix, fields in known.items():
            if name.startswith(prefix) and name not in fields:
                problems.append(f"{where}: {name} is not a field of the {prefix.strip('_')} settings")
    return problems


# -- network policies --------------------------------------------------------------------------------------------


def label_selector_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        k, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(k) not in values:
            return False
        if op == "NotIn" and k in labels and labels[k] in values:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


class Peer:
    """A pod (labels, in the release's namespace) or something outside: a namespace, or an external address."""

    def __init__(self, labels: dict[str, str] | None = None, *, namespace: str | None = None, ip: str | None = None):
        self.labels = labels or {}
        self.namespace = namespace  # None = the release's namespace
        self.ip = ip


def _peer_matches(rule_peers: list[Obj] | None, peer: Peer, policy_namespace: str) -> bool:
    if not rule_peers:  # no `from`/`to`: every peer
        return True
    peer_namespace = peer.namespace or policy_namespace
    for p in rule_peers:
        if "ipBlock" in p:
            if peer.ip is not None and _in_cidr(peer.ip, p["ipBlock"]):
                return True
            continue
        if peer.ip is not None:
            continue
        ns_sel, pod_sel = p.get("namespaceSelector"), p.get("podSelector")
        if ns_sel is None:
            ns_ok = peer_namespace == policy_namespace
        else:
            ns_ok = label_selector_matches(ns_sel, {"kubernetes.io/metadata.name": peer_namespace})
        if ns_ok and (pod_sel is None or label_selector_matches(pod_sel, peer.labels)):
            return True
    return False


def _in_cidr(ip: str, block: Obj) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    if addr not in ipaddress.ip_network(block["cidr"]):
        return False
    return not any(addr in ipaddress.ip_network(e) for e in block.get("except") or [])


def _port_matches(rule_ports: list[Obj] | None, port: int, named: dict[str, int]) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        value = p.get("port")
        if value is None or value == port or (isinstance(value, str) and named.get(value) == port):
            return True
    return False


def _allowed(policies: list[Obj], direction: str, subject: dict[str, str], peer: Peer, port: int) -> bool:
    """Whether `subject` (a pod's labels) allows `peer` on `port` in `direction` ("Ingress" or "Egress")."""
    selecting = [
        p
        for p in policies
        if label_selector_matches(p["spec"]["podSelector"], subject)
        and direction in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True  # no policy isolates this pod in this direction
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for p in selecting:
        for rule in p["spec"].get(rules_key) or []:
            if _peer_matches(rule.get(peers_key), peer, "preft") and _port_matches(rule.get("ports"), port, {}):
                return True
    return False


def flow_allowed(policies: list[Obj], src: Peer, dst: Peer, port: int) -> bool:
    """A TCP connection src -> dst:port under the rendered NetworkPolicies (pods in the release namespace are
    subject to egress and ingress policies; outside peers only to the in-namespace side)."""
    if src.namespace is None and src.ip is None and not _allowed(policies, "Egress", src.labels, dst, port):
        return False
    return not (dst.namespace is None and dst.ip is None and not _allowed(policies, "Ingress", dst.labels, src, port))


# -- PromQL ------------------------------------------------------------------------------------------------------


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (parsed by promql-parser; Grafana's $__ variables replaced first)."""
    return {name for name, _ in promql_selectors(expr) if name}


def promql_selectors(expr: str) -> list[tuple[str | None, dict[str, tuple[str, str]]]]:
    """Every vector selector of an expression: (metric name, {label: (match operator, value)}), the operator as
    PromQL writes it (=, !=, =~, !~); Grafana's $__ interval variables replaced first, its own $variables kept."""
    import promql_parser

    text = re.sub(r"\$__(rate_interval|interval|range)", "5m", expr)
    ast = promql_parser.parse(text)
    ops = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}
    selectors: list[tuple[str | None, dict[str, tuple[str, str]]]] = []

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {m.name: (ops[str(m.op).rsplit(".", 1)[-1]], m.value) for m in node.matchers.matchers}
            selectors.append((node.name, matchers))
            return
        for attr in ("expr", "lhs", "rhs", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for arg in getattr(node, "args", None) or []:
            walk(arg)

    walk(ast)
    return selectors


def declared_metric_series(kind: str | None = None) -> set[str]:
    """Series names preft exports (services/preft/common/metrics.py), with their counter/histogram suffixes; `kind`:
    only those of that type's metrics (counter, gauge, histogram)."""
    from prometheus_client.metrics import MetricWrapperBase

    import preft.common.metrics as metrics

    series: set[str] = set()
    for obj in vars(metrics).values():
        if not isinstance(obj, MetricWrapperBase):
            continue
        for family in obj.describe():
            if kind is not None and family.type != kind:
                continue
            if family.type == "histogram":
                series |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
            elif family.type == "counter":
                series.add(f"{family.name}_total")
            else:
                series.add(family.name)
    return series


# Ray's own series the rules read (Ray Serve's controller exports them; the PodMonitor keeps their names).
RAY_SERIES = frozenset({"ray_serve_deployment_replica_healthy"})


def engine_exported_series() -> set[str]:
    """Series of the engine's scrape beyond preft's own: the vLLM families the replicas copy into Ray's metrics
    (engine.ray_metrics.VLLM_METRICS, named back vllm:* by the PodMonitor), with their suffixes, and RAY_SERIES."""
    from preft.engine.ray_metrics import VLLM_METRICS

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f"{name}{s}" for name, kind in VLLM_METRICS.items() for s in suffixes[kind]} | RAY_SERIES


def engine_metric_relabelings() -> list[Obj]:
    """The engine PodMonitor's metricRelabelings, as deploy/base/monitoring/servicemonitor.yaml has them."""
    docs = load_all((DEPLOY / "base" / "monitoring" / "servicemonitor.yaml").read_text())
    return one(docs, "PodMonitor", "preft-engine")["spec"]["podMetricsEndpoints"][0]["metricRelabelings"]


def relabel(labels: dict[str, str], rules: list[Obj]) -> dict[str, str]:
    """Prometheus's relabeling of one sample's labels (`__name__` included) by `replace` rules, in order: the source
    labels' values joined by the separator, matched whole against the regex, set the target to the replacement with
    the regex's groups expanded ($1, ${1})."""
    out = dict(labels)
    for rule in rules:
        assert rule.get("action", "replace").lower() == "replace", f"relabel() models replace only: {rule}"
        value = rule.get("separator", ";").join(out.get(name, "") for name in rule.get("sourceLabels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1"))
            out[rule["targetLabel"]] = match.expand(replacement)
    return out
