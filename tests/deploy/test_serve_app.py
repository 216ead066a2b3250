"""The Serve config in the RayService names an application builder that Ray Serve accepts, and the deployment whose
num_replicas it overrides is the one the builder creates. Checked with Ray Serve's own builder call (no Ray cluster:
building an application only binds the deployment)."""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest

from tests.deploy import manifests as m

SOURCES = ["kustomize:dev", "kustomize:gpu", "helm:values-cpu", "helm:values-gpu"]


@pytest.mark.parametrize("source", SOURCES)
def test_serve_config_builds_the_engine_app(all_outputs, source, monkeypatch):
    docs = all_outputs[source]
    ray = m.one(docs, "RayService", next(o["metadata"]["name"] for o in m.by_kind(docs, "RayService")))
    (app,) = m.serve_config(ray)["applications"]
    module_name, attr = app["import_path"].split(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
        from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    builder = getattr(module, attr)
    assert len(inspect.signature(builder).parameters) == 1, "Serve calls the import path with the args dict"
    # the Secrets' values the Ray pods' env names (the engine refuses to start without its token); every other
    # setting is in the args
    (head,) = ray["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    secret_names = {e["name"] for e in head.get("env") or [] if "secretKeyRef" in (e.get("valueFrom") or {})}
    assert {"PREFT_ENGINE__API_TOKEN", "PREFT_ENGINE__REGISTRY_TOKEN"} <= secret_names
    for name in secret_names:
        monkeypatch.setenv(name, f"secret-of-{name.lower()}")
    application = call_user_app_builder_with_args_if_necessary(builder, app.get("args") or {})
    deployment = application._bound_deployment  # Serve exposes no public accessor
    assert [d["name"] for d in app["deployments"]] == [deployment.name]
    (settings,) = deployment.init_args  # the EngineSettings the replicas get, from the args
    args = app.get("args") or {}
    assert settings.max_loras == args["max_loras"] and str(settings.model_dir) == args["model_dir"]
    assert deployment.ray_actor_options["num_gpus"] == args["replica"].get("num_gpus_per_replica", 0)
