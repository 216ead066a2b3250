"""`preft-admin cluster` against a Kubernetes API on 127.0.0.1 (tests/deploy/fake_apiserver.py), reached the way a real
cluster is: a kubeconfig, the official client's DynamicClient (discovery, server-side apply, JSON patch) over HTTP."""

from __future__ import annotations

import json
import tempfile

import pytest
import typer
import yaml
from typer.testing import CliRunner

from preft.cli import cluster as cli
from preft.cli import kube
from tests.deploy import manifests as m
from tests.deploy.fake_apiserver import CORE, KUBERAY, FakeApiServer

runner = CliRunner()


@pytest.fixture
def api():
    with FakeApiServer(rollout_polls=2) as server:
        yield server


@pytest.fixture
def kubeconfig(api, tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(api.kubeconfig())
    return path


@pytest.fixture(autouse=True)
def _own_discovery_cache(tmp_path, monkeypatch):
    """The client caches discovery in the temp dir, keyed by server URL; a later test's server may reuse a port."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def invoke(kubeconfig, tmp_path, *args: str):
    return runner.invoke(cli.cluster_app, ["--kubeconfig", str(kubeconfig), *args])


def apply_dev(kubeconfig, tmp_path, *extra: str):
    return invoke(
        kubeconfig,
        tmp_path,
        "apply",
        "--overlay",
        "dev",
        "--deploy-dir",
        str(m.DEPLOY),
        "--poll-s",
        "0.01",
        "--timeout-s",
        "20",
        *extra,
    )


def test_apply_overlay_server_side_applies_everything_and_waits(api, kubeconfig, tmp_path):
    result = apply_dev(kubeconfig, tmp_path)
    assert result.exit_code == 0, result.output
    rendered = m.kustomize_build(m.DEPLOY / "overlays" / "dev")
    for o in rendered:
        stored = api.find(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))
        assert stored is not None, f"{m.key(o)} not applied"
        for field in ("spec", "data"):
            assert stored.get(field) == o.get(field), f"{m.key(o)}: {field} differs from the rendered object"
        assert {k: v for k, v in stored["metadata"]["managedFields"][0].items() if k != "fieldsV1"} == {
            "manager": "preft-admin",
            "operation": "Apply",
            "apiVersion": o["apiVersion"],
            "fieldsType": "FieldsV1",
        }
    patches = [r for r in api.requests if r["method"] == "PATCH"]
    assert len(patches) == len(rendered)
    assert all(r["content_type"] == "application/apply-patch+yaml" for r in patches)
    assert all(r["query"]["fieldManager"] == "preft-admin" and r["query"]["force"] == "true" for r in patches)
    assert patches[0]["path"] == "/api/v1/namespaces/preft"  # the Namespace before what lives in it
    assert patches[-1]["path"].startswith("/apis/monitoring.coreos.com/")
    # it waited: every workload was polled until the toy controller reported it rolled out
    polled = {r["path"] for r in api.requests if r["method"] == "GET" and "/deployments/" in r["path"]}
    assert polled == {
        "/apis/apps/v1/namespaces/preft/deployments/preft-gateway",
        "/apis/apps/v1/namespaces/preft/deployments/preft-registry",
    }
    assert "rolled out" in result.output
    assert api.find("RayService", "preft-engine")["status"]["conditions"][0]["status"] == "True"


def test_apply_is_idempotent(api, kubeconfig, tmp_path):
    assert apply_dev(kubeconfig, tmp_path).exit_code == 0
    before = {k: (o["metadata"]["generation"], o["metadata"]["resourceVersion"]) for k, o in api.objects.items()}
    assert apply_dev(kubeconfig, tmp_path, "--no-wait").exit_code == 0
    after = {k: (o["metadata"]["generation"], o["metadata"]["resourceVersion"]) for k, o in api.objects.items()}
    assert before == after


def test_dry_run_stores_nothing(api, kubeconfig, tmp_path):
    result = apply_dev(kubeconfig, tmp_path, "--dry-run")
    assert result.exit_code == 0, result.output
    assert api.objects == {}
    assert all(r["query"].get("dryRun") == "All" for r in api.requests if r["method"] == "PATCH")
    assert "validated (dry run)" in result.output


def test_missing_crds_fail_before_anything_is_applied(tmp_path):
    with FakeApiServer(resources=CORE + KUBERAY) as api:  # no prometheus-operator
        path = tmp_path / "kubeconfig"
        path.write_text(api.kubeconfig())
        result = apply_dev(path, tmp_path)
        assert result.exit_code == 1
        assert "no ServiceMonitor in monitoring.coreos.com/v1 (install the prometheus-operator CRDs)" in result.output
        assert api.objects == {}


def test_rollout_timeout_is_exit_1(tmp_path):
    with FakeApiServer(rollout_polls=10**9) as api:
        path = tmp_path / "kubeconfig"
        path.write_text(api.kubeconfig())
        result = invoke(
            path,
            tmp_path,
            "apply",
            "--overlay",
            "dev",
            "--deploy-dir",
            str(m.DEPLOY),
            "--poll-s",
            "0.01",
            "--timeout-s",
            "0.3",
        )
        assert result.exit_code == 1
        assert "timed out" in result.output and "0/1 updated" in result.output


def test_apply_rendered_chart_into_the_chosen_namespace(api, kubeconfig, tmp_path):
    docs = m.helm_render(m.helm_values_file("values-gpu.yaml"), release="serving", namespace="llm")
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    result = invoke(
        kubeconfig,
        tmp_path,
        "--namespace",
        "llm",
        "--engine",
        "serving-preft-engine",
        "--json",
        "apply",
        "-f",
        str(manifest),
        "--poll-s",
        "0.01",
        "--timeout-s",
        "20",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ready"] is True and len(report["applied"]) == len(docs)
    assert api.find("RayService", "serving-preft-engine", "llm") is not None
    assert (
        api.find("Deployment", "serving-preft-gateway", "llm")["spec"]
        == m.one(docs, "Deployment", "serving-preft-gateway")["spec"]
    )


def test_usage_errors_are_exit_2(kubeconfig, tmp_path):
    assert invoke(kubeconfig, tmp_path, "apply").exit_code == 2
    result = invoke(kubeconfig, tmp_path, "apply", "--overlay", "nope", "--deploy-dir", str(m.DEPLOY))
    assert result.exit_code == 2 and "no kustomization.yaml" in result.output


def test_status_before_and_after_rollout(api, kubeconfig, tmp_path):
    assert apply_dev(kubeconfig, tmp_path, "--no-wait").exit_code == 0
    first = invoke(kubeconfig, tmp_path, "--json", "status")
    assert first.exit_code == 1  # the toy controller needs a few polls
    report = json.loads(first.output)
    assert report["ready"] is False
    for _ in range(3):
        result = invoke(kubeconfig, tmp_path, "--json", "status")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {(w["kind"], w["name"]) for w in report["workloads"]} == {
        ("Deployment", "preft-gateway"),
        ("Deployment", "preft-registry"),
        ("StatefulSet", "preft-redis"),
        ("StatefulSet", "preft-seaweedfs"),
    }
    engine = report["engine"]
    assert engine["ready"] is True and engine["serve_endpoints"] == 2
    assert engine["applications"] == {"preft-engine": "RUNNING"}
    assert engine["deployments"] == {"preft-engine/PreftEngine": "HEALTHY"}
    assert engine["num_replicas"] == {"preft-engine/PreftEngine": 1}
    assert engine["worker_groups"] == [{"groupName": "cpu-workers", "replicas": 1, "minReplicas": 1, "maxReplicas": 2}]
    assert report["residency"] is None
    table = invoke(kubeconfig, tmp_path, "status")
    assert table.exit_code == 0
    assert "worker group cpu-workers" in table.output and "pass --redis-url" in table.output


def test_status_shows_adapters_per_replica_from_redis(api, kubeconfig, tmp_path):
    from preft.stack import RedisServer, free_port
    from preft.stack.servers import ServerError

    try:
        server = RedisServer(tmp_path / "redis", free_port(), persist=False).start()
    except ServerError as e:
        pytest.skip(f"no redis-server: {e}")
    try:
        import redis

        r = redis.Redis.from_url(server.url)
        r.sadd("preft:residency:replica-a", "sha256:" + "a" * 64, "sha256:" + "b" * 64)
        r.sadd("preft:residency:replica-b", "sha256:" + "c" * 64)
        r.set("preft:other", "x")
        assert apply_dev(kubeconfig, tmp_path).exit_code == 0
        result = invoke(kubeconfig, tmp_path, "--json", "status", "--redis-url", server.url)
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["residency"] == {
            "replica-a": ["sha256:" + "a" * 64, "sha256:" + "b" * 64],
            "replica-b": ["sha256:" + "c" * 64],
        }
        table = invoke(kubeconfig, tmp_path, "status", "--redis-url", server.url)
        assert "replica-a" in table.output and "aaaaaaaaaaaa" in table.output
    finally:
        server.stop()


def test_status_survives_an_unreachable_redis(api, kubeconfig, tmp_path):
    from preft.stack import free_port

    assert apply_dev(kubeconfig, tmp_path).exit_code == 0
    result = invoke(kubeconfig, tmp_path, "status", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert result.exit_code == 0
    assert "Redis not reachable" in result.output


def test_scale_engine_patches_serve_config_and_workers(api, kubeconfig, tmp_path):
    assert apply_dev(kubeconfig, tmp_path).exit_code == 0
    result = invoke(
        kubeconfig,
        tmp_path,
        "scale",
        "engine",
        "2",
        "--workers",
        "2",
        "--wait",
        "--poll-s",
        "0.01",
        "--timeout-s",
        "20",
    )
    assert result.exit_code == 0, result.output
    ray = api.find("RayService", "preft-engine")
    config = yaml.safe_load(ray["spec"]["serveConfigV2"])
    assert config["applications"][0]["deployments"] == [{"name": "PreftEngine", "num_replicas": 2}]
    assert config["applications"][0]["import_path"] == "preft.engine.serve_app:app_builder"  # the rest untouched
    assert ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 2
    (patch,) = [r for r in api.requests if r["method"] == "PATCH" and r["content_type"].startswith("application/json")]
    assert patch["content_type"] == "application/json-patch+json"
    assert m.schema_errors(ray | {"status": {}}) == []  # still a valid RayService
    assert "num_replicas preft-engine/PreftEngine=2" in result.output


def test_scale_refuses_a_concurrent_change(api, kubeconfig, tmp_path):
    assert apply_dev(kubeconfig, tmp_path).exit_code == 0

    def someone_else_edits(server, current):
        current["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 100)
        server.before_patch = None

    api.before_patch = someone_else_edits
    result = invoke(kubeconfig, tmp_path, "scale", "engine", "3")
    assert result.exit_code == 1
    assert "422" in result.output and "testing value /metadata/resourceVersion failed" in result.output
    config = yaml.safe_load(api.find("RayService", "preft-engine")["spec"]["serveConfigV2"])
    assert config["applications"][0]["deployments"][0]["num_replicas"] == 1


def test_scale_usage_errors(api, kubeconfig, tmp_path):
    assert apply_dev(kubeconfig, tmp_path).exit_code == 0
    result = invoke(kubeconfig, tmp_path, "scale", "engine", "2", "--workers", "9")
    assert result.exit_code == 2 and "allows 1..2 workers" in result.output
    result = invoke(kubeconfig, tmp_path, "scale", "engine", "2", "--deployment", "Other")
    assert result.exit_code == 2 and "pass --deployment" in result.output
    assert invoke(kubeconfig, tmp_path, "scale", "engine", "0").exit_code == 2  # typer's min=1
    result = invoke(kubeconfig, tmp_path, "--engine", "missing", "scale", "engine", "2")
    assert result.exit_code == 1 and "RayService preft/missing not found" in result.output


def test_wrong_credentials_are_exit_1(api, tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(api.kubeconfig().replace(api.token, "wrong"))
    result = invoke(path, tmp_path, "status")
    assert result.exit_code == 1
    assert "cannot reach the Kubernetes API" in result.output or "401" in result.output


def test_rollout_rules():
    dep = {
        "kind": "Deployment",
        "metadata": {"name": "d", "generation": 3},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 2},
    }
    assert kube.rollout_of(dep).detail == "waiting for the controller to see the new spec"
    dep["status"] = {"observedGeneration": 3, "replicas": 3, "updatedReplicas": 2, "availableReplicas": 2}
    assert kube.rollout_of(dep).detail == "1 old replicas pending termination"
    dep["status"]["replicas"] = 2
    assert kube.rollout_of(dep).ready
    old_kuberay = {
        "kind": "RayService",
        "metadata": {"name": "e", "generation": 1},
        "spec": {},
        "status": {"serviceStatus": "Running"},
    }
    assert kube.rollout_of(old_kuberay).ready


def test_mounts_under_a_parent_app_with_global_json(api, kubeconfig, tmp_path):
    """As preft-admin will mount it (`app.add_typer(cluster_app, name="cluster")`), `--json` on the parent counts."""
    from dataclasses import dataclass

    @dataclass
    class ParentOptions:
        as_json: bool

    parent = typer.Typer()

    @parent.callback()
    def main(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
        ctx.obj = ParentOptions(as_json)

    parent.add_typer(cli.cluster_app, name="cluster")
    assert apply_dev(kubeconfig, tmp_path).exit_code == 0
    result = runner.invoke(parent, ["--json", "cluster", "--kubeconfig", str(kubeconfig), "status"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ready"] is True


def _gateway_with_hpa(replicas: int | None) -> list[dict]:
    """The dev overlay's gateway Deployment (with `replicas` as an older manifest had it, or without) and its HPA."""
    docs = m.kustomize_build(m.DEPLOY / "overlays" / "dev")
    deployment = m.one(docs, "Deployment", "preft-gateway")
    if replicas is not None:
        deployment["spec"]["replicas"] = replicas
    return [deployment, m.one(docs, "HorizontalPodAutoscaler", "preft-gateway")]


def _apply_file(kubeconfig, tmp_path, docs: list[dict]):
    manifest = tmp_path / "gateway.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    result = invoke(kubeconfig, tmp_path, "apply", "-f", str(manifest), "--no-wait")
    assert result.exit_code == 0, result.output


def _hpa_scales(api, replicas: int) -> None:
    """The HPA's scale update (an Update by the controller manager, as the scale subresource records it)."""
    status, _ = api.handle(
        "PATCH",
        "/apis/apps/v1/namespaces/preft/deployments/preft-gateway?fieldManager=kube-controller-manager",
        {"Authorization": f"Bearer {api.token}", "Content-Type": "application/merge-patch+json"},
        json.dumps({"spec": {"replicas": replicas}}).encode(),
    )
    assert status == 200


def test_apply_leaves_an_hpa_scaled_deployment_at_its_count(api, kubeconfig, tmp_path):
    """issue 55: `cluster apply` force-applied the manifest's `replicas: 3` beside an HPA, resetting every scale-out."""
    _apply_file(kubeconfig, tmp_path, _gateway_with_hpa(3))
    assert "replicas" not in api.find("Deployment", "preft-gateway")["spec"], "the HPA's target got a count"
    _hpa_scales(api, 7)
    _apply_file(kubeconfig, tmp_path, _gateway_with_hpa(3))
    assert api.find("Deployment", "preft-gateway")["spec"]["replicas"] == 7


def test_apply_hands_replicas_preft_admin_owned_over_before_dropping_them(api, kubeconfig, tmp_path):
    """A Deployment an older preft-admin applied with `replicas: 3` (before an HPA scaled it): dropping the field from
    the apply would remove it (the count falls to 1 until the HPA acts); the hand-over keeps 3."""
    docs = _gateway_with_hpa(3)
    manifest = tmp_path / "old.yaml"
    manifest.write_text(yaml.safe_dump(docs[0]))  # the Deployment alone: no HPA in that apply, replicas sent
    assert invoke(kubeconfig, tmp_path, "apply", "-f", str(manifest), "--no-wait").exit_code == 0
    _apply_file(kubeconfig, tmp_path, docs)
    stored = api.find("Deployment", "preft-gateway")
    assert stored["spec"]["replicas"] == 3
    owners = {e["manager"] for e in stored["metadata"]["managedFields"] if "fieldsV1" in e}
    assert owners == {kube.HANDOVER_FIELD_MANAGER}
    _hpa_scales(api, 5)
    _apply_file(kubeconfig, tmp_path, docs)
    assert api.find("Deployment", "preft-gateway")["spec"]["replicas"] == 5


def test_the_manifests_leave_hpa_targets_without_replicas(all_outputs):
    for source, docs in all_outputs.items():
        for target in kube.hpa_targets(docs):
            (workload,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == target]
            assert "replicas" not in workload["spec"], f"{source}: {target} has replicas beside its HPA"
