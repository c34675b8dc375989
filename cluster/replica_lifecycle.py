"""One replica's model lifecycle while it serves: another model loaded, sleep and wake, with
the requests that arrive or run meanwhile (the engine's own part: engine/lifecycle.py).

States: `serving`; `switching` (draining, then loading and warming up another model, or
waking); `asleep`. The engine changes models only while idle, so a switch first drains:
new requests wait (they run on the new model once it is warm: none ever sees a half-loaded
model) while those running finish, and those still running after `switch_drain_timeout_s`
are aborted with a 503 `model_switching` (an SSE error event where the stream has begun).
A failed load leaves the old model serving and raises the cause (APIError, 400 for a
missing file or a checkpoint that does not fit, else 500). Asleep, a generation request
gets a 503 `model_asleep` naming the admin wake-up, or, with `wake_on_request`, wakes it.

The rolling switch across a model's replicas (one at a time) is driven by the ingress
(cluster/admin_api.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from engine.api.errors import APIError

logger = logging.getLogger("ray.serve")

STATES = ("serving", "switching", "asleep")

ABORT_WAIT_S = 5.0
"""How long a drain waits for the requests it aborted to end."""


def switch_aborted(model: str) -> APIError:
    return APIError(
        f"the request was aborted: {model!r} is switching to another model and the request "
        "was still running past switch_drain_timeout_s; send it again",
        503,
        code="model_switching",
        retry_after_s=1,
    )


def asleep(model: str) -> APIError:
    return APIError(
        f"{model!r} is asleep: an admin wakes it with POST /v1/admin/wake_up",
        503,
        code="model_asleep",
        retry_after_s=5,
    )


class ReplicaRequest:
    """A request running on the replica, as a drain sees it.

    A drain aborts it by cancelling its task only while the task waits on the engine
    (`in_engine`, set by the host around those awaits): a cancellation that landed where
    the request hands an item to its caller would end it there, without its error. Between
    engine outputs the request sees `aborted` itself, after its current item.
    """

    __slots__ = ("task", "in_engine", "aborted", "cancelled")

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.in_engine = True
        self.aborted = False
        self.cancelled = False

    def abort(self) -> None:
        self.aborted = True
        if self.in_engine and not self.cancelled:
            self.cancelled = True
            self.task.cancel()


class ReplicaLifecycle:
    """The state of one replica's model and the admin operations on it.

    `engine_call(method, *args)` runs an engine method between steps (AsyncEngine.call);
    `load(model, weights_only)` has the idle engine load `model` and rebuilds what was read
    off the old one (tokenizer, limits); `warm_up()` runs a tiny request through the model
    before it takes traffic again.
    """

    def __init__(
        self,
        model: str,
        engine_call: Callable[..., Awaitable[Any]],
        load: Callable[[str, bool], Awaitable[None]],
        warm_up: Callable[[], Awaitable[None]],
        *,
        drain_timeout_s: float | None = 60.0,
        wake_on_request: bool = False,
        sink: Any = None,
    ) -> None:
        self.model = model
        self.engine_call = engine_call
        self.load = load
        self.warm_up = warm_up
        self.drain_timeout_s = drain_timeout_s
        self.wake_on_request = wake_on_request
        self.sink = sink
        self.state = "serving"
        self.sleep_level = 0
        self.switches = {"done": 0, "failed": 0}
        self._settled = asyncio.Event()  # set while not switching
        self._settled.set()
        self._lock = asyncio.Lock()  # one admin operation at a time
        self._running: set[ReplicaRequest] = set()
        self.publish()

    # -- the request path ------------------------------------------------------------------

    async def admit(self) -> APIError | None:
        """Before a generation request starts: None once the model serves (after waiting
        out a switch), else why it cannot run (asleep)."""
        while self.state != "serving":
            if self.state == "asleep":
                if not self.wake_on_request:
                    return asleep(self.model)
                await self.wake_up()
            else:
                await self._settled.wait()
        return None

    def started(self) -> ReplicaRequest:
        """The calling request runs: a drain waits for it (or aborts it past its bound)."""
        running = ReplicaRequest()
        self._running.add(running)
        return running

    def ended(self, running: ReplicaRequest) -> None:
        self._running.discard(running)

    def took_back(self, running: ReplicaRequest) -> bool:
        """Whether the cancellation `running` sees is a drain's abort; if so it is taken back
        (the request answers with `switch_aborted`)."""
        if not running.cancelled:
            return False
        running.cancelled = False
        running.task.uncancel()
        return True

    # -- admin operations ------------------------------------------------------------------

    async def load_model(self, model: str, weights_only: bool) -> dict:
        """Drain, load `model`, warm up, serve: {"model": ..., "weights_only": ...}."""
        async with self._lock:
            if self.state == "asleep":
                raise APIError(
                    f"{self.model!r} is asleep: wake it up (POST /v1/admin/wake_up) before "
                    "loading another model",
                    409,
                    code="model_asleep",
                )
            self._enter("switching")
            try:
                await self._drain()
                try:
                    await self.load(model, weights_only)
                except Exception as e:
                    self._count("failed")
                    status = 400 if isinstance(e, ValueError | OSError) else 500
                    raise APIError(
                        f"loading {model!r} failed, the old model serves on: "
                        f"{type(e).__name__}: {e}",
                        status,
                        param="model",
                        code="model_load_failed",
                    ) from None
                await self.warm_up()
                self._count("done")
            finally:
                self._enter("serving")
        return {"model": model, "weights_only": weights_only}

    async def sleep(self, level: int) -> dict:
        async with self._lock:
            if self.state != "asleep":
                self._enter("switching")
                try:
                    await self._drain()
                    await self.engine_call("sleep", level)
                except BaseException:
                    self._enter("serving")
                    raise
                self.sleep_level = level
                self._enter("asleep")
        return {"is_sleeping": True, "level": self.sleep_level}

    async def wake_up(self) -> dict:
        async with self._lock:
            if self.state == "asleep":
                self._enter("switching")
                try:
                    await self.engine_call("wake_up")
                    await self.warm_up()
                    self.sleep_level = 0
                    self._enter("serving")
                except BaseException:
                    self._enter("asleep")
                    raise
        return {"is_sleeping": False}

    def is_sleeping(self) -> dict:
        return {"is_sleeping": self.state == "asleep", "level": self.sleep_level}

    async def reset_prefix_cache(self) -> dict:
        """Forget every cached prefix; waits out a switch, drains nothing (the engine's reset
        refuses while a request holds blocks: `reset` is then false)."""
        async with self._lock:
            if self.state == "asleep":  # asleep, the engine has no cache to reset
                return {"reset": True}
            return {"reset": bool(await self.engine_call("reset_prefix_cache"))}

    # -- internals -------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Wait for the running requests; abort those left past the bound, and wait for them
        to end (the engine refuses a load while a request is unfinished)."""
        loop = asyncio.get_running_loop()
        bound = self.drain_timeout_s
        deadline = None if bound is None else loop.time() + bound
        while self._running and (deadline is None or loop.time() < deadline):
            await asyncio.sleep(0.02)
        if not self._running:
            return
        logger.warning(
            "%s: aborting %d request(s) still running past switch_drain_timeout_s (%s s)",
            self.model,
            len(self._running),
            bound,
        )
        for running in list(self._running):
            running.abort()
        deadline = loop.time() + ABORT_WAIT_S
        while self._running and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def _enter(self, state: str) -> None:
        self.state = state
        if state == "switching":
            self._settled.clear()
        else:
            self._settled.set()
        self.publish()

    def publish(self) -> None:
        """The gauges of the state and of the switches (set again on health checks)."""
        if self.sink is None:
            return
        for state in STATES:
            labels = {"model": self.model, "state": state}
            self.sink.set("kvray_model_state", 1.0 if state == self.state else 0.0, labels)
        for outcome, count in self.switches.items():
            labels = {"model": self.model, "outcome": outcome}
            self.sink.set("kvray_model_switches", float(count), labels)

    def _count(self, outcome: str) -> None:
        self.switches[outcome] += 1
        self.publish()
