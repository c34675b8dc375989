"""A real Serve app's HTTP routes beside OpenAI's: GET /metrics, the series Prometheus
would scrape from Ray's metrics export, on the HTTP port where vLLM's users look."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import KVRAY_SERIES_PREFIX, merge_kvray_series
from tests.ingress_outside_serve import build_ingress, outside_serve  # noqa: F401 (a fixture)
from tests.serve.test_serve_support import delete_app, run_app

# Ray reports metrics every 10 s by default; read when Ray starts, and this module is
# imported (collected) before any test starts Ray.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

APP = "surface"
ARGS = {"max_model_len": 256, "max_num_seqs": 4, "num_cpus": 0.25, "ingress_max_replicas": 1}


@pytest.fixture(scope="module")
def url():
    url = run_app(APP, ARGS)
    yield url
    delete_app(APP)


def _node_exports() -> list[str]:
    return [
        httpx.get(f"http://127.0.0.1:{n['MetricsExportPort']}/metrics", timeout=10).text
        for n in ray.nodes()
        if n["Alive"]
    ]


def _families(text: str) -> dict[str, set]:
    """Family name -> its series (sample name and labels), as Prometheus parses them."""
    return {
        family.name: {(s.name, tuple(sorted(s.labels.items()))) for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


@pytest.fixture(scope="module")
def scraped(url) -> str:
    """/metrics once the engine's and the ingress's series of a request have arrived."""
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(f"{url}/metrics", timeout=30)
        assert r.status_code == 200
        if "ray_kvray_generation_tokens" in r.text and "ray_kvray_http_requests" in r.text:
            return r
        assert time.monotonic() < deadline, r.text
        time.sleep(1)


def test_metrics_serves_the_apps_kvray_series_in_prometheus_text(scraped):
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = _families(scraped.text)
    assert all(name.startswith(KVRAY_SERIES_PREFIX) for name in families)
    series = {s for found in families.values() for s in found}
    for name, labels in series:
        assert dict(labels).get("application", APP) == APP, (name, labels)
    assert any(n.startswith("ray_kvray_generation_tokens") for n, _ in series)
    assert any(n.startswith("ray_kvray_http_requests") for n, _ in series)


def test_metrics_holds_the_series_the_nodes_export(scraped):
    """The dashboard's queries read the same names and labels either way."""
    for _ in range(5):  # a gauge may age out between the two reads: read both again
        served = _families(httpx.get(scraped.url, timeout=30).text)
        exported = _families(merge_kvray_series(_node_exports(), APP))
        if served == exported:
            break
    assert served == exported


def test_merging_exports_names_each_family_once_and_drops_other_apps():
    node = (
        "# HELP ray_kvray_x_total Things.\n# TYPE ray_kvray_x_total counter\n"
        'ray_kvray_x_total{application="a",NodeAddress="%s"} 1.0\n'
        'ray_kvray_x_total{application="b",NodeAddress="%s"} 1.0\n'
        "# HELP ray_other Other.\n# TYPE ray_other gauge\nray_other 1.0\n"
    )
    merged = merge_kvray_series([node % ("n1", "n1"), node % ("n2", "n2")], "a")
    assert merged.count("# TYPE ray_kvray_x_total counter") == 1
    families = _families(merged)
    assert list(families) == ["ray_kvray_x"]
    assert {dict(labels)["NodeAddress"] for _, labels in families["ray_kvray_x"]} == {"n1", "n2"}
    assert "ray_other" not in merged and 'application="b"' not in merged


def test_kvray_serve_prints_where_the_metrics_and_the_dashboard_are(monkeypatch, capsys):
    from ray import serve

    import cluster.deployments
    from cluster.cli import main

    monkeypatch.setattr(ray, "init", lambda **_: None)
    monkeypatch.setattr(serve, "start", lambda **_: None)
    monkeypatch.setattr(serve, "run", lambda *_, **__: None)
    monkeypatch.setattr(cluster.deployments, "build_openai_app", lambda config: None)
    assert main(["serve", "--port", "8123"]) == 0
    out = capsys.readouterr().out
    assert "http://127.0.0.1:8123/metrics" in out
    assert "grafana/kvray-dashboard.json" in out


@pytest.mark.usefixtures("outside_serve")
def test_an_ingress_logs_where_the_metrics_and_the_dashboard_are(monkeypatch):
    """What `serve run serve_app:app` (and a config file) shows when the app starts."""
    import asyncio

    import cluster.ingress
    from cluster.app_config import load_app_config
    from cluster.local_server import LocalServer

    logged: list[str] = []
    monkeypatch.setattr(cluster.ingress.logger, "info", lambda message: logged.append(message))
    asyncio.run(build_ingress(LocalServer(object(), 1), load_app_config({})))
    assert any("GET /metrics" in m and "grafana/kvray-dashboard.json" in m for m in logged)
