"""Ray's ports in the rendered manifests: every Ray node takes the pod IP as its address, and tenant ids label the
engine's metrics only where the NetworkPolicies keep the ports serving them (Serve's, Ray's metrics port) to the
platform (issue 53, item 6)."""

from __future__ import annotations

import pytest

from tests.deploy import manifests as m
from tests.deploy.test_networkpolicies import INGRESS, KUBERAY, PROMETHEUS, STRANGER, pod

SOURCES = ["kustomize:dev", "kustomize:gpu", *(f"helm:{n}" for n in ("defaults", "values-cpu", "values-gpu"))]


def _tenant_label(docs: list[dict]) -> bool:
    return m.engine_args(docs).get("replica", {}).get("metrics_tenant_label", False) is True


@pytest.mark.parametrize("source", [*SOURCES, "helm:all-disabled-external", "helm:all-enabled-url"])
def test_every_ray_node_takes_the_pod_ip_as_its_address(all_outputs, source):
    (rayservice,) = m.by_kind(all_outputs[source], "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["rayStartParams"]["node-ip-address"] == "$MY_POD_IP"
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        ray = group["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in ray.get("env", [])}
        assert env["MY_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


@pytest.mark.parametrize("source", [*SOURCES, "helm:all-disabled-external", "helm:all-enabled-url"])
def test_tenant_ids_label_engine_metrics_only_behind_network_policies(all_outputs, source):
    docs = all_outputs[source]
    labelled = _tenant_label(docs)
    policies = m.by_kind(docs, "NetworkPolicy")
    if not labelled:
        return
    assert m.flow_allowed(policies, PROMETHEUS, pod("engine"), 8080)
    for stranger in (STRANGER, INGRESS, KUBERAY, pod("registry"), pod("gateway")):
        assert not m.flow_allowed(policies, stranger, pod("engine"), 8080), stranger
    for stranger in (STRANGER, INGRESS, PROMETHEUS, pod("registry")):
        assert not m.flow_allowed(policies, stranger, pod("engine"), 8000), stranger


def test_the_overlays_and_the_confined_chart_label_by_tenant_and_the_open_chart_does_not(all_outputs):
    by_source = {s: _tenant_label(docs) for s, docs in all_outputs.items()}
    assert by_source["kustomize:dev"] is by_source["kustomize:gpu"] is True
    assert by_source["helm:all-enabled-url"] is True
    assert by_source["helm:defaults"] is by_source["helm:all-disabled-external"] is False


def test_the_chart_refuses_tenant_labels_without_network_policies():
    with pytest.raises(Exception, match=r"metricsTenantLabel needs networkPolicies\.enabled"):
        m.helm_render({"engine": {"metricsTenantLabel": True}, "networkPolicies": {"enabled": False}})
