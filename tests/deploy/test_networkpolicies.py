"""The rendered NetworkPolicies, evaluated: the flows preft needs are open, the others closed.

A small evaluator (tests/deploy/manifests.py: flow_allowed) applies Kubernetes NetworkPolicy semantics — a pod
selected by a policy for a direction is isolated in that direction and admits only what some rule allows; a
connection needs the source's egress and the destination's ingress — to pods labelled as the manifests label them.
"""

from __future__ import annotations

import pytest

from tests.deploy import manifests as m

Peer = m.Peer


def pod(component: str, instance: str = "preft") -> Peer:
    return Peer(
        {
            "app.kubernetes.io/name": "preft",
            "app.kubernetes.io/instance": instance,
            "app.kubernetes.io/component": component,
        }
    )


INGRESS = Peer({"app.kubernetes.io/name": "ingress-nginx"}, namespace="ingress-nginx")
PROMETHEUS = Peer({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
KUBERAY = Peer({"app.kubernetes.io/name": "kuberay-operator"}, namespace="ray-system")
STRANGER = Peer({"app": "something"}, namespace="default")
DNS = Peer({"k8s-app": "kube-dns"}, namespace="kube-system")
INTERNET = Peer(ip="203.0.113.7")

NEEDED = [
    (INGRESS, pod("gateway"), 8080),
    (pod("gateway"), pod("registry"), 50051),
    (pod("gateway"), pod("engine"), 8000),
    (pod("engine"), pod("registry"), 50051),  # (the reader token: the Hot ranking for prefetch)
    (pod("engine"), pod("engine"), 6379),  # Ray GCS
    (pod("engine"), pod("engine"), 12345),  # Ray workers' ports
    (KUBERAY, pod("engine"), 8265),
    (PROMETHEUS, pod("gateway"), 9101),  # the gateway's /metrics
    (PROMETHEUS, pod("engine"), 8080),
    (PROMETHEUS, pod("registry"), 9102),  # the registry's /metrics
    (pod("gateway"), DNS, 53),
    (pod("engine"), DNS, 53),
]
IN_CLUSTER_STORES = [
    (pod("gateway"), pod("redis"), 6379),
    (pod("registry"), pod("redis"), 6379),
    (pod("engine"), pod("redis"), 6379),
    (pod("gateway"), pod("seaweedfs"), 8333),  # (the Files and Batch APIs)
    (pod("registry"), pod("seaweedfs"), 8333),
    (pod("engine"), pod("seaweedfs"), 8333),
]
EXTERNAL_STORES = [
    (pod("gateway"), INTERNET, 443),
    (pod("registry"), INTERNET, 443),
    (pod("engine"), INTERNET, 443),
    (pod("gateway"), INTERNET, 6380),
    (pod("registry"), INTERNET, 6380),
    (pod("engine"), INTERNET, 6379),
]
FORBIDDEN = [
    (STRANGER, pod("gateway"), 8080),
    (INGRESS, pod("registry"), 50051),
    (INGRESS, pod("engine"), 8000),
    (STRANGER, pod("engine"), 8265),
    (pod("redis"), pod("seaweedfs"), 8333),
    (pod("registry"), pod("engine"), 8000),
    (pod("redis"), pod("engine"), 8000),  # only the gateway spends the engine (beside its token)
    (pod("seaweedfs"), pod("engine"), 8000),
    (STRANGER, pod("seaweedfs"), 8333),
    (pod("gateway"), pod("seaweedfs"), 9333),  # SeaweedFS's master, volume and filer: in the pod only
    (pod("engine"), pod("seaweedfs"), 8080),
    (pod("registry"), pod("seaweedfs"), 8888),
    (pod("gateway"), pod("engine"), 8265),  # the Ray dashboard is not the gateway's business
    (pod("registry"), INTERNET, 22),
    (pod("redis"), INTERNET, 443),
    (PROMETHEUS, pod("registry"), 50051),
    # Ray's metrics port serves the engine's tenant-labelled metrics: Prometheus' alone
    (STRANGER, pod("engine"), 8080),
    (INGRESS, pod("engine"), 8080),
    (pod("gateway"), pod("engine"), 8080),
    (pod("registry"), pod("engine"), 8080),
    # the registry's metrics port: Prometheus' alone
    (STRANGER, pod("registry"), 9102),
    (INGRESS, pod("registry"), 9102),
    (pod("gateway"), pod("registry"), 9102),
    # the gateway's metrics port: Prometheus' alone (and Prometheus reaches no other port of the gateway)
    (STRANGER, pod("gateway"), 9101),
    (INGRESS, pod("gateway"), 9101),
    (PROMETHEUS, pod("gateway"), 8080),
]


def _check(policies, flows, expect):
    wrong = [
        f"{s.labels or s.ip} -> {d.labels or d.ip}:{port}"
        for s, d, port in flows
        if m.flow_allowed(policies, s, d, port) != expect
    ]
    return wrong


@pytest.mark.parametrize(
    ("source", "stores"),
    [
        ("kustomize:dev", "in-cluster"),
        ("kustomize:gpu", "external"),
        ("helm:values-cpu", "in-cluster"),
        ("helm:values-gpu", "external"),
        ("helm:all-enabled-url", "external"),
    ],
)
def test_flows(all_outputs, source, stores):
    policies = m.by_kind(all_outputs[source], "NetworkPolicy")
    needed = NEEDED + (IN_CLUSTER_STORES if stores == "in-cluster" else EXTERNAL_STORES)
    forbidden = FORBIDDEN + (EXTERNAL_STORES if stores == "in-cluster" else [])
    assert not (closed := _check(policies, needed, True)), f"needed but blocked: {closed}"
    assert not (opened := _check(policies, forbidden, False)), f"forbidden but allowed: {opened}"


def test_another_release_is_isolated(helm_outputs):
    """The chart's policies select by release: pods of another release in the namespace get nothing from them."""
    policies = m.by_kind(helm_outputs["values-cpu"], "NetworkPolicy")
    assert not m.flow_allowed(policies, pod("gateway", "other"), pod("registry"), 50051)
    assert not m.flow_allowed(policies, pod("engine", "other"), pod("redis"), 6379)


def test_evaluator_sees_no_isolation_without_policies():
    assert m.flow_allowed([], STRANGER, pod("registry"), 50051)
