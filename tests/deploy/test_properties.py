"""Properties every rendering must have: no committed secret values, non-root pods with limits, probes on every
workload, pinned images, NetworkPolicies present when enabled."""

from __future__ import annotations

import pytest

from tests.deploy import manifests as m
from tests.deploy.conftest import HELM_SCENARIOS

SOURCES = [f"kustomize:{o}" for o in m.OVERLAYS] + [f"helm:{s}" for s in HELM_SCENARIOS]


@pytest.mark.parametrize("source", SOURCES)
def test_pods_are_non_root_restricted_and_limited(all_outputs, source):
    problems = m.security_problems(all_outputs[source])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", SOURCES)
def test_every_workload_has_probes(all_outputs, source):
    problems = m.probe_problems(all_outputs[source])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", SOURCES)
def test_images_are_pinned(all_outputs, source):
    problems = m.image_problems(all_outputs[source])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_kustomize_commits_no_secret(kustomize_outputs, overlay):
    docs = kustomize_outputs[overlay]
    assert not m.by_kind(docs, "Secret"), "Secrets are created out of band (deploy/secrets.example.env)"
    assert not m.secret_problems(docs, allow_generated=False)


def test_no_secret_values_in_the_repository_files():
    """The kustomize sources define no Secret and no secretGenerator; the chart's values hold no secret defaults."""
    import yaml

    for path in m.DEPLOY.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict):
                assert doc.get("kind") != "Secret", f"{path} defines a Secret"
                assert "secretGenerator" not in doc, f"{path} has a secretGenerator"
    for name in ("values.yaml", "values-cpu.yaml", "values-gpu.yaml"):
        values = m.helm_values_file(name)
        assert not values.get("registry", {}).get("auth", {}).get("adminToken"), name
        assert not values.get("s3", {}).get("accessKey") and not values.get("s3", {}).get("secretKey"), name
        assert not values.get("externalRedis", {}).get("url"), name


@pytest.mark.parametrize("source", SOURCES)
def test_registry_uses_grpc_probes_and_gateway_http_probes(all_outputs, source):
    docs = all_outputs[source]
    reg = next(o for o in m.by_kind(docs, "Deployment") if o["metadata"]["name"].endswith("-registry"))
    gw = next(o for o in m.by_kind(docs, "Deployment") if o["metadata"]["name"].endswith("-gateway"))
    (rc,) = reg["spec"]["template"]["spec"]["containers"]
    (gc,) = gw["spec"]["template"]["spec"]["containers"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert rc[probe]["grpc"]["service"] == "preft.api.v1.Registry"
    assert gc["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gc["readinessProbe"]["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize("source", [*(f"kustomize:{o}" for o in m.OVERLAYS), "helm:values-cpu", "helm:values-gpu"])
def test_network_policies_exist_with_default_deny(all_outputs, source):
    policies = m.by_kind(all_outputs[source], "NetworkPolicy")
    assert policies
    deny = [
        p
        for p in policies
        if not p["spec"].get("ingress")
        and not p["spec"].get("egress")
        and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ]
    assert deny, "no default-deny policy"
