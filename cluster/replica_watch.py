"""What the ingress knows of whether a model's server has a replica that answers.

Serve's handle holds a request until a replica takes it, however long that is: while every
replica of a model is dead and Serve starts new ones (a model load), a request, and a
health check sent through the handle, would wait that long. So the ingress keeps, per
model, the latest word on its replicas: any reply (a first reply, a stream's chunk, a
probe's answer) says one is up; a replica that died under a request (Ray's actor errors),
or a health probe that no replica answered in time (and no other reply came meanwhile),
says none may be. While none is known to be up:

- /health answers 503 at once;
- a new request waits at most `no_replica_wait_s` for one, then gets 503 with Retry-After;
- requests already waiting for their first reply get the same bound: their time limits
  are moved in, and back out as soon as a replica answers;
- a probe asks the model's server again and again until a replica answers.

Replicas that are all busy (each at max_ongoing_requests) take no probe either: they
count as up again with their next reply, so a request they run is cut by the bound only
where none of them replies, nor streams, for that long.

A model that may scale to zero (min_replicas 0) gets no bound: a request is what makes
Serve start its first replica, and it waits for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.api.errors import APIError

RETRY_AFTER_S = 1
"""Retry-After of these 503s: another replica may take the retry at once, and while none
is up the retry itself waits out no_replica_wait_s."""

PROBE_TIMEOUT_S = 0.9
"""How long a health probe waits for a replica: /health answers within a second."""

PROBE_INTERVAL_S = 0.5
"""Pause between probes while no replica of a model is known to be up."""


def replica_lost(model: str, error: BaseException) -> APIError:
    """503 for a request whose replica died under it (Ray's actor errors)."""
    return APIError(
        f"the replica serving model `{model}` stopped while it ran this request "
        f"({type(error).__name__}); retry it",
        503,
        code="replica_unavailable",
        retry_after_s=RETRY_AFTER_S,
    )


def no_replica(model: str) -> APIError:
    """503 for a request that found no replica of its model up, nor one within the bound."""
    return APIError(
        f"no replica of model `{model}` is up (Serve is starting one); retry shortly",
        503,
        code="no_replica",
        retry_after_s=RETRY_AFTER_S,
    )


def cancel_call(reply: Any) -> None:
    """Best-effort cancel of a server call (frees the engine's request if still running)."""
    try:
        reply.cancel()
    except Exception:
        pass


class ReplicaWatch:
    """One model's replicas as the ingress last heard of them (see the module docstring)."""

    def __init__(self, model: str, server: Any, no_replica_wait_s: float | None) -> None:
        """`server`: the model's LLMServer handle (or LocalServer); `no_replica_wait_s`:
        the bound on waiting while no replica is up (None: wait as Serve does)."""
        self.model = model
        self.server = server
        self.no_replica_wait_s = no_replica_wait_s
        self.up = True
        """False from a loss until a replica answers again."""
        self._replies = 0
        """Replies seen so far: a probe that fails after a newer reply is stale news."""
        self._up_event = asyncio.Event()
        self._up_event.set()
        self._lost_at = 0.0
        self._waiting: dict[asyncio.Timeout, float | None] = {}
        """Time limits of requests awaiting their first reply -> their own deadline."""
        self._prober: asyncio.Task | None = None

    def saw_reply(self) -> None:
        """A replica answered: one is up."""
        self._replies += 1
        if self.up:
            return
        self.up = True
        self._up_event.set()
        for limit, own in self._waiting.items():
            limit.reschedule(own)

    def saw_loss(self) -> None:
        """A replica died under a request, or no replica answered a probe in time."""
        if not self.up:
            return
        self.up = False
        self._up_event.clear()
        loop = asyncio.get_running_loop()
        self._lost_at = loop.time()
        for limit in self._waiting:
            self._bound(limit)
        if self._prober is None or self._prober.done():
            self._prober = loop.create_task(self._probe_until_up())

    async def wait_up(self) -> bool:
        """Whether a replica is up, waiting for one at most `no_replica_wait_s`."""
        if self.up:
            return True
        try:
            async with asyncio.timeout(self.no_replica_wait_s):
                await self._up_event.wait()
        except TimeoutError:
            return False
        return True

    def awaiting_first_reply(self, limit: asyncio.Timeout) -> None:
        """`limit` (an entered asyncio.timeout) bounds a request until its first reply:
        while no replica is up it ends no later than `no_replica_wait_s` after the loss."""
        self._waiting[limit] = limit.when()
        if not self.up:
            self._bound(limit)

    def first_reply_done(self, limit: asyncio.Timeout) -> bool:
        """Stop bounding `limit`: whether the bound, not its own deadline, had moved it in."""
        own = self._waiting.pop(limit, None)
        when = limit.when()
        return when is not None and (own is None or when < own)

    async def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """Ask the model's server whether its engine is healthy; no answer within
        `timeout_s` (no replica took the call) counts as a loss, unless a replica answered
        something else meanwhile: a busy replica can be slow to take a probe."""
        replies_before = self._replies
        reply = self.server.is_healthy.remote()
        answered = False
        try:
            async with asyncio.timeout(timeout_s):
                healthy = bool(await reply)
            answered = True
        except asyncio.CancelledError:
            cancel_call(reply)  # else Serve's handle keeps it queued for a replica
            raise
        except Exception:  # no answer in time, a dead replica, a failing check
            cancel_call(reply)
            healthy = False
        if healthy:
            self.saw_reply()
        elif answered or self._replies == replies_before:
            self.saw_loss()
        return healthy

    def _bound(self, limit: asyncio.Timeout) -> None:
        if self.no_replica_wait_s is None:
            return
        own = self._waiting[limit]
        bound = self._lost_at + self.no_replica_wait_s
        limit.reschedule(bound if own is None else min(own, bound))

    async def _probe_until_up(self) -> None:
        while not self.up:
            if not await self.probe():
                await asyncio.sleep(PROBE_INTERVAL_S)
