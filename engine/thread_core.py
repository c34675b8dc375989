"""The engine on a thread of this process, for `AsyncEngine` (engine/async_engine.py).

Beside `ProcessCore` (engine/core_process.py), which runs it in a process of its own, with
the same calls: `submit` an op, `is_alive`, `shutdown`; results, the loop's end and metric
events go to the callbacks it was built with.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from engine.core_loop import CoreLoop, Op
from engine.observability.metrics import BufferedSink

logger = logging.getLogger(__name__)


class ThreadCore:
    """The engine in a thread of this process: ops wait on a condition between steps."""

    def __init__(self, engine: Any, deliver: Any, on_dead: Any, on_metrics: Any) -> None:
        self.engine = engine
        self._deliver, self._on_dead, self._on_metrics = deliver, on_dead, on_metrics
        self.metrics: BufferedSink | None = None
        """Where the engine records its metrics once they are on: handed on after outputs."""
        self._cond = threading.Condition()
        self._ops: list[Op] = []
        self._stopping = False
        self.step_started: float | None = None
        self._thread = threading.Thread(target=self._run, name="kvray-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, op: Op) -> bool:
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                return False
            self._ops.append(op)
            self._cond.notify()
        return True

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        core = CoreLoop(self.engine)
        has_work = False
        arrival_wait = 0.0
        try:
            while True:
                with self._cond:
                    while not self._ops and not has_work and not self._stopping:
                        self._cond.wait()
                    if arrival_wait > 0 and not self._ops and not self._stopping:
                        # A batch waits for more arrivals: until one comes or time is up.
                        self._cond.wait(arrival_wait)
                    if self._stopping:
                        break
                    ops, self._ops = self._ops, []
                applied = core.apply(ops)
                if applied:
                    self._deliver(applied)
                arrival_wait = core.arrival_wait_s() if core.has_work() else 0.0
                if core.has_work() and arrival_wait <= 0:
                    self.step_started = time.monotonic()
                    stepped = core.step()
                    self.step_started = None
                    self._deliver(stepped)
                if self.metrics is not None:
                    events = self.metrics.drain()
                    if events:
                        self._on_metrics(events)
                has_work = core.has_work()
            self._on_dead("the engine was shut down")
        except BaseException as e:
            logger.exception("the engine loop stopped")
            self._on_dead(f"the engine loop stopped: {type(e).__name__}: {e}")
