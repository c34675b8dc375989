"""Writes grafana/kvray-dashboard.json: `python grafana/build_dashboard.py`.

The dashboard is generated so that every panel follows one pattern; a test checks that the
JSON on disk is what this script writes. Metric names are those Ray exports (`ray_` +
engine/observability/metrics.py's names). The Prometheus data source is the `datasource` variable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvray-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model=~"$model", replica=~"$replica"'
TENANT = 'tenant=~"$tenant"'
MODEL = 'model=~"$model"'
RATE = "$__rate_interval"
WIDTH = 24


def quantiles(metric: str, selector: str = SEL) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"P{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def rate(metric: str, by: str = "", selector: str = SEL) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[{RATE}]))"


def ratio(num: str, den: str) -> str:
    return f"{num} / {den}"


# (row title, [(panel title, kind, unit, [(expr, legend)])])
ROWS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]]]]]] = [
    (
        "Overview",
        [
            (
                "Ready replicas",
                "stat",
                "none",
                [('sum(ray_kvray_replica_ready{model=~"$model"})', "ready")],
            ),
            (
                "Finished requests / s",
                "stat",
                "reqps",
                [(rate("ray_kvray_request_success_total"), "requests/s")],
            ),
            (
                "HTTP error rate (5xx)",
                "stat",
                "percentunit",
                [
                    (
                        ratio(
                            rate("ray_kvray_http_requests_total", selector='code=~"5.."'),
                            rate("ray_kvray_http_requests_total", selector=""),
                        ),
                        "5xx",
                    )
                ],
            ),
            (
                "KV cache usage (max replica)",
                "stat",
                "percentunit",
                [(f"max(ray_kvray_kv_cache_usage_perc{{{SEL}}})", "usage")],
            ),
        ],
    ),
    (
        "Latency",
        [
            (
                "Time to first token",
                "timeseries",
                "s",
                quantiles("ray_kvray_time_to_first_token_seconds"),
            ),
            (
                "Inter-token latency",
                "timeseries",
                "s",
                quantiles("ray_kvray_inter_token_latency_seconds"),
            ),
            (
                "End-to-end latency",
                "timeseries",
                "s",
                quantiles("ray_kvray_e2e_request_latency_seconds"),
            ),
            (
                "Queue wait (arrival to first scheduled)",
                "timeseries",
                "s",
                quantiles("ray_kvray_request_queue_time_seconds"),
            ),
        ],
    ),
    (
        "Throughput",
        [
            (
                "Tokens / s",
                "timeseries",
                "short",
                [
                    (rate("ray_kvray_prompt_tokens_total"), "prompt"),
                    (rate("ray_kvray_generation_tokens_total"), "generation"),
                ],
            ),
            (
                "Finished requests / s by reason",
                "timeseries",
                "reqps",
                [
                    (
                        rate("ray_kvray_request_success_total", "finished_reason"),
                        "{{finished_reason}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Scheduler",
        [
            (
                "Queue backlog",
                "timeseries",
                "short",
                [
                    (f"sum(ray_kvray_num_requests_running{{{SEL}}})", "running"),
                    (f"sum(ray_kvray_num_requests_waiting{{{SEL}}})", "waiting"),
                    (f"sum(ray_kvray_num_requests_swapped{{{SEL}}})", "swapped"),
                ],
            ),
            (
                "Batch utilization: tokens per step",
                "timeseries",
                "short",
                [
                    (
                        ratio(
                            rate("ray_kvray_iteration_tokens_sum"),
                            rate("ray_kvray_iteration_tokens_count"),
                        ),
                        "mean",
                    ),
                    *quantiles("ray_kvray_iteration_tokens")[1:2],
                ],
            ),
            (
                "Batch size: requests per step",
                "timeseries",
                "short",
                [
                    (
                        ratio(rate("ray_kvray_batch_size_sum"), rate("ray_kvray_batch_size_count")),
                        "mean",
                    ),
                    *quantiles("ray_kvray_batch_size")[1:2],
                ],
            ),
            (
                "Preemptions / s",
                "timeseries",
                "short",
                [(rate("ray_kvray_num_preemptions_total", "replica"), "{{replica}}")],
            ),
        ],
    ),
    (
        "KV cache",
        [
            (
                "KV cache usage",
                "timeseries",
                "percentunit",
                [(f"max by (replica) (ray_kvray_kv_cache_usage_perc{{{SEL}}})", "{{replica}}")],
            ),
            (
                "KV internal fragmentation",
                "timeseries",
                "percentunit",
                [
                    (
                        f"max by (replica) (ray_kvray_kv_cache_fragmentation_perc{{{SEL}}})",
                        "{{replica}}",
                    )
                ],
            ),
            (
                "Prefix cache hit rate",
                "timeseries",
                "percentunit",
                [
                    (
                        ratio(
                            rate("ray_kvray_prefix_cache_hits_total"),
                            rate("ray_kvray_prefix_cache_queries_total"),
                        ),
                        "hit rate",
                    ),
                    (
                        ratio(
                            rate("ray_kvray_prefix_cache_cpu_hits_total"),
                            rate("ray_kvray_prefix_cache_queries_total"),
                        ),
                        "from the CPU tier",
                    ),
                ],
            ),
            (
                "CPU KV pool (swap_space) usage",
                "timeseries",
                "percentunit",
                [
                    (
                        f"max by (replica) (ray_kvray_cpu_kv_cache_usage_perc{{{SEL}}})",
                        "{{replica}}",
                    ),
                    (
                        f"max by (replica) (ray_kvray_cpu_prefix_cache_usage_perc{{{SEL}}})",
                        "{{replica}} prefix tier",
                    ),
                ],
            ),
            (
                "Swaps / s",
                "timeseries",
                "short",
                [
                    (rate("ray_kvray_num_swap_outs_total", "replica"), "{{replica}} out"),
                    (rate("ray_kvray_num_swap_ins_total", "replica"), "{{replica}} in"),
                ],
            ),
        ],
    ),
    (
        "Replicas",
        [
            (
                "Ready replicas by model",
                "timeseries",
                "none",
                [("sum by (model) (ray_kvray_replica_ready)", "{{model}}")],
            ),
            (
                "Running requests by replica",
                "timeseries",
                "short",
                [(f"sum by (replica) (ray_kvray_num_requests_running{{{SEL}}})", "{{replica}}")],
            ),
            (
                # Recorded by the ingress's router: no engine replica label to select.
                "Routing decisions / s (prefix_affinity)",
                "timeseries",
                "reqps",
                [
                    (
                        rate("ray_kvray_routing_decisions_total", "model, decision", MODEL),
                        "{{model}} {{decision}}",
                    )
                ],
            ),
        ],
    ),
    (
        # Replicas, queue wait and TTFT as the autoscaler sees them (autoscaling_metric):
        # each replica's look-back mean that it reports, the target, and the mean of all.
        "Autoscaling",
        [
            (
                f"{title} vs the autoscaling target",
                "timeseries",
                "s",
                [
                    (
                        "max by (replica) (ray_kvray_autoscaling_signal_seconds"
                        f'{{{SEL}, signal="{signal}"}})',
                        "{{replica}} reported",
                    ),
                    (
                        "max by (model) (ray_kvray_autoscaling_target_seconds"
                        f'{{{MODEL}, signal="{signal}"}})',
                        "{{model}} target",
                    ),
                    (ratio(rate(f"{histogram}_sum"), rate(f"{histogram}_count")), "mean"),
                ],
            )
            for title, signal, histogram in (
                ("Queue wait", "queue_wait", "ray_kvray_request_queue_time_seconds"),
                ("Time to first token", "ttft", "ray_kvray_time_to_first_token_seconds"),
            )
        ],
    ),
    (
        "Tenants",
        [
            (
                "Requests / s by tenant and status",
                "timeseries",
                "reqps",
                [
                    (
                        rate("ray_kvray_http_requests_total", "tenant, code", TENANT),
                        "{{tenant}} {{code}}",
                    )
                ],
            ),
            (
                "Tokens / s by tenant and model",
                "timeseries",
                "short",
                [
                    (
                        rate("ray_kvray_tenant_tokens_total", "model, tenant, kind", TENANT),
                        "{{tenant}} {{model}} {{kind}}",
                    )
                ],
            ),
            (
                "Rejections (429) / s by tenant",
                "timeseries",
                "reqps",
                [
                    (
                        rate("ray_kvray_tenant_rejections_total", "tenant, reason", TENANT),
                        "{{tenant}} {{reason}}",
                    )
                ],
            ),
        ],
    ),
    (
        # The admin API's model lifecycle (cluster/replica_lifecycle.py).
        "Model lifecycle",
        [
            (
                "Replicas by model state (serving, switching, asleep)",
                "timeseries",
                "none",
                [
                    (
                        f"sum by (model, state) (ray_kvray_model_state{{{MODEL}}})",
                        "{{model}} {{state}}",
                    )
                ],
            ),
            (
                "Model switches by outcome (since each replica started)",
                "timeseries",
                "short",
                [
                    (
                        f"sum by (model, outcome) (ray_kvray_model_switches{{{MODEL}}})",
                        "{{model}} {{outcome}}",
                    )
                ],
            ),
        ],
    ),
]


def panel(pid: int, title: str, kind: str, unit: str, targets, grid: dict) -> dict[str, Any]:
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DS,
        "gridPos": grid,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def query_variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": DS,
        "query": query,
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "sort": 1,
    }


def build_dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    pid = 1
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": WIDTH, "h": 1},
                "panels": [],
            }
        )
        pid += 1
        y += 1
        per_line = 4 if row_panels[0][1] == "stat" else 2
        width = WIDTH // per_line
        height = 4 if per_line == 4 else 8
        for i, (title, kind, unit, targets) in enumerate(row_panels):
            grid = {
                "x": (i % per_line) * width,
                "y": y + (i // per_line) * height,
                "w": width,
                "h": height,
            }
            panels.append(panel(pid, title, kind, unit, targets, grid))
            pid += 1
        y += -(-len(row_panels) // per_line) * height
    return {
        "uid": "kvray-overview",
        "title": "kvray",
        "description": "kvray LLM serving: latency, throughput, scheduler, KV cache, tenants.",
        "tags": ["kvray", "llm", "ray"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "refresh": 1,
                },
                query_variable("model", "label_values(ray_kvray_num_requests_running, model)"),
                query_variable(
                    "replica",
                    'label_values(ray_kvray_num_requests_running{model=~"$model"}, replica)',
                ),
                query_variable("tenant", "label_values(ray_kvray_http_requests_total, tenant)"),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
