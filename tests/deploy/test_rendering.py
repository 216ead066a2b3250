"""Every overlay and every chart value set renders, with the real kustomize and the real Helm engine, into objects
that pass the Kubernetes schemas (strict) and the CRD schemas, and whose references hold together."""

from __future__ import annotations

import pytest

from tests.deploy import manifests as m
from tests.deploy.conftest import HELM_SCENARIOS

SOURCES = [f"kustomize:{o}" for o in m.OVERLAYS] + [f"helm:{s}" for s in HELM_SCENARIOS]


def test_kustomize_is_the_real_one():
    version = m.kustomize_version()
    assert version.startswith("v5."), f"expected kubectl's bundled Kustomize v5, got {version}"


def test_helm_engine_is_the_real_one():
    import helm_python

    assert helm_python.helm_sdk_version().startswith("v4."), helm_python.helm_sdk_version()


@pytest.mark.parametrize("source", SOURCES)
def test_objects_pass_kubernetes_and_crd_schemas(all_outputs, source):
    docs = all_outputs[source]
    assert docs, f"{source} rendered nothing"
    problems = [p for o in docs for p in m.schema_errors(o)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", SOURCES)
def test_references_resolve(all_outputs, source):
    external = m.EXTERNAL_SECRETS | {"ops-redis", "ops-redis-acl", "ops-s3", "ops-registry", "ops-engine"}
    problems = m.reference_problems(all_outputs[source], external_secrets=external)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", SOURCES)
def test_rayservice_is_consistent(all_outputs, source):
    (ray,) = m.by_kind(all_outputs[source], "RayService")
    problems = m.rayservice_problems(ray) + m.serve_config_errors(ray)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", SOURCES)
def test_every_preft_variable_is_a_settings_field(all_outputs, source):
    problems = m.env_name_problems(all_outputs[source])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", SOURCES)
def test_names_are_unique(all_outputs, source):
    keys = [m.key(o) for o in all_outputs[source]]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_kustomize_namespace_and_labels(kustomize_outputs):
    for overlay, docs in kustomize_outputs.items():
        for o in docs:
            if o["kind"] != "Namespace":
                assert o["metadata"].get("namespace") == "preft", f"{overlay}: {m.key(o)} not in namespace preft"
            labels = o["metadata"].get("labels") or {}
            assert labels.get("app.kubernetes.io/part-of") == "preft-serve", f"{overlay}: {m.key(o)} labels {labels}"


def test_helm_labels_come_from_helpers(helm_outputs):
    for scenario, docs in helm_outputs.items():
        for o in docs:
            labels = o["metadata"].get("labels") or {}
            for k in (
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/managed-by",
                "helm.sh/chart",
                "app.kubernetes.io/version",
            ):
                assert k in labels, f"{scenario}: {m.key(o)} lacks label {k}"


def test_overlays_differ_where_they_should(kustomize_outputs):
    dev, gpu = kustomize_outputs["dev"], kustomize_outputs["gpu"]
    assert {m.key(o) for o in m.by_kind(dev, "StatefulSet")} == {
        ("StatefulSet", "preft-redis"),
        ("StatefulSet", "preft-seaweedfs"),
    }
    assert not m.by_kind(gpu, "StatefulSet"), "gpu uses external Redis and S3"
    dev_ray, gpu_ray = m.one(dev, "RayService", "preft-engine"), m.one(gpu, "RayService", "preft-engine")
    gpu_worker = gpu_ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    dev_worker = dev_ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert gpu_worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu_worker["rayStartParams"]["num-gpus"] == "1"
    assert "nvidia.com/gpu" not in dev_worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert dev_worker["template"]["spec"]["containers"][0]["image"].endswith(":0.1.0-cpu")
    assert gpu_worker["template"]["spec"]["containers"][0]["image"].endswith(":0.1.0-gpu")
    # dev generates the tiny model; gpu mounts the model PVC
    dev_models = {v["name"]: v for v in dev_worker["template"]["spec"]["volumes"]}["models"]
    gpu_models = {v["name"]: v for v in gpu_worker["template"]["spec"]["volumes"]}["models"]
    assert "emptyDir" in dev_models and "persistentVolumeClaim" not in dev_models
    assert gpu_models["persistentVolumeClaim"]["claimName"] == "preft-models"
    assert [c["name"] for c in dev_worker["template"]["spec"]["initContainers"]] == ["tiny-model"]
    # gpu reads the Redis URL from its Secret, everywhere
    for o in [*m.by_kind(gpu, "Deployment"), gpu_ray]:
        for where, tpl in m.pod_templates(o):
            env = {e["name"]: e for c in tpl["spec"]["containers"] for e in c.get("env") or []}
            redis = [e for n, e in env.items() if n.endswith("REDIS__URL")]
            assert redis and redis[0]["valueFrom"]["secretKeyRef"]["name"] == "preft-redis", where
    (deployment,) = m.serve_config(gpu_ray)["applications"][0]["deployments"]
    assert deployment["autoscaling_config"]["min_replicas"] == 2 and "num_replicas" not in deployment
    assert "replicas" not in gpu_worker, "Ray's autoscaler owns the gpu workers' count"
    assert m.serve_config(dev_ray)["applications"][0]["deployments"][0]["num_replicas"] == 1


@pytest.mark.parametrize("source", SOURCES)
def test_the_ray_pods_take_no_configmap_and_no_checksum(all_outputs, source):
    """The engine's settings are serveConfigV2's args: no ConfigMap (kustomize's would carry a content hash in its
    name) and no checksum annotation in the Ray pod templates, whose change would replace the Ray cluster."""
    (ray,) = m.by_kind(all_outputs[source], "RayService")
    for where, tpl in m.pod_templates(ray):
        assert not [a for a in (tpl["metadata"].get("annotations") or {}) if a.startswith("checksum/")], where
        for _, c in m.containers(tpl["spec"]):
            assert not c.get("envFrom"), f"{where}/{c['name']}: envFrom {c['envFrom']}"
            assert not [e for e in c.get("env") or [] if "configMapKeyRef" in (e.get("valueFrom") or {})], where
    assert not [o for o in m.by_kind(all_outputs[source], "ConfigMap") if "engine" in o["metadata"]["name"]]


# The chart and the overlays describe the same system: same workloads, Services, ConfigMaps and monitoring objects.
COMPARED_KINDS = {
    "Deployment",
    "StatefulSet",
    "Service",
    "ServiceAccount",
    "RayService",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
}


def _comparable(docs):
    out = set()
    for o in docs:
        kind, name = m.key(o)
        if kind in COMPARED_KINDS or kind == "ConfigMap":
            if kind == "ConfigMap" and "-config-" in name:
                name = name.rsplit("-", 1)[0]  # kustomize's hash suffix
            out.add((kind, name))
    return out


@pytest.mark.parametrize(
    ("overlay", "scenario"), [("gpu", "values-gpu"), ("gpu-s3", "values-gpu"), ("dev", "values-cpu")]
)
def test_chart_renders_the_same_objects_as_the_overlay(kustomize_outputs, helm_outputs, overlay, scenario):
    kust, chart = _comparable(kustomize_outputs[overlay]), _comparable(helm_outputs[scenario])
    if scenario == "values-cpu":  # the CPU preset leaves monitoring and the HPA off (no CRDs assumed on dev clusters)
        kust -= {
            k for k in kust if k[0] in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "HorizontalPodAutoscaler")
        }
        kust.discard(("ConfigMap", "preft-grafana-dashboard"))
    assert kust == chart, f"only in kustomize: {sorted(kust - chart)}; only in the chart: {sorted(chart - kust)}"


def test_chart_and_overlays_share_rules_and_dashboard(kustomize_outputs, helm_outputs):
    k_rule = m.one(kustomize_outputs["gpu"], "PrometheusRule", "preft")["spec"]
    h_rule = m.one(helm_outputs["values-gpu"], "PrometheusRule", "preft")["spec"]
    assert k_rule == h_rule
    k_dash = m.one(kustomize_outputs["gpu"], "ConfigMap", "preft-grafana-dashboard")["data"]
    h_dash = m.one(helm_outputs["values-gpu"], "ConfigMap", "preft-grafana-dashboard")["data"]
    assert k_dash == h_dash
    assert (m.CHART / "dashboards" / "preft-serve.json").read_text() == (
        m.DEPLOY / "base" / "monitoring" / "dashboards" / "preft-serve.json"
    ).read_text()


def _acl_script_lines(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if line.strip().startswith("user ")]


def test_the_dev_redis_has_the_codes_acl_users_and_each_service_its_own(kustomize_outputs):
    from preft.common.redis_acl import ADMIN_USER, SERVICES, acl_lines

    docs = kustomize_outputs["dev"]
    (redis,) = m.one(docs, "StatefulSet", "preft-redis")["spec"]["template"]["spec"]["containers"]
    placeholders = {user: f"${{REDIS_PASSWORD_{user.upper()}}}" for user in (ADMIN_USER, *SERVICES)}
    assert _acl_script_lines(redis["args"][0]) == acl_lines(placeholders)
    assert "--aclfile /run/redis/users.acl" in redis["args"][0]
    for name in kustomize_outputs:
        for kind, obj, prefix, user in (
            ("Deployment", "preft-gateway", "PREFT_GATEWAY__", "gateway"),
            ("Deployment", "preft-registry", "PREFT_REGISTRY__", "registry"),
        ):
            (c,) = m.one(kustomize_outputs[name], kind, obj)["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e for e in c["env"]}
            assert env[f"{prefix}REDIS__USERNAME"]["value"] == user
            ref = env[f"{prefix}REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "preft-redis-acl", "key": user}
