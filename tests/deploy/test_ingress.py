"""Ingress to the gateway (issue 55, item 4): the optional Ingress and HTTPRoute route the API and its health check,
never /metrics; nginx's body limit fits the gateway's largest upload and its timeouts keep streams (SSE) and uploads
open; the NetworkPolicy admits the ingress controller's namespace, a value (chart) and a patch point (kustomize)."""

from __future__ import annotations

import pytest

from tests.deploy import manifests as m
from tests.deploy.test_networkpolicies import pod

ON = {
    "ingress": {"enabled": True, "className": "nginx", "hosts": ["api.example.com", "alt.example.com"]},
    "httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateway-system"}]},
}


@pytest.fixture(scope="module")
def routed() -> list[dict]:
    return m.helm_render(ON)


def _ingress_paths(ing: dict) -> list[tuple[str, str]]:
    return [(p["path"], p["pathType"]) for rule in ing["spec"]["rules"] for p in rule["http"]["paths"]]


def test_both_are_off_by_default(helm_outputs):
    for name in ("defaults", "values-cpu", "values-gpu"):
        assert not m.by_kind(helm_outputs[name], "HTTPRoute") and not m.by_kind(helm_outputs[name], "Ingress")


def test_the_ingress_routes_the_api_and_health_not_metrics(routed):
    (ing,) = m.by_kind(routed, "Ingress")
    assert not m.schema_errors(ing)
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert [r["host"] for r in ing["spec"]["rules"]] == ["api.example.com", "alt.example.com"]
    paths = _ingress_paths(ing)
    assert set(paths) == {("/v1", "Prefix"), ("/healthz", "Exact")}
    for path, kind in paths:
        assert not "/metrics".startswith(path) and not (kind == "Prefix" and path == "/")
    svc = m.one(routed, "Service", "preft-gateway")
    for rule in ing["spec"]["rules"]:
        for p in rule["http"]["paths"]:
            assert p["backend"]["service"]["name"] == svc["metadata"]["name"]
            assert p["backend"]["service"]["port"]["name"] in {q["name"] for q in svc["spec"]["ports"]}


def test_nginx_annotations_fit_uploads_and_streams(routed):
    (ing,) = m.by_kind(routed, "Ingress")
    a = ing["metadata"]["annotations"]
    body = a["nginx.ingress.kubernetes.io/proxy-body-size"]
    assert body.endswith("m") and int(body[:-1]) * 2**20 > 512 * 2**20  # the gateway's max_adapter_upload_bytes
    from preft.gateway.settings import GatewaySettings

    fields = GatewaySettings.model_fields
    assert int(body[:-1]) * 2**20 > max(fields["max_adapter_upload_bytes"].default, fields["files_max_bytes"].default)
    longest_wait = max(fields["registry_upload_timeout_s"].default, fields["engine_read_timeout_s"].default)
    for k in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(a[f"nginx.ingress.kubernetes.io/{k}"]) > longest_wait
    assert a["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # SSE chunks pass as they come
    assert a["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"


def test_the_body_limit_follows_the_gateway_setting_and_annotations_override():
    docs = m.helm_render(
        {
            "ingress": {"enabled": True, "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "42"}},
            "gateway": {"env": {"MAX_ADAPTER_UPLOAD_BYTES": str(2 * 2**30)}},
        }
    )
    (ing,) = m.by_kind(docs, "Ingress")
    a = ing["metadata"]["annotations"]
    assert a["nginx.ingress.kubernetes.io/proxy-body-size"] == "2049m"
    assert a["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "42"
    plain = m.helm_render({"ingress": {"enabled": True, "nginxAnnotations": False}})
    assert not m.by_kind(plain, "Ingress")[0]["metadata"].get("annotations")


def test_the_httproute_routes_the_api_and_health_not_metrics(routed):
    (route,) = m.by_kind(routed, "HTTPRoute")
    assert not m.schema_errors(route)
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateway-system"}]
    (rule,) = route["spec"]["rules"]
    matches = {(x["path"]["type"], x["path"]["value"]) for x in rule["matches"]}
    assert matches == {("PathPrefix", "/v1"), ("Exact", "/healthz")}
    assert rule["backendRefs"] == [{"name": "preft-gateway", "port": 8080}]
    assert rule["timeouts"]["request"] == "3600s"  # a stream may last; the gateway's own timeouts bound it


def test_the_httproute_needs_its_gateway():
    with pytest.raises(Exception, match=r"httpRoute\.parentRefs"):
        m.helm_render({"httpRoute": {"enabled": True}})


def test_the_schema_refuses_a_bad_httproute_timeout():
    bad = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "x"}}
    bad["spec"] = {"rules": [{"timeouts": {"request": "ten minutes"}}]}
    assert m.schema_errors(bad)


def test_the_ingress_namespace_is_a_value():
    docs = m.helm_render({"networkPolicies": {"enabled": True, "ingressNamespace": "envoy-gateway-system"}})
    policies = m.by_kind(docs, "NetworkPolicy")
    controller = m.Peer({"app": "envoy"}, namespace="envoy-gateway-system")
    assert m.flow_allowed(policies, controller, pod("gateway"), 8080)
    assert not m.flow_allowed(policies, m.Peer({}, namespace="ingress-nginx"), pod("gateway"), 8080)


# gpu-s3 is the gpu overlay with the model fetched: it takes gpu's patch point.
PATCH_POINT_OVERLAY = {"gpu-s3": "gpu"}


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_the_overlays_patch_point_sets_the_ingress_namespace(overlay, tmp_path):
    """Each overlay's patches/ingress-namespace.yaml (or that of the overlay it builds on) is where the controller's
    namespace is set: changing it there changes whom the gateway admits."""
    import shutil

    root = tmp_path / "deploy"
    shutil.copytree(m.DEPLOY, root, ignore=shutil.ignore_patterns("docker"))
    patch = root / "overlays" / PATCH_POINT_OVERLAY.get(overlay, overlay) / "patches" / "ingress-namespace.yaml"
    text = patch.read_text()
    head, tail = text.rsplit("value: ingress-nginx", 1)
    patch.write_text(head + "value: traefik" + tail)
    policies = m.by_kind(m.kustomize_build(root / "overlays" / overlay), "NetworkPolicy")
    assert m.flow_allowed(policies, m.Peer({}, namespace="traefik"), pod("gateway"), 8080)
    assert not m.flow_allowed(policies, m.Peer({}, namespace="ingress-nginx"), pod("gateway"), 8080)
