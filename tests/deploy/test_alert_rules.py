"""The alerts under promtool: `promtool check rules` on the PrometheusRule's groups as the chart renders them and as
kustomize builds them, and `promtool test rules` on each alert's unit tests (tests/deploy/alerts/<alert>.yaml: series
that fire it and series that do not).

The chart's templates/monitoring.yaml is the source: deploy/base/monitoring/prometheusrule.yaml is it rendered with
the default values, and a test holds the two equal. The unit tests run on the rules without their annotations
(promtool would otherwise compare every annotation's text); `check rules` validates the annotations' templates.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import manifests as m

ALERT_TESTS = Path(__file__).parent / "alerts"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")


@pytest.fixture(scope="module")
def chart_groups() -> list[dict]:
    return m.one(m.helm_render({"monitoring": {"enabled": True}}), "PrometheusRule", "preft")["spec"]["groups"]


@pytest.fixture(scope="module")
def kustomize_groups(kustomize_outputs) -> list[dict]:
    return m.one(kustomize_outputs["gpu"], "PrometheusRule", "preft")["spec"]["groups"]


def _alerts(groups: list[dict]) -> dict[str, dict]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def _write_rules(path: Path, groups: list[dict], *, annotations: bool = True) -> Path:
    groups = [
        {**g, "rules": [r if annotations else {k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
        for g in groups
    ]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_kustomize_rules_are_the_chart_rendered_with_its_defaults(chart_groups, kustomize_groups):
    assert kustomize_groups == chart_groups


def test_the_alerts_platform_operators_need_are_there(chart_groups):
    assert set(_alerts(chart_groups)) >= {
        "PreftEngineDown",
        "PreftKVCachePressure",
        "PreftAdapterLoadFailures",
        "PreftAdapterPagingThrash",
        "PreftRedisErrors",
        "PreftS3Errors",
        "PreftGatewayHighErrorRate",
        "PreftTimeToFirstTokenHigh",
    }


@needs_promtool
@pytest.mark.parametrize("source", ["chart", "kustomize"])
def test_promtool_check_rules_passes(source, chart_groups, kustomize_groups, tmp_path):
    groups = chart_groups if source == "chart" else kustomize_groups
    proc = _promtool("check", "rules", str(_write_rules(tmp_path / "rules.yaml", groups)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in proc.stdout


def test_every_alert_has_unit_tests_that_fire_it_and_that_do_not(chart_groups):
    files = {p.stem: yaml.safe_load(p.read_text()) for p in ALERT_TESTS.glob("*.yaml")}
    assert set(files) == set(_alerts(chart_groups))
    for alert, spec in files.items():
        cases = [c for t in spec["tests"] for c in t.get("alert_rule_test", [])]
        assert cases and all(c["alertname"] == alert for c in cases), alert
        assert any(c["exp_alerts"] for c in cases), f"{alert}: no case fires it"
        assert any(not c["exp_alerts"] for c in cases), f"{alert}: no case where it stays quiet"


@needs_promtool
@pytest.mark.parametrize("alert_test", sorted(ALERT_TESTS.glob("*.yaml")), ids=lambda p: p.stem)
def test_promtool_unit_tests(alert_test, chart_groups, tmp_path):
    _write_rules(tmp_path / "rules.yaml", chart_groups, annotations=False)
    shutil.copy(alert_test, tmp_path / alert_test.name)
    proc = _promtool("test", "rules", alert_test.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_chart_thresholds_reach_every_alert():
    alerts = {
        "kvCacheUsageRatio": 0.8,
        "adapterLoadFailuresPer10m": 7,
        "storeErrorsPerSecond": 0.2,
        "registryErrorRatio": 0.02,
        "engineDownFor": "3m",
    }
    rule = m.one(m.helm_render({"monitoring": {"enabled": True, "alerts": alerts}}), "PrometheusRule", "preft")
    rendered = _alerts(rule["spec"]["groups"])
    assert rendered["PreftKVCachePressure"]["expr"].endswith("> 0.8")
    assert rendered["PreftAdapterLoadFailures"]["expr"].endswith("> 7")
    assert rendered["PreftRedisErrors"]["expr"].endswith("> 0.2")
    assert rendered["PreftS3Errors"]["expr"].endswith("> 0.2")
    assert rendered["PreftRegistryErrors"]["expr"].endswith("> 0.02")
    assert rendered["PreftEngineDown"]["for"] == "3m"
