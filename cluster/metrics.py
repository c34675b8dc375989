"""kvray metrics through Ray's metrics agent (what the ingress records per tenant:
engine/observability/tenant_metrics.py).

Every Ray node exports the metrics of all processes on it at its metrics export port
(`ray start --metrics-export-port=8080`), as `ray_<name>`: one Prometheus scrape per node
covers every replica there. Inside a Serve replica, `ray.serve.metrics` adds the
`deployment`, `replica` and `application` labels.

Build a `RayMetricsSink` inside the replica (in `__init__`), never at import time: Serve
copies a deployment class with its globals, and a metric object made at module level in
the driver never reaches the exporter.

Ray's agent drops a gauge value that its process has not set again within two report
intervals (so a dead replica's gauges vanish); `RayMetricsSink` therefore sets its gauges
again every `refresh_interval_s` from a daemon thread, so an idle engine stays visible.

The ingress serves them at GET /metrics too, where vLLM's users look (`kvray_metrics_text`):
it reads every node's export and keeps the app's `ray_kvray_*` series, so a scrape of the
HTTP port yields the series (names and labels) the dashboard and the alerts query.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from engine.observability.metrics import METRICS


class RayMetricsSink:
    """The `engine.observability.metrics.MetricsSink` on `ray.serve.metrics` (plain Ray tags outside Serve)."""

    def __init__(self, refresh_interval_s: float = 1.0) -> None:
        from ray.serve import metrics

        if refresh_interval_s <= 0:
            raise ValueError(f"refresh_interval_s must be > 0, got {refresh_interval_s}")
        self.refresh_interval_s = refresh_interval_s
        self._gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._metrics: dict[str, Any] = {}
        for m in METRICS:
            if m.kind == "counter":
                metric = metrics.Counter(m.name, m.description, tag_keys=m.labels)
            elif m.kind == "gauge":
                metric = metrics.Gauge(m.name, m.description, tag_keys=m.labels)
            else:
                metric = metrics.Histogram(
                    m.name, m.description, boundaries=list(m.buckets), tag_keys=m.labels
                )
            self._metrics[m.name] = metric
        threading.Thread(target=self._refresh_gauges, name="kvray-gauges", daemon=True).start()

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        if value > 0:  # Ray raises on increments <= 0
            self._metrics[name].inc(value, tags=dict(labels))

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        with self._lock:
            self._gauges[(name, tuple(labels.items()))] = value
        self._metrics[name].set(value, tags=dict(labels))

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._metrics[name].observe(value, tags=dict(labels))

    def close(self) -> None:
        """Stop refreshing gauges: they age out of Ray's export within two report intervals."""
        self._closed.set()

    def _refresh_gauges(self) -> None:
        while not self._closed.wait(self.refresh_interval_s):
            with self._lock:
                gauges = list(self._gauges.items())
            for (name, labels), value in gauges:
                self._metrics[name].set(value, tags=dict(labels))


class ReplicaReadiness:
    """`kvray_replica_ready`: 1 while the replica's engine is healthy (set on health checks)."""

    def __init__(self, sink: Any, model_name: str) -> None:
        self.sink = sink
        self.labels = {"model": model_name}

    def set(self, ready: bool) -> None:
        self.sink.set("kvray_replica_ready", 1.0 if ready else 0.0, self.labels)


APP_SERIES_PREFIX = "ray_kvray_"
"""kvray's metrics as Ray's export names them."""


def metrics_notice(base_url: str | None = None) -> str:
    """Where a running app's metrics and the Grafana dashboard are (logged at start)."""
    where = f"{base_url}/metrics" if base_url else "GET /metrics on the app's HTTP port"
    return (
        f"Prometheus metrics: {where} (ray_kvray_*, also at each Ray node's metrics export "
        "port); Grafana dashboard: grafana/kvray-dashboard.json (docs/monitoring.md)"
    )


_APPLICATION = re.compile(r'[{,]application="((?:[^"\\]|\\.)*)"')

logger = logging.getLogger("ray.serve")


async def kvray_metrics_text(application: str | None, timeout_s: float = 5.0) -> str:
    """The `ray_kvray_*` series of every live Ray node's metrics export, Prometheus text,
    without those of other Serve applications than `application` (None: keep all)."""
    import ray

    nodes = await asyncio.to_thread(ray.nodes)
    urls = [
        f"http://{_host(node['NodeManagerAddress'])}:{node['MetricsExportPort']}/metrics"
        for node in nodes
        if node.get("Alive") and node.get("MetricsExportPort")
    ]
    texts = await asyncio.gather(*(asyncio.to_thread(_fetch, url, timeout_s) for url in urls))
    return merge_kvray_series(texts, application)


def merge_kvray_series(texts: Iterable[str], application: str | None) -> str:
    """The kvray families of several exports as one exposition: each family's HELP and
    TYPE once, then its samples from every export (a node's labels tell them apart)."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        family = None  # the family the export's samples now belong to
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2] if parts[2].startswith(APP_SERIES_PREFIX) else None
                    if family is not None:
                        (helps if parts[1] == "HELP" else types).setdefault(family, line)
                        samples.setdefault(family, [])
                continue
            if family is None or not line.startswith(APP_SERIES_PREFIX):
                continue
            found = _APPLICATION.search(line)
            if application is None or found is None or found.group(1) == application:
                samples[family].append(line)
    lines = []
    for family, found in samples.items():
        lines += [h for h in (helps.get(family), types.get(family)) if h is not None] + found
    return "\n".join(lines) + "\n" if lines else ""


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _fetch(url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", "replace")
    except OSError as e:
        logger.warning("could not read the Ray metrics export at %s: %s", url, e)
        return ""
