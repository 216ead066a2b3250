"""The chart through Helm's own engine (helm-python-sdk: Helm v4's Go SDK): lint, schema enforcement, and what each
switch renders."""

from __future__ import annotations

import base64

import helm_python
import pytest

from tests.deploy import manifests as m


@pytest.mark.parametrize("values_file", [None, "values-cpu.yaml", "values-gpu.yaml"])
def test_lint_is_clean(values_file):
    values = m.helm_values_file(values_file) if values_file else None
    report = helm_python.lint(m.CHART, values, strict=True, kube_version="v1.31.0")
    assert report["errors"] == []
    worse_than_info = [msg for msg in report["messages"] if msg["severity"] >= 2]
    assert worse_than_info == []


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"image": {"engine": {"tag": "latest"}}}, "/image/engine/tag"),
        ({"gateway": {"replicas": 0}}, "/gateway/replicas"),
        ({"engine": {"maxLoras": "four"}}, "/engine/maxLoras"),
        ({"engine": {"workers": {"gpu": 1}}}, "additional properties 'gpu' not allowed"),
        ({"model": {"source": "pvc"}}, "/model/existingClaim"),
        ({"model": {"source": "s3"}}, "/model/uri"),
        ({"model": {"source": "hf", "uri": "hf://org/name@main"}}, "/model/uri"),  # (a branch can move)
        ({"model": {"source": "gcs"}}, "/model/source"),
        ({"externalRedis": {"url": "http://redis:6379"}}, "/externalRedis/url"),
        ({"engine": {"head": {"rayStartParams": {"num-cpus": 0}}}}, "/engine/head/rayStartParams/num-cpus"),
        ({"gateway": {"resources": {"limits": {"memory": None}}}}, "/gateway/resources/limits"),  # null removes a key
        ({"gateway": {"resources": {"limits": {"cpu": "two"}}}}, "/gateway/resources/limits/cpu"),
        ({"networkPolicies": {"externalCidr": "everywhere"}}, "/networkPolicies/externalCidr"),
    ],
)
def test_schema_rejects_bad_values(values, needle):
    with pytest.raises(helm_python.HelmValuesError) as e:
        m.helm_render(values)
    assert needle in str(e.value)


def test_redis_must_come_from_somewhere():
    with pytest.raises(helm_python.HelmRenderError, match=r"externalRedis\.url or externalRedis\.existingSecret"):
        m.helm_render({"redis": {"enabled": False}})


def test_s3_key_without_secret_is_refused():
    with pytest.raises(helm_python.HelmRenderError, match=r"s3\.secretKey is required"):
        m.helm_render({"seaweedfs": {"enabled": False}, "s3": {"accessKey": "AKIA"}})


def _env(docs, kind_name, container=None):
    o = m.one(docs, *kind_name)
    out = {}
    for _, tpl in m.pod_templates(o):
        for c in tpl["spec"]["containers"]:
            if container in (None, c["name"]):
                out.update({e["name"]: e for e in c.get("env") or []})
    return out


def test_existing_secrets_are_referenced_and_nothing_is_generated(helm_outputs):
    docs = helm_outputs["all-disabled-external"]
    assert m.by_kind(docs, "Secret") == []
    gw = _env(docs, ("Deployment", "preft-gateway"))
    reg = _env(docs, ("Deployment", "preft-registry"))
    eng = _env(docs, ("RayService", "preft-engine"))
    refs = [
        (gw, "PREFT_GATEWAY__REGISTRY_TOKEN", ("ops-registry", "gw")),  # the gateway role, not the admin token
        (gw, "PREFT_GATEWAY__ENGINE_TOKEN", ("ops-engine", "shared")),
        (reg, "PREFT_REGISTRY__ADMIN_TOKEN", ("ops-registry", "token")),
        (reg, "PREFT_REGISTRY__GATEWAY_TOKEN", ("ops-registry", "gw")),
        (reg, "PREFT_REGISTRY__READER_TOKEN", ("ops-registry", "ro")),
        (eng, "PREFT_ENGINE__API_TOKEN", ("ops-engine", "shared")),
        (eng, "PREFT_ENGINE__REGISTRY_TOKEN", ("ops-registry", "ro")),  # read-only: engines hold no admin token
    ]
    for env, name, (secret, key) in refs:
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}, name
    for env, prefix in ((gw, "PREFT_GATEWAY__"), (reg, "PREFT_REGISTRY__"), (eng, "PREFT_ENGINE__")):
        assert env[f"{prefix}REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "ops-redis", "key": "redis-url"}
        user = prefix.split("_")[1].lower()
        assert env[f"{prefix}REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ops-redis-acl", "key": user}
    for env, prefix in ((reg, "PREFT_REGISTRY__"), (eng, "PREFT_ENGINE__")):
        assert env[f"{prefix}S3__ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "ops-s3", "key": "id"}
        assert env[f"{prefix}S3__SECRET_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "ops-s3", "key": "key"}
    cm = m.one(docs, "ConfigMap", "preft-registry-config")["data"]
    assert cm["PREFT_REGISTRY__S3__ENDPOINT_URL"] == "https://s3.eu-west-1.amazonaws.com"
    assert "PREFT_REGISTRY__REDIS__URL" not in cm


def test_everything_disabled_renders_only_the_core(helm_outputs):
    kinds = {o["kind"] for o in helm_outputs["all-disabled-external"]}
    assert kinds == {"ConfigMap", "Deployment", "Service", "ServiceAccount", "RayService"}
    assert (
        "gcsFaultToleranceOptions"
        not in m.one(helm_outputs["all-disabled-external"], "RayService", "preft-engine")["spec"]["rayClusterConfig"]
    )
    names = {o["metadata"]["name"] for o in helm_outputs["all-disabled-external"]}
    assert not any("redis" in n or "seaweedfs" in n for n in names)
    ray = m.one(helm_outputs["all-disabled-external"], "RayService", "preft-engine")
    for _, tpl in m.pod_templates(ray):
        models = {v["name"]: v for v in tpl["spec"]["volumes"]}["models"]
        assert models["persistentVolumeClaim"] == {"claimName": "llama-8b", "readOnly": True}
        assert "initContainers" not in tpl["spec"]
    assert m.engine_args(helm_outputs["all-disabled-external"])["model_dir"] == "/models/llama-3-8b"


def test_everything_enabled(helm_outputs):
    docs = helm_outputs["all-enabled-url"]
    kinds = {o["kind"] for o in docs}
    assert {
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
    } <= kinds
    assert "replicas" not in m.one(docs, "Deployment", "preft-gateway")["spec"], "the HPA owns replicas"
    assert m.one(docs, "PodMonitor", "preft-gateway")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # the Redis URL given in values goes to a chart Secret, never to a ConfigMap
    secret = m.one(docs, "Secret", "preft-redis")
    assert base64.b64decode(secret["data"]["url"]).decode() == "rediss://:pw@redis.internal:6380/0"
    assert not any("redis.internal" in str(o.get("data")) for o in m.by_kind(docs, "ConfigMap"))
    # no S3 keys anywhere: IRSA / instance profile
    eng = _env(docs, ("RayService", "preft-engine"))
    assert not any("S3__ACCESS_KEY" in k for k in eng)
    # GPUs from engine.workers.gpus, the digest instead of the tag
    ray = m.one(docs, "RayService", "preft-engine")
    worker = ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    (c,) = worker["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert worker["rayStartParams"]["num-gpus"] == "2"
    assert c["image"] == "registry.example.com/preft-serve/preft-engine@sha256:" + "ab" * 32


def test_generated_registry_token_is_random_and_given_token_is_used():
    def token(docs, secret="preft-registry-token", key="admin-token"):
        return base64.b64decode(m.one(docs, "Secret", secret)["data"][key]).decode()

    first, second = m.helm_render(), m.helm_render()
    a, b = token(first), token(second)
    assert len(a) == 48 and a != b
    generated = {token(first, key=k) for k in ("admin-token", "gateway-token", "reader-token")}
    generated.add(token(first, "preft-engine-token", "token"))
    assert len(generated) == 4 and all(len(t) == 48 for t in generated)  # one random token per role
    assert token(m.helm_render({"registry": {"auth": {"adminToken": "s3cr3t-from-set"}}})) == "s3cr3t-from-set"
    given = m.helm_render({"registry": {"auth": {"readerToken": "r-from-set"}}, "engine": {"auth": {"token": "e-set"}}})
    assert token(given, key="reader-token") == "r-from-set"
    assert token(given, "preft-engine-token", "token") == "e-set"
    env = _env(given, ("Deployment", "preft-gateway"))
    assert env["PREFT_GATEWAY__ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "preft-engine-token",
        "key": "token",
    }


def test_the_release_seaweedfs_takes_only_the_s3_key_pair_and_binds_s3_alone():
    (c,) = m.one(m.helm_render(), "StatefulSet", "preft-seaweedfs")["spec"]["template"]["spec"]["containers"]
    assert {"-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3.ip.bind=0.0.0.0", "-filer.disableHttp"} <= set(c["args"])
    assert "SIGNING_READ_KEY" in c["command"][2] and c["command"][2].endswith('exec weed "$@"')
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "preft-s3", "key": "access-key"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "preft-s3", "key": "secret-key"}


def test_fullname_follows_the_release():
    docs = m.helm_render(release="prod", namespace="serving")
    assert ("Deployment", "prod-preft-gateway") in {m.key(o) for o in docs}
    cm = m.one(docs, "ConfigMap", "prod-preft-gateway-config")["data"]
    assert cm["PREFT_GATEWAY__ENGINE_URL"] == "http://prod-preft-engine-serve-svc:8000"
    assert cm["PREFT_GATEWAY__REGISTRY_ADDRESS"] == "prod-preft-registry:50051"
    assert cm["PREFT_GATEWAY__REDIS__URL"] == "redis://prod-preft-redis:6379/0"
    assert not m.reference_problems(docs, external_secrets=set())


def test_serve_replicas_and_worker_params_reach_the_rayservice():
    docs = m.helm_render(
        {
            "engine": {
                "serve": {"numReplicas": 3, "deploymentName": "Engine"},
                "workers": {"rayStartParams": {"object-store-memory": "1000000000"}},
            }
        }
    )
    ray = m.one(docs, "RayService", "preft-engine")
    (app,) = m.serve_config(ray)["applications"]
    assert app["deployments"] == [{"name": "Engine", "num_replicas": 3}]
    params = ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]
    assert params == {
        "object-store-memory": "1000000000",
        "node-ip-address": "$MY_POD_IP",  # (the chart's own, beside the values')
        "metrics-export-port": "8080",
    }


def test_notes_render():
    with helm_python.Chart.load(m.CHART) as chart:
        notes = chart.render(None, name="preft", namespace="preft")["preft/templates/NOTES.txt"]
    assert "preft-admin cluster --namespace preft --engine preft-engine status" in notes
    assert "port-forward svc/preft-gateway 8080:8080" in notes


def test_a_gateway_setting_does_not_restart_the_ray_cluster():
    """Pod templates carry a checksum of their own ConfigMap only: a new gateway setting rolls the gateway, not the
    RayService (whose changed pod template would make KubeRay bring up a whole new Ray cluster)."""

    def checksums(docs):
        out = {}
        for o in docs:
            for where, tpl in m.pod_templates(o):
                out[where] = (tpl["metadata"].get("annotations") or {}).get("checksum/config")
        return out

    before = checksums(m.helm_render())
    after = checksums(m.helm_render({"gateway": {"env": {"KEY_CACHE_TTL_S": "5"}}}))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"Deployment/preft-gateway"}


def test_redis_has_the_codes_acl_users_and_each_service_its_own(helm_outputs):
    from preft.common.redis_acl import ADMIN_USER, SERVICES, acl_lines

    docs = helm_outputs["defaults"]
    (redis,) = m.one(docs, "StatefulSet", "preft-redis")["spec"]["template"]["spec"]["containers"]
    placeholders = {user: f"${{REDIS_PASSWORD_{user.upper()}}}" for user in (ADMIN_USER, *SERVICES)}
    users = [line.strip() for line in redis["args"][0].splitlines() if line.strip().startswith("user ")]
    assert users == acl_lines(placeholders)
    secret = m.one(docs, "Secret", "preft-redis-acl")
    passwords = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert sorted(passwords) == sorted([ADMIN_USER, *SERVICES]) and len(set(passwords.values())) == len(SERVICES) + 1
    for scenario, outputs in helm_outputs.items():
        for name, user, prefix in (
            ("preft-gateway", "gateway", "PREFT_GATEWAY__"),
            ("preft-registry", "registry", "PREFT_REGISTRY__"),
        ):
            (c,) = m.one(outputs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e for e in c["env"]}
            assert env[f"{prefix}REDIS__USERNAME"]["value"] == user, scenario
            ref = env[f"{prefix}REDIS__PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == user and ref["name"] in ("preft-redis-acl", "ops-redis-acl"), scenario
    ray = m.one(docs, "RayService", "preft-engine")["spec"]["rayClusterConfig"]
    head_env = {e["name"]: e for e in ray["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert head_env["PREFT_ENGINE__REDIS__USERNAME"]["value"] == "engine"
    existing = m.helm_render({"redis": {"auth": {"existingSecret": "ops-redis-acl"}}})
    assert not [s for s in m.by_kind(existing, "Secret") if s["metadata"]["name"].endswith("redis-acl")]
