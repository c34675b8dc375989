"""An engine's metric events, buffered on the engine loop, recorded into a sink elsewhere.

A flush under load holds one event per running request per step (thousands a second,
microseconds each in Ray's metrics): recorded on the engine's thread (or the engine
process's reader thread) they held up every stream's next outputs. `MetricsReplay` records
them on the event loop that switched metrics on instead, spread out (`SpreadRecorder`).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

METRICS_SPREAD_S = 1.0
"""An event loop records a batch of metric events over about this long (SpreadRecorder)."""
METRICS_TICK_S = 0.005
"""...a few at a time, this often."""


def record(sink: Any, events: list) -> None:
    for kind, name, value, labels in events:
        getattr(sink, kind)(name, value, labels)


class SpreadRecorder:
    """Records metric events into a sink on an event loop, a few every METRICS_TICK_S, so
    that each batch is recorded within about METRICS_SPREAD_S and never holds the loop for
    long: recorded at once, an idle engine's flush (one request's events) held up the next
    request, which arrives just then (bench/RESULTS.md, figures formerly in docstrings)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sink: Any) -> None:
        self.loop, self.sink = loop, sink
        self._backlog: collections.deque = collections.deque()
        self._per_tick = 1
        self._timer: asyncio.TimerHandle | None = None

    def add(self, events: list) -> None:
        """On the loop."""
        self._backlog.extend(events)
        ticks = max(1, round(METRICS_SPREAD_S / METRICS_TICK_S))
        self._per_tick = -(-len(self._backlog) // ticks)
        if self._timer is None:
            self._timer = self.loop.call_later(METRICS_TICK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        try:
            for _ in range(min(self._per_tick, len(self._backlog))):
                kind, name, value, labels = self._backlog.popleft()
                getattr(self.sink, kind)(name, value, labels)
        finally:
            if self._backlog:
                self._timer = self.loop.call_later(METRICS_TICK_S, self._tick)


class MetricsReplay:
    """Where metric events go once they reach this process: `sink`, recorded by the event
    loop that built this (spread out), or, built off any event loop, by the thread that
    hands them over."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        try:
            self.recorder: SpreadRecorder | None = SpreadRecorder(asyncio.get_running_loop(), sink)
        except RuntimeError:
            self.recorder = None

    def replay(self, events: list) -> None:
        """From any thread."""
        if self.recorder is None:
            record(self.sink, events)
            return
        try:
            self.recorder.loop.call_soon_threadsafe(self.recorder.add, events)
        except RuntimeError:
            pass  # that event loop is closed: nobody is left to export them
