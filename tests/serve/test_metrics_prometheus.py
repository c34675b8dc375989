"""A real Prometheus scrapes a running kvray Serve app through Ray's metrics export.

Traffic is shaped to touch every metric: a burst larger than the batch (queue wait), a KV
cache too small for the batch (preemptions, swapped out to a CPU pool), a shared prompt
prefix (prefix hits, on the GPU and from the pool's CPU tier), and a
tenant over its token budget (429 rejections); two engine replicas, so requests go through
the prefix-affinity router (its decisions). Prometheus evaluates the shipped alert
rules with `for:` shortened so that the queue-wait alert fires within the test.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import subprocess
import time

import httpx
import pytest
import yaml

from tests.support.grafana_queries import (
    ALERTS,
    dashboard_exprs,
    queried_metric_names,
    to_prometheus_expr,
)
from tests.support.serve_apps import served_app

# Ray reports metrics every 10 s by default; read when Ray starts, and this module is
# imported (collected) before any test starts Ray.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

APP = "metrics"
ARGS = {
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_ongoing_requests": 32,
    "max_queued_requests": 64,
    "num_gpu_blocks": 12,
    "swap_space": 0.05,
    "preemption_mode": "swap",
    "num_cpus": 0.25,
    "min_replicas": 2,  # two engine replicas: the router's decisions are on the dashboard
    "max_replicas": 2,
    "ingress_max_replicas": 1,
    "request_timeout_s": 120,
    "tenants": {"metered": {"tokens_per_minute": 1}},
    # The autoscaling panels' target series (min = max replicas: nothing scales).
    "autoscaling_metric": "queue_wait",
    "target_queue_wait_s": 1.0,
}
# Sent before the burst and again after it: the burst evicts its blocks to the CPU tier.
EVICTED = "A list of rivers by length, longest first, with the seas they flow into: " * 2
SHARED = "Here is a long story about a fox, a dog and a river that both of them had to cross. "
BURST = 16
ALERT = "KvrayQueueWaitHigh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(url: str, prompt: str, max_tokens: int, tenant: str = "default") -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Tenant-Id": tenant}, timeout=120)
    return r.status_code


@pytest.fixture(scope="module")
def app_url():
    with served_app(APP, ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def prometheus(app_url, tmp_path_factory):
    import ray

    promtool = shutil.which("prometheus")
    assert promtool, "prometheus not found: apt-get install prometheus (.ci/run does)"
    tmp = tmp_path_factory.mktemp("prometheus")
    targets = [f"127.0.0.1:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]]
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "1s"
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = subprocess.Popen(
        [
            promtool,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "prometheus.log", "w"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(f"{base}/-/ready", timeout=2).status_code == 200, 30, "ready")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = condition()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _query(base: str, expr: str) -> list[dict]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _alert_state(base: str, name: str) -> str | None:
    alerts = httpx.get(f"{base}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    states = {a["state"] for a in alerts if a["labels"]["alertname"] == name}
    return "firing" if "firing" in states else (states.pop() if states else None)


@pytest.fixture(scope="module")
def traffic(app_url, prometheus):
    # Before any load the queue-wait alert has nothing to fire on.
    time.sleep(3)
    assert _alert_state(prometheus, ALERT) != "firing"
    assert _complete(app_url, EVICTED, 2) == 200
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        codes = list(pool.map(lambda i: _complete(app_url, f"{SHARED}Part {i}:", 40), range(BURST)))
    assert codes == [200] * BURST
    assert _complete(app_url, EVICTED, 2) == 200
    # A tenant over its minute of tokens: the first request passes, later ones get 429.
    assert _complete(app_url, "Hi", 2, tenant="metered") == 200
    _wait(lambda: _complete(app_url, "Hi", 2, tenant="metered") == 429, 10, "a 429")
    return prometheus


def test_every_queried_metric_has_a_series(traffic):
    names = sorted(queried_metric_names())

    def missing() -> list[str]:
        return [n for n in names if not _query(traffic, f'{{__name__="{n}"}}')]

    last: list[list[str]] = []

    def all_there() -> bool:
        last[:] = [missing()]
        return not last[0]

    try:
        _wait(all_there, 30, "every metric")
    except AssertionError:
        pytest.fail(f"no series in Prometheus for: {last[0]}")
    preemptions = _query(traffic, "sum(ray_kvray_num_preemptions_total)")
    assert float(preemptions[0]["value"][1]) > 0
    # Every dashboard query is accepted by Prometheus itself.
    for expr in dashboard_exprs():
        _query(traffic, to_prometheus_expr(expr))


def test_queue_wait_alert_fires_under_a_burst(traffic):
    _wait(lambda: _alert_state(traffic, ALERT) == "firing", 30, f"{ALERT} to fire")
    p90 = _query(
        traffic,
        "histogram_quantile(0.9, sum by (le) "
        "(rate(ray_kvray_request_queue_time_seconds_bucket[1m])))",
    )
    assert float(p90[0]["value"][1]) > 0.2


def test_tenant_series_name_the_model_a_request_went_to(app_url, traffic):
    served = httpx.get(f"{app_url}/v1/models", timeout=10).json()["data"][0]["id"]
    # Refused before it reached a model (malformed JSON): no model label.
    bad = httpx.post(f"{app_url}/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400

    def series(expr: str) -> list[dict]:
        return _query(traffic, expr)

    tokens = _wait(
        lambda: series('ray_kvray_tenant_tokens_total{tenant="default",kind="prompt"}'),
        30,
        "tenant tokens",
    )
    assert {s["metric"]["model"] for s in tokens} == {served}
    rejected = _wait(
        lambda: series('ray_kvray_tenant_rejections_total{tenant="metered"}'), 30, "the 429s"
    )
    assert {s["metric"]["model"] for s in rejected} == {served}
    refused = _wait(
        lambda: series('ray_kvray_http_requests_total{code="400"}'), 30, "the 400's series"
    )
    # Prometheus keeps no empty label: the series has no model at all.
    assert {s["metric"].get("model") for s in refused} == {None}
