"""In-place updates (issue 55, item 3): the engine's settings travel in serveConfigV2 (the Serve application's args),
so changing one edits serveConfigV2 alone and KubeRay updates the Serve application on the running Ray cluster; the
builder reads those args as it would the environment, and refuses secrets there. Serve autoscaling, GCS fault
tolerance, the workers' PodDisruptionBudget and drain, and GPUs per replica are values."""

from __future__ import annotations

import copy
import json
import warnings

import pytest

from tests.deploy import manifests as m


def _ray(values: dict) -> dict:
    (ray,) = m.by_kind(m.helm_render(values), "RayService")
    return ray


@pytest.mark.parametrize(
    "change",
    [
        {"engine": {"maxLoras": 8, "maxCpuLoras": 64}},
        {"engine": {"tensorParallelSize": 2, "gpusPerReplica": 2, "workers": {"gpus": 2}}},
        {"engine": {"settings": {"max_num_seqs": 128, "replica": {"max_ongoing_requests": 96}}}},
        {"engine": {"env": {"CPU_NUM_THREADS": "2"}}},
    ],
)
def test_an_engine_settings_change_edits_serve_config_only(change):
    base = {"engine": {"workers": {"gpus": 2}, "gpusPerReplica": 1}}
    before = _ray(base)
    after = _ray(m_merge(base, change))
    assert before["spec"]["serveConfigV2"] != after["spec"]["serveConfigV2"]
    cluster = lambda r: json.dumps(r["spec"]["rayClusterConfig"], sort_keys=True)  # noqa: E731
    if "workers" in change["engine"]:  # a pod's GPUs are the pod's shape: only that may differ
        b, a = before["spec"]["rayClusterConfig"], after["spec"]["rayClusterConfig"]
        assert b["headGroupSpec"] == a["headGroupSpec"]
        return
    assert cluster(before) == cluster(after), "the Ray cluster's spec changed: KubeRay would replace the cluster"
    assert {k: v for k, v in before["spec"].items() if k != "serveConfigV2"} == {
        k: v for k, v in after["spec"].items() if k != "serveConfigV2"
    }


def m_merge(base: dict, change: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in change.items():
        out[k] = m_merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_the_chart_puts_settings_in_args_typed():
    args = m.engine_args(m.helm_render({"engine": {"maxLoras": 8, "maxCpuLoras": 64, "env": {"REPLICA__X_Y": "1"}}}))
    assert args["max_loras"] == 8 and args["max_cpu_loras"] == 64
    assert args["replica"]["max_adapters_per_replica"] == 64 and args["replica"]["x_y"] == "1"


def _builder_settings(args: dict, env: dict[str, str], monkeypatch) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from preft.engine.serve_app import app_builder
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (settings,) = app_builder(args)._bound_deployment.init_args
    return settings


def test_the_builder_reads_args_as_it_would_the_environment(monkeypatch):
    from preft.engine.settings import EngineSettings

    secrets = {"PREFT_ENGINE__API_TOKEN": "engine-secret-1234567890", "PREFT_ENGINE__REDIS__PASSWORD": "pw"}
    env = {
        **secrets,
        "PREFT_ENGINE__MODEL_DIR": "/models/base",
        "PREFT_ENGINE__MAX_LORAS": "8",
        "PREFT_ENGINE__MAX_CPU_LORAS": "64",
        "PREFT_ENGINE__TENSOR_PARALLEL_SIZE": "2",
        "PREFT_ENGINE__REPLICA__NUM_GPUS_PER_REPLICA": "2",
        "PREFT_ENGINE__REPLICA__MAX_ADAPTERS_PER_REPLICA": "64",
        "PREFT_ENGINE__S3__BUCKET": "b",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from_env = EngineSettings()
    for k in env:
        if k not in secrets:
            monkeypatch.delenv(k)
    args = {
        "model_dir": "/models/base",
        "max_loras": 8,
        "max_cpu_loras": 64,
        "tensor_parallel_size": 2,
        "replica": {"num_gpus_per_replica": 2, "max_adapters_per_replica": 64},
        "s3": {"bucket": "b"},
    }
    from_args = _builder_settings(args, {}, monkeypatch)
    assert from_args == from_env
    assert from_args.api_token.get_secret_value() == "engine-secret-1234567890"  # the secret, still from the env
    assert from_args.redis.password.get_secret_value() == "pw"


def test_args_override_the_environment_field_by_field(monkeypatch):
    env = {
        "PREFT_ENGINE__API_TOKEN": "engine-secret-1234567890",
        "PREFT_ENGINE__REPLICA__NUM_CPUS_PER_REPLICA": "3",
        "PREFT_ENGINE__MAX_LORAS": "2",
    }
    settings = _builder_settings({"model_dir": "/m", "max_loras": 4, "replica": {"num_replicas": 2}}, env, monkeypatch)
    assert settings.max_loras == 4 and settings.replica.num_replicas == 2
    assert settings.replica.num_cpus_per_replica == 3  # a nested field the args leave alone keeps the env's


@pytest.mark.parametrize(
    "secret",
    [
        {"api_token": "x"},
        {"registry_token": "x"},
        {"redis": {"password": "x"}},
        {"redis": {"url": "redis://engine:pw@redis:6379/0"}},
        {"s3": {"secret_key": "x"}},
    ],
)
def test_the_builder_refuses_secrets_in_args(secret, monkeypatch):
    with pytest.raises(ValueError, match="secret settings belong in the pods' environment"):
        _builder_settings({"model_dir": "/m", **secret}, {"PREFT_ENGINE__API_TOKEN": "t" * 24}, monkeypatch)


@pytest.mark.parametrize("source", ["kustomize:dev", "kustomize:gpu", "helm:defaults", "helm:values-gpu"])
def test_no_secret_in_any_serve_config(all_outputs, source):
    from preft.engine.serve_app import secrets_in_args

    assert secrets_in_args(m.engine_args(all_outputs[source])) == []


# -- Serve autoscaling -------------------------------------------------------------------------------------------


def test_serve_autoscaling_leaves_num_replicas_and_worker_replicas_out():
    ray = _ray({"engine": {"serve": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}}}})
    (dep,) = m.serve_config(ray)["applications"][0]["deployments"]
    assert "num_replicas" not in dep
    assert dep["autoscaling_config"]["min_replicas"] == 2 and dep["autoscaling_config"]["max_replicas"] == 6
    cluster = ray["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert "replicas" not in cluster["workerGroupSpecs"][0], "Ray's autoscaler owns the worker count"
    assert cluster["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert not m.rayservice_problems(ray) and not m.serve_config_errors(ray)
    fixed = _ray({})
    assert m.serve_config(fixed)["applications"][0]["deployments"][0]["num_replicas"] == 1
    assert fixed["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False


# -- GPUs per replica, tensor parallelism ------------------------------------------------------------------------


def test_gpus_per_replica_and_tensor_parallel_size_reach_the_replicas(monkeypatch):
    args = m.engine_args(
        m.helm_render({"engine": {"tensorParallelSize": 4, "gpusPerReplica": 4, "workers": {"gpus": 8}}})
    )
    settings = _builder_settings(args, {"PREFT_ENGINE__API_TOKEN": "t" * 24}, monkeypatch)
    assert settings.engine_options().tensor_parallel_size == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from preft.engine.serve_app import app_builder
    assert app_builder(args)._bound_deployment.ray_actor_options["num_gpus"] == 4


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"tensorParallelSize": 2, "gpusPerReplica": 1, "workers": {"gpus": 1}}, "at least engine.tensorParallelSize"),
        ({"gpusPerReplica": 2, "workers": {"gpus": 1}}, "must not exceed engine.workers.gpus"),
    ],
)
def test_the_chart_refuses_replicas_that_do_not_fit(engine, message):
    with pytest.raises(Exception, match=message):
        m.helm_render({"engine": engine})


# -- GCS fault tolerance -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source", ["kustomize:dev", "kustomize:gpu", "helm:defaults", "helm:values-gpu", "helm:all-enabled-url"]
)
def test_gcs_fault_tolerance_on_redis_as_the_ray_user(all_outputs, source):
    from preft.common.redis_acl import SERVICES

    (ray,) = m.by_kind(all_outputs[source], "RayService")
    ft = ray["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert ft["redisUsername"] == {"value": "ray"} and "ray" in SERVICES
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]["key"] == "ray"
    assert ft["redisAddress"] and "@" not in ft["redisAddress"], "no credentials in the address"


def test_gcs_address_from_an_external_url_without_its_credentials(helm_outputs):
    (ray,) = m.by_kind(helm_outputs["all-enabled-url"], "RayService")
    assert ray["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"] == "rediss://redis.internal:6380"


def test_an_existing_redis_secret_needs_the_gcs_address():
    values = {"redis": {"enabled": False}, "externalRedis": {"existingSecret": "r"}}
    with pytest.raises(Exception, match=r"gcsFaultTolerance\.redisAddress is required"):
        m.helm_render(values)
    assert (
        "gcsFaultToleranceOptions"
        not in _ray({**values, "engine": {"gcsFaultTolerance": {"enabled": False}}})["spec"]["rayClusterConfig"]
    )


# -- worker PodDisruptionBudget and drain ------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["kustomize:dev", "kustomize:gpu", "helm:defaults", "helm:values-gpu"])
def test_a_pdb_covers_the_ray_workers_and_not_the_head(all_outputs, source):
    docs = all_outputs[source]
    (ray,) = m.by_kind(docs, "RayService")
    cluster = ray["spec"]["rayClusterConfig"]
    worker_labels = cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    pdbs = [
        p
        for p in m.by_kind(docs, "PodDisruptionBudget")
        if m.label_selector_matches(p["spec"]["selector"], worker_labels)
    ]
    assert len(pdbs) == 1 and pdbs[0]["spec"]["maxUnavailable"] == 1
    assert not m.label_selector_matches(pdbs[0]["spec"]["selector"], head_labels)


@pytest.mark.parametrize("source", ["kustomize:dev", "kustomize:gpu", "helm:defaults", "helm:values-gpu"])
def test_workers_drain_their_replicas_before_stopping(all_outputs, source):
    (ray,) = m.by_kind(all_outputs[source], "RayService")
    spec = ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    (app,) = m.serve_config(ray)["applications"]
    drain_s = app["args"]["replica"]["graceful_shutdown_timeout_s"]
    script = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert script.index("ray drain-node") < script.index("ray::Serve[R]eplica") < script.index("ray stop")
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= drain_s + 30
    assert f"--deadline-remaining-seconds {grace - 10}" in " ".join(script.split())


@pytest.mark.parametrize("source", ["kustomize:dev", "kustomize:gpu", "helm:defaults", "helm:values-gpu"])
def test_gateways_stop_after_the_endpoint_is_gone_and_their_streams_end(all_outputs, source):
    (gw,) = [d for d in m.by_kind(all_outputs[source], "Deployment") if d["metadata"]["name"].endswith("gateway")]
    spec = gw["spec"]["template"]["spec"]
    sleep_s = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep_s > 0 and spec["terminationGracePeriodSeconds"] >= sleep_s + 30  # gateway/server.py: 30 s shutdown


def test_the_chart_refuses_a_grace_period_shorter_than_the_drain():
    with pytest.raises(Exception, match="terminationGracePeriodSeconds must"):
        m.helm_render({"engine": {"workers": {"terminationGracePeriodSeconds": 60}}})
    with pytest.raises(Exception, match="terminationGracePeriodSeconds must"):
        m.helm_render({"gateway": {"terminationGracePeriodSeconds": 20}})
