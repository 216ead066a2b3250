"""Rendered manifests, built once per session: every kustomize overlay and the chart under its value sets."""

from __future__ import annotations

import pytest

from tests.deploy import manifests as m

# The chart's value sets under test: defaults, the two presets, and non-defaults exercising every switch.
HELM_SCENARIOS: dict[str, dict] = {
    "defaults": {},
    "values-cpu": m.helm_values_file("values-cpu.yaml"),
    "values-gpu": m.helm_values_file("values-gpu.yaml"),
    # every optional part off, Redis and S3 external through existing Secrets, the model on a PVC
    "all-disabled-external": {
        "redis": {"enabled": False, "auth": {"existingSecret": "ops-redis-acl"}},
        "seaweedfs": {"enabled": False},
        "monitoring": {"enabled": False},
        "networkPolicies": {"enabled": False},
        "hpa": {"enabled": False},
        "pdb": {"enabled": False},
        "externalRedis": {"existingSecret": "ops-redis", "existingSecretKey": "redis-url"},
        "s3": {
            "existingSecret": "ops-s3",
            "existingSecretAccessKeyKey": "id",
            "existingSecretSecretKeyKey": "key",
            "endpointUrl": "https://s3.eu-west-1.amazonaws.com",
        },
        "registry": {
            "auth": {
                "existingSecret": "ops-registry",
                "existingSecretKey": "token",
                "existingSecretGatewayTokenKey": "gw",
                "existingSecretReaderTokenKey": "ro",
            }
        },
        "engine": {
            "auth": {"existingSecret": "ops-engine", "existingSecretKey": "shared"},
            "gcsFaultTolerance": {"enabled": False},
            "workers": {"pdb": {"enabled": False}},
        },
        "model": {"source": "pvc", "existingClaim": "llama-8b", "path": "llama-3-8b"},
    },
    # everything on, external Redis by URL (a chart Secret), S3 by IRSA (no keys), a digest-pinned engine image
    "all-enabled-url": {
        "redis": {"enabled": False},
        "seaweedfs": {"enabled": False},
        "monitoring": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "networkPolicies": {"enabled": True},
        "hpa": {"enabled": True},
        "pdb": {"enabled": True},
        "externalRedis": {"url": "rediss://:pw@redis.internal:6380/0"},
        "image": {"engine": {"digest": "sha256:" + "ab" * 32}},
        "engine": {
            "workers": {"gpus": 2, "replicas": 2},
            "gpusPerReplica": 1,
            "metricsTenantLabel": True,
            "serve": {"autoscaling": {"enabled": True}},
        },
        "ingress": {"enabled": True, "className": "nginx", "hosts": ["api.example.com"]},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateway-system"}]},
    },
}


@pytest.fixture(scope="session")
def kustomize_outputs() -> dict[str, list[dict]]:
    try:
        return {name: m.kustomize_build(m.DEPLOY / "overlays" / name) for name in m.OVERLAYS}
    except m.RenderError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def helm_outputs() -> dict[str, list[dict]]:
    return {name: m.helm_render(values) for name, values in HELM_SCENARIOS.items()}


@pytest.fixture(scope="session")
def all_outputs(kustomize_outputs, helm_outputs) -> dict[str, list[dict]]:
    return {
        **{f"kustomize:{k}": v for k, v in kustomize_outputs.items()},
        **{f"helm:{k}": v for k, v in helm_outputs.items()},
    }
