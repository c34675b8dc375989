"""Engine metrics: one table of definitions, a recorder the engine calls, and a sink interface.

`METRICS` is the single list of what kvray exports; the Grafana dashboard and the alert
rules may only name these (a test checks it). `EngineMetrics` turns engine events into
observations and buffers them: the engine thread only appends to lists, and the sink is
called at most once per `flush_interval_s` (and whenever the engine goes idle, so gauges
never stay stale). A `MetricsSink` puts observations somewhere:

- `PrometheusSink` (prometheus-client): the engine outside Ray, exported names as defined;
- a Ray metrics sink outside the engine: Ray's metrics agent, which exports them on every
  node as `ray_<name>` (Ray Serve adds `deployment`, `replica` and `application` labels).

prometheus-client appends `_total` to counters, as Ray does: `kvray_prompt_tokens` is
scraped as `kvray_prompt_tokens_total` (or `ray_kvray_prompt_tokens_total`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

MetricKind = Literal["counter", "gauge", "histogram"]

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
"""Seconds: millisecond resolution where interactive latency lives, up to long generations."""
COUNT_BUCKETS = tuple(float(2**i) for i in range(15))
"""1, 2, 4, ... 16384: tokens or requests per engine step."""


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: MetricKind
    description: str
    labels: tuple[str, ...] = ("model",)
    buckets: tuple[float, ...] = ()

    def exported_names(self, prefix: str = "") -> frozenset[str]:
        """Sample names a scrape shows for this metric (`prefix="ray_"` behind Ray)."""
        base = prefix + self.name
        if self.kind == "counter":
            return frozenset({base + "_total"})
        if self.kind == "histogram":
            return frozenset({base + "_bucket", base + "_sum", base + "_count"})
        return frozenset({base})


def _gauge(name: str, description: str, labels: tuple[str, ...] = ("model",)) -> MetricDef:
    return MetricDef(name, "gauge", description, labels)


def _counter(name: str, description: str, labels: tuple[str, ...] = ("model",)) -> MetricDef:
    return MetricDef(name, "counter", description, labels)


def _histogram(name: str, description: str, buckets: tuple[float, ...]) -> MetricDef:
    return MetricDef(name, "histogram", description, ("model",), buckets)


METRICS: tuple[MetricDef, ...] = (
    _gauge("kvray_num_requests_running", "Requests in the running batch."),
    _gauge("kvray_num_requests_waiting", "Requests waiting to be scheduled (new or preempted)."),
    _gauge("kvray_num_requests_swapped", "Requests whose KV blocks are swapped out to CPU."),
    _gauge("kvray_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."),
    _gauge(
        "kvray_kv_cache_fragmentation_perc",
        "Fraction of the token slots in running requests' blocks that hold no token (0 to 1).",
    ),
    _counter("kvray_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    _counter(
        "kvray_prefix_cache_hits", "Prompt tokens served from the prefix cache (GPU or CPU tier)."
    ),
    _counter(
        "kvray_prefix_cache_cpu_hits",
        "Of the prefix-cache hits, tokens copied in from the CPU tier (swap_space).",
    ),
    _counter("kvray_num_preemptions", "Running requests preempted to free KV blocks."),
    _counter("kvray_num_swap_outs", "Preempted requests whose KV was swapped out to CPU."),
    _counter("kvray_num_swap_ins", "Swapped requests whose KV was copied back to resume."),
    _gauge(
        "kvray_cpu_kv_cache_usage_perc",
        "Fraction of the CPU pool's KV blocks (swap_space) in use: swapped and CPU tier (0 to 1).",
    ),
    _gauge(
        "kvray_cpu_prefix_cache_usage_perc",
        "Fraction of the CPU pool's KV blocks held by the prefix cache's CPU tier (0 to 1).",
    ),
    _counter("kvray_prompt_tokens", "Prompt tokens of requests that produced a first token."),
    _counter("kvray_generation_tokens", "Tokens generated."),
    _counter(
        "kvray_request_success",
        "Finished requests by finish reason (stop, length, abort).",
        ("model", "finished_reason"),
    ),
    _histogram("kvray_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS),
    _histogram(
        "kvray_inter_token_latency_seconds",
        "Time between consecutive engine outputs of a request.",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "kvray_e2e_request_latency_seconds", "Arrival to finish (or abort).", LATENCY_BUCKETS
    ),
    _histogram(
        "kvray_request_queue_time_seconds",
        "Arrival in the engine to first scheduled.",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "kvray_iteration_tokens",
        "Tokens scheduled per engine step (batch utilization).",
        COUNT_BUCKETS,
    ),  # fmt: skip
    _histogram("kvray_batch_size", "Requests scheduled per engine step.", COUNT_BUCKETS),
    _gauge("kvray_replica_ready", "1 while this replica's engine loop is healthy, else 0."),
    _gauge(
        "kvray_autoscaling_signal_seconds",
        "A replica's mean queue wait or time to first token over the autoscaler's look-back "
        "window, as the replica reports it to the autoscaler, by signal (queue_wait, ttft).",
        ("model", "signal"),
    ),
    _gauge(
        "kvray_autoscaling_target_seconds",
        "The target of the signal a model's replicas scale on (autoscaling_metric queue_wait "
        "or ttft), by signal.",
        ("model", "signal"),
    ),
    _gauge(
        "kvray_model_state",
        "1 for the lifecycle state a replica's model is in (serving, switching, asleep), "
        "0 for the others.",
        ("model", "state"),
    ),
    _gauge(
        "kvray_model_switches",
        "Model loads this replica has finished since it started, by outcome (done, or failed: "
        "the old model serves on); a gauge, so that a replica that never switched shows 0.",
        ("model", "outcome"),
    ),
    _counter(
        "kvray_http_requests",
        "HTTP generation requests by model, tenant and status code (no model for a request "
        "refused before it named a served model).",
        ("model", "tenant", "code"),
    ),
    _counter(
        "kvray_tenant_tokens",
        "Tokens billed to a tenant, by model and kind (prompt or generation).",
        ("model", "tenant", "kind"),
    ),
    _counter(
        "kvray_tenant_rejections",
        "Requests refused with 429, by model, tenant and reason (the error code).",
        ("model", "tenant", "reason"),
    ),
    _counter(
        "kvray_routing_decisions",
        "Generation requests routed among a model's replicas, by decision: affinity (to the "
        "replica holding the prompt's start), no_match or over_bound (by load).",
        ("model", "decision"),
    ),
)

METRICS_BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def exported_metric_names(prefix: str = "") -> dict[str, MetricDef]:
    """Every sample name a scrape can show -> its definition."""
    return {n: m for m in METRICS for n in m.exported_names(prefix)}


class MetricsSink(Protocol):
    """Where observations go. `labels` holds exactly the metric's `MetricDef.labels`."""

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None: ...

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None: ...

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None: ...


class BufferedSink:
    """Observations kept as events for another thread or process to record (`drain`):
    recording into an exporter (Ray's metrics: a few microseconds a call, thousands a
    second under load) would otherwise hold up the engine loop that makes them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, dict]] = []

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.events.append(("inc", name, value, dict(labels)))

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.events.append(("set", name, value, dict(labels)))

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.events.append(("observe", name, value, dict(labels)))

    def drain(self) -> list[tuple[str, str, float, dict]]:
        """The events since the last drain, in order; `getattr(sink, kind)(name, value,
        labels)` records one."""
        events, self.events = self.events, []
        return events


class PrometheusSink:
    """prometheus-client metrics in their own registry (serve it with `start_http_server`).

    `const_labels` are added to every metric, e.g. `{"replica": "0"}` so that the
    dashboard's replica filter works as it does behind Ray Serve.
    """

    def __init__(
        self,
        registry: object | None = None,
        const_labels: Mapping[str, str] | None = None,
    ) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry() if registry is None else registry
        self.const_labels = dict(const_labels or {})
        self._metrics: dict[str, object] = {}
        for m in METRICS:
            labelnames = (*self.const_labels, *m.labels)
            if m.kind == "counter":
                metric = prom.Counter(m.name, m.description, labelnames, registry=self.registry)
            elif m.kind == "gauge":
                metric = prom.Gauge(m.name, m.description, labelnames, registry=self.registry)
            else:
                metric = prom.Histogram(
                    m.name, m.description, labelnames, registry=self.registry, buckets=m.buckets
                )
            self._metrics[m.name] = metric

    def _child(self, name: str, labels: Mapping[str, str]):
        return self._metrics[name].labels(**self.const_labels, **labels)

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._child(name, labels).inc(value)

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._child(name, labels).set(value)

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._child(name, labels).observe(value)

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve `/metrics` for Prometheus from a daemon thread."""
        import prometheus_client as prom

        prom.start_http_server(port, addr=addr, registry=self.registry)


@dataclass
class RequestTimes:
    """Monotonic timestamps of one request, for queue time, TTFT, ITL and e2e latency."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Buffer:
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    observations: dict[str, list[float]] = field(default_factory=dict)


_ENGINE_GAUGES = {
    "kvray_num_requests_running": "num_running",
    "kvray_num_requests_waiting": "num_waiting",
    "kvray_num_requests_swapped": "num_swapped",
    "kvray_kv_cache_usage_perc": "kv_cache_usage",
    "kvray_kv_cache_fragmentation_perc": "kv_cache_fragmentation",
    "kvray_cpu_kv_cache_usage_perc": "cpu_kv_cache_usage",
    "kvray_cpu_prefix_cache_usage_perc": "cpu_prefix_cache_usage",
}
_ENGINE_TOTALS = {
    "kvray_prefix_cache_queries": "prefix_cache_queries",
    "kvray_prefix_cache_hits": "prefix_cache_hits",
    "kvray_prefix_cache_cpu_hits": "cpu_prefix_cache_hits",
    "kvray_num_preemptions": "num_preemptions",
    "kvray_num_swap_outs": "num_swap_outs",
    "kvray_num_swap_ins": "num_swap_ins",
}
"""Counters kept as running totals by the scheduler: the sink gets the difference."""


class EngineMetrics:
    """What `LLMEngine` records; all calls come from the engine's own thread."""

    def __init__(
        self,
        sink: MetricsSink,
        model_name: str,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if flush_interval_s < 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        self.sink = sink
        self.labels = {"model": model_name}
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        self._buffer = _Buffer()
        self._last_flush = clock()
        self._last_totals: dict[str, float] = {}

    def request_scheduled(self, times: RequestTimes, now: float) -> None:
        if times.scheduled is None:
            times.scheduled = now
            self._observe("kvray_request_queue_time_seconds", now - times.arrival)

    def request_tokens(
        self, times: RequestTimes, num_new_tokens: int, num_prompt_tokens: int, now: float
    ) -> None:
        """A request got `num_new_tokens` (> 0) generated tokens in the step that ended `now`."""
        if times.first_token is None:
            times.first_token = now
            self._observe("kvray_time_to_first_token_seconds", now - times.arrival)
            self._inc("kvray_prompt_tokens", num_prompt_tokens)
        else:
            self._observe("kvray_inter_token_latency_seconds", now - times.last_token)
        times.last_token = now
        self._inc("kvray_generation_tokens", num_new_tokens)

    def request_finished(self, times: RequestTimes, finish_reason: str, now: float) -> None:
        self._observe("kvray_e2e_request_latency_seconds", now - times.arrival)
        self._inc("kvray_request_success", 1, finished_reason=finish_reason)

    def step(self, num_scheduled_tokens: int, batch_size: int) -> None:
        if batch_size > 0:
            self._observe("kvray_iteration_tokens", num_scheduled_tokens)
            self._observe("kvray_batch_size", batch_size)

    def maybe_flush(self, stats: Callable[[], Mapping[str, float]], idle: bool) -> bool:
        """Flush when the interval has passed or the engine is idle; True if it flushed.

        `stats` (the scheduler's) is only called when flushing: some of it walks the batch.
        """
        now = self.clock()
        if not idle and now - self._last_flush < self.flush_interval_s:
            return False
        self.flush(stats())
        self._last_flush = now
        return True

    def flush(self, stats: Mapping[str, float]) -> None:
        for name, key in _ENGINE_GAUGES.items():
            self.sink.set(name, float(stats.get(key, 0)), self.labels)
        for name, key in _ENGINE_TOTALS.items():
            total = float(stats.get(key, 0))
            self._inc(name, total - self._last_totals.get(name, 0.0))
            self._last_totals[name] = total
        buffer, self._buffer = self._buffer, _Buffer()
        for (name, extra), value in buffer.counters.items():
            # Ray refuses increments <= 0; a counter that did not move has nothing to say.
            if value > 0:
                self.sink.inc(name, value, {**self.labels, **dict(extra)})
        for name, values in buffer.observations.items():
            for value in values:
                self.sink.observe(name, value, self.labels)

    def _inc(self, name: str, value: float, **extra: str) -> None:
        key = (name, tuple(sorted(extra.items())))
        counters = self._buffer.counters
        counters[key] = counters.get(key, 0.0) + value

    def _observe(self, name: str, value: float) -> None:
        self._buffer.observations.setdefault(name, []).append(value)
