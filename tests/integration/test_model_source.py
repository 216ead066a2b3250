"""Model sources: a model pushed to S3 (SeaweedFS) and fetched into a cache, checked against its manifest, whole or
only its tokenizer, once per host under concurrency; a Hugging Face source found in huggingface_hub's own cache
(offline: the hub cannot be reached from here, so its download is not exercised)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from preft.common.errors import InvalidArgument, NotFound, Unavailable
from preft.common.model_source import COMPLETE, MANIFEST, ModelSource, fetch, push
from tests.deploy import manifests as m

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(model_dirs) -> Path:
    return model_dirs["llama"]


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file() and p.name not in (MANIFEST, COMPLETE)
    }


def test_a_model_pushed_to_s3_is_fetched_whole_and_checked(model, s3_bucket, tmp_path):
    source = f"s3://{s3_bucket.bucket}/models/tiny-llama"
    settings = s3_bucket.settings()
    manifest = push(model, source, s3=settings)
    assert set(manifest["files"]) == set(_files(model)) and "model.safetensors" in manifest["files"]

    cache = tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:  # a node's replicas starting together: one download, one entry
        paths = list(pool.map(lambda _: fetch(source, cache, s3=settings), range(4)))
    assert len(set(paths)) == 1 and _files(paths[0]) == _files(model)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [paths[0].name]

    tokenizer = fetch(source, cache, s3=settings, tokenizer_only=True)
    names = set(_files(tokenizer))
    assert "config.json" in names and any(n.startswith("tokenizer") for n in names)
    assert not any(n.endswith(".safetensors") for n in names)

    # the model replaced in the bucket: a new entry, never mixed with the old one
    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    push(changed, source, s3=settings)
    again = fetch(source, cache, s3=settings)
    assert again != paths[0] and _files(again) == _files(changed) and _files(paths[0]) == _files(model)


def test_a_file_that_does_not_match_its_manifest_is_refused_and_nothing_is_left(model, s3_bucket, tmp_path):
    source = f"s3://{s3_bucket.bucket}/m"
    settings = s3_bucket.settings()
    push(model, source, s3=settings)
    s3_bucket.client().put_object(Bucket=s3_bucket.bucket, Key="m/config.json", Body=b"{}")  # tampered after push
    cache = tmp_path / "cache"
    with pytest.raises(Unavailable, match=r"config\.json does not match"):
        fetch(source, cache, s3=settings)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_bad_sources_are_named(s3_bucket, tmp_path):
    for text in ("s3://bucket-only", "hf://name-without-org@" + "a" * 40, "hf://org/name@main", "gs://x/y"):
        with pytest.raises(InvalidArgument):
            ModelSource.parse(text)
    with pytest.raises(NotFound, match="push the model first"):
        fetch(f"s3://{s3_bucket.bucket}/nothing", tmp_path, s3=s3_bucket.settings())
    with pytest.raises(NotFound, match=r"no config\.json"):
        fetch(str(tmp_path), tmp_path / "cache")


def test_a_local_directory_is_used_as_it_is(model, tmp_path):
    assert fetch(str(model), tmp_path / "cache") == model and not (tmp_path / "cache").exists()


def test_the_command_line_fetches_into_a_link(model, s3_bucket, tmp_path):
    env = {
        **os.environ,
        "PREFT_MODEL__S3__ENDPOINT_URL": s3_bucket.endpoint_url,
        "PREFT_MODEL__S3__ACCESS_KEY": s3_bucket.access_key,
        "PREFT_MODEL__S3__SECRET_KEY": s3_bucket.secret_key,
    }
    cli = [sys.executable, "-m", "preft.common.model_source"]
    target = f"s3://{s3_bucket.bucket}/cli"
    pushed = subprocess.run([*cli, "push", str(model), target], env=env, capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0, pushed.stderr
    link = tmp_path / "models" / "base"
    env["PREFT_MODEL__SOURCE"] = target
    got = subprocess.run(
        [*cli, "fetch", "--cache-dir", str(tmp_path / "cache"), "--link", str(link)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr
    assert link.is_symlink() and _files(link.resolve()) == _files(model)
    missing = subprocess.run([*cli, "fetch", "s3://nope/x"], env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "error:" in missing.stderr


def test_a_hugging_face_source_is_its_snapshot_in_the_hub_cache(model, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "huggingface" / "models--acme--tiny"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model, snapshot)  # (as huggingface_hub lays out a fetched snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch(f"hf://acme/tiny@{commit}", tmp_path / "cache") == snapshot
    with pytest.raises(Unavailable, match="could not be fetched"):
        fetch(f"hf://acme/other@{commit}", tmp_path / "cache")


def _fetch_init(values: dict) -> dict[str, dict]:
    """The chart's fetch-model init container of each pod template, by the object's name."""
    docs = m.helm_render(values)
    out = {}
    for o in docs:
        for _, tpl in m.pod_templates(o):
            for c in tpl["spec"].get("initContainers", []):
                if c["name"] == "fetch-model":
                    volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
                    out.setdefault(o["metadata"]["name"], {**c, "models_volume": volumes["models"]})
    return out


def test_the_charts_init_container_fetches_the_model_as_rendered(model, s3_bucket, tmp_path):
    source = f"s3://{s3_bucket.bucket}/chart/tiny"
    push(model, source, s3=s3_bucket.settings())
    values = {
        "model": {"source": "s3", "uri": source, "path": "base"},
        "seaweedfs": {"enabled": False},
        "s3": {"endpointUrl": s3_bucket.endpoint_url, "accessKey": "x", "secretKey": "y"},
    }
    inits = _fetch_init(values)
    assert set(inits) == {"preft-gateway", "preft-engine"}
    gateway, engine = inits["preft-gateway"], inits["preft-engine"]
    assert engine["models_volume"]["emptyDir"] == {"sizeLimit": "64Gi"} and gateway["image"] != engine["image"]
    for name, init in inits.items():  # run as rendered, the Secret's keys being the bucket's
        env = {e["name"]: e.get("value") for e in init["env"]}
        secrets = {
            "PREFT_MODEL__S3__ACCESS_KEY": s3_bucket.access_key,
            "PREFT_MODEL__S3__SECRET_KEY": s3_bucket.secret_key,
        }
        assert {e["name"] for e in init["env"] if "valueFrom" in e} == set(secrets)
        root = tmp_path / name
        command = [a.replace("/models", str(root)) for a in init["command"]]
        assert command[:3] == ["python", "-m", "preft.common.model_source"]
        run = subprocess.run(
            [sys.executable, *command[1:]],
            env={**os.environ, **{k: v for k, v in env.items() if v is not None}, **secrets, "HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        fetched = set(_files((root / "base").resolve()))
        if env["PREFT_MODEL__TOKENIZER_ONLY"] == "true":
            assert "config.json" in fetched and "model.safetensors" not in fetched
        else:
            assert fetched == set(_files(model))

    hf = _fetch_init({"model": {"source": "hf", "uri": "hf://acme/tiny@" + "a" * 40, "hfTokenSecret": "hf"}})
    env = {e["name"]: e for e in hf["preft-engine"]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert "PREFT_MODEL__S3__ACCESS_KEY" not in env
