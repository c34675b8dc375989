"""A real Serve app's HTTP routes beside OpenAI's: GET /metrics, the series Prometheus
would scrape from Ray's metrics export, on the HTTP port where vLLM's users look; and
/openapi.json, whose request-body schemas are the protocol's models, held to by a small
fuzz: bodies built from the published schemas, valid and broken, never get a 5xx."""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import APP_SERIES_PREFIX, merge_kvray_series
from cluster.request_bodies import REQUEST_MODELS
from tests.support.outside_serve import build_ingress
from tests.support.serve_apps import delete_app, run_app

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
    assert all(name.startswith(APP_SERIES_PREFIX) for name in families)
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


POSTS = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}


@pytest.fixture(scope="module")
def openapi(url) -> dict:
    r = httpx.get(f"{url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def _body_schema(document: dict, path: str) -> dict:
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    return body["content"]["application/json"]["schema"]


def _resolve(document: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_every_post_path_publishes_its_request_model(openapi):
    posts = {path for path, ops in openapi["paths"].items() if "post" in ops}
    assert posts == POSTS
    models = {model.__name__: model for model in REQUEST_MODELS.values()}
    for path in posts:
        ref = _body_schema(openapi, path)["$ref"]
        model = models[ref.rsplit("/", 1)[1]]
        schema = _resolve(openapi, {"$ref": ref})
        required = {f.alias or name for name, f in model.model_fields.items() if f.is_required()}
        assert set(schema.get("required", [])) == required, path
        assert set(schema["properties"]) >= required and schema["additionalProperties"] is False
    assert _resolve(openapi, _body_schema(openapi, "/v1/chat/completions"))["required"] == [
        "messages"
    ]


class _Bodies:
    """Request bodies from a published JSON schema: small values (a few tokens to
    generate), and broken copies of them."""

    def __init__(self, document: dict, seed: int) -> None:
        self.document = document
        self.rng = random.Random(seed)

    def valid(self, schema: dict, depth: int = 0) -> Any:
        rng = self.rng
        schema = _resolve(self.document, schema)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.valid(rng.choice(schema[key]), depth)
        kind = schema.get("type")
        if kind == "object":
            fields = schema.get("properties", {})
            chosen = set(schema.get("required", []))
            if depth < 3:
                chosen |= set(rng.sample(sorted(fields), min(len(fields), rng.randint(0, 3))))
            return {name: self.valid(fields[name], depth + 1) for name in chosen}
        if kind == "array":
            least = schema.get("minItems", 0)
            count = rng.randint(least, max(least, 2)) if depth < 4 else least
            return [self.valid(schema.get("items", {}), depth + 1) for _ in range(count)]
        if kind == "string":
            return rng.choice(["", "hi", "Hello there", "{", "a b c"])[: schema.get("maxLength")]
        if kind == "integer":
            low = schema.get("minimum", -1)
            return rng.randint(low, min(schema.get("maximum", low + 5), low + 5))
        if kind == "number":
            return round(rng.uniform(schema.get("minimum", -1.0), schema.get("maximum", 2.0)), 2)
        if kind == "boolean":
            return rng.choice([True, False])
        if kind == "null":
            return None
        return rng.choice([1, "x", None, [], {}])

    def broken(self, body: dict, schema: dict) -> Any:
        rng = self.rng
        schema = _resolve(self.document, schema)
        body = dict(body)
        how = rng.choice(["drop", "extra", "retype", "top", "text"])
        if how == "drop" and schema.get("required"):
            body.pop(rng.choice(schema["required"]))
        elif how == "retype" and body:
            body[rng.choice(sorted(body))] = rng.choice([[{}], {"x": 1}, "x", 1.5, -7, True])
        elif how == "top":
            return rng.choice([[], "x", 3, None, [body]])
        elif how == "text":
            return json.dumps(body)[: rng.randint(0, 20)]
        else:
            body["not_a_field"] = 1
        return body


def _small(path: str, body: dict) -> dict:
    """A valid body that names the served model (or none) and generates a few tokens."""
    body.pop("model", None)
    if path in ("/v1/completions", "/v1/chat/completions"):
        body["max_tokens"] = body.get("max_tokens") and min(max(body["max_tokens"], 1), 4) or 2
        body.pop("max_completion_tokens", None)
    if path == "/tokenize" and not {"prompt", "messages"} & body.keys():
        body["prompt"] = "hi"  # one of the two, which the schema cannot say
    return body


def test_generated_bodies_never_get_a_server_error(url, openapi):
    bodies = _Bodies(openapi, seed=0)
    sent: list[tuple[str, Any, int]] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for path in sorted(POSTS):
            schema = _body_schema(openapi, path)
            for _ in range(8):
                body = _small(path, bodies.valid(schema))
                for sending in (body, bodies.broken(body, schema)):
                    content = sending if isinstance(sending, str) else json.dumps(sending)
                    r = client.post(path, content=content)
                    sent.append((path, sending, r.status_code))
    failed = [s for s in sent if s[2] >= 500]
    assert not failed, failed
    assert {code for _, _, code in sent} & {200} and {code for _, _, code in sent} & {400}
