"""The checks can fail: each takes a good rendered object, breaks it one way, and must report exactly that."""

from __future__ import annotations

import copy

import pytest

from tests.deploy import manifests as m


@pytest.fixture(scope="module")
def dev(kustomize_outputs):
    return kustomize_outputs["dev"]


def _get(docs, kind, name):
    return copy.deepcopy(m.one(docs, kind, name))


def test_good_objects_pass(dev):
    for kind, name in (
        ("Deployment", "preft-gateway"),
        ("RayService", "preft-engine"),
        ("ServiceMonitor", "preft-registry"),
        ("PodMonitor", "preft-gateway"),
        ("PrometheusRule", "preft"),
    ):
        assert m.schema_errors(_get(dev, kind, name)) == []


@pytest.mark.parametrize(
    ("kind", "name", "breaks", "expected"),
    [
        ("Deployment", "preft-gateway", lambda o: o["spec"].update(replica=2), "Additional properties"),
        ("Deployment", "preft-gateway", lambda o: o["spec"].pop("selector"), "'selector' is a required property"),
        (
            "Deployment",
            "preft-registry",
            lambda o: o["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"].update(port="grpc"),
            "livenessProbe/grpc/port",
        ),
        (
            "Deployment",
            "preft-gateway",
            lambda o: o["spec"]["template"]["spec"]["containers"][0].update(imagePulPolicy="Always"),
            "imagePulPolicy",
        ),
        ("Service", "preft-gateway", lambda o: o["spec"]["ports"][0].update(port="http"), "spec/ports/0/port"),
        ("NetworkPolicy", "preft-gateway", lambda o: o["spec"].update(policyType=["Ingress"]), "policyType"),
        ("HorizontalPodAutoscaler", "preft-gateway", lambda o: o["spec"].pop("maxReplicas"), "maxReplicas"),
        # RayService: the CRD schema, and the Kubernetes pod template schema it refers to
        (
            "RayService",
            "preft-engine",
            lambda o: o["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
            "headGroupSpec/rayStartParams/num-cpus",
        ),
        (
            "RayService",
            "preft-engine",
            lambda o: o["spec"]["rayClusterConfig"].pop("headGroupSpec"),
            "'headGroupSpec' is a required property",
        ),
        (
            "RayService",
            "preft-engine",
            lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replica=3),
            "Additional properties",
        ),
        (
            "RayService",
            "preft-engine",
            lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(
                imagePulPolicy="Always"
            ),
            "imagePulPolicy",
        ),
        (
            "RayService",
            "preft-engine",
            lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
                "resources"
            ].update(limits="lots"),
            "resources/limits",
        ),
        (
            "RayService",
            "preft-engine",
            lambda o: o["spec"].update(upgradeStrategy={"type": "Rolling"}),
            "upgradeStrategy/type",
        ),
        (
            "ServiceMonitor",
            "preft-registry",
            lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds"),
            "endpoints/0/interval",
        ),
        ("ServiceMonitor", "preft-registry", lambda o: o["spec"].pop("endpoints"), "'endpoints' is a required"),
        ("PodMonitor", "preft-engine", lambda o: o["spec"]["podMetricsEndpoints"][0].update(prot="metrics"), "prot"),
        (
            "PrometheusRule",
            "preft",
            lambda o: o["spec"]["groups"][1]["rules"][0].update(record="x:y"),
            "groups/1/rules/0",
        ),
        (
            "PrometheusRule",
            "preft",
            lambda o: o["spec"]["groups"][1]["rules"][0].update({"for": "10 minutes"}),
            "groups/1/rules/0/for",
        ),
    ],
)
def test_schema_rejects(dev, kind, name, breaks, expected):
    o = _get(dev, kind, name)
    breaks(o)
    errors = m.schema_errors(o)
    assert errors, f"{kind}/{name}: the broken object passed"
    assert any(expected in e for e in errors), errors


def test_unknown_kind_is_an_error():
    assert m.schema_errors({"apiVersion": "v1", "kind": "Deploymint", "metadata": {"name": "x"}})


def test_serve_config_is_checked_by_rays_schema(dev):
    o = _get(dev, "RayService", "preft-engine")
    o["spec"]["serveConfigV2"] = o["spec"]["serveConfigV2"].replace("num_replicas: 1", "num_replicas: -1")
    assert m.serve_config_errors(o)
    o["spec"]["serveConfigV2"] = "applications: [{import_path: 3}]"
    assert m.serve_config_errors(o)


def test_rayservice_replica_bounds(dev):
    o = _get(dev, "RayService", "preft-engine")
    o["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = 5
    assert any("outside" in p for p in m.rayservice_problems(o))


def test_security_checks_bite(dev):
    d = _get(dev, "Deployment", "preft-gateway")
    spec = d["spec"]["template"]["spec"]
    spec["securityContext"]["runAsNonRoot"] = False
    spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    spec["containers"][0]["securityContext"]["capabilities"] = {"add": ["NET_ADMIN"]}
    del spec["containers"][0]["resources"]["limits"]["memory"]
    spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    problems = " | ".join(m.security_problems([d]))
    for expected in (
        "runAsNonRoot is not true",
        "root filesystem is writable",
        "do not drop ALL",
        "adds capabilities",
        "no memory limit",
        "hostPath volume host",
    ):
        assert expected in problems, problems


def test_probe_image_secret_checks_bite(dev):
    d = _get(dev, "StatefulSet", "preft-redis")
    del d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert m.probe_problems([d]) == ["StatefulSet/preft-redis/redis: no readinessProbe"]
    d["spec"]["template"]["spec"]["containers"][0]["image"] = "redis:latest"
    assert "uses :latest" in m.image_problems([d])[0]
    d["spec"]["template"]["spec"]["containers"][0]["image"] = "redis"
    assert "no tag or digest" in m.image_problems([d])[0]
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "leak"}, "data": {"k": "dg=="}}
    assert m.secret_problems([secret], allow_generated=False) == ["Secret/leak carries data"]


def test_reference_checks_bite(dev):
    docs = copy.deepcopy(dev)
    gw = m.one(docs, "Deployment", "preft-gateway")
    gw["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"] = "preft-gateway-config"
    svc = m.one(docs, "Service", "preft-registry")
    svc["spec"]["selector"]["app.kubernetes.io/component"] = "regsitry"
    problems = m.reference_problems(docs, external_secrets=m.EXTERNAL_SECRETS)
    assert any("ConfigMap preft-gateway-config is not rendered" in p for p in problems), problems
    assert any("Service/preft-registry: selector matches no pod template" in p for p in problems), problems
    assert any(
        "Secret preft-s3 is neither rendered nor documented" in p
        for p in m.reference_problems(dev, external_secrets=set())
    )


def test_settings_names_are_checked(dev):
    docs = copy.deepcopy(dev)
    cm = next(o for o in m.by_kind(docs, "ConfigMap") if o["metadata"]["name"].startswith("preft-gateway-config"))
    cm["data"]["PREFT_GATEWAY__REDIS_URL"] = "redis://x"  # one underscore: pydantic-settings would ignore it
    cm["data"]["PREFT_GATEWAY__REDIS__URL"] = "redis://x"
    problems = m.env_name_problems(docs)
    assert len(problems) == 1 and "PREFT_GATEWAY__REDIS_URL" in problems[0]


def test_network_evaluator_notices_a_missing_rule(dev):
    policies = copy.deepcopy(m.by_kind(dev, "NetworkPolicy"))
    gw = {"app.kubernetes.io/name": "preft", "app.kubernetes.io/component": "gateway"}
    reg = {"app.kubernetes.io/name": "preft", "app.kubernetes.io/component": "registry"}
    assert m.flow_allowed(policies, m.Peer(gw), m.Peer(reg), 50051)
    gw_policy = next(p for p in policies if p["metadata"]["name"] == "preft-gateway")
    gw_policy["spec"]["egress"] = gw_policy["spec"]["egress"][1:]  # drop gateway -> registry
    assert not m.flow_allowed(policies, m.Peer(gw), m.Peer(reg), 50051)


def test_promql_parse_errors_surface():
    with pytest.raises(ValueError):
        m.promql_metric_names("sum(rate(preft_requests_total[5m])")
