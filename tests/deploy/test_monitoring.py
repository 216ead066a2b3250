"""The PrometheusRule and the Grafana dashboard: every expression parses as PromQL (promql-parser) and selects only
series preft declares (services/preft/common/metrics.py) or that the rules record."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy import manifests as m

DASHBOARD = m.DEPLOY / "base" / "monitoring" / "dashboards" / "preft-serve.json"


@pytest.fixture(scope="module")
def rule(kustomize_outputs):
    return m.one(kustomize_outputs["gpu"], "PrometheusRule", "preft")


def _rules(rule):
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_rule_expressions_parse_and_use_declared_series(rule):
    declared = m.declared_metric_series() | m.engine_exported_series()
    recorded = {r["record"] for r in _rules(rule) if "record" in r}
    for r in _rules(rule):
        names = m.promql_metric_names(r["expr"])
        assert names, f"{r.get('record') or r.get('alert')} selects nothing"
        unknown = names - declared - recorded
        assert not unknown, f"{r.get('record') or r.get('alert')} uses undeclared series {unknown}"


def test_alerts_cover_errors_ttft_and_paging_thrash(rule):
    alerts = {r["alert"]: r for r in _rules(rule) if "alert" in r}
    assert {"PreftGatewayHighErrorRate", "PreftTimeToFirstTokenHigh", "PreftAdapterPagingThrash"} <= set(alerts)
    recorded = {r["record"]: r["expr"] for r in _rules(rule) if "record" in r}

    def expanded(expr):  # the series an alert reaches through recording rules
        names = m.promql_metric_names(expr)
        return names | {n for rec in names & set(recorded) for n in m.promql_metric_names(recorded[rec])}

    assert "preft_gateway_requests_total" in expanded(alerts["PreftGatewayHighErrorRate"]["expr"])
    assert 'status_class="5xx"' in recorded["preft:gateway_5xx_ratio:rate5m"]
    assert "preft_time_to_first_token_seconds_bucket" in expanded(alerts["PreftTimeToFirstTokenHigh"]["expr"])
    assert {"preft_paging_evictions_total", "preft_paging_hits_total"} <= expanded(
        alerts["PreftAdapterPagingThrash"]["expr"]
    )
    assert "ray_serve_deployment_replica_healthy" in expanded(alerts["PreftEngineDown"]["expr"])
    assert "vllm:kv_cache_usage_perc" in expanded(alerts["PreftKVCachePressure"]["expr"])
    assert "preft_adapter_load_failures_total" in expanded(alerts["PreftAdapterLoadFailures"]["expr"])
    assert 'store="redis"' in alerts["PreftRedisErrors"]["expr"] and 'store="s3"' in alerts["PreftS3Errors"]["expr"]
    assert "preft_registry_rpcs_total" in expanded(alerts["PreftRegistryErrors"]["expr"])
    for a in alerts.values():
        assert a["labels"]["severity"] in ("critical", "warning")
        assert a["annotations"]["summary"] and a["annotations"]["description"]
        assert a.get("for")


def test_rule_groups_have_unique_names(rule):
    names = [g["name"] for g in rule["spec"]["groups"]]
    assert len(names) == len(set(names))


def test_chart_thresholds_reach_the_rules(helm_outputs):
    values = {
        "monitoring": {"enabled": True, "alerts": {"ttftP95Seconds": 0.75, "gatewayErrorRatio": 0.01}},
        "redis": {"enabled": True},
    }
    rule = m.one(m.helm_render(values), "PrometheusRule", "preft")
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert alerts["PreftTimeToFirstTokenHigh"].endswith("> 0.75")
    assert alerts["PreftGatewayHighErrorRate"].endswith("> 0.01")


def test_dashboard_queries_parse_and_use_declared_series(rule):
    dash = json.loads(DASHBOARD.read_text())
    declared = m.declared_metric_series() | m.engine_exported_series()
    seen: set[str] = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            names = m.promql_metric_names(target["expr"])
            assert names, f"panel {panel['title']!r}: selects nothing"
            assert names <= declared, f"panel {panel['title']!r}: undeclared {names - declared}"
            seen |= names
    # the views the dashboard exists for
    for series in (
        "preft_tokens_per_second",
        "preft_generated_tokens_total",
        "preft_time_to_first_token_seconds_bucket",
        "preft_inter_token_latency_seconds_bucket",
        "preft_paging_hits_total",
        "preft_paging_misses_total",
        "preft_paging_evictions_total",
        "preft_requests_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "preft_registry_rpcs_total",
        "preft_store_errors_total",
        "preft_adapter_load_failures_total",
    ):
        assert series in seen, f"no panel shows {series}"
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    assert "by (mode)" in exprs and "by (tier)" in exprs and "by (tenant)" in exprs
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_filters_every_query_by_namespace_and_instance():
    """The dashboard's namespace and instance (pod) variables: every selector of every panel is narrowed by both, so
    one Grafana shows one installation (and, where chosen, some of its pods) out of a shared Prometheus."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["namespace"]["type"] == "query" and not variables["namespace"]["multi"]
    assert variables["instance"]["includeAll"] and variables["instance"]["allValue"] == ".*"
    assert "$namespace" in variables["instance"]["definition"]  # (the pods of the namespace chosen)
    for v in ("namespace", "instance"):  # (their own queries parse too)
        inner = re.fullmatch(r"label_values\((.*), (\w+)\)", variables[v]["definition"])
        assert inner and m.promql_selectors(inner.group(1)), v
    targets = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    assert targets
    for title, expr in targets:
        for name, matchers in m.promql_selectors(expr):
            assert matchers.get("namespace") == ("=", "$namespace"), f"{title}: {name} not filtered by namespace"
            assert matchers.get("pod") == ("=~", "$instance"), f"{title}: {name} not filtered by instance"


def test_dashboard_ships_in_a_configmap_for_the_grafana_sidecar(kustomize_outputs):
    cm = m.one(kustomize_outputs["dev"], "ConfigMap", "preft-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["preft-serve.json"])["uid"] == "preft-serve"


def test_engine_podmonitor_gives_the_replicas_samples_back_their_names(kustomize_outputs):
    """Each replica's preft_* samples reach Prometheus through Ray's metrics port (engine.ray_metrics): Ray names a
    sample ray_<name>, and appends _total to a counter without it (a histogram's _bucket, _sum and _count are
    copied as counters). The PodMonitor's relabelings must turn each back into the series preft declares, so the
    rules and the dashboard read it, and leave Ray's own series alone. (That Ray names them so is checked against a
    real Ray node in tests/integration/engine/test_serve_app.py.)"""
    rules = m.engine_metric_relabelings()
    monitor = m.one(kustomize_outputs["gpu"], "PodMonitor", "preft-engine")
    assert monitor["spec"]["podMetricsEndpoints"][0]["metricRelabelings"] == rules  # (what the overlays deploy)
    engine = {s for s in m.declared_metric_series() if not s.startswith("preft_gateway_")}  # (gateways: scraped)
    gauges = {s for s in m.declared_metric_series(kind="gauge") if not s.startswith("preft_gateway_")}
    assert engine and gauges and gauges < engine
    for series in sorted(engine):
        exported = f"ray_{series}" if series in gauges or series.endswith("_total") else f"ray_{series}_total"
        assert m.relabel({"__name__": exported, "mode": "prefill"}, rules) == {"__name__": series, "mode": "prefill"}
    # vLLM's families ride the same copy as vllm_<name> (Ray takes no ':') and are named back vllm:<name>
    for series in sorted(m.engine_exported_series() - m.RAY_SERIES):
        ray = "ray_" + series.replace(":", "_")
        histogram_part = series.endswith(("_bucket", "_sum", "_count"))
        exported = f"{ray}_total" if histogram_part else ray
        assert m.relabel({"__name__": exported, "engine": "0"}, rules) == {"__name__": series, "engine": "0"}
    for ray_own in ("ray_tasks", "ray_node_cpu_utilization", "ray_serve_num_http_requests_total"):
        assert m.relabel({"__name__": ray_own}, rules) == {"__name__": ray_own}


@pytest.mark.parametrize("source", ["kustomize:gpu", "helm:all-enabled-url"])
def test_gateway_podmonitor_scrapes_the_metrics_address_the_gateway_binds_which_no_service_carries(all_outputs, source):
    """Prometheus scrapes the gateway's pods on their `metrics` port, the one PREFT_GATEWAY__METRICS_ADDRESS binds; the
    gateway's Service (what an Ingress or a LoadBalancer exposes) carries the API's port alone."""
    docs = all_outputs[source]
    (monitor,) = [d for d in m.by_kind(docs, "PodMonitor") if d["metadata"]["name"].endswith("gateway")]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (deployment,) = [d for d in m.by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("gateway")]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (container_port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    config = next(d for d in m.by_kind(docs, "ConfigMap") if "PREFT_GATEWAY__PORT" in d.get("data", {}))
    assert config["data"]["PREFT_GATEWAY__METRICS_ADDRESS"] == f"0.0.0.0:{container_port['containerPort']}"
    assert container_port["containerPort"] != int(config["data"]["PREFT_GATEWAY__PORT"])
    (service,) = [d for d in m.by_kind(docs, "Service") if d["metadata"]["name"].endswith("gateway")]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize("source", ["kustomize:gpu", "helm:all-enabled-url"])
def test_registry_servicemonitor_reaches_the_metrics_address_the_registry_binds(all_outputs, source):
    """Prometheus scrapes the registry through its Service's `metrics` port, which leads to the container port the
    registry's PREFT_REGISTRY__METRICS_ADDRESS binds on all of the pod's interfaces."""
    docs = all_outputs[source]
    (monitor,) = [
        d
        for d in m.by_kind(docs, "ServiceMonitor")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "registry"
    ]
    (endpoint,) = monitor["spec"]["endpoints"]
    (service,) = [d for d in m.by_kind(docs, "Service") if d["metadata"]["name"].endswith("registry")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    (deployment,) = [d for d in m.by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("registry")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (container_port,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    config = next(d for d in m.by_kind(docs, "ConfigMap") if "PREFT_REGISTRY__LISTEN_ADDRESS" in d.get("data", {}))
    assert config["data"]["PREFT_REGISTRY__METRICS_ADDRESS"] == f"0.0.0.0:{container_port['containerPort']}"
