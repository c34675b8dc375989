"""What the Grafana dashboard and the alert rules query: their PromQL expressions and the
metric names those select."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "kvray-dashboard.json"
ALERTS = GRAFANA / "alerts.yaml"
RAY_PREFIX = "ray_"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
_KEYWORDS |= {"and", "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric (and recording-rule) names an expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\boffset\s+\S+", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[m.end() :].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in load_dashboard()["panels"] for t in p.get("targets", [])]


def load_alert_groups() -> list[dict]:
    return yaml.safe_load(ALERTS.read_text())["groups"]


def alert_exprs() -> list[str]:
    return [str(r["expr"]) for g in load_alert_groups() for r in g["rules"]]


def recording_rules() -> set[str]:
    return {r["record"] for g in load_alert_groups() for r in g["rules"] if "record" in r}


def queried_metric_names() -> set[str]:
    """Every exported metric the dashboard and the alert rules read (recording rules aside)."""
    names = set()
    for expr in dashboard_exprs() + alert_exprs():
        names |= promql_metric_names(expr)
    return names - recording_rules()


def to_prometheus_expr(expr: str) -> str:
    """A dashboard expression as Prometheus itself would get it from Grafana."""
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)
