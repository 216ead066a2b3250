"""The base model fetched in the pods under kustomize (deploy/components/model-fetch with model-s3 or model-hf): the
gpu-s3 overlay renders a fetch-model init container, as the chart's model.source=s3 does, into every pod that reads
the model, all from the one ConfigMap the operator edits; the rendered init containers then run here, against a
local S3 (SeaweedFS) holding a pushed model and against a pre-filled Hugging Face cache (offline: no hub here).

As in test_boot_dev, only what a pod has and a laptop has not is adapted: the models volume's path becomes a
directory per pod, HOME a temporary one, and the Secrets' values the local S3's keys.
"""

from __future__ import annotations

import copy
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy import manifests as m

GPU_S3 = m.DEPLOY / "overlays" / "gpu-s3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fetch_inits(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """(pod template, fetch-model init container) by where (Deployment/<name>, RayService/<name>/<head|group>)."""
    out = {}
    for o in docs:
        for where, tpl in m.pod_templates(o):
            for c in tpl["spec"].get("initContainers") or []:
                if c["name"] == m.FETCH_INIT:
                    out[where] = (tpl, c)
    return out


def model_readers(docs: list[dict]) -> set[str]:
    return {
        where
        for o in docs
        for where, tpl in m.pod_templates(o)
        if "models" in {v["name"] for v in tpl["spec"].get("volumes") or []}
    }


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


def model_source(overlay: Path = GPU_S3) -> dict[str, str]:
    return yaml.safe_load((overlay / "model-source.yaml").read_text())["data"]


def copy_deploy(tmp_path: Path) -> Path:
    root = tmp_path / "deploy"
    shutil.copytree(m.DEPLOY, root, ignore=shutil.ignore_patterns("docker"))
    return root


def write_overlay(root: Path, name: str, kustomization: dict, files: dict[str, dict] | None = None) -> Path:
    path = root / "overlays" / name
    path.mkdir(parents=True)
    (path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    for file, doc in (files or {}).items():
        (path / file).write_text(yaml.safe_dump(doc))
    return path


def source_configmap(**data: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "preft-model-source", "annotations": {"config.kubernetes.io/local-config": "true"}},
        "data": data,
    }


def set_model_source(root: Path, **data: str) -> None:
    """Edit the copied gpu-s3 overlay's model-source.yaml, as an operator would."""
    path = root / "overlays" / "gpu-s3" / "model-source.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["data"].update(data)
    path.write_text(yaml.safe_dump(doc))


# -- rendered ----------------------------------------------------------------------------------------------------


def test_gpu_keeps_the_pvc_and_gpu_s3_mounts_none(kustomize_outputs):
    def claims(docs):
        return [
            (where, v["persistentVolumeClaim"]["claimName"])
            for o in docs
            for where, tpl in m.pod_templates(o)
            for v in tpl["spec"].get("volumes") or []
            if "persistentVolumeClaim" in v
        ]

    gpu = kustomize_outputs["gpu"]
    assert {claim for _, claim in claims(gpu)} == {"preft-models"}
    assert {where for where, _ in claims(gpu)} == model_readers(gpu)
    assert not fetch_inits(gpu), "the gpu overlay mounts the PVC by default"
    assert claims(kustomize_outputs["gpu-s3"]) == []


def test_every_pod_that_reads_the_model_fetches_the_configured_one(kustomize_outputs):
    docs = kustomize_outputs["gpu-s3"]
    config = model_source()
    inits = fetch_inits(docs)
    ray = m.one(docs, "RayService", "preft-engine")
    groups = [g["groupName"] for g in ray["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert (
        set(inits)
        == model_readers(docs)
        == {
            "Deployment/preft-gateway",
            "RayService/preft-engine/head",
            *(f"RayService/preft-engine/{g}" for g in groups),
        }
    )
    problems = m.model_fetch_problems(docs)
    assert not problems, "\n".join(problems)

    (gateway_cm,) = [c for c in m.by_kind(docs, "ConfigMap") if c["metadata"]["name"].startswith("preft-gateway-")]
    model_dir = m.engine_args(docs)["model_dir"]
    assert model_dir == gateway_cm["data"]["PREFT_GATEWAY__MODEL_DIR"]
    for where, (tpl, init) in inits.items():
        env = env_of(init)
        assert env["PREFT_MODEL__SOURCE"]["value"] == config["uri"], where
        assert init["command"][init["command"].index("--link") + 1] == model_dir, where
        volume = {v["name"]: v for v in tpl["spec"]["volumes"]}["models"]
        gateway = where.startswith("Deployment/")
        assert env["PREFT_MODEL__TOKENIZER_ONLY"]["value"] == ("true" if gateway else "false"), where
        assert volume == {
            "name": "models",
            "emptyDir": {"sizeLimit": "256Mi" if gateway else config["cache-size-limit"]},
        }
        assert init["securityContext"]["readOnlyRootFilesystem"] is gateway, where  # as the pod's main container
        if gateway:  # HOME=/tmp is writable under the read-only root: the pod's /tmp emptyDir
            assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]
            assert "emptyDir" in {v["name"]: v for v in tpl["spec"]["volumes"]}["tmp"]


def test_the_s3_settings_come_from_the_configmap_and_the_services_secret(kustomize_outputs):
    docs = kustomize_outputs["gpu-s3"]
    config = model_source()
    (registry,) = m.one(docs, "Deployment", "preft-registry")["spec"]["template"]["spec"]["containers"]
    registry_env = env_of(registry)
    for where, (_, init) in fetch_inits(docs).items():
        env = env_of(init)
        assert env["PREFT_MODEL__S3__ENDPOINT_URL"]["value"] == config["s3-endpoint-url"], where
        assert env["PREFT_MODEL__S3__REGION"]["value"] == config["s3-region"], where
        for key in ("ACCESS_KEY", "SECRET_KEY"):
            assert "value" not in env[f"PREFT_MODEL__S3__{key}"], where
            assert (
                env[f"PREFT_MODEL__S3__{key}"]["valueFrom"] == registry_env[f"PREFT_REGISTRY__S3__{key}"]["valueFrom"]
            )
        assert "HF_TOKEN" not in env


def test_the_init_containers_are_the_charts(kustomize_outputs):
    """The chart's model.source=s3 with the same model, S3 and Secret renders the same init containers (but their
    image names) and the same models volumes."""
    config = model_source()
    values = {
        "model": {"source": "s3", "uri": config["uri"], "path": "base", "cacheSizeLimit": config["cache-size-limit"]},
        "seaweedfs": {"enabled": False},
        "s3": {
            "existingSecret": "preft-s3",
            "existingSecretAccessKeyKey": "access-key",
            "existingSecretSecretKeyKey": "secret-key",
            "endpointUrl": config["s3-endpoint-url"],
            "region": config["s3-region"],
        },
    }

    def by_role(docs):
        return {
            where.split("/")[0] + ("/head" if where.endswith("/head") else ""): (
                {k: v for k, v in init.items() if k != "image"},
                {v["name"]: v for v in tpl["spec"]["volumes"]}["models"],
            )
            for where, (tpl, init) in fetch_inits(docs).items()
        }

    kust, chart = by_role(kustomize_outputs["gpu-s3"]), by_role(m.helm_render(values))
    assert set(kust) == {"Deployment", "RayService/head", "RayService"}
    assert kust == chart


@pytest.mark.parametrize(
    "model",
    [
        {"source": "s3", "uri": "s3://models/llama", "path": "llama"},
        {"source": "hf", "uri": f"hf://acme/tiny@{COMMIT}", "hfTokenSecret": "hf"},
    ],
)
def test_the_charts_fetched_models_hold_together_too(model):
    """The same check on the chart's fetching pods (its own model.path: the link follows it)."""
    docs = m.helm_render({"model": model})
    assert set(fetch_inits(docs)) == model_readers(docs) and len(model_readers(docs)) == 3
    problems = m.model_fetch_problems(docs)
    assert not problems, "\n".join(problems)


def test_the_pods_that_fetch_may_reach_the_models_s3_endpoint(kustomize_outputs):
    docs = kustomize_outputs["gpu-s3"]
    policies = m.by_kind(docs, "NetworkPolicy")
    endpoint = urlparse(model_source()["s3-endpoint-url"])
    port = endpoint.port or {"https": 443, "http": 80}[endpoint.scheme]
    for where, (tpl, _) in fetch_inits(docs).items():
        pod = m.Peer(tpl["metadata"]["labels"])
        assert m.flow_allowed(policies, pod, m.Peer({"k8s-app": "kube-dns"}, namespace="kube-system"), 53), where
        assert m.flow_allowed(policies, pod, m.Peer(ip="203.0.113.7"), port), where


# Each way model_fetch_problems must catch, applied to the rendered gpu-s3 overlay.
def _gateway_init(docs):
    return fetch_inits(docs)["Deployment/preft-gateway"][1]


def _worker(docs):
    return m.one(docs, "RayService", "preft-engine")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]


def _break_link(docs):
    command = _gateway_init(docs)["command"]
    command[command.index("--link") + 1] = "/models/other"


def _drop_worker_init(docs):
    _worker(docs)["spec"]["initContainers"] = []


def _literal_key(docs):
    env = env_of(_gateway_init(docs))["PREFT_MODEL__S3__SECRET_KEY"]
    env.pop("valueFrom")
    env["value"] = "hunter2"


def _mount_elsewhere(docs):
    (c,) = _worker(docs)["spec"]["containers"]
    next(v for v in c["volumeMounts"] if v["name"] == "models")["mountPath"] = "/model"


def _swap_tokenizer_only(docs):
    env_of(_gateway_init(docs))["PREFT_MODEL__TOKENIZER_ONLY"]["value"] = "false"


def _two_models(docs):
    env_of(_worker(docs)["spec"]["initContainers"][0])["PREFT_MODEL__SOURCE"]["value"] = "s3://other/model"


def _keep_the_pvc(docs):
    volumes = _worker(docs)["spec"]["volumes"]
    volumes[[v["name"] for v in volumes].index("models")] = {
        "name": "models",
        "persistentVolumeClaim": {"claimName": "preft-models"},
    }


def _unlimited_volume(docs):
    volumes = _worker(docs)["spec"]["volumes"]
    volumes[[v["name"] for v in volumes].index("models")] = {"name": "models", "emptyDir": {}}


@pytest.mark.parametrize(
    ("breakage", "reported"),
    [
        (_break_link, "PREFT_GATEWAY__MODEL_DIR is /models/base, the init container links /models/other"),
        (_drop_worker_init, "reads the model but has no fetch-model init container"),
        (_literal_key, "PREFT_MODEL__S3__SECRET_KEY is not read from a Secret"),
        (_mount_elsewhere, "mounts models at /model, not read-only at /models"),
        (_swap_tokenizer_only, "PREFT_MODEL__TOKENIZER_ONLY is false, the Deployment needs true"),
        (_two_models, "the pods fetch different models"),
        (_keep_the_pvc, "the models volume is not an emptyDir alone"),
        (_unlimited_volume, "the models emptyDir has no sizeLimit"),
    ],
)
def test_model_fetch_problems_are_reported(kustomize_outputs, breakage, reported):
    docs = copy.deepcopy(kustomize_outputs["gpu-s3"])
    breakage(docs)
    problems = m.model_fetch_problems(docs)
    assert any(reported in p for p in problems), problems


# -- the components, built in other shapes -----------------------------------------------------------------------


def test_every_worker_group_gets_the_fetch(tmp_path):
    """A second worker group (one more gpu group, as an overlay might add) gets its own fetch-model, by `*`."""
    root = copy_deploy(tmp_path)
    workers = "/spec/rayClusterConfig/workerGroupSpecs"
    write_overlay(
        root,
        "gpu-two-groups",
        {
            "resources": ["../gpu"],
            "patches": [
                {
                    "target": {"group": "ray.io", "version": "v1", "kind": "RayService", "name": "preft-engine"},
                    "patch": yaml.safe_dump(
                        [
                            {"op": "copy", "from": f"{workers}/0", "path": f"{workers}/-"},
                            {"op": "replace", "path": f"{workers}/1/groupName", "value": "gpu-workers-large"},
                        ]
                    ),
                }
            ],
        },
    )
    path = write_overlay(
        root,
        "gpu-two-groups-s3",
        {
            "resources": ["../gpu-two-groups", "model-source.yaml"],
            "components": ["../../components/model-s3", "../../components/model-fetch"],
        },
        {"model-source.yaml": source_configmap(**model_source())},
    )
    docs = m.kustomize_build(path)
    assert (
        set(fetch_inits(docs))
        == model_readers(docs)
        == {
            "Deployment/preft-gateway",
            "RayService/preft-engine/head",
            "RayService/preft-engine/gpu-workers",
            "RayService/preft-engine/gpu-workers-large",
        }
    )
    problems = m.model_fetch_problems(docs) + [p for o in docs for p in m.schema_errors(o)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("kustomization", "data", "error"),
    [
        # model-fetch first: the template it copies is not there yet
        (
            {"components": ["../../components/model-fetch", "../../components/model-s3"]},
            None,
            "nothing selected by ModelFetch",
        ),
        ({"components": ["../../components/model-fetch"]}, None, "nothing selected by ModelFetch"),  # no source
        ({}, {"uri": "s3://b/m", "s3-endpoint-url": "https://s3", "s3-region": "r"}, "data.cache-size-limit"),
        ({}, {"uri": "s3://b/m", "cache-size-limit": "1Gi", "s3-region": "r"}, "data.s3-endpoint-url"),
        ({"resources": ["../gpu"]}, None, "nothing selected by ConfigMap"),  # no preft-model-source
    ],
)
def test_a_misused_component_fails_the_build(tmp_path, kustomization, data, error):
    root = copy_deploy(tmp_path)
    config = model_source() if data is None else data
    path = write_overlay(
        root,
        "broken",
        {
            "resources": ["../gpu", "model-source.yaml"],
            "components": ["../../components/model-s3", "../../components/model-fetch"],
            **kustomization,
        },
        {"model-source.yaml": source_configmap(**config)},
    )
    with pytest.raises(m.RenderError, match=error):
        m.kustomize_build(path)


@pytest.fixture
def gpu_hf(tmp_path) -> tuple[Path, list[dict]]:
    root = copy_deploy(tmp_path)
    path = write_overlay(
        root,
        "gpu-hf",
        {
            "resources": ["../gpu", "model-source.yaml"],
            "components": ["../../components/model-hf", "../../components/model-fetch"],
        },
        {"model-source.yaml": source_configmap(uri=f"hf://acme/tiny-llama@{COMMIT}", **{"cache-size-limit": "32Gi"})},
    )
    return path, m.kustomize_build(path)


def test_the_hf_component_renders_valid_pods_with_an_optional_token(gpu_hf):
    _, docs = gpu_hf
    problems = [p for o in docs for p in m.schema_errors(o)]
    problems += m.security_problems(docs) + m.image_problems(docs) + m.env_name_problems(docs)
    problems += m.reference_problems(docs, external_secrets=m.EXTERNAL_SECRETS) + m.model_fetch_problems(docs)
    assert not problems, "\n".join(problems)
    inits = fetch_inits(docs)
    assert set(inits) == model_readers(docs) and len(inits) == 3
    for where, (tpl, init) in inits.items():
        env = env_of(init)
        assert env["HF_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": "preft-hf-token", "key": "token", "optional": True}
        }
        assert not [n for n in env if n.startswith("PREFT_MODEL__S3__")], where
        if where.startswith("RayService/"):
            assert {v["name"]: v for v in tpl["spec"]["volumes"]}["models"]["emptyDir"] == {"sizeLimit": "32Gi"}


# -- run as rendered ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from preft.devtools.tiny import TinyModelSpec, build_model

    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama", TinyModelSpec(arch="llama", seed=7))


def _files(root: Path) -> set[str]:
    from preft.common.model_source import COMPLETE, MANIFEST

    return {
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE)
    }


def run_init(init: dict, pod_root: Path, secret_values: dict[tuple[str, str], str], **extra_env: str):
    """The init container's command and env, its /models in pod_root; Secrets' keys from secret_values (an optional
    Secret that is not there leaves its variable unset, as the kubelet does)."""
    command = [
        pod_root.as_posix() + a.removeprefix("/models") if a.startswith("/models") else a for a in init["command"]
    ]
    assert command[:2] == ["python", "-m"], command
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFT_", "HF_", "AWS_"))}
    for e in init["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]["secretKeyRef"]
        if (ref["name"], ref["key"]) in secret_values:
            env[e["name"]] = secret_values[(ref["name"], ref["key"])]
        else:
            assert ref.get("optional"), f"{e['name']}: Secret {ref['name']} is required"
    assert env["HOME"] == "/tmp"
    env["HOME"] = str(pod_root.parent / "home")
    env["PYTHONPATH"] = str(m.REPO / "services")
    pod_root.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, *command[1:]], env={**env, **extra_env}, capture_output=True, text=True, timeout=180
    )


@pytest.mark.integration
def test_the_rendered_init_containers_fetch_the_pushed_model_from_s3(tiny_model, s3_server, tmp_path):
    from pydantic import SecretStr

    from preft.common.model_source import push
    from preft.common.settings import S3Settings
    from preft.gateway.core.tokenization import PromptTokenizer

    bucket = f"models-{secrets.token_hex(4)}"
    s3_server.client().create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/tiny-llama"
    s3 = S3Settings(
        endpoint_url=s3_server.endpoint_url,
        access_key=s3_server.access_key,
        secret_key=SecretStr(s3_server.secret_key),
    )
    push(tiny_model, uri, s3=s3)
    root = copy_deploy(tmp_path)
    set_model_source(root, uri=uri, **{"s3-endpoint-url": s3_server.endpoint_url})
    docs = m.kustomize_build(root / "overlays" / "gpu-s3")
    inits = fetch_inits(docs)
    assert len(inits) == 3
    keys = {("preft-s3", "access-key"): s3_server.access_key, ("preft-s3", "secret-key"): s3_server.secret_key}

    for where, (tpl, init) in inits.items():
        pod_root = tmp_path / "pods" / where.replace("/", "_") / "models"
        run = run_init(init, pod_root, keys)
        assert run.returncode == 0, f"{where}: {run.stderr[-3000:]}"
        (model_dir,) = set(m.model_dirs_read(docs, _owner(docs, where), tpl["spec"]).values())
        fetched = Path(pod_root.as_posix() + model_dir.removeprefix("/models"))
        assert fetched.is_symlink() and fetched.resolve().is_relative_to(pod_root.resolve())
        files = _files(fetched.resolve())
        if where.startswith("Deployment/"):
            assert "config.json" in files and not [f for f in files if f.endswith(".safetensors")], files
            # the gateway loads its tokenizer from what it fetched, as it does from the whole model
            assert PromptTokenizer.load(fetched).encode_now("hello adapter") == PromptTokenizer.load(
                tiny_model
            ).encode_now("hello adapter")
        else:
            assert files == _files(tiny_model), where

    # S3 refuses other keys: the init container fails (the pod does not start) and links nothing
    (_, gateway_init) = inits["Deployment/preft-gateway"]
    pod_root = tmp_path / "pods" / "wrong-key" / "models"
    run = run_init(gateway_init, pod_root, {**keys, ("preft-s3", "secret-key"): "not-the-key"})
    assert run.returncode != 0 and "error:" in run.stderr
    assert not (pod_root / "base").exists()


def _owner(docs, where):
    kind, name = where.split("/")[:2]
    return m.one(docs, kind, name)


def test_the_rendered_init_containers_link_a_hugging_face_snapshot(gpu_hf, tiny_model, tmp_path):
    """Offline: each pod's cache holds the repository's snapshot at the commit (as huggingface_hub lays one out),
    so the rendered command resolves and links it without the hub."""
    _, docs = gpu_hf
    for where, (tpl, init) in fetch_inits(docs).items():
        pod_root = tmp_path / where.replace("/", "_") / "models"
        cache = Path(pod_root.as_posix() + init["command"][init["command"].index("--cache-dir") + 1][len("/models") :])
        repo = cache / "huggingface" / "models--acme--tiny-llama"
        shutil.copytree(tiny_model, repo / "snapshots" / COMMIT)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
        run = run_init(init, pod_root, {}, HF_HUB_OFFLINE="1")
        assert run.returncode == 0, f"{where}: {run.stderr[-3000:]}"
        (model_dir,) = set(m.model_dirs_read(docs, _owner(docs, where), tpl["spec"]).values())
        linked = Path(pod_root.as_posix() + model_dir.removeprefix("/models"))
        assert linked.resolve() == (repo / "snapshots" / COMMIT).resolve(), where
