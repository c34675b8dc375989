"""A replica's side of latency autoscaling: its engine's recent queue wait and time to first
token, for Serve's autoscaler (cluster/autoscaling_policy.py) and the dashboard.

The engine already measures both for its metrics (`kvray_request_queue_time_seconds` when a
request is first scheduled, `kvray_time_to_first_token_seconds` at its first token): the
replica's metrics sink is wrapped (`AutoscalingSignals`) so that those two observations also
land in a window of the last `look_back_period_s`, which keeps a running sum. Serve calls
`record_autoscaling_stats` every metrics interval; the answer is each window's mean, O(1)
besides dropping the observations that left the window. A window without observations (an
idle replica) reports 0.

Both signals are also gauges (`kvray_autoscaling_signal_seconds`, and the target the
deployment scales on, `kvray_autoscaling_target_seconds`), set on each report.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cluster.autoscaling_policy import SIGNAL_KEYS

OBSERVED_SIGNALS = {
    "kvray_request_queue_time_seconds": "queue_wait",
    "kvray_time_to_first_token_seconds": "ttft",
}
"""The engine's histograms whose observations are the autoscaling signals."""


class LatencyWindow:
    """Observations of the last `window_s` seconds and their mean."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self._items: collections.deque[tuple[float, float]] = collections.deque()
        self._sum = 0.0
        # Observations arrive on the replica's event loop; Serve may ask from another thread.
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        now = self.clock()
        with self._lock:
            self._items.append((now, value))
            self._sum += value
            self._expire(now)

    def mean(self) -> float:
        """The mean of the window's observations, 0.0 without any."""
        with self._lock:
            self._expire(self.clock())
            if not self._items:
                self._sum = 0.0  # no float residue left behind by the subtractions
                return 0.0
            return max(0.0, self._sum / len(self._items))

    def _expire(self, now: float) -> None:
        oldest = now - self.window_s
        while self._items and self._items[0][0] < oldest:
            self._sum -= self._items.popleft()[1]


class AutoscalingSignals:
    """The engine's metrics sink for a replica: every event goes on to `sink`; queue wait
    and TTFT observations also go into their windows."""

    def __init__(
        self,
        sink: Any,
        model_name: str,
        window_s: float,
        metric: str,
        target_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if metric != "ongoing_requests" and metric not in SIGNAL_KEYS:
            raise ValueError(f"autoscaling_metric {metric!r} is not one kvray reports")
        self.sink = sink
        self.model_name = model_name
        self.metric = metric
        self.target_s = target_s
        self.windows = {signal: LatencyWindow(window_s, clock) for signal in SIGNAL_KEYS}

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.sink.inc(name, value, labels)

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.sink.set(name, value, labels)

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        signal = OBSERVED_SIGNALS.get(name)
        if signal is not None:
            self.windows[signal].add(value)
        self.sink.observe(name, value, labels)

    def report(self) -> dict[str, float]:
        """What the replica hands Serve's autoscaler: the scaled-on signal's window mean
        under its SIGNAL_KEYS name (nothing under ongoing_requests, Serve counts those
        itself); both means and the target go to the gauges."""
        means = {signal: window.mean() for signal, window in self.windows.items()}
        for signal, value in means.items():
            self.sink.set(
                "kvray_autoscaling_signal_seconds",
                value,
                {"model": self.model_name, "signal": signal},
            )
        if self.metric == "ongoing_requests":
            return {}
        if self.target_s is not None:
            self.sink.set(
                "kvray_autoscaling_target_seconds",
                self.target_s,
                {"model": self.model_name, "signal": self.metric},
            )
        return {SIGNAL_KEYS[self.metric]: means[self.metric]}


def autoscaling_signals(config: Any, sink: Any, model_name: str) -> AutoscalingSignals:
    """A replica's signals under its `AppConfig`: the window is the autoscaler's look-back."""
    from cluster.autoscaling_policy import TARGET_KEYS

    metric = config.autoscaling_metric
    target = getattr(config, TARGET_KEYS[metric]) if metric in TARGET_KEYS else None
    return AutoscalingSignals(sink, model_name, config.look_back_period_s, metric, target)
