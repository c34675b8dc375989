"""The Grafana dashboard and the alert rules: valid PromQL, and only metrics the code exports."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess

import yaml

from engine.observability.metrics import METRICS, exported_metric_names
from tests.support.grafana_queries import (
    ALERTS,
    DASHBOARD,
    GRAFANA,
    RAY_PREFIX,
    alert_exprs,
    dashboard_exprs,
    load_alert_groups,
    load_dashboard,
    promql_metric_names,
    queried_metric_names,
    recording_rules,
    to_prometheus_expr,
)


def _build_dashboard_module():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install prometheus (.ci/run does)"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_alert_rules():
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": to_prometheus_expr(e)}
                    for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_queried_metric_is_exported_by_the_code():
    exported = exported_metric_names(RAY_PREFIX)
    names = queried_metric_names()
    assert names, "no metric found in the dashboard or the alert rules"
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"queried but never exported: {missing}"
    for expr in alert_exprs():
        for name in promql_metric_names(expr) & recording_rules():
            assert name.startswith("kvray:")


def test_every_metric_has_a_panel():
    on_dashboard = set()
    for expr in dashboard_exprs():
        on_dashboard |= promql_metric_names(expr)
    for m in METRICS:
        assert m.exported_names(RAY_PREFIX) & on_dashboard, f"{m.name} has no panel"


def test_parser_finds_metrics_not_labels_or_functions():
    expr = (
        'histogram_quantile(0.9, sum by (le, model) (rate(a_bucket{code=~"5..", x="y"}[5m])))'
        " > on() group_left() b:rule or absent(c_total) unless d offset 5m"
    )
    assert promql_metric_names(expr) == {"a_bucket", "b:rule", "c_total", "d"}


def test_dashboard_json_is_what_the_generator_writes():
    assert DASHBOARD.read_text() == _build_dashboard_module().render(), (
        "run `python grafana/build_dashboard.py`"
    )


def test_dashboard_reads_prometheus_through_the_datasource_variable():
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"
            metric = re.match(r"label_values\((\w+)", v["query"]).group(1)
            assert metric in exported_metric_names(RAY_PREFIX)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_panels_do_not_overlap():
    cells = set()
    for p in load_dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))


def test_alert_rules_cover_the_operating_signals():
    rules = {r["alert"]: r for g in load_alert_groups() for r in g["rules"] if "alert" in r}
    queue = rules["KvrayQueueWaitHigh"]
    assert "ray_kvray_request_queue_time_seconds_bucket" in queue["expr"]
    assert "histogram_quantile(0.9" in queue["expr"] and queue["for"] == "2m"
    assert rules["KvrayKVCacheNearlyFull"]["for"] == "5m"
    assert "kvray:ttft_p99_slo_seconds" in rules["KvrayTTFTAboveSLO"]["expr"]
    assert "absent(ray_kvray_replica_ready)" in rules["KvrayNoReadyReplica"]["expr"]
    assert 'code=~"5.."' in rules["KvrayErrorRateHigh"]["expr"]
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
