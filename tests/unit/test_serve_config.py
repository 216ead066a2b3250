"""The engine's Serve config as the testbed submits it (`serve_app.serve_config`, args from `stack.wiring`): deploy/'s
shape, valid for Ray Serve, no secret in it, and the secrets a Ray node's environment carries merge into the args
where EngineSettings reads them (what `app_builder` relies on)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from preft.engine.serve_app import serve_config
from preft.engine.settings import EngineSettings
from preft.stack.wiring import PlatformSecrets, StackProfile, Wiring

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def wiring(tmp_path) -> Wiring:
    return Wiring(
        secrets=PlatformSecrets.load(tmp_path),
        profile=StackProfile(),
        model_dir=tmp_path / "model",
        redis_url="redis://10.77.0.10:6379/0",
        s3_endpoint_url="http://10.77.0.10:8333",
        registry_address="10.77.0.10:50051",
        engine_url="http://10.77.0.11:8000",
    )


def test_the_config_has_deploys_shape_and_passes_serves_schema(wiring, tmp_path):
    args = wiring.engine_args(tmp_path / "cache", cpu_num_threads=1, replica={"num_replicas": 2})
    config = serve_config(args, num_replicas=2)
    with warnings.catch_warnings():  # Ray's own pydantic models warn about deprecated Field arguments
        warnings.simplefilter("ignore")
        from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)
    rayservice = yaml.safe_load((REPO / "deploy/base/engine/rayservice.yaml").read_text())
    deployed = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,), (deployed_app,) = config["applications"], deployed["applications"]
    assert {k: v for k, v in config.items() if k != "applications"} == {
        k: v for k, v in deployed.items() if k != "applications"
    }
    assert {k: v for k, v in app.items() if k not in ("args", "deployments")} == {
        k: v for k, v in deployed_app.items() if k not in ("args", "deployments")
    }
    assert app["deployments"] == [{"name": "PreftEngine", "num_replicas": 2}]
    assert args["replica"] == {"num_replicas": 2, "metrics_tenant_label": True}


def test_secrets_are_refused_in_the_args(wiring, tmp_path):
    args = wiring.engine_args(tmp_path / "cache")
    with pytest.raises(ValueError, match=r"redis\.password"):
        serve_config({**args, "redis": {**args["redis"], "password": "x"}}, num_replicas=1)
    with pytest.raises(ValueError, match="api_token"):
        serve_config({**args, "api_token": "x"}, num_replicas=1)


def test_a_nodes_secret_environment_completes_the_args(wiring, tmp_path, monkeypatch):
    """The args name where Redis and S3 are; the node's PREFT_ENGINE__* variables who the engine is there."""
    for name, value in wiring.engine_secret_env().items():
        monkeypatch.setenv(name, value)
    settings = EngineSettings(**wiring.engine_args(tmp_path / "cache"))
    s = wiring.secrets
    assert settings.redis.url == "redis://10.77.0.10:6379/0" and settings.redis.username == "engine"
    assert (
        settings.redis.password is not None
        and settings.redis.password.get_secret_value() == s.redis_passwords["engine"]
    )
    assert settings.s3.endpoint_url == "http://10.77.0.10:8333" and settings.s3.access_key == "preft-local"
    assert settings.s3.secret_key is not None and settings.s3.secret_key.get_secret_value() == s.s3_secret
    assert settings.api_token.get_secret_value() == s.engine_token
    assert settings.registry_token is not None and settings.registry_token.get_secret_value() == s.reader_token
    assert settings.registry_address == "10.77.0.10:50051"
